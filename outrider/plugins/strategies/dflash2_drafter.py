"""The DFlash 2 drafter network: the DFlash block backbone with grouped dynamic causal
convolutions around each sublayer, and the candidate selector's parameters.

Forward as in z-lab/dflash `dflash/model.py` (DFlash2DraftModel, Qwen3DFlashDecoderLayer,
GroupedDynamicCausalConv): `a = conv.prepare(input_norm(h))`, `h += conv.finish(attn(a))`, the
same around the MLP. The convolutions see the block only (the context enters as K/V), so slot 0
(the anchor) reads zero padding. Sliding layers see keys within `sliding_window` positions and
keep the last `window - 1` context rows; a layer is causal when the config's `is_causal` says
so, else when it slides (z-lab `Qwen3DFlashAttention`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...core.cpu_fusion import fuse_for_cpu
from ...core.device import split_attention
from ...core.drafter_spec import DrafterSpec
from .block_drafter import ContextBackbone, DraftAttention, DraftMLP
from .draft_context import ContextCache, ordered_mask
from .drafter_weights import load_strict, quantize


def grouped_causal_conv(
    x: mx.array, dynamic: mx.array, base: mx.array, group_size: int
) -> mx.array:
    """y_t = sum_o (base[o] + dynamic[t, o, group]) * x_{t-o}, with x_{t-o} = 0 before row 0.

    x [b, n, H]; dynamic [b, n, K, H / group_size] (one correction per channel group, made from
    row t's own input); base [K, H].
    """
    b, n, h = x.shape
    groups = h // group_size
    rows = x.reshape(b, n, groups, group_size)
    out = mx.zeros_like(rows)
    for o in range(base.shape[0]):
        if o == 0:
            shifted = rows
        elif o >= n:
            continue
        else:
            pad = mx.zeros((b, o, groups, group_size), dtype=rows.dtype)
            shifted = mx.concatenate([pad, rows[:, : n - o]], axis=1)
        tap = base[o].reshape(1, 1, groups, group_size) + dynamic[:, :, o, :, None]
        out = out + tap * shifted
    return out.reshape(b, n, h)


class GroupedDynamicCausalConv(nn.Module):
    """One instance wraps one sublayer: `prepare` convolves its input with kernel side 0 and
    hands back side 1 of the dynamic kernel (made from the same input) for `finish`."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        groups = hidden_size // group_size
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        dyn = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, -1)
        out = grouped_causal_conv(x, dyn[:, :, 0], self.base_kernel[0], self.group_size)
        return out, dyn[:, :, 1]

    def finish(self, x: mx.array, dyn: mx.array) -> mx.array:
        return grouped_causal_conv(x, dyn, self.base_kernel[1], self.group_size)


class WindowContextCache:
    """Context K/V of a sliding layer: only the last `window - 1` rows are kept between calls
    (z-lab crops its sliding cache so); a call sees those plus the rows it adds."""

    def __init__(self, window: int) -> None:
        self.keep = window - 1
        self.offset = 0  # context rows seen, i.e. the block's first position
        self._kept: tuple[mx.array | None, mx.array | None] = (None, None)

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += keys.shape[2]
        old_k, old_v = self._kept
        if old_k is not None:
            keys = mx.concatenate([old_k, keys], axis=2)
            values = mx.concatenate([old_v, values], axis=2)
        self._kept = (keys[:, :, -self.keep :], values[:, :, -self.keep :])
        return keys, values

    def fetch(self) -> tuple[mx.array | None, mx.array | None]:
        return self._kept

    def mark(self) -> tuple:
        """What the cache holds now (for `rewind`): its arrays are never written in place."""
        return self.offset, self._kept

    def rewind(self, mark: tuple) -> None:
        """Back to what it held at `mark` (see `ContextCache.rewind`)."""
        self.offset, self._kept = mark

    def mask(self, n: int, keys: int, causal: bool, window: int | None) -> mx.array | None:
        """Keys in order: the last context positions kept, then the block's."""
        return ordered_mask(self.offset, keys - n, n, causal, window)


