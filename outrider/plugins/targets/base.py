"""What the mlx-lm target families share: finding the decoder stack, detecting the family from
config.json, building caches that can roll back, and rolling back every cache kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING
from mlx_lm.utils import load as mlx_lm_load

from ...core.errors import UnsupportedTargetError
from . import caches


def model_types(config: dict) -> tuple[str, str]:
    """(top-level model_type, text_config model_type), each after mlx-lm's remapping."""
    top = config.get("model_type", "") or ""
    text = (config.get("text_config") or {}).get("model_type", "") or ""
    return MODEL_REMAPPING.get(top, top), MODEL_REMAPPING.get(text, text)


def decoder(model: nn.Module) -> nn.Module:
    """The module that owns the decoder-layer list (the list its forward iterates)."""
    node = model
    for _ in range(4):
        if "layers" in node and isinstance(node["layers"], list):
            return node
        for name in ("language_model", "model", "backbone", "transformer"):
            child = node[name] if name in node else None
            if isinstance(child, nn.Module):
                node = child
                break
        else:
            break
    raise UnsupportedTargetError("cannot find the model's decoder stack")


def head_owner(model: nn.Module) -> nn.Module:
    """The module holding lm_head (the text model inside a multimodal wrapper)."""
    lm = model["language_model"] if "language_model" in model else model
    return lm if isinstance(lm, nn.Module) else model


class MlxLmFamily:
    """An mlx-lm text family: loaded by mlx-lm, caches rolled back per kind (see caches.py).

    Subclasses name their model_types and, where the model holds recurrent state, wrap its
    recurrent mixers per instance in `prepare`.
    """

    name = "mlx_lm"
    description = ""
    model_types: frozenset[str] = frozenset()

    def supports(self, config: dict) -> bool:
        return bool(self.model_types & set(model_types(config)))

    def load(self, path: Path, config: dict) -> tuple[nn.Module, Any]:
        model, tokenizer = mlx_lm_load(str(path))
        self.prepare(model)
        return model, tokenizer

    def prepare(self, model: nn.Module) -> None:
        """Install per-instance wrappers the family's rollback needs (none by default)."""

    def layers(self, model: nn.Module) -> list:
        return decoder(model).layers

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        return decoder(model).embed_tokens(ids)

    def project(self, model: nn.Module, hidden: mx.array) -> mx.array:
        owner = head_owner(model)
        if "lm_head" in owner:
            return owner.lm_head(hidden)
        return decoder(model).embed_tokens.as_linear(hidden)

    def make_cache(self, model: nn.Module) -> list:
        return caches.as_recording(make_prompt_cache(model))

    def begin_forward(self, cache: list, verify: bool) -> None:
        caches.begin_forward(cache, verify)

    def rollback(self, cache: list, n: int) -> None:
        caches.rollback_all(cache, n)
