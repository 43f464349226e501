"""DFlash 2: one parallel block per round, then the candidate selector walks the slots.

Per round (z-lab/dflash `dflash/model.py`, DFlash2DraftModel.propose, CandidateSelector.select):
the backbone runs the block [anchor, mask, ...] once; each draft slot's logits are the target's
raw output head in fp32, times `output_multiplier`, then softcapped; the selector keeps each
slot's top-k candidates and walks from the anchor, scoring candidate c after predecessor a as
U(c) + <A[a] * P h, S[c]>. Greedy takes the best edge; sampled draws from softmax(score / T)
over the candidates, and that distribution, scattered into the vocabulary, is the q of the
loop's rejection sampling, so sampled output stays the target's.

Candidates are ordered by descending logit (ties in MLX's partition order) and the first best
edge wins; z-lab takes them unsorted (`topk(sorted=False)`), so on exactly tied edge scores the
two may pick different tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ...core.drafter_spec import DrafterSpec
from ...core.errors import OutriderError, UnsupportedTargetError
from ...core.hookspecs import hookimpl
from ...core.proposer import DraftContext, Proposal
from ...core.target import Target
from ..targets.base import decoder, head_owner
from .dflash2_drafter import CandidateSelector, DFlash2Drafter, load_dflash2_drafter


def raw_embedding(target: Target) -> Callable[[mx.array], mx.array]:
    """The target's embedding table lookup, without a family's input scaling or norm (z-lab
    looks ids up in `get_input_embeddings().weight` and applies `input_embedding_scale`)."""
    try:
        stack = decoder(target.model)
    except UnsupportedTargetError:
        return target.embed
    for name in ("embed_tokens", "embeddings"):
        if name in stack and isinstance(stack[name], nn.Module):
            return stack[name]
    return target.embed


def raw_head(target: Target) -> Callable[[mx.array], mx.array]:
    """The target's output projection alone (z-lab applies the drafter's own multiplier and
    softcap to `lm_head(h)`; a family's `project` may already apply the target's)."""
    owner = head_owner(target.model)
    if "lm_head" in owner and isinstance(owner["lm_head"], nn.Module):
        return owner["lm_head"]
    embed = raw_embedding(target)
    if hasattr(embed, "as_linear"):
        return embed.as_linear
    return target.project


def transform_logits(logits: mx.array, multiplier: float, softcap: float | None) -> mx.array:
    """fp32, times output_multiplier, then cap * tanh(x / cap) (z-lab `compute_logits`)."""
    logits = logits.astype(mx.float32) * multiplier
    if softcap:
        logits = mx.tanh(logits / softcap) * softcap
    return logits


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(unary [n, k], ids [n, k]) of each row's k largest logits, in descending order."""
    part = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]  # no full sort of V
    unsorted = mx.take_along_axis(logits, part, axis=-1)
    order = mx.argsort(-unsorted, axis=-1)
    return mx.take_along_axis(unsorted, order, axis=-1), mx.take_along_axis(part, order, axis=-1)


