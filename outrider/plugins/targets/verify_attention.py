"""Verify attention that stays on MLX's one-query attention kernel, for CUDA GPUs.

On MLX's CUDA backend `mx.fast.scaled_dot_product_attention` runs its fused vector kernel only
for fewer than 4 float32 query rows (one row in half precision); a verify forward of 5 or 8 rows
(cap 4 or 7) falls back to separate matmul, mask and softmax kernels in float32, which made a
5-row forward of the demo target cost 1.8x a one-row one on the H200
(docs/receipts/verify_kernels_h200.txt); in half precision (measured with head dim 64) it goes
to cuDNN, which builds a new graph for each key length. Split into causal chunks the kernel takes, each chunk seeing the keys up to
its own last row, the same attention runs as a few fused kernels, and each row is computed by
the kernel plain decoding uses.

`ChunkedAttention` wraps one model instance's attention module (never the class): widths one
kernel call takes, prefill chunks and any call it does not recognise go to the wrapped module
unchanged. By default only float32 models are split (see CHUNK for half precision). It knows
the mlx-lm attention layout shared by llama, qwen2, qwen3 and mistral (q/k/v/o projections,
optional per-head q/k norms, one rope); `install` checks that layout and then checks on a short
input that the wrapped forward agrees with the model's own before it keeps the wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ...core.device import attention_choice, split_attention
from ...core.wrapper import PassThrough

# Query rows per kernel call: MLX's CUDA vector kernel takes up to 3 float32 rows, and one row
# in half precision. Half precision is split only when OUTRIDER_ATTENTION=split asks for it:
# with head dim 64 on the H200, MLX's own path there builds a cuDNN graph for every new key
# length (40-60 ms a verify forward, once per round) and one row per call fixes that, but for
# other head dims it was not measured, and one row per call may cost more than MLX's own path.
CHUNK = {mx.float32: 3}
MAX_ROWS = 16  # wider forwards (prefill) keep MLX's own attention
LAYOUT = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
MODULES = ("llama", "qwen2", "qwen3", "mistral")  # mlx_lm.models.* with that exact layout
# How far the probe's logits may part, relative to the largest |logit|: kernel shapes round
# differently (TF32 matmuls on CUDA by ~1e-3, half precision by a few of its 8-bit steps); a
# wrong layout, mask or rope parts them by O(1).
PROBE_TOLERANCE = {mx.float32: 1e-2}
HALF_PROBE_TOLERANCE = 5e-2


def chunked_causal_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, chunk: int | None = None
) -> mx.array:
    """Causal attention of q [B, H, L, D] over k, v [B, Hkv, S, D], whose last L rows are the
    queries' own, as ceil(L / chunk) kernel calls: chunk rows [i, j) see keys [0, S - L + j)."""
    n, s = q.shape[2], k.shape[2]
    chunk = chunk or CHUNK.get(q.dtype, 1)
    parts = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        end = s - n + stop
        parts.append(
            mx.fast.scaled_dot_product_attention(
                q[:, :, start:stop], k[:, :, :end], v[:, :, :end], scale=scale, mask="causal"
            )
        )
    return mx.concatenate(parts, axis=2)


class ChunkedAttention(PassThrough):
    """One decoder layer's attention, with verify-width calls split into kernel-sized chunks."""

    wrapped = "attention"

    def __init__(self, attention: nn.Module, half: bool = False) -> None:
        super().__init__()
        self.attention = attention
        self.half = half  # split half-precision calls too, one row per kernel call

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        a = self.attention
        b, n, _ = x.shape
        chunk = CHUNK.get(x.dtype, 1 if self.half else MAX_ROWS)
        if not (chunk < n <= MAX_ROWS and type(cache) is KVCache and _is_causal(mask)):
            return a(x, mask=mask, cache=cache)
        q = a.q_proj(x).reshape(b, n, a.n_heads, -1)
        k = a.k_proj(x).reshape(b, n, a.n_kv_heads, -1)
        if "q_norm" in a:
            q, k = a.q_norm(q), a.k_norm(k)
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = a.rope(q, offset=cache.offset)
        k = a.rope(k, offset=cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        out = chunked_causal_attention(q, keys, values, a.scale, chunk)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _is_causal(mask: Any) -> bool:
    return isinstance(mask, str) and mask == "causal"


def fits(attention: nn.Module) -> bool:
    """Whether `attention` has the mlx-lm layout `ChunkedAttention` re-states."""
    module = type(attention).__module__.rsplit(".", 1)[-1]
    if module not in MODULES or type(attention).__name__ != "Attention":
        return False
    if not all(name in attention for name in LAYOUT):
        return False
    if ("q_norm" in attention) != ("k_norm" in attention):
        return False
    return all(hasattr(attention, a) for a in ("n_heads", "n_kv_heads", "scale"))


def install(model: nn.Module, layers: list, make_cache: Callable[[], list]) -> bool:
    """Wrap the attention of every layer in `layers` (the model's own list) when it is wanted
    and every layer fits, and keep the wrappers only if a short verify after a short prefill
    gives the model's own logits. Returns whether the wrappers stay."""
    if not split_attention():
        return False
    half = attention_choice() == "split"
    attentions = [getattr(layer, "self_attn", None) for layer in layers]
    if not attentions or not all(a is not None and fits(a) for a in attentions):
        return False
    reference, dtype = _probe(model, make_cache)
    if dtype not in CHUNK and not half:
        return False  # half precision stays on MLX's own path unless asked (see CHUNK)
    originals = []
    for layer in layers:
        originals.append(layer.self_attn)
        layer.self_attn = ChunkedAttention(layer.self_attn, half)
    got, _ = _probe(model, make_cache)
    limit = PROBE_TOLERANCE.get(dtype, HALF_PROBE_TOLERANCE) * mx.abs(reference).max().item()
    if mx.abs(got - reference).max().item() > limit + 1e-6:
        for layer, original in zip(layers, originals):
            layer.self_attn = original
        return False
    return True


def _probe(model: nn.Module, make_cache: Callable[[], list]) -> tuple[mx.array, mx.Dtype]:
    """Logits (as float32, and their own dtype) of an 8-row verify after a 4-token prefill:
    chunks of 3, 3 and 2 rows in float32, 8 single rows in half precision."""
    cache = make_cache()
    model(mx.array([[1, 2, 3, 4]], dtype=mx.uint32), cache=cache)
    logits = model(mx.array([[5, 6, 7, 8, 9, 10, 11, 12]], dtype=mx.uint32), cache=cache)
    as_f32 = logits.astype(mx.float32)
    mx.eval(as_f32)
    return as_f32, logits.dtype
