"""Proposing with a block drafter: one backbone call per round, then DSpark's sequential head
(Markov bias, confidence) or DFlash's independent per-slot choice."""

from __future__ import annotations

import mlx.core as mx

from ...core.proposer import DraftContext, Proposal
from ...core.sampling import probabilities, sample
from ...core.target import Target
from .block_drafter import BlockDrafter


class BlockProposer:
    def __init__(
        self,
        name: str,
        target: Target,
        drafter: BlockDrafter,
        sequential: bool,
        confidence_threshold: float = 0.0,
    ) -> None:
        spec = drafter.spec
        self.name = name
        self.drafter = drafter
        self.spec = spec
        self.tap_layer_ids = tuple(spec.target_layer_ids)
        self.max_draft = spec.max_draft
        self.sequential = sequential and spec.markov_rank > 0
        self.use_confidence = confidence_threshold > 0 and spec.confidence_head
        self.threshold = confidence_threshold
        self._embed = drafter.embed_tokens if spec.own_embedding else target.embed
        self._head = drafter.lm_head if spec.own_lm_head else target.project
        self._cache = drafter.make_cache()
        # Taps of rows verified since the last draft; joined once, when the drafter reads them
        # (a parked run of plain steps adds one row a step).
        self._pending: list[mx.array] = []
        self._masks = [spec.mask_token_id] * (spec.block_size - 1)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._cache = self.drafter.make_cache()
        self._pending = [] if taps is None else [taps]

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        if taps is None:
            return
        self._pending.append(taps)

    def propose(self, ctx: DraftContext) -> Proposal:
        cap = min(ctx.cap, self.max_draft)
        if cap <= 0:
            return Proposal.empty()
        block_ids = mx.array([ctx.tokens[-1], *self._masks], dtype=mx.uint32)
        block = self._embed(block_ids)[None]
        pending = self._pending
        if len(pending) > 1:
            pending = [mx.concatenate(pending)]
        context = pending[0] if pending else None
        hidden = self.drafter.backbone(block, context, self._cache)
        self._pending = []
        start = self.spec.logits_start
        slots = hidden[start : start + cap]
        logits = self._head(slots).astype(mx.float32)  # [cap, V]
        greedy = ctx.sampling.greedy
        keys = mx.random.split(ctx.key, cap) if not greedy else None
        if not self.sequential:
            if greedy:
                return Proposal(mx.argmax(logits, axis=-1).astype(mx.uint32), cap)
            q = probabilities(logits, ctx.sampling)
            tokens = mx.stack([sample(q[i], keys[i]) for i in range(cap)])
            return Proposal(tokens.astype(mx.uint32), cap, probs=q)
        return self._sequential(ctx, logits, slots, cap, keys)

    def _sequential(self, ctx, logits, slots, cap, keys) -> Proposal:
        head = self.drafter.markov_head
        prev = mx.array([ctx.tokens[-1]], dtype=mx.uint32)
        state = None
        tokens, probs, conf = [], [], []
        for i in range(cap):
            h = slots[i : i + 1]
            bias, e, state = head.step(prev, h, state)
            z = logits[i : i + 1] + bias.astype(mx.float32)
            if self.use_confidence:
                feats = [h, e] if self.spec.confidence_with_markov else [h]
                c = self.drafter.confidence_head.proj(mx.concatenate(feats, axis=-1))
                conf.append(mx.sigmoid(c.astype(mx.float32))[0, 0])
            if ctx.sampling.greedy:
                prev = mx.argmax(z, axis=-1).astype(mx.uint32)
            else:
                q = probabilities(z, ctx.sampling)
                probs.append(q[0])
                prev = sample(q, keys[i]).astype(mx.uint32)
            tokens.append(prev)
        proposal = Proposal(mx.concatenate(tokens), cap, probs=mx.stack(probs) if probs else None)
        if self.use_confidence:
            proposal = self._truncate(proposal, mx.stack(conf))
        return proposal

    def _truncate(self, proposal: Proposal, conf: mx.array) -> Proposal:
        """Keep drafts while the cumulative confidence stays >= threshold (at least one).

        Slot k's confidence depends on draft k-1, never on draft k, so the cut never looks at
        the token it admits and sampled output stays lossless.
        """
        survival = mx.cumprod(conf)
        mx.eval(survival, proposal.tokens)
        keep = max(1, sum(1 for s in survival.tolist() if s >= self.threshold))
        if keep == proposal.k:
            proposal.confidence = conf
            return proposal
        return Proposal(
            proposal.tokens[:keep],
            keep,
            probs=None if proposal.probs is None else proposal.probs[:keep],
            confidence=conf[:keep],
        )
