"""Reduced draft vocabularies (vLLM speculators, SpecForge EAGLE-3 heads).

A head over `draft_vocab_size` < V ids ships a `d2t` table of *offsets*: the target id of draft
id i is i + d2t[i] (vllm-project/speculators; SpecForge writes the same table). Greedy drafting
maps the chosen draft id to its target id; sampled drafting must hand rejection sampling a q
over the target vocabulary, zero outside the draft vocabulary, or it stops being lossless.
"""

from __future__ import annotations

import mlx.core as mx

from .errors import CheckpointError


class DraftVocab:
    """The map from a reduced head's ids to the target's (identity when the head is full)."""

    def __init__(self, d2t: mx.array | None, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.target_ids: mx.array | None = None
        if d2t is not None:
            ids = mx.arange(d2t.shape[0], dtype=mx.int64) + d2t.astype(mx.int64)
            lo, hi = mx.min(ids).item(), mx.max(ids).item()
            if lo < 0 or hi >= vocab_size:
                raise CheckpointError(
                    f"d2t maps draft ids to target ids {lo}..{hi}, outside the target's "
                    f"vocabulary of {vocab_size}"
                )
            if len(set(ids.tolist())) != ids.shape[0]:
                raise CheckpointError("d2t maps two draft ids to the same target id")
            self.target_ids = ids.astype(mx.uint32)

    @property
    def reduced(self) -> bool:
        return self.target_ids is not None

    def to_target(self, draft_ids: mx.array) -> mx.array:
        """Target ids of draft ids (any shape)."""
        if self.target_ids is None:
            return draft_ids.astype(mx.uint32)
        return self.target_ids[draft_ids]

    def widen(self, q: mx.array) -> mx.array:
        """q [..., Vd] over the draft vocabulary -> [..., V] over the target's, zeros elsewhere."""
        if self.target_ids is None:
            return q
        out = mx.zeros((*q.shape[:-1], self.vocab_size), dtype=q.dtype)
        out[..., self.target_ids] = q
        return out


def read_draft_vocab(
    d2t: mx.array | None, t2d: mx.array | None, draft_vocab_size: int, vocab_size: int
) -> DraftVocab:
    """Check a reduced head's saved buffers against each other and the declared sizes.

    vllm-project/speculators `src/speculators/model.py` (`DraftVocabMixin`) saves `d2t`
    [draft_vocab] int64 offsets and `t2d` [V] bool (True at the target ids the head covers);
    `t2d` is redundant, so it is only checked when present.
    """
    if d2t is None:
        raise CheckpointError(
            f"draft_vocab_size {draft_vocab_size} is smaller than the vocabulary ({vocab_size}) "
            "but the checkpoint has no d2t table"
        )
    if d2t.ndim != 1 or d2t.shape[0] != draft_vocab_size:
        raise CheckpointError(
            f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},) "
            "from draft_vocab_size"
        )
    if not mx.issubdtype(d2t.dtype, mx.integer):
        raise CheckpointError(f"d2t must hold integer offsets, got {d2t.dtype}")
    vocab = DraftVocab(d2t, vocab_size)
    if t2d is not None:
        if t2d.ndim != 1 or t2d.shape[0] != vocab_size:
            raise CheckpointError(
                f"t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) from vocab_size"
            )
        covered = t2d.astype(mx.bool_)
        if int(covered.sum().item()) != draft_vocab_size or not bool(
            mx.all(covered[vocab.target_ids]).item()
        ):
            raise CheckpointError("t2d and d2t disagree about which target ids the head covers")
    return vocab
