"""Looped-depth targets: one decoder stack run several times a forward with shared weights
(mlx-lm `nanbeige`, Nanbeige4.2 with `num_loops`). Each loop has its own KV caches, which trim
like a dense model's; what differs is the drafter's view. Its tap ids index the unrolled
stream (layer j of loop k is id j + k·n), and between loops the model norms the stream, so the
last layer's tap of every loop but the last is that normed state, the input of the next loop
(`core/target.py`, `_TappedLayer`)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ...core.hookspecs import hookimpl
from .dense import DenseFamily, _inner, model_type


class LoopedDepthFamily(DenseFamily):
    name = "looped_depth"
    description = "looped-depth decoders: one layer stack run num_loops times (nanbeige)"
    model_types = frozenset({"nanbeige"})

    def supports(self, config: dict) -> bool:
        return model_type(config) in self.model_types and "vision_config" not in config

    def loops(self, model: nn.Module) -> int:
        return int(getattr(_inner(model), "num_loops", 1))

    def loop_boundary(self, model: nn.Module) -> Callable[[mx.array], mx.array] | None:
        """The norm the model applies between loops (none with `skip_loop_final_norm`)."""
        inner = _inner(model)
        return None if getattr(inner, "skip_loop_final_norm", False) else inner.norm


@hookimpl
def register_target_families(register):
    register(LoopedDepthFamily())
