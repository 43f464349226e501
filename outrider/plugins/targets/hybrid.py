"""Hybrid targets with recurrent state: gated-delta-net (Qwen3.5 / 3.6 / 3.8, Qwen3-Next,
Ornith, Ternary-Bonsai, MoE variants), Mamba-2 (Nemotron-H) and gated short convolutions
(LiquidAI LFM2, LFM2.5). Attention layers keep KV caches
that trim; each recurrent mixer is wrapped per instance so a verify forward records its state
after every token, and rollback restores the state at the accept point (see caches.py)."""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ...core.hookspecs import hookimpl
from . import verify_attention
from .base import MlxLmFamily
from .batched import BatchedRows
from .caches import Snapshots, wrap_mixers


class GatedDeltaFamily(BatchedRows, Snapshots, MlxLmFamily):
    name = "gated_delta"
    description = (
        "gated-delta-net hybrids with recurrent state (qwen3_5, qwen3_5_moe, qwen3_next, "
        "prism_hadamard_qwen35)"
    )
    model_types = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "prism_hadamard_qwen35"})

    def prepare(self, model: nn.Module) -> None:
        layers = self.layers(model)
        wrap_mixers(layers, "linear_attn", lambda layer: getattr(layer, "is_linear", False))
        # the attention layers, on a CUDA GPU (verify_attention.py)
        verify_attention.install(model, layers, lambda: make_prompt_cache(model))


class NemotronHFamily(BatchedRows, Snapshots, MlxLmFamily):
    name = "nemotron_h"
    description = "Mamba-2 + attention + MoE hybrids with recurrent state (nemotron_h)"
    model_types = frozenset({"nemotron_h"})

    def prepare(self, model: nn.Module) -> None:
        layers = self.layers(model)
        wrap_mixers(layers, "mixer", lambda layer: getattr(layer, "block_type", "") == "M")
        verify_attention.install(  # the attention blocks, on a CUDA GPU (verify_attention.py)
            model,
            layers,
            lambda: make_prompt_cache(model),
            attr="mixer",
            attends=lambda layer: getattr(layer, "block_type", "") == "*",
        )

    def embed(self, model, ids):
        return model.backbone.embeddings(ids)


class ShortConvFamily(BatchedRows, Snapshots, MlxLmFamily):
    """LFM2's gated short convolutions keep the last few inputs as state (an `ArraysCache`),
    which rolls back by replay like the other recurrent mixers."""

    name = "short_conv"
    description = "gated short-convolution + attention hybrids (lfm2, lfm2_moe)"
    model_types = frozenset({"lfm2", "lfm2_moe"})

    def prepare(self, model: nn.Module) -> None:
        layers = self.layers(model)
        wrap_mixers(layers, "conv", lambda layer: not getattr(layer, "is_attention_layer", True))
        verify_attention.install(model, layers, lambda: make_prompt_cache(model))


@hookimpl
def register_target_families(register):
    register(GatedDeltaFamily())
    register(NemotronHFamily())
    register(ShortConvFamily())