class DFlash2Attention(DraftAttention):
    """Block attention over the context cache, with the layer's window and causality."""

    def __init__(self, spec: DrafterSpec, layer_type: str):
        super().__init__(spec, layer_type)
        configured = spec.extra.get("is_causal")
        self.causal = layer_type == "sliding_attention" if configured is None else bool(configured)


class DFlash2Layer(nn.Module):
    def __init__(self, spec: DrafterSpec, layer_type: str):
        super().__init__()
        h, k, g = spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size
        self.self_attn = DFlash2Attention(spec, layer_type)
        self.mlp = DraftMLP(h, spec.intermediate_size)
        self.input_layernorm = nn.RMSNorm(h, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=spec.rms_norm_eps)
        self.attention_conv = GroupedDynamicCausalConv(h, k, g)
        self.mlp_conv = GroupedDynamicCausalConv(h, k, g)

    def __call__(self, h: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        a, dyn = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(a, context, cache), dyn)
        m, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), dyn)


class CandidateSelector(nn.Module):
    """Low-rank predecessor/successor lattice over each slot's top-k candidates.

    Edge score of predecessor a and candidate c at slot t: U_t(c) + <A[a] * P h_t, S[c]>
    (z-lab `CandidateSelector.select`). The codebooks are plain arrays, named as published.
    """

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        v, r = spec.vocab_size, spec.selector_rank
        self.top_k = spec.selector_top_k
        self.hidden_projection = nn.Linear(spec.hidden_size, r, bias=False)
        self.predecessor_codebook = mx.zeros((v, r))
        self.successor_codebook = mx.zeros((v, r))

    def lattice(self, hidden: mx.array, candidates: mx.array) -> mx.array:
        """[n, K, R] rows S[c] * P h_t: the edge score's pairwise term is lattice @ A[prev]."""
        ph = self.hidden_projection(hidden).astype(mx.float32)  # [n, R]
        succ = self.successor_codebook[candidates].astype(mx.float32)  # [n, K, R]
        return succ * ph[:, None, :]

    def predecessor(self, token: mx.array) -> mx.array:
        return self.predecessor_codebook[token].astype(mx.float32)


class DFlash2Drafter(ContextBackbone, nn.Module):
    """DFlash 2 network; its parameter names are the published tensor names."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        types = spec.layer_types or ("full_attention",) * spec.num_layers
        self.fc = nn.Linear(len(spec.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=spec.rms_norm_eps)
        self.layers = [DFlash2Layer(spec, t) for t in types]
        self.norm = nn.RMSNorm(h, eps=spec.rms_norm_eps)
        self.candidate_selector = CandidateSelector(spec)

    def make_cache(self) -> list[ContextCache | WindowContextCache]:
        return [
            WindowContextCache(layer.self_attn.window)
            if layer.self_attn.window is not None
            else ContextCache()
            for layer in self.layers
        ]


def _quantizable(path: str, module: nn.Module, group_size: int) -> bool:
    """Attention, MLP and fc projections; the convs' and selector's small projections stay."""
    return (
        isinstance(module, nn.Linear)
        and "kernel_projection" not in path
        and not path.startswith("candidate_selector")
        and module.weight.shape[-1] % group_size == 0
        and module.weight.shape[0] > 1
    )


def load_dflash2_drafter(spec: DrafterSpec, bits: int = 4, group_size: int = 64) -> DFlash2Drafter:
    """Build the network, check the checkpoint's tensors strictly, load, optionally quantise."""
    if bits not in (4, 8, 16):
        raise ValueError(f"drafter bits must be 16, 8 or 4, got {bits}")
    model = DFlash2Drafter(spec)
    load_strict(model, spec.weights, "DFlash 2")
    spec.weights = {}  # the network holds them now
    quantize(model, bits, group_size, keep=lambda path, m: not _quantizable(path, m, group_size))
    if split_attention():
        for layer in model.layers:
            if not layer.self_attn.causal and layer.self_attn.window is None:
                layer.self_attn.fold_rows = True
    fuse_for_cpu(model)  # MLX's CPU backend runs norms and ropes unfused
    return model
