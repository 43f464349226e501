"""Exact rollback for every cache kind a target family may use.

After the target verifies [anchor, d1..dk] in one forward and keeps a < k drafts, every layer's
cache must hold exactly what it would hold had the target seen only [anchor, d1..da]:

- KV caches (mlx-lm `KVCache`, `QuantizedKVCache`): drop the last n rows (`trim`).
- Rotating (sliding-window) caches: a multi-token update leaves mlx-lm's `RotatingKVCache` in
  temporal order holding the window's last `max_size - 1` rows plus the verified rows, so
  dropping the last n rows is exact even after the window has wrapped (mlx-lm's own `trim`
  only moves offsets, which is wrong once the buffer has rotated).
- Recurrent state (gated-delta-net, Mamba-2: an `ArraysCache` of conv window + state): a state
  cannot be un-applied, so during a verify forward the recurrent mixer runs one step per token
  (`StepwiseMixer`, wrapped per instance) and `RecordingArraysCache` keeps the state after each
  step; rollback sets the state recorded after the last accepted token. The steps are what plain
  decoding computes, so the state equals plain decoding's bit for bit, and only the recurrent
  mixers re-run per step, never the whole model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ...core.errors import UnsupportedTargetError


class RecordingArraysCache(ArraysCache):
    """An `ArraysCache` that remembers its arrays after each step of a verify forward."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.recording = False
        self.steps: list[list] = []

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if len(self.steps) <= n:
            raise UnsupportedTargetError(
                f"cannot roll a recurrent state back by {n} steps: the last forward recorded "
                f"{len(self.steps)} (rollback must follow a verify forward)"
            )
        keep = len(self.steps) - n
        self.cache = list(self.steps[keep - 1])
        del self.steps[keep:]


def as_recording(caches: list) -> list:
    """The same cache list with every `ArraysCache` replaced by a recording one."""
    out = []
    for c in caches:
        if isinstance(c, ArraysCache) and not isinstance(c, RecordingArraysCache):
            c = RecordingArraysCache(len(c.cache))
        out.append(c)
    return out


class StepwiseMixer(nn.Module):
    """Per-instance wrapper of one recurrent mixer: steps token by token while recording.

    Outside a verify forward (prefill) it is a plain pass-through.
    """

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key == "mixer" or "mixer" not in self:
                raise
            return getattr(self["mixer"], key)

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, RecordingArraysCache) or not cache.recording:
            return self.mixer(x, mask, cache)
        outs = []
        cache.steps = []
        for t in range(x.shape[1]):
            step_mask = None if mask is None else mask[:, t : t + 1]
            outs.append(self.mixer(x[:, t : t + 1], step_mask, cache))
            cache.steps.append(list(cache.cache))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def wrap_mixers(layers: list, attribute: str, wanted=lambda layer: True) -> int:
    """Wrap `layer.<attribute>` in a `StepwiseMixer` on each layer where `wanted(layer)`."""
    n = 0
    for layer in layers:
        inner = getattr(layer, "layer", layer)  # a tap wrapper may sit around the layer
        if wanted(inner) and attribute in inner:
            mixer = inner[attribute]
            if not isinstance(mixer, StepwiseMixer):
                setattr(inner, attribute, StepwiseMixer(mixer))
            n += 1
    return n


def begin_forward(caches: list, verify: bool) -> None:
    """Tell recording caches whether the next forward is a verify (record steps) or not."""
    for c in caches:
        if isinstance(c, RecordingArraysCache):
            c.recording = verify
            c.steps = []


def is_rotating(c: Any) -> bool:
    return type(c).__name__ == "RotatingKVCache"


def rollback_rotating(c: Any, n: int) -> None:
    """Drop the last n rows of a rotating cache right after a multi-token update."""
    if c.keys is None or c._idx != c.keys.shape[2] or n >= c.keys.shape[2]:
        raise UnsupportedTargetError(
            "a sliding-window cache can only be rolled back right after a verify forward"
        )
    keep = c.keys.shape[2] - n
    c.keys = c.keys[..., :keep, :]
    c.values = c.values[..., :keep, :]
    c.offset -= n
    c._idx = keep


def rollback_cache(c: Any, n: int) -> None:
    """Roll one layer's cache back by n positions, whatever its kind."""
    if n <= 0:
        return
    if isinstance(c, RecordingArraysCache):
        c.rollback(n)
    elif is_rotating(c):
        rollback_rotating(c, n)
    elif hasattr(c, "trim") and hasattr(c, "is_trimmable") and c.is_trimmable():
        c.trim(n)
    else:
        raise UnsupportedTargetError(
            f"a {type(c).__name__} cannot be rolled back; use --mode baseline with this model"
        )


def rollback_all(caches: list, n: int) -> None:
    for c in caches:
        rollback_cache(c, n)
