"""Lookup drafts inside model-drafted rounds: when the text is being copied, a round verifies the
copy instead of the drafter's guess.

Agents and code edits re-emit what is already in the context (a file with one line changed, a
function being edited). There a drafter's block of a few tokens loses to prompt lookup, whose
continuation of a long match is right for as long as the copy runs. `LookupAssist` wraps a
model proposer: each round it finds the longest match of the text's end earlier in the
context; when the match is at least `min_match` tokens and its continuation is longer than what
the drafter has been getting accepted, the round drafts that continuation instead, as many
tokens as the match length makes likely (twice the match, capped by `max_lookup`, by the tokens
left, and where a calibration exists by the widest verify that still costs less than
`WIDE_COST` plain steps). Otherwise the drafter drafts as usual.

The drafter's own state never depends on who drafted: it observes the verified tokens' hidden
states every round either way (only proposers that say `lookup_assist_safe` are wrapped).
Lookup drafts are chosen deterministically (q is one-hot), so sampled output stays the target's.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from ...core.proposer import DraftContext, Proposal, Proposer
from .lookup import NGramIndex, run_back

EMA = 0.25
COPY_PRIOR = 0.7  # the share of a copy's drafts a round is expected to keep before any has run
WIDE_COST = 2.0  # a lookup verify may cost at most this many one-row forwards


class LookupAssist:
    """A model proposer with lookup rounds where the context is being copied."""

    def __init__(
        self,
        inner: Proposer,
        min_match: int = 4,
        max_lookup: int = 32,
        calibration=None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.tap_layer_ids = inner.tap_layer_ids
        self.max_draft = inner.max_draft
        self.min_match = min_match
        self.max_lookup = max_lookup
        self.calibration = calibration
        self.lookup_rounds = 0  # rounds lookup drafted (telemetry, tests)
        self._index = NGramIndex(min_match, min_match)  # the text's min_match-grams
        self._accepted = float(inner.max_draft) / 2  # running mean of the drafter's accepts
        self._looked = False
        self._bound: tuple[object, int] | None = None  # (calibration, widest copy it allows)
        self._copied = 0  # drafts of the copy the last round verified (0: the drafter's)
        self.copy_rate = COPY_PRIOR  # running share of a copy's drafts its rounds kept

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # the wrapped proposer's own members (drafter, spec…)

    def fork(self) -> LookupAssist:
        from ...core.batch import fork

        return LookupAssist(fork(self.inner), self.min_match, self.max_lookup, self.calibration)

    def with_threshold(self, threshold: float) -> LookupAssist:
        """The wrapped drafter at another confidence threshold (`BlockProposer.with_threshold`),
        wrapped alike."""
        inner = self.inner.with_threshold(threshold)
        return LookupAssist(inner, self.min_match, self.max_lookup, self.calibration)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self.inner.start(prompt, taps)
        self._index, self._looked = NGramIndex(self.min_match, self.min_match), False

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        self.inner.observe(accepted, taps)
        if not self._looked:
            self._accepted += EMA * (accepted - self._accepted)
        elif self._copied:
            self.copy_rate += EMA * (min(accepted, self._copied) / self._copied - self.copy_rate)
            self._copied = 0

    @property
    def rows_key(self):
        """Rows whose drafters draft together (`core/proposer.py`) still do when wrapped."""
        key = getattr(self.inner, "rows_key", None)
        return None if key is None else ("lookup", key)

    def propose(self, ctx: DraftContext) -> Proposal:
        return self.propose_rows([self], [ctx])[0]

    def propose_rows(self, assists: list[LookupAssist], ctxs: list[DraftContext]) -> list[Proposal]:
        """Each row's lookup copy where it wins, the drafter's drafts elsewhere: the drafter
        is asked for every row (cap 0 where the copy drafts), so it takes in every row's
        verified context whoever drafts."""
        copies = [a._lookup(ctx) if ctx.cap > 0 else None for a, ctx in zip(assists, ctxs)]
        asks = [ctx if c is None else replace(ctx, cap=0) for c, ctx in zip(copies, ctxs)]
        inners = [a.inner for a in assists]
        if getattr(self.inner, "rows_key", None) is not None:
            drafted = self.inner.propose_rows(inners, asks)
        else:
            drafted = [
                p.propose(c) if c.cap > 0 else Proposal.empty() for p, c in zip(inners, asks)
            ]
        return [d if c is None else Proposal.from_list(c, True) for c, d in zip(copies, drafted)]

    def copy_ready(self, tokens: list[int], room: int) -> int:
        """The drafts of the lookup copy a round at cap 1 would verify at `tokens`' end (at
        most `room`), 0 when none would: what a parked `auto` asks after each plain step
        (core/parked.py), which then weighs the copy's expected tokens (`copy_rate`) against
        what breaking its plain steps costs."""
        copy = self._copy(tokens, room)
        return len(copy) if self._wins(copy, 1, room) else 0

    def _lookup(self, ctx: DraftContext) -> list[int] | None:
        """This round's lookup copy, or None when the drafter drafts it."""
        room = int(ctx.extras.get("room", ctx.cap))
        copy = self._copy(ctx.tokens, room)
        self._looked = self._wins(copy, ctx.cap, room)
        if not self._looked:
            return None
        self.lookup_rounds += 1
        self._copied = len(copy)
        return copy

    def _wins(self, copy: list[int], cap: int, room: int) -> bool:
        """A copy drafts the round when it is longer than what the drafter has been getting
        accepted, and longer than the round's cap or as long as the round may draft at all
        (a given cap bounds the copy too)."""
        return len(copy) > self._accepted + 1 and (len(copy) > cap or len(copy) >= room > 0)

    def propose_ahead(self, ctx: DraftContext) -> Proposal:
        """While a copy drafts the round in flight, the copy's continuation after it (a round
        queued before that one is read, core/loop.py); nothing while the drafter drafts: its
        block needs the round's hidden states. `ctx.tokens` may end in unverified drafts, so
        nothing is indexed."""
        if not self._looked:
            return Proposal.empty()
        room = int(ctx.extras.get("room", ctx.cap - 1))
        return Proposal.from_list(self._match(ctx.tokens, 1 + room), True)

    def draft_ahead(self, ctx: DraftContext, anchor: mx.array, taps: mx.array) -> Proposal | None:
        """While the drafter drafts the round in flight, its block for the round after (the
        drafter's own `draft_ahead`; None where it has none). That round is the drafter's:
        the text it would be checked against for a copy is not read back yet."""
        inner = getattr(self.inner, "draft_ahead", None)
        if inner is None or self._looked:
            return None
        return inner(ctx, anchor, taps)

    def _copy(self, tokens: list[int], room: int) -> list[int]:
        """The continuation of the longest earlier match of the text's end, as long as the
        match makes likely; [] when the match is shorter than `min_match`."""
        self._index.extend_to(tokens, len(tokens) - 1)  # every n-gram but the last
        return self._match(tokens, room)

    def _match(self, tokens: list[int], room: int) -> list[int]:
        """`_copy` from what is indexed now."""
        n, at = self._index.match(tokens)
        if not n:
            return []
        # followed back only as far as can lengthen the copy (twice the match, max_lookup at
        # most): a parked run asks after every plain step, and copied text matches far back
        match = run_back(tokens, at - 1, n, (self.max_lookup + 1) // 2)
        length = min(2 * match, self.max_lookup, room, self._widest())
        return tokens[at : at + length]

    def _widest(self) -> int:
        """Drafts one verify may carry: the widest calibrated forward still cheaper than
        `WIDE_COST` one-row forwards (no bound without a calibration)."""
        if self.calibration is None:
            return self.max_lookup
        if self._bound is not None and self._bound[0] is self.calibration:
            return self._bound[1]
        one = self.calibration.verify_cost(1)
        widest = 0
        for w in range(2, self.max_lookup + 2):
            if self.calibration.verify_cost(w) > WIDE_COST * one:
                break
            widest = w - 1
        self._bound = (self.calibration, max(widest, 1))
        return self._bound[1]
