"""Prompt lookup: drafter-free n-gram drafting from the text so far; works on any target."""

from __future__ import annotations

import mlx.core as mx

from ...core.hookspecs import hookimpl
from ...core.proposer import DraftContext, Proposal
from ...core.target import Target


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

    def continuation(self, tokens: list[int], cap: int) -> list[int]:
        """Tokens that followed the latest earlier occurrence of the longest matching suffix."""
        self.extend_to(tokens, len(tokens) - 1)  # the current suffix itself is not a match
        return self.peek(tokens, cap)

    def peek(self, tokens: list[int], cap: int) -> list[int]:
        """`continuation` from what is indexed now, indexing nothing: `tokens` may end in
        guesses that must not enter the index."""
        m = len(tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if m < n:
                continue
            end = self._last.get(tuple(tokens[m - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + cap]
        return []


class LookupProposer:
    name = "lookup"
    tap_layer_ids: tuple[int, ...] = ()
    drafts_on_host = True  # parked plain steps can check its drafts for free

    def __init__(self, max_draft: int = 8, min_n: int = 1, max_n: int = 4) -> None:
        self.max_draft = max_draft
        self.min_n, self.max_n = min_n, max_n
        self._index = NGramIndex(min_n, max_n)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._index = NGramIndex(self.min_n, self.max_n)

    def propose(self, ctx: DraftContext) -> Proposal:
        return Proposal.from_list(self.propose_host(ctx))

    def propose_host(self, ctx: DraftContext) -> list[int]:
        """`propose`'s drafts as host ids, without the device array a round needs (what a
        parked `auto` checks after every plain step, core/loop.py `Shadow`)."""
        return self._index.continuation(ctx.tokens, ctx.cap)

    def propose_ahead(self, ctx: DraftContext) -> Proposal:
        """What follows `ctx.tokens` (the history and a round's drafts, not yet verified) from
        what is indexed now: a round queued before that one is read (core/loop.py)."""
        return Proposal.from_list(self._index.peek(ctx.tokens, ctx.cap))

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        pass


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
