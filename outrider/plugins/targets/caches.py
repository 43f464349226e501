"""Exact rollback for every cache kind a target family may use.

After the target verifies [anchor, d1..dk] in one forward and keeps a < k drafts, every layer's
cache must hold exactly what it would hold had the target seen only [anchor, d1..da]:

- KV caches (mlx-lm `KVCache`, `QuantizedKVCache`, core/kv_quant.py's `DequantizingKVCache`):
  drop the last n rows (`trim`).
- Rotating (sliding-window) caches: a multi-token update leaves mlx-lm's `RotatingKVCache` in
  temporal order holding the window's last `max_size - 1` rows plus the verified rows, so
  dropping the last n rows is exact even after the window has wrapped (mlx-lm's own `trim`
  only moves offsets, which is wrong once the buffer has rotated).
- Recurrent state (gated-delta-net, Mamba-2: an `ArraysCache` of conv window + state): a state
  cannot be un-applied. Each recurrent mixer is wrapped per instance (`ReplayableMixer`); during
  a verify forward it runs as the model's own (one call over the whole block) and its cache,
  a `RecordingArraysCache`, keeps references to the mixer's input and the pre-round arrays.
  Rollback puts the pre-round arrays back and runs that mixer again over the accepted prefix of
  the recorded input: only the recurrent mixers re-run, never the whole model, and only in
  rounds that reject something. The mixer's output of that re-run is never used, so MLX never
  computes it (its output projection stays unevaluated); the conv window and state it leaves
  are exactly those of a forward over the accepted tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ...core.errors import UnsupportedTargetError
from ...core.family import LayerSnapshot, NotSnapshottable, restore_kv, snapshot_kv
from ...core.kv_quant import stored_quantized
from ...core.wrapper import PassThrough


class RecordingArraysCache(ArraysCache):
    """An `ArraysCache` that can replay the accepted prefix of its last verify forward."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.recording = False
        self.replay: tuple | None = None  # (mixer, input, mask, arrays before the forward)

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self.replay is None or self.replay[1].shape[1] <= n:
            raise UnsupportedTargetError(
                f"cannot roll a recurrent state back by {n} tokens: the last forward was not a "
                "verify forward that long"
            )
        mixer, x, mask, before = self.replay
        keep = x.shape[1] - n
        self.cache = list(before)
        self.replay = None
        mixer(x[:, :keep], None if mask is None else mask[:, :keep], self)

    # -- several rows (continuous batching: plugins/targets/batched.py) ----------------------
    # `merge`, `filter` and `extend` are mlx-lm's own (they build and keep this class); its
    # `extract` would return a plain ArraysCache, hence this one.
    def extract(self, idx: int) -> RecordingArraysCache:
        out = RecordingArraysCache(len(self.cache))
        out.cache = [None if c is None else c[idx : idx + 1] for c in self.cache]
        return out

    def rollback_rows(self, n: list[int]) -> None:
        """Row i back by n[i] positions of the last (verify) forward: rows that keep the same
        number of positions replay together from their states before it."""
        if not any(n):
            self.replay = None
            return
        if self.replay is None:
            raise UnsupportedTargetError(
                "cannot roll recurrent state back: the last forward was not a verify forward"
            )
        mixer, x, mask, before = self.replay
        width = x.shape[1]
        groups: dict[int, list[int]] = {}
        for row, k in enumerate(n):
            if k > 0:
                groups.setdefault(width - k, []).append(row)
        state = list(self.cache)
        for keep, rows in groups.items():
            idx = mx.array(rows, dtype=mx.int32)
            part = ArraysCache(len(before))
            part.cache = [None if b is None else b[idx] for b in before]
            if keep > 0:
                mixer(x[idx, :keep], None if mask is None else mask[idx, :keep], part)
            for e, value in enumerate(part.cache):
                if value is not None:
                    state[e][idx] = value
        self.cache = state
        self.replay = None


def as_recording(caches: list) -> list:
    """The same cache list with every `ArraysCache` replaced by a recording one."""
    out = []
    for c in caches:
        if isinstance(c, ArraysCache) and not isinstance(c, RecordingArraysCache):
            c = RecordingArraysCache(len(c.cache))
        out.append(c)
    return out


class ReplayableMixer(PassThrough):
    """Per-instance wrapper of one recurrent mixer: in a verify forward, it records what its
    cache needs to replay the accepted prefix; otherwise it is a plain pass-through."""

    wrapped = "mixer"

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.mixer = mixer

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if isinstance(cache, RecordingArraysCache) and cache.recording:
            cache.replay = (self.mixer, x, mask, list(cache.cache))
        return self.mixer(x, mask, cache)