def walk(
    selector: CandidateSelector,
    hidden: mx.array,
    unary: mx.array,
    candidates: mx.array,
    anchor: int | mx.array,
    temperature: float = 0.0,
    key: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """Tokens [n] along the selector's path from the anchor, and (sampled) the q rows [n, k]
    each token was drawn from over its slot's candidates."""
    lattice = selector.lattice(hidden, candidates)  # [n, K, R]
    prev = mx.array(anchor, dtype=mx.uint32) if isinstance(anchor, int) else anchor
    keys = mx.random.split(key, hidden.shape[0]) if temperature > 0 else None
    tokens, q_rows = [], []
    for t in range(hidden.shape[0]):
        scores = unary[t] + lattice[t] @ selector.predecessor(prev)  # [K]
        if temperature > 0:
            scaled = scores / temperature
            q_rows.append(mx.softmax(scaled, axis=-1))
            index = mx.random.categorical(scaled, key=keys[t])
        else:
            index = mx.argmax(scores, axis=-1)
        prev = candidates[t, index].astype(mx.uint32)
        tokens.append(prev)
    return mx.stack(tokens), (mx.stack(q_rows) if q_rows else None)


class DFlash2Proposer:
    # its state never depends on who drafted a round (lookup_assist.py may draft some)
    lookup_assist_safe = True

    def __init__(self, target: Target, drafter: DFlash2Drafter) -> None:
        spec = drafter.spec
        self.name = "dflash2"
        self.drafter = drafter
        self.spec = spec
        self.tap_layer_ids = tuple(spec.target_layer_ids)
        self.max_draft = spec.max_draft
        self._embed = raw_embedding(target)
        self._embed_scale = float(spec.extra.get("input_embedding_scale", 1.0))
        self._head = raw_head(target)
        self._cache = drafter.make_cache()
        self._pending: list[mx.array] = []  # taps of rows verified since the last draft
        # a block drafted ahead: the context rows it took in, and each cache's mark before
        self._ahead: tuple[int, list] | None = None
        self._masks = [spec.mask_token_id] * (spec.block_size - 1)

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._cache = self.drafter.make_cache()
        self._pending = [] if taps is None else [taps]
        self._ahead = None

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        if self._ahead is not None:  # a block was drafted ahead on this round's rows
            (rows, marks), self._ahead = self._ahead, None
            if taps is not None and taps.shape[0] == rows:
                return  # the round kept every draft: its rows went in as they were assumed
            for cache, mark in zip(self._cache, marks, strict=True):
                cache.rewind(mark)
        if taps is not None:
            self._pending.append(taps)

    def add_rows(self, taps: mx.array) -> None:
        """Context rows of tokens observed without them (a parked run's, recomputed): taken
        in with the next drafting call, after those observed before."""
        self._pending.append(taps)

    def draft_ahead(self, ctx: DraftContext, anchor: mx.array, taps: mx.array) -> Proposal | None:
        """The next round's block before this round is read (as `BlockProposer.draft_ahead`):
        its context rows `taps` and its `anchor` are arrays not yet computed; `observe` keeps
        the rows when the round kept every draft and rewinds the caches otherwise. Greedy
        only."""
        if self._ahead is not None or self._pending or not ctx.sampling.greedy:
            return None
        if min(ctx.cap, self.max_draft) <= 0:  # no block: nothing may be taken in either
            return None
        marks = [cache.mark() for cache in self._cache]
        self._pending = [taps]
        proposal = self._propose(ctx, anchor.reshape(()).astype(mx.uint32))
        self._ahead = (taps.shape[0], marks)
        return proposal

    def slot_logits(self, slots: mx.array) -> mx.array:
        """Transformed target-head logits of draft slots [n, H] -> [n, V_target]."""
        return transform_logits(
            self._head(slots), self.spec.output_multiplier, self.spec.final_logit_softcapping
        )

    def propose(self, ctx: DraftContext) -> Proposal:
        return self._propose(ctx, mx.array(ctx.tokens[-1], dtype=mx.uint32))

    def _propose(self, ctx: DraftContext, anchor: mx.array) -> Proposal:
        """The round's block from `anchor` (a uint32 scalar, perhaps not computed yet)."""
        cap = min(ctx.cap, self.max_draft)
        if cap <= 0:
            return Proposal.empty()
        masks = mx.array(self._masks, dtype=mx.uint32)
        block_ids = mx.concatenate([anchor.reshape(1), masks])
        block = self._embed(block_ids)[None]
        if self._embed_scale != 1.0:
            block = block * self._embed_scale
        pending = self._pending
        context = None
        if pending:
            context = pending[0] if len(pending) == 1 else mx.concatenate(pending)
        hidden = self.drafter.backbone(block, context, self._cache)
        self._pending = []
        start = self.spec.logits_start
        slots = hidden[start : start + cap]
        logits = self.slot_logits(slots)
        width = logits.shape[-1]
        # Candidates come from the drafter's vocabulary (a padded head's extra rows never win).
        unary, candidates = top_candidates(
            logits[:, : self.spec.vocab_size], self.spec.selector_top_k
        )
        selector = self.drafter.candidate_selector
        if ctx.sampling.greedy:
            tokens, _ = walk(selector, slots, unary, candidates, anchor)
            return Proposal(tokens, cap)
        t = ctx.sampling.temperature
        tokens, q_rows = walk(selector, slots, unary, candidates, anchor, t, ctx.key)
        q = mx.zeros((cap, width), dtype=mx.float32)
        q = mx.put_along_axis(q, candidates, q_rows, axis=-1)
        return Proposal(tokens, cap, probs=q)


class DFlash2:
    name = "dflash2"
    description = "DFlash 2 drafter: parallel block with dynamic convs, candidate path selector"
    needs_drafter = True
    default_cap = 8

    def build(self, target: Target, drafter: DrafterSpec | None, options: dict) -> DFlash2Proposer:
        if drafter is None:
            raise OutriderError("--mode dflash2 needs a DFlash 2 drafter (--drafter)")
        if drafter.kind != "dflash2":
            raise OutriderError(
                f"--mode dflash2 needs a DFlash 2 drafter; this one is a {drafter.kind} drafter"
            )
        vocab = target.config.get("vocab_size") or (target.config.get("text_config") or {}).get(
            "vocab_size"
        )
        if vocab and vocab < drafter.vocab_size:
            raise OutriderError(
                f"DFlash 2 drafter vocabulary ({drafter.vocab_size}) is larger than the "
                f"target's ({vocab})"
            )
        model = load_dflash2_drafter(drafter, bits=options.get("drafter_bits", 4))
        return DFlash2Proposer(target, model)


@hookimpl
def register_strategies(register):
    register(DFlash2())
