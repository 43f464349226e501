"""Quantized KV caches (`--kv-bits`): where keys and values are kept quantized, and how
attention reads them.

Both kinds store every position exactly as mlx-lm's `QuantizedKVCache` does (groups of 64
along the head dim, each position on its own, so a trim drops rejected positions exactly).
They differ in the attention that reads them:

- `QuantizedKVCache` (mlx-lm's): attention multiplies by the quantized keys and values
  (`mx.quantized_matmul`, mlx-lm's `quantized_scaled_dot_product_attention`).
- `DequantizingKVCache`: each forward dequantizes the cached keys and values and hands them
  to MLX's dense attention. MLX 0.32's CUDA backend has no quantized product for the cache's
  slices at some shapes and computed wrong ones at others (docs/testing-on-gpu.md), while
  `mx.dequantize` and dense attention are right there; the memory saved is the same, since only
  one layer's keys are dense at a time.

`core/device.py: kv_attention()` picks one per device; OUTRIDER_KV_ATTENTION overrides it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, create_attention_mask

KV_GROUP_SIZE = 64  # mlx-lm's default for quantized KV caches


class DequantizingKVCache:
    """A `QuantizedKVCache` whose update hands attention dense keys and values.

    It holds mlx-lm's cache (`stored`) and answers the cache interface mlx-lm's models and
    outrider's rollback use. It has no `bits` attribute, so mlx-lm's attention takes its dense
    path (it dispatches on `hasattr(cache, "bits")`)."""

    def __init__(self, group_size: int = KV_GROUP_SIZE, bits: int = 8) -> None:
        self.stored = QuantizedKVCache(group_size=group_size, bits=bits)

    @property
    def offset(self) -> int:
        return self.stored.offset

    @offset.setter
    def offset(self, n: int) -> None:
        self.stored.offset = n

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        qk, qv = self.stored.update_and_fetch(keys, values)
        return self._dense(qk), self._dense(qv)

    def _dense(self, parts: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        s = self.stored
        return mx.dequantize(*parts, group_size=s.group_size, bits=s.bits)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.stored.offset, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.stored.trim(n)

    def size(self) -> int:
        return self.stored.offset

    def empty(self) -> bool:
        return self.stored.empty()

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes

    @property
    def state(self) -> Any:
        return self.stored.state

    @state.setter
    def state(self, v: Any) -> None:
        self.stored.state = v


def quantized_kv(cache: Any, bits: int, attention: str = "quantized") -> Any:
    """An empty quantized cache in place of an empty plain KV cache (`attention`: how it is
    read, see `kv_attention`); other kinds as they are."""
    if type(cache) is not KVCache:
        return cache
    if attention == "dequantized":
        return DequantizingKVCache(group_size=KV_GROUP_SIZE, bits=bits)
    return QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits)


def stored_quantized(cache: Any) -> QuantizedKVCache | None:
    """The quantized store of a layer's cache (either kind), or None for other kinds."""
    if isinstance(cache, DequantizingKVCache):
        return cache.stored
    return cache if isinstance(cache, QuantizedKVCache) else None
