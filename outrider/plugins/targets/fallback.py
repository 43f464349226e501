"""The last resort: any model mlx-lm can load, for modes that need no hidden-state taps.

`--mode baseline` runs it as mlx-lm would; `--mode lookup` runs it too when its caches are of a
kind we can roll back. Drafter modes are refused with a message naming the model_type, since no
installed family vouches for its layer list and rollback.
"""

from __future__ import annotations

import importlib.util

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ...core.errors import UnsupportedTargetError
from ...core.hookspecs import hookimpl
from .base import MlxLmFamily, model_types


class MlxLmFallbackFamily(MlxLmFamily):
    name = "mlx_lm"
    description = "any other mlx-lm model: --mode lookup and --mode baseline only (no taps)"
    priority = -100  # chosen only when no other family supports the model

    def supports(self, config: dict) -> bool:
        top, _ = model_types(config)
        return bool(top) and importlib.util.find_spec(f"mlx_lm.models.{top}") is not None

    def layers(self, model: nn.Module) -> list:
        kind = getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
        raise UnsupportedTargetError(
            f"model_type {kind!r} has no target-family plugin with hidden-state taps and exact "
            "rollback, so drafter modes cannot run on it; --mode lookup and --mode baseline "
            "still work"
        )

    def make_cache(self, model: nn.Module) -> list:
        return make_prompt_cache(model)  # recurrent caches stay plain: rollback refuses them


@hookimpl
def register_target_families(register):
    register(MlxLmFallbackFamily())
