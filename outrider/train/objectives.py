"""DeepSpec's block-drafter objective, batched: anchors, the block forward, and the losses.

Per training window (deepseek-ai/DeepSpec, `deepspec/modeling/dspark/common.py` and `loss.py`;
the DSpark paper §3.3): sample anchors among supervised positions;
each anchor a gets a block [token at a, mask x (B-1)] at positions a..a+B-1 that sees the
target's tapped rows strictly before a and its own whole block. Slot k predicts the token at
a+k+1 (DeepSpec semantics, `logits_start` 0). Losses, weighted by exp(-k/gamma) over the
contiguous supervised prefix of each block:

    CE(z, label)                        z = base logits + Markov bias (teacher-forced)
    || softmax(z) - softmax(z_target) ||_1   z_target = the target's logits at a+k
    BCE(confidence, 1 - L1/2)           the confidence head learns the expected acceptance

The forward runs the inference network's own modules (`BlockDrafter`), so what is trained is
exactly what `outrider generate` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..plugins.strategies.block_drafter import BlockDrafter, DraftAttention


@dataclass(frozen=True)
class LossWeights:
    ce: float
    l1: float
    confidence: float
    gamma: float = 4.0  # DeepSpec's loss_decay_gamma

    @classmethod
    def for_kind(cls, kind: str, confidence_head: bool) -> LossWeights:
        """DeepSpec's recipes: DSpark 0.1 CE + 0.9 L1 + 1.0 BCE; DFlash CE only."""
        if kind == "dspark":
            return cls(0.1, 0.9, 1.0 if confidence_head else 0.0)
        return cls(1.0, 0.0, 0.0)


def sample_anchors(
    mask: np.ndarray, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Up to `n` anchors per row among positions t with mask[t] and mask[t+1] set.

    mask [b, T] -> (anchors [b, n] sorted, keep [b, n]); rows with fewer candidates are padded
    with position 0 and keep=False.
    """
    b = mask.shape[0]
    anchors = np.zeros((b, n), dtype=np.int32)
    keep = np.zeros((b, n), dtype=bool)
    for i in range(b):
        cand = np.flatnonzero(mask[i, :-1] & mask[i, 1:])
        if cand.size == 0:
            continue
        pick = np.sort(rng.choice(cand, size=min(n, cand.size), replace=False))
        anchors[i, : pick.size] = pick
        keep[i, : pick.size] = True
    return anchors, keep


def attention_mask(anchors: mx.array, seq_len: int, block_size: int) -> mx.array:
    """[b, 1, N·B, T + N·B]: block queries see context rows < their anchor and their own block."""
    b, n = anchors.shape
    rows = mx.repeat(anchors, block_size, axis=1)  # anchor of each query row [b, N·B]
    ctx = mx.arange(seq_len)[None, None, :] < rows[:, :, None]
    block_of = mx.repeat(mx.arange(n), block_size)
    own = block_of[:, None] == block_of[None, :]
    own = mx.broadcast_to(own[None], (b, n * block_size, n * block_size))
    return mx.concatenate([ctx, own], axis=-1)[:, None]


def _attend(
    attn: DraftAttention, u: mx.array, context: mx.array, anchors: mx.array, mask: mx.array
) -> mx.array:
    """One draft layer's attention for every block of a batch at once; u [b, N, B, H]."""
    b, n, bs, _ = u.shape
    offsets = anchors.reshape(-1)  # slot k of each block sits at its anchor + k

    def heads(x: mx.array, count: int) -> mx.array:  # [b, N, B, count·hd] -> [b·N, count, B, hd]
        return x.reshape(b * n, bs, count, -1).transpose(0, 2, 1, 3)

    q = attn.rope(attn.q_norm(heads(attn.q_proj(u), attn.n_heads)), offset=offsets)
    bk = attn.rope(attn.k_norm(heads(attn.k_proj(u), attn.n_kv)), offset=offsets)
    bv = heads(attn.v_proj(u), attn.n_kv)

    def heads1(x: mx.array, count: int) -> mx.array:  # [b, T, count·hd] -> [b, count, T, hd]
        return x.reshape(b, x.shape[1], count, -1).transpose(0, 2, 1, 3)

    def merge(x: mx.array, count: int) -> mx.array:  # [b·N, count, B, hd] -> [b, count, N·B, hd]
        return x.reshape(b, n, count, bs, -1).transpose(0, 2, 1, 3, 4).reshape(b, count, n * bs, -1)

    # context rows at their absolute positions 0..T-1; the context skips input_layernorm
    ck = attn.rope(attn.k_norm(heads1(attn.k_proj(context), attn.n_kv)))
    cv = heads1(attn.v_proj(context), attn.n_kv)
    keys = mx.concatenate([ck, merge(bk, attn.n_kv)], axis=2)
    values = mx.concatenate([cv, merge(bv, attn.n_kv)], axis=2)
    out = mx.fast.scaled_dot_product_attention(
        merge(q, attn.n_heads), keys, values, scale=attn.scale, mask=mask
    )
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, bs, -1))