def wrap_mixers(layers: list, attribute: str, wanted=lambda layer: True) -> int:
    """Wrap `layer.<attribute>` in a `ReplayableMixer` on each layer where `wanted(layer)`."""
    n = 0
    for layer in layers:
        inner = getattr(layer, "layer", layer)  # a tap wrapper may sit around the layer
        if wanted(inner) and attribute in inner:
            mixer = inner[attribute]
            if not isinstance(mixer, ReplayableMixer):
                setattr(inner, attribute, ReplayableMixer(mixer))
            n += 1
    return n


def begin_forward(caches: list, verify: bool) -> None:
    """Tell recording caches whether the next forward is a verify (record) or not."""
    for c in caches:
        if isinstance(c, RecordingArraysCache):
            c.recording = verify
            c.replay = None


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


# -- prefix-cache snapshots (core/family.py: LayerSnapshot) ---------------------------------------
# A KV cache is trimmable: one snapshot (views of its rows) serves every shorter prefix. A rotating
# window and a recurrent state are not (the rows or inputs they dropped are gone), so the prefix
# cache snapshots them at checkpoints and resumes from the last one at or before a divergence.
# Copies are new array objects: mlx-lm updates KV and rotating buffers in place (slice
# assignment), which would otherwise reach into a stored snapshot.


def snapshot_layer(c: Any) -> LayerSnapshot:
    """One layer's cache as a `LayerSnapshot`, whatever its kind."""
    if isinstance(c, ArraysCache):
        return LayerSnapshot("arrays", [None if a is None else mx.array(a) for a in c.cache])
    if is_rotating(c):
        if c.keys is None:
            return LayerSnapshot("rotating", [None, None], {"offset": 0})
        meta = {"offset": c.offset, "keep": c.keep, "max_size": c.max_size, "idx": c._idx}
        return LayerSnapshot("rotating", [mx.array(c.keys), mx.array(c.values)], meta)
    q = stored_quantized(c)
    if q is not None:
        n = q.offset
        meta = {"offset": n, "group_size": q.group_size, "bits": q.bits}
        if q.keys is None:
            return LayerSnapshot("quantized_kv", [None] * 6, meta, True)
        arrays = [a[..., :n, :] for a in (*q.keys, *q.values)]
        return LayerSnapshot("quantized_kv", arrays, meta, True)
    return snapshot_kv(c)


def restore_layer(c: Any, snap: LayerSnapshot, n: int) -> None:
    """Fill a fresh cache of the same kind so it holds the first n positions of `snap`."""
    if snap.kind == "kv":
        restore_kv(c, snap, n)
        return
    if snap.kind == "quantized_kv":
        if n > snap.meta["offset"]:
            raise NotSnapshottable(f"cannot restore {n} positions from {snap.meta['offset']}")
        if n and snap.arrays[0] is not None:
            parts = [a[..., :n, :] for a in snap.arrays]
            q = stored_quantized(c)
            q.keys, q.values, q.offset = tuple(parts[:3]), tuple(parts[3:]), n
        return
    if n != snap.meta.get("offset", n):
        raise NotSnapshottable(f"a {snap.kind} snapshot holds exactly {snap.meta['offset']}")
    if snap.kind == "rotating":
        if snap.arrays[0] is not None:
            c.keys, c.values = mx.array(snap.arrays[0]), mx.array(snap.arrays[1])
            c.offset, c.keep = snap.meta["offset"], snap.meta["keep"]
            c.max_size, c._idx = snap.meta["max_size"], snap.meta["idx"]
    elif snap.kind == "arrays":
        c.cache = list(snap.arrays)  # rebound by the mixers, never written in place
    else:
        raise NotSnapshottable(f"unknown snapshot kind {snap.kind!r}")


def snapshot_all(cache: list) -> list[LayerSnapshot]:
    return [snapshot_layer(c) for c in cache]


def restore_all(cache: list, snapshots: list[LayerSnapshot], n: int) -> None:
    for c, snap in zip(cache, snapshots, strict=True):
        restore_layer(c, snap, n)


class Snapshots:
    """The prefix-cache members of a family whose caches are any of the kinds above."""

    def snapshot(self, cache: list) -> list[LayerSnapshot]:
        return snapshot_all(cache)

    def restore(self, cache: list, snapshots: list[LayerSnapshot], n: int) -> None:
        restore_all(cache, snapshots, n)
