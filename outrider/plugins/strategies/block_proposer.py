"""Proposing with a block drafter: one backbone call per round, then DSpark's sequential head
(Markov bias, confidence) or DFlash's independent per-slot choice.

A head over a reduced vocabulary (vllm-project/speculators `draft_vocab_size` < V) picks draft
ids; they become target ids through `d2t` before the target sees them or the Markov head reads
them (its W1 is indexed by target ids), and each sampled draft's q is widened to the target
vocabulary with zeros outside the head's ids, so rejection sampling stays exact.
"""

from __future__ import annotations

import mlx.core as mx

from ...core.draft_vocab import DraftVocab
from ...core.proposer import DraftContext, Proposal
from ...core.sampling import probabilities, sample
from ...core.target import Target
from .block_drafter import BlockDrafter


class BlockProposer:
    # its state never depends on who drafted a round (lookup_assist.py may draft some)
    lookup_assist_safe = True

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
        self.vocab: DraftVocab = getattr(drafter, "draft_vocab", None) or DraftVocab(
            None, spec.vocab_size
        )
        self._embed = drafter.embed_tokens if spec.own_embedding else target.embed
        self._head = drafter.lm_head if spec.own_lm_head else self._target_head(target)
        self._cache = drafter.make_cache()
        # Taps of rows verified since the last draft; joined once, when the drafter reads them
        # (a parked run of plain steps adds one row a step).
        self._pending: list[mx.array] = []
        self._masks = [spec.mask_token_id] * (spec.block_size - 1)

    def _target_head(self, target: Target):
        """The target's output head, restricted to the draft vocabulary when it is reduced."""
        ids = self.vocab.target_ids
        if ids is None:
            return target.project
        return lambda hidden: target.project(hidden)[..., ids]

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
        logits = self._head(slots).astype(mx.float32)  # [cap, head vocabulary]
        greedy = ctx.sampling.greedy
        keys = mx.random.split(ctx.key, cap) if not greedy else None
        vocab = self.vocab
        if not self.sequential:
            if greedy:
                return Proposal(vocab.to_target(mx.argmax(logits, axis=-1)), cap)
            q = probabilities(logits, ctx.sampling)
            tokens = mx.stack([sample(q[i], keys[i]) for i in range(cap)])
            return Proposal(vocab.to_target(tokens), cap, probs=vocab.widen(q))
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
                chosen = mx.argmax(z, axis=-1)
            else:
                q = probabilities(z, ctx.sampling)
                probs.append(q[0])
                chosen = sample(q, keys[i])
            prev = self.vocab.to_target(chosen)  # a target id: W1's index and the draft
            tokens.append(prev)
        widened = self.vocab.widen(mx.stack(probs)) if probs else None
        proposal = Proposal(mx.concatenate(tokens), cap, probs=widened)
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