def block_forward(
    drafter: BlockDrafter, taps: mx.array, block_ids: mx.array, anchors: mx.array
) -> mx.array:
    """taps [b, T, n·H], block ids [b, N, B], anchors [b, N] -> final-normed hidden [b, N, B, H]."""
    seq_len = taps.shape[1]
    block_size = block_ids.shape[-1]
    h = drafter.embed_tokens(block_ids)
    context = drafter.hidden_norm(drafter.fc(taps.astype(h.dtype)))
    mask = attention_mask(anchors, seq_len, block_size)
    for layer in drafter.layers:
        h = h + _attend(layer.self_attn, layer.input_layernorm(h), context, anchors, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


@dataclass
class Batch:
    """One optimizer step's inputs, all on the device.

    ids [b, T] and mask [b, T] of the windows; taps [b, T, n·H] and the target's probabilities
    at each block slot's position target_probs [b, N, B, V]; anchors / keep [b, N].
    """

    ids: mx.array
    mask: mx.array
    taps: mx.array
    target_probs: mx.array
    anchors: mx.array
    keep: mx.array


def slot_positions(anchors: mx.array, block_size: int) -> mx.array:
    """[b, N, B]: the position a+k of each block slot."""
    return anchors[..., None] + mx.arange(block_size)


def gather_rows(x: mx.array, positions: mx.array) -> mx.array:
    """x [b, T, ...] at positions [b, N, B] (clipped into range) -> [b, N, B, ...]."""
    b, t = x.shape[:2]
    pos = mx.clip(positions, 0, t - 1)
    flat = (mx.arange(b)[:, None, None] * t + pos).reshape(-1)
    rows = x.reshape(b * t, *x.shape[2:])[flat]
    return rows.reshape(*positions.shape, *x.shape[2:])


def losses(
    drafter: BlockDrafter, batch: Batch, mask_token_id: int, weights: LossWeights
) -> tuple[mx.array, dict[str, mx.array]]:
    """The weighted DeepSpec loss and its parts (CE, L1, confidence BCE, teacher-forced tau)."""
    spec = drafter.spec
    bs = spec.block_size
    t = batch.ids.shape[1]
    pos = slot_positions(batch.anchors, bs)  # slot k sits at a+k and predicts a+k+1
    label_pos = pos + 1
    labels = gather_rows(batch.ids, label_pos)
    prev = gather_rows(batch.ids, pos)  # teacher forcing: anchor, then the previous label
    valid = (label_pos < t) & (gather_rows(batch.mask, label_pos) > 0) & batch.keep[..., None]
    valid = mx.cumprod(valid.astype(mx.float32), axis=-1)  # a contiguous supervised prefix

    block_ids = mx.where(mx.arange(bs) == 0, prev[..., :1], mask_token_id).astype(mx.uint32)
    hidden = block_forward(drafter, batch.taps, block_ids, batch.anchors)
    z = drafter.lm_head(hidden).astype(mx.float32)
    e = None
    if spec.markov_rank > 0:
        bias, e = markov_bias(drafter, prev, hidden)
        z = z + bias.astype(mx.float32)

    logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(logp, labels[..., None].astype(mx.int32), axis=-1)[..., 0]
    l1 = mx.abs(mx.exp(logp) - batch.target_probs).sum(axis=-1)
    w = mx.exp(-mx.arange(bs, dtype=mx.float32) / weights.gamma) * valid
    norm = mx.maximum(w.sum(), 1e-6)
    parts = {"ce": (w * ce).sum() / norm, "l1": (w * l1).sum() / norm}
    loss = weights.ce * parts["ce"] + weights.l1 * parts["l1"]
    if spec.confidence_head and weights.confidence > 0:
        feats = [hidden, e] if spec.confidence_with_markov and e is not None else [hidden]
        c = drafter.confidence_head.proj(mx.concatenate(feats, axis=-1))[..., 0]
        goal = mx.stop_gradient(mx.clip(1 - 0.5 * l1, 0, 1))
        bce = nn.losses.binary_cross_entropy(c.astype(mx.float32), goal, with_logits=True)
        parts["confidence"] = (w * bce).sum() / norm
        loss = loss + weights.confidence * parts["confidence"]
    hit = (mx.argmax(z, axis=-1) == labels).astype(mx.float32) * valid
    blocks = mx.maximum(batch.keep.astype(mx.float32).sum(), 1.0)
    parts["tau"] = 1 + mx.cumprod(hit, axis=-1).sum() / blocks  # teacher-forced greedy accept
    parts["supervised"] = valid.sum()
    return loss, parts


def markov_bias(
    drafter: BlockDrafter, prev: mx.array, hidden: mx.array
) -> tuple[mx.array, mx.array]:
    """Teacher-forced Markov bias [b, N, B, V] and W1[prev] [b, N, B, r] for every slot."""
    head = drafter.markov_head
    if head.kind != "rnn":
        bias, e, _ = head.step(prev, hidden, None)
        return bias, e
    state = None
    biases, embeds = [], []
    for k in range(prev.shape[-1]):  # the recurrent state runs left to right over the block
        bias, e, state = head.step(prev[..., k], hidden[..., k, :], state)
        biases.append(bias)
        embeds.append(e)
    return mx.stack(biases, axis=-2), mx.stack(embeds, axis=-2)


def check_block_forward(drafter: BlockDrafter, seq_len: int = 12) -> float:
    """Max |difference| between the batched training forward and the cached inference forward
    on a small random input, for two blocks of one window, relative to the largest |value|.

    Run once per training run on the device that trains: a kernel that handled per-block
    positions or the block mask differently there would otherwise train the drafter on
    semantics it never sees at inference, silently.
    """
    spec = drafter.spec
    dtype = drafter.fc.weight.dtype
    key = mx.random.key(0)
    taps = mx.random.normal((1, seq_len, len(spec.target_layer_ids) * spec.hidden_size), key=key)
    taps = taps.astype(dtype)
    anchors = mx.array([[2, seq_len - 3]])
    ids = mx.random.randint(0, spec.vocab_size, (1, 2, spec.block_size), key=key)
    hidden = block_forward(drafter, taps, ids.astype(mx.uint32), anchors)
    worst = 0.0
    for j in range(2):
        a = anchors[0, j].item()
        block = drafter.embed_tokens(ids[0, j].astype(mx.uint32))[None]
        ref = drafter.backbone(block, taps[0, :a], drafter.make_cache())
        ref = ref.astype(mx.float32)
        diff = mx.abs(ref - hidden[0, j].astype(mx.float32)).max() / mx.abs(ref).max()
        worst = max(worst, diff.item())
    return worst
