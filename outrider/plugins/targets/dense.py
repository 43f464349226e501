"""Dense mlx-lm targets: a plain decoder-layer list and trimmable KV caches (qwen3, llama,
qwen2, mistral, ...). Rollback is a trim of every layer's KV cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING
from mlx_lm.utils import load as mlx_lm_load

from ...core import gguf, gguf_header
from ...core.errors import FamilyDeclined, UnsupportedTargetError
from ...core.hookspecs import hookimpl
from . import verify_attention
from .batched import BatchedRows
from .caches import Snapshots

# Families whose caches are not plain KV (recurrent state, sliding windows): another plugin's job.
NOT_DENSE = {
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "nemotron_h",
    "mamba",
    "mamba2",
    "gemma3",
    "gemma3_text",
    "gemma4",
    "gemma4_text",
    "lfm2",
    "lfm2_moe",
    "recurrent_gemma",
    "rwkv7",
    "plamo2",
    "falcon_h1",
    "granitemoehybrid",
    "jamba",
    "muse_glimmer",
    "prism_hadamard_qwen35",
    "nanbeige",  # looped depth: looped.py
}


def model_type(config: dict) -> str:
    t = config.get("model_type", "")
    return MODEL_REMAPPING.get(t, t)


def _inner(model: nn.Module) -> nn.Module:
    for name in ("model", "language_model", "backbone", "transformer"):
        inner = getattr(model, name, None) if name in model else None
        if isinstance(inner, nn.Module):
            return inner
    raise UnsupportedTargetError("cannot find the model's decoder stack")


class DenseFamily(BatchedRows, Snapshots):
    name = "dense"
    # rollback is a trim, so a verify forward may run padded to a cheaper width (core/device.py)
    pads_verify = True
    description = "mlx-lm decoder-only models with plain KV caches (qwen3, llama, qwen2, ...)"

    def supports(self, config: dict) -> bool:
        t = model_type(config)
        if not t or t in NOT_DENSE or "vision_config" in config:
            return False
        return importlib.util.find_spec(f"mlx_lm.models.{t}") is not None

    def load(self, path: Path, config: dict) -> tuple[nn.Module, Any]:
        # A GGUF file is another packaging of the same mlx-lm architectures (core/gguf.py).
        if gguf_header.is_gguf(path):
            model, tokenizer = gguf.load(path, config)
        else:
            model, tokenizer = mlx_lm_load(str(path))
        caches = make_prompt_cache(model)
        odd = {type(c).__name__ for c in caches if not isinstance(c, (KVCache, QuantizedKVCache))}
        if odd:
            raise FamilyDeclined(
                f"model_type {config.get('model_type')!r} uses {', '.join(sorted(odd))} caches, "
                "which the dense family cannot roll back"
            )
        verify_attention.install(model, self.layers(model), lambda: make_prompt_cache(model))
        return model, tokenizer

    def layers(self, model: nn.Module) -> list:
        # The decoder stack's own list: `model.layers` is a sliced copy on pipeline-capable
        # models, and wrapping entries of a copy would tap nothing.
        return _inner(model).layers

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        return _inner(model).embed_tokens(ids)

    def project(self, model: nn.Module, hidden: mx.array) -> mx.array:
        if "lm_head" in model:
            return model.lm_head(hidden)
        return _inner(model).embed_tokens.as_linear(hidden)

    def make_cache(self, model: nn.Module) -> list:
        return make_prompt_cache(model)

    def rollback(self, cache: list, n: int) -> None:
        for c in cache:
            c.trim(n)


class Gemma2Family(DenseFamily):
    """Gemma 2 as mlx-lm's gemma2 runs it: plain KV caches (mlx-lm slides no window, so
    neither does this; past 4,096 tokens both part from the reference model), embeddings
    scaled by √hidden and logits soft-capped in the model's own forward. The dense family ran
    it before, but handed drafters that share the target's embedding and head the unscaled
    embedding and uncapped logits."""

    name = "gemma2"
    description = "Gemma 2 (gemma2): plain KV caches, scaled embeddings, soft-capped logits"
    priority = 1  # before `dense`, which would claim the same model_type

    def supports(self, config: dict) -> bool:
        return model_type(config) == "gemma2" and "vision_config" not in config

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        inner = _inner(model)
        return inner.embed_tokens(ids) * (inner.args.hidden_size**0.5)

    def project(self, model: nn.Module, hidden: mx.array) -> mx.array:
        cap = model.final_logit_softcapping
        return mx.tanh(super().project(model, hidden) / cap) * cap


@hookimpl
def register_target_families(register):
    register(DenseFamily())
    register(Gemma2Family())
