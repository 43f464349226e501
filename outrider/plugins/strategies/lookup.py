"""Prompt lookup: drafter-free n-gram drafting from the text so far; works on any target."""

from __future__ import annotations

import mlx.core as mx

from ...core.hookspecs import hookimpl
from ...core.proposer import DraftContext, Proposal
from ...core.target import Target

RATE_EMA = 0.1  # weight of the newest check in a match kind's estimate
# drafts a copy must be expected to keep before a parked run stops for it: a round that keeps
# fewer commits under two tokens for a verify, the plain step it drops and a restart
MIN_KEPT = 1.0
LONGER = 3  # a match of max_n tokens is told apart further by its doublings, up to 8 max_n
# the shortest match a copy is offered for: a one-token match's continuation keeps under one
# draft on average, so its estimate clears MIN_KEPT only after a lucky run of checks, and the
# copies it then bought kept 0.7-0.8 drafts against 2.0-2.6 expected (benchmarks/
# lookup_copies.py, every group of the synthetic mix)
COPY_MATCH = 2


class NGramIndex:
    """Latest end position of every n-gram (min_n..max_n) of a growing token list."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions < _indexed are in the index

    def extend_to(self, tokens: list[int], upto: int) -> None:
        for end in range(self._indexed, upto):
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    self._last[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def peek(self, tokens: list[int], cap: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix, from
        what is indexed now, indexing nothing: `tokens` may end in guesses that must not enter
        the index."""
        n, at = self.match(tokens)
        return tokens[at : at + cap] if n else []

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """The length of the longest suffix of `tokens` indexed earlier (0: none) and where
        the tokens after its latest occurrence start."""
        m = len(tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if m < n:
                continue
            end = self._last.get(tuple(tokens[m - n :]))
            if end is not None:
                return n, end + 1
        return 0, 0


class MatchRates:
    """How many of a lookup continuation's drafts the text went on to repeat, learnt per kind
    of match that found it: its length (1 to max_n tokens), and for a match of max_n tokens
    how many times over it runs when followed back (`_longer`). A continuation found by a
    4-token match runs on far longer than one found by a single token: in the demo target's
    answers to made-up chat prompts, a 4-token match's continuation kept 2.45 tokens on
    average and a 1-token match's 0.70 (docs/performance.md, "Lookup copies by match kind").
    Counts, not shares of the drafts: a continuation cut short where the text ends is often
    kept whole, and its share would promise as much of a longer one. Each estimate starts at
    0 and rises only as checks hold: a first check taken at face value let one lucky
    continuation buy rounds (on made-up chat prompts, copies of 2- and 3-token matches were
    expected to keep 3-4 drafts and kept 1-1.6). One instance serves a pipeline's
    generations (a fork shares it), so what one answer taught carries on."""

    def __init__(self, longest: int) -> None:
        self.kept = [0.0] * (longest + 1)  # index: the match's kind (`LookupProposer._drafted`)
        self.checks = [0] * (longest + 1)

    def learn(self, n: int, kept: int) -> None:
        self.kept[n] += RATE_EMA * (kept - self.kept[n])
        self.checks[n] += 1

    def snapshot(self) -> dict[str, list]:
        """Each kind's estimate and checks, for a receipt (kinds that no check reached: 0)."""
        return {"kept": [round(k, 3) for k in self.kept], "checks": list(self.checks)}


class LookupProposer:
    """Prompt lookup: each round drafts what followed the latest earlier occurrence of the
    text's longest matching suffix (1 to 4 tokens).

    While `--max-draft auto` has parked speculation, a parked run asks after every plain step
    whether a copy is ready (`copy_ready`) and what share of it should hold (`copy_rate`, by
    the kind of match that found it), and verifies it when its expected tokens pay for the
    round (core/parked.py `copy_ready`): rounds go to the long matches that keep their drafts,
    not to the one-token matches that mostly do not. Every continuation drafted is checked
    against the tokens that follow it, verified or not, and teaches `MatchRates`."""

    name = "lookup"
    tap_layer_ids: tuple[int, ...] = ()
    drafts_on_host = True  # parked plain steps can check its drafts for free

    def __init__(self, max_draft: int = 8, min_n: int = 1, max_n: int = 4) -> None:
        self.max_draft = max_draft
        self.min_n, self.max_n = min_n, max_n
        self._index = NGramIndex(min_n, max_n)
        self.rates = MatchRates(max_n + LONGER)  # shared with forks (a shallow copy keeps it)
        self._pending: tuple[int, int, list[int]] | None = None  # (at, kind, copy) unchecked
        self._offer: tuple[int, int, list[int]] | None = None  # (at, kind, copy): `copy_ready`'s

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._index = NGramIndex(self.min_n, self.max_n)
        self._pending = self._offer = None

    def propose(self, ctx: DraftContext) -> Proposal:
        """The round's drafts; where `copy_ready` offered a copy at this very point (a parked
        run stopped for it), that copy, as long as the round has room for (`Proposal.copied`:
        its length is the copy's, not the policy's cap)."""
        offer, self._offer = self._offer, None
        if offer is not None and offer[0] == len(ctx.tokens):
            room = min(self.max_draft, int(ctx.extras.get("room", ctx.cap)))
            return Proposal.from_list(offer[2][: max(room, ctx.cap)], copied=True)
        return Proposal.from_list(self.propose_host(ctx))

    def propose_host(self, ctx: DraftContext) -> list[int]:
        """`propose`'s drafts as host ids, without the device array a round needs (what a
        parked `auto` checks after every plain step, core/parked.py `Shadow`)."""
        return self._drafted(ctx.tokens, ctx.cap)[1]

    def copy_ready(self, tokens: list[int], room: int) -> int:
        """The drafts of the continuation a round would verify at `tokens`' end (at most
        `room` and the cap), 0 for none; `copy_rate` then says what share should hold."""
        n, copy = self._drafted(tokens, min(room, self.max_draft))
        if not copy or n < COPY_MATCH or min(self.rates.kept[n], len(copy)) < MIN_KEPT:
            self._offer = None  # it should commit under two tokens: no round pays for that
            return 0
        self._offer = (len(tokens), n, copy)
        return len(copy)

    @property
    def copy_rate(self) -> float:
        """The share of `copy_ready`'s copy the text should repeat, by its match's kind."""
        if self._offer is None:
            return 0.0
        _, n, copy = self._offer
        return min(1.0, self.rates.kept[n] / len(copy))

    def propose_ahead(self, ctx: DraftContext) -> Proposal:
        """What follows `ctx.tokens` (the history and a round's drafts, not yet verified) from
        what is indexed now: a round queued before that one is read (core/loop.py)."""
        return Proposal.from_list(self._index.peek(ctx.tokens, ctx.cap))

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        pass

    def snapshot(self) -> dict:
        """What the copies learnt, for a receipt: `copies`, each match kind's estimate."""
        return {"copies": self.rates.snapshot()}

    def _drafted(self, tokens: list[int], cap: int) -> tuple[int, list[int]]:
        """The continuation at `tokens`' end and the kind of its match (its length; for a
        match of max_n tokens, max_n plus `_longer`), once the continuation drafted before is
        checked against what followed it. One continuation at a time waits to be checked
        (until the text has gone off it or past it): the next one drafted after that is the
        next checked."""
        self._check(tokens)
        self._index.extend_to(tokens, len(tokens) - 1)  # the current suffix is not a match
        n, at = self._index.match(tokens)
        copy = tokens[at : at + cap] if n else []
        if n == self.max_n:  # how far back the match runs tells a long copy from a phrase
            n += _longer(tokens, at, self.max_n)
        if copy and (self._pending is None or self._pending[0] == len(tokens)):
            self._pending = (len(tokens), n, copy)  # (asked again here: the longer one)
        return n, copy

    def _check(self, tokens: list[int]) -> None:
        if self._pending is None:
            return
        at, n, copy = self._pending
        seen = tokens[at : at + len(copy)]
        kept = 0
        while kept < len(seen) and seen[kept] == copy[kept]:
            kept += 1
        if kept < len(seen) or kept == len(copy):  # the text went off the copy, or past it
            self.rates.learn(n, kept)
            self._pending = None


def run_back(tokens: list[int], end: int, n: int, limit: int) -> int:
    """How long the match of the text's last `n` tokens with those ending at `end` runs when
    followed back, at most `limit` (lookup's match kinds; `LookupAssist`'s copy lengths)."""
    m, length = len(tokens), n
    while length < limit and end - length >= 0 and tokens[end - length] == tokens[m - 1 - length]:
        length += 1
    return length


def _longer(tokens: list[int], at: int, n: int) -> int:
    """0 to LONGER: how many times over a match of `n` tokens whose earlier occurrence ends
    before `at` doubles when followed back (n to 2n-1 tokens: 0; 2n to 4n-1: 1; ...)."""
    length = run_back(tokens, at - 1, n, n << LONGER)
    return min(LONGER, (length // n).bit_length() - 1)


class Lookup:
    name = "lookup"
    description = "n-gram prompt lookup (no drafter; any target)"
    needs_drafter = False
    default_cap = 6

    def build(self, target: Target, drafter, options: dict) -> LookupProposer:
        return LookupProposer(max_draft=options.get("lookup_max_draft", 16))


@hookimpl
def register_strategies(register):
    register(Lookup())
