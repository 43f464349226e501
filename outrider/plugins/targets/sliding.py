"""Sliding-window targets: Gemma-4 (mlx-lm `gemma4_text`, and the mlx-vlm `gemma4` language
tower), Gemma 3 (mlx-lm `gemma3_text` and `gemma3`) and Muse-Glimmer (sliding layers plus NoPE global layers; mlx-lm `muse_glimmer`, and the
mlx-vlm one). Sliding layers use rotating caches; their rollback stays exact after the window
has wrapped (see caches.py). A multimodal checkpoint (one with a vision_config) is loaded
through mlx-vlm and only its language model runs, wrapped per instance as `LanguageTower`.
Several rows batch (continuous batching): sliding layers in a batched rotating cache, global
layers in a batched KV cache, each row rolled back exactly after a verify round (batched.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ...core import gguf, gguf_header
from ...core.errors import UnsupportedTargetError
from ...core.hookspecs import hookimpl
from . import verify_attention
from .base import MlxLmFamily, decoder, head_owner
from .batched import BatchedRows
from .caches import Snapshots


class LanguageTower(nn.Module):
    """Text-only view of an mlx-vlm model: ids -> logits through its language model."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.language_model(inputs, cache=cache).logits

    def make_cache(self) -> list:
        return self.language_model.make_cache()


def load_language_tower(path: Path) -> tuple[nn.Module, Any]:
    """The language model of an mlx-vlm checkpoint plus mlx-lm's tokenizer wrapper."""
    from mlx_lm.utils import load_tokenizer

    try:
        from mlx_vlm.utils import load_model
    except ImportError:
        raise UnsupportedTargetError(
            "this multimodal checkpoint's language model loads through mlx-vlm, which is not "
            "installed: pip install 'outrider[vlm]'"
        ) from None

    model = load_model(Path(path))
    tower = LanguageTower(model.language_model)
    tower.eval()
    return tower, load_tokenizer(Path(path))


def _arg(owner: nn.Module, name: str) -> Any:
    value = getattr(owner, name, None)
    return getattr(getattr(owner, "args", None), name, None) if value is None else value


class SlidingWindowFamily(BatchedRows, Snapshots, MlxLmFamily):
    """mlx-lm text models with rotating caches; multimodal checkpoints via mlx-vlm."""

    def load(self, path: Path, config: dict) -> tuple[nn.Module, Any]:
        if "vision_config" in config:
            model, tokenizer = load_language_tower(path)
            self.prepare(model)
            return model, tokenizer
        return super().load(path, config)

    def project(self, model: nn.Module, hidden: mx.array) -> mx.array:
        owner = head_owner(model)
        if "lm_head" in owner:
            out = owner.lm_head(hidden)
        else:
            out = decoder(model).embed_tokens.as_linear(hidden)
        multiplier = _arg(owner, "output_multiplier")
        if multiplier is not None:
            out = out * multiplier
        cap = _arg(owner, "final_logit_softcapping")
        if cap:
            out = mx.tanh(out / cap) * cap
        return out


class Gemma4Family(SlidingWindowFamily):
    name = "gemma4"
    description = "Gemma-4: sliding-window + global attention (gemma4_text; mlx-vlm gemma4)"
    model_types = frozenset({"gemma4", "gemma4_text"})

    def prepare(self, model: nn.Module) -> None:
        # the attention layers of mlx-lm's gemma4_text, on a CUDA GPU (verify_attention.py);
        # mlx-vlm's language tower keeps its own
        verify_attention.install(model, self.layers(model), lambda: make_prompt_cache(model))

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        stack = decoder(model)
        return stack.embed_tokens(ids) * stack.embed_scale


class Gemma3Family(SlidingWindowFamily):
    name = "gemma3"
    description = "Gemma 3: sliding-window + global attention (gemma3_text; gemma3 as text)"
    model_types = frozenset({"gemma3", "gemma3_text"})

    def load(self, path: Path, config: dict) -> tuple[nn.Module, Any]:
        # mlx-lm's gemma3 reads a multimodal checkpoint as its text model (the vision tower's
        # weights are dropped), so Gemma 3 never needs mlx-vlm here; a GGUF file is another
        # packaging of gemma3_text (core/gguf.py)
        if gguf_header.is_gguf(path):
            return gguf.load(path, config)
        return MlxLmFamily.load(self, path, config)

    # its attention keeps MLX's own path on every device: the split and bucketed wrappers
    # (verify_attention.py) know Gemma-4's layout, not this one's

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        # gemma3_text scales by sqrt(hidden) rounded to bfloat16, whatever the weights' dtype
        stack = decoder(model)
        scale = mx.array(stack.args.hidden_size**0.5, mx.bfloat16)
        h = stack.embed_tokens(ids)
        return h * scale.astype(h.dtype)


class MuseGlimmerFamily(SlidingWindowFamily):
    name = "muse_glimmer"
    description = "Muse-Glimmer: sliding-window + NoPE global attention (muse_glimmer)"
    model_types = frozenset({"muse_glimmer"})

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        stack = decoder(model)
        return mx.fast.rms_norm(stack.embed_tokens(ids), None, stack.embed_eps)


@hookimpl
def register_target_families(register):
    register(Gemma4Family())
    register(Gemma3Family())
    register(MuseGlimmerFamily())
