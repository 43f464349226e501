"""The EAGLE-3 drafter network: one decoder layer over [token embedding ; fused target taps].

Per row (deepseek-ai/DeepSpec `deepspec/modeling/eagle3/qwen3/modeling.py`; SpecForge
`specforge/modeling/draft/llama3_eagle.py`; vllm-project/speculators
`src/speculators/models/eagle3/model_definitions.py`): g = fc(concat taps) for a context row, or
the drafter's own previous un-normed output for a chained step; the layer reads
x = [input_layernorm(E[token]) ; hidden_norm(g)] (2H wide) for q/k/v, adds attention to the
residual g, then its MLP; logits are lm_head(norm(h)). The layer keeps its K/V in an mlx-lm
`KVCache`, whose offset is the RoPE position of the next row, so rollback is a trim.

Packaging options a format may set in `spec.extra` (speculators / SpecForge config flags):
`norm_before_residual` (the residual is hidden_norm(g)), `fc_norm` (one RMSNorm per tap before
fc), `input_norm` (one RMSNorm over the concatenated taps), `norm_feedback` (chained steps read
norm(h), Eagle 3.1), `norm_before_head` (False: lm_head reads h unnormed).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ...core.cpu_fusion import fuse_for_cpu
from ...core.device import split_attention
from ...core.drafter_spec import DrafterSpec
from ...core.errors import CheckpointError
from ..targets.attention_forms import chunked_causal_attention
from ..targets.verify_attention import MAX_ROWS
from .block_drafter import DraftMLP, drafter_rope
from .drafter_weights import load_strict, quantize


class Eagle3Attention(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        h, hd, bias = spec.hidden_size, spec.head_dim, spec.attention_bias
        self.n_heads, self.n_kv = spec.num_heads, spec.num_kv_heads
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(2 * h, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=bias)
        if spec.backbone == "qwen3":  # Qwen3 layers norm q and k per head; Llama layers do not
            self.q_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)
            self.k_norm = nn.RMSNorm(hd, eps=spec.rms_norm_eps)
        self.rope = drafter_rope(spec, hd)
        # Several rows at once (the rows a verify committed, caught up when the next round
        # drafts) go to the one-query kernel in causal chunks: on MLX's CUDA backend a
        # half-precision multi-row call builds a cuDNN graph for every new key length, which
        # made a 2-row catch-up cost ~35 ms on the H200 (a whole round of the SmolLM2 pair
        # takes ~6; benchmarks/round_profile.py). A drafter has one layer and a few rows:
        # one kernel call a row costs microseconds.
        self.split_rows = False

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1)
        k = self.k_proj(x).reshape(b, n, self.n_kv, -1)
        v = self.v_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        if self.split_rows and 1 < n <= MAX_ROWS:  # a round's catch-up rows, on a CUDA GPU
            out = chunked_causal_attention(q, keys, values, self.scale)
        else:
            mask = "causal" if n > 1 else None
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.norm_before_residual = bool(spec.extra.get("norm_before_residual", False))
        self.self_attn = Eagle3Attention(spec)
        self.mlp = DraftMLP(h, spec.intermediate_size)
        self.hidden_norm = nn.RMSNorm(h, eps=eps)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)

    def __call__(self, embeds: mx.array, g: mx.array, cache: KVCache) -> mx.array:
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + self.self_attn(x, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter; its parameter names are the canonical (DeepSpec) tensor names."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        if spec.num_layers != 1:
            raise CheckpointError(
                f"EAGLE-3 drafters with {spec.num_layers} layers are not supported (one layer, "
                "as DeepSpec's evaluator requires)"
            )
        self.spec = spec
        h, eps, n_taps = spec.hidden_size, spec.rms_norm_eps, len(spec.target_layer_ids)
        extra = spec.extra
        self.norm_feedback = bool(extra.get("norm_feedback", False))
        self.norm_before_head = bool(extra.get("norm_before_head", True))
        if extra.get("input_norm"):
            self.input_norm = nn.RMSNorm(n_taps * h, eps=eps)
        if extra.get("fc_norm"):
            self.fc_norm = [nn.RMSNorm(h, eps=eps) for _ in range(n_taps)]
        self.fc = nn.Linear(n_taps * h, h, bias=False)
        self.layers = [Eagle3Layer(spec)]
        self.norm = nn.RMSNorm(h, eps=eps)
        if spec.own_embedding:
            self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        if spec.own_lm_head:
            self.lm_head = nn.Linear(h, spec.draft_vocab_size or spec.vocab_size, bias=False)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def project(self, taps: mx.array) -> mx.array:
        """Target taps [S, n·H] -> the layer's hidden input g [1, S, H]."""
        x = taps.astype(self.norm.weight.dtype)[None]
        if "input_norm" in self:
            x = self.input_norm(x)
        if "fc_norm" in self:
            parts = mx.split(x, len(self.fc_norm), axis=-1)
            x = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts)], axis=-1)
        return self.fc(x)

    def step(self, embeds: mx.array, g: mx.array, cache: list[KVCache]) -> mx.array:
        """Rows of (token embedding, hidden input) [1, n, H] each -> the layer's output h.

        The rows take the next n positions of the cache; the output is what a chained step
        feeds back (normed first under `norm_feedback`)."""
        h = self.layers[0](embeds, g.astype(embeds.dtype), cache[0])
        return self.norm(h) if self.norm_feedback else h

    def head_input(self, h: mx.array) -> mx.array:
        """What the output head reads of a step's output."""
        if self.norm_feedback or not self.norm_before_head:
            return h
        return self.norm(h)


def load_eagle3_drafter(spec: DrafterSpec, bits: int = 4, group_size: int = 64) -> Eagle3Drafter:
    """Build the network, check the checkpoint's tensors strictly, load, optionally quantise.

    `d2t` (a reduced head's map) is not a network weight: it stays in `spec.weights`."""
    model = Eagle3Drafter(spec)
    got = {k: v for k, v in spec.weights.items() if k != "d2t"}
    load_strict(model, got, "EAGLE-3 drafter", f"a {spec.format} drafter")
    # The network holds them now; only the vocabulary map stays with the spec.
    spec.weights = {k: v for k, v in spec.weights.items() if k == "d2t"}
    quantize(model, bits, group_size)
    if split_attention():
        for layer in model.layers:
            layer.self_attn.split_rows = True
    fuse_for_cpu(model)  # MLX's CPU backend runs norms and ropes unfused
    return model
