"""The Gemma-4 block drafter (DeepSpec's `Gemma4DSparkModel`): the block drafter of
`block_drafter.py` with Gemma-4's own layer conventions.

What differs from the Qwen3 backbone (deepseek-ai/DeepSpec
`deepspec/modeling/dspark/gemma4/modeling.py`, on transformers' `modeling_gemma4.py`):
- attention scale 1.0 (q_norm / k_norm carry the scale); head size `global_head_dim`;
- V is RMS-normalised without a weight (`v_norm`); with `attention_k_eq_v` there is no v_proj
  and V is the raw K projection (K alone goes through k_norm and RoPE);
- sandwich norms: post_attention_layernorm on the attention output before the residual add,
  pre_/post_feedforward_layernorm around a gelu-tanh gated MLP; the layer output is multiplied
  by the `layer_scalar` buffer;
- every RMSNorm is plain `x / rms(x) * w` (Gemma4RMSNorm; no `1 + w` offset);
- block embeddings are `E[x] * sqrt(H)` (Gemma4TextScaledWordEmbedding), and base logits are
  soft-capped, `c * tanh(U / c)` with `final_logit_softcapping` (`compute_logits`), before the
  Markov bias is added.
The embedding scale and the soft cap live in the `embed_tokens` / `lm_head` modules themselves
(also once quantised), so `BlockProposer` drives this network exactly as the Qwen3 one.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ...core.drafter_spec import DrafterSpec
from .block_drafter import BlockDrafter, DraftAttention, DraftMLP
from .draft_context import ContextCache


class ScaledEmbedding(nn.Embedding):
    """Gemma4TextScaledWordEmbedding: rows times sqrt(H), the scale rounded to the rows' dtype."""

    def __init__(self, num_embeddings: int, dims: int, scale: float):
        super().__init__(num_embeddings, dims)
        self.scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        rows = super().__call__(x)
        return rows * mx.array(self.scale, dtype=rows.dtype)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        if quantize_input:
            raise ValueError("Quantized input is not supported.")
        q = ScaledQuantizedEmbedding.from_embedding(self, group_size, bits, mode)
        q.scale = self.scale
        return q


class ScaledQuantizedEmbedding(nn.QuantizedEmbedding):
    scale = 1.0

    def __call__(self, x: mx.array) -> mx.array:
        rows = super().__call__(x)
        return rows * mx.array(self.scale, dtype=rows.dtype)


def softcap(logits: mx.array, cap: float | None) -> mx.array:
    """cap * tanh(logits / cap), in float32; None leaves the logits as they are."""
    if cap is None:
        return logits
    return mx.tanh(logits.astype(mx.float32) / cap) * cap


class SoftcappedHead(nn.Linear):
    """The output head with Gemma-4's final-logit soft cap applied to what it returns."""

    def __init__(self, dims: int, rows: int, cap: float | None):
        super().__init__(dims, rows, bias=False)
        self.cap = cap

    def __call__(self, x: mx.array) -> mx.array:
        return softcap(super().__call__(x), self.cap)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        if quantize_input:
            raise ValueError("Quantized input is not supported.")
        q = SoftcappedQuantizedHead.from_linear(self, group_size, bits, mode)
        q.cap = self.cap
        return q


class SoftcappedQuantizedHead(nn.QuantizedLinear):
    cap = None

    def __call__(self, x: mx.array) -> mx.array:
        return softcap(super().__call__(x), self.cap)


class Gemma4DraftAttention(DraftAttention):
    """DraftAttention (context K/V cache, bidirectional block) with Gemma-4's projections."""

    def __init__(self, spec: DrafterSpec):
        super().__init__(spec)  # q/k/v projections, q_norm / k_norm, full-attention RoPE
        self.scale = 1.0
        self.eps = spec.rms_norm_eps
        self.k_eq_v = bool(spec.extra.get("attention_k_eq_v", False))
        if self.k_eq_v:
            del self.v_proj
        self.o_proj = nn.Linear(
            self.n_heads * spec.head_dim, spec.hidden_size, bias=spec.attention_bias
        )

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        b, n, _ = x.shape
        k = self.k_proj(x).reshape(b, n, self.n_kv, -1)
        v = k if self.k_eq_v else self.v_proj(x).reshape(b, n, self.n_kv, -1)
        k = self.k_norm(k).transpose(0, 2, 1, 3)
        v = mx.fast.rms_norm(v, None, self.eps).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v


class Gemma4DraftMLP(DraftMLP):
    def __init__(self, h: int, inter: int, activation: str):
        super().__init__(h, inter)
        self.exact_gelu = activation == "gelu"

    def __call__(self, x: mx.array) -> mx.array:
        gate = self.gate_proj(x)
        gate = nn.gelu(gate) if self.exact_gelu else nn.gelu_approx(gate)
        return self.down_proj(gate * self.up_proj(x))


class Gemma4DraftLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, index: int):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        wide = index in spec.extra.get("double_wide_mlp_layers", ())
        inter = spec.intermediate_size * (2 if wide else 1)
        self.self_attn = Gemma4DraftAttention(spec)
        self.mlp = Gemma4DraftMLP(h, inter, spec.extra.get("hidden_activation", ""))
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, h: mx.array, context: mx.array | None, cache: ContextCache) -> mx.array:
        attn = self.self_attn(self.input_layernorm(h), context, cache)
        h = h + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class Gemma4BlockDrafter(BlockDrafter):
    """BlockDrafter (fc, hidden_norm, norm, heads, backbone call) with Gemma-4 layers, a scaled
    embedding and a soft-capped head; parameter names are DeepSpec's saved tensor names."""

    def __init__(self, spec: DrafterSpec):
        super().__init__(spec)
        h = spec.hidden_size
        self.layers = [Gemma4DraftLayer(spec, i) for i in range(spec.num_layers)]
        if "embed_tokens" in self:
            rows = self.embed_tokens.weight.shape[0]
            self.embed_tokens = ScaledEmbedding(rows, h, math.sqrt(h))
        if "lm_head" in self:
            rows = self.lm_head.weight.shape[0]
            self.lm_head = SoftcappedHead(h, rows, spec.final_logit_softcapping)

    def logits(self, hidden: mx.array) -> mx.array:
        """Base logits of slot hiddens: the soft-capped head (DeepSpec `compute_logits`)."""
        return self.lm_head(hidden)
