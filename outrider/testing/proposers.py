"""A proposer that drafts the known answer at a chosen acceptance rate."""

from __future__ import annotations

import random

import mlx.core as mx

from ..core.proposer import DraftContext, Proposal


class OracleProposer:
    """Drafts the known continuation; each drafted token is right with probability `rate`.

    `reference` is the full expected sequence (prompt + plain greedy output); a wrong draft is
    the right token + 1 (mod vocab), so acceptance per token is exactly `rate` in expectation.
    """

    tap_layer_ids: tuple[int, ...] = ()

    def __init__(
        self, reference: list[int], rate: float, vocab_size: int, max_draft: int = 8, seed: int = 0
    ) -> None:
        self.name = "oracle"
        self.reference = reference
        self.rate = rate
        self.vocab_size = vocab_size
        self.max_draft = max_draft
        self._rng = random.Random(seed)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Proposal:
        m = len(ctx.tokens)
        truth = self.reference[m : m + min(ctx.cap, self.max_draft)]
        return Proposal.from_list(self._noisy(truth))

    def propose_ahead(self, ctx: DraftContext) -> Proposal:
        """The known continuation after `ctx.tokens`, each token right with probability `rate`
        (nothing where the tokens already left the reference)."""
        m = len(ctx.tokens)
        if ctx.tokens != self.reference[:m]:
            return Proposal.empty()
        return Proposal.from_list(self._noisy(self.reference[m : m + ctx.cap]))

    def _noisy(self, truth: list[int]) -> list[int]:
        return [t if self._rng.random() < self.rate else (t + 1) % self.vocab_size for t in truth]

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        pass
