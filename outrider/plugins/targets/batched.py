"""Several rows in one cache, for families whose layers hold plain KV caches or recurrent
state (gated-delta-net, Mamba-2).

mlx-lm's `BatchKVCache` keeps rows left-padded: every row's last position sits at the same
column, each row has its own rope offset, and its mask hides each row's padding. A verify
round writes the same number of columns for every row, but rows keep different numbers of
them. Rolling back: every row drops what all rows rejected (a trim), then a row that rejected
e more than that rolls its columns right by e. Its rejected columns wrap round to the front,
where they become padding that its mask hides, so each row's keys, values and positions are
exactly those of its own accepted tokens. A row's output therefore equals what it produces
alone, up to the rounding of batched matmuls.

Recurrent layers hold one state per row (no padding: a state has no length). Their rollback
replays the layer's mixer over each row's accepted prefix from the state before the round,
rows that kept the same number of tokens in one call (see `RecordingArraysCache.rollback_rows`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from ...core.errors import UnsupportedTargetError
from ...core.family import BatchedCache
from .caches import RecordingArraysCache


def _merge_layer(layer: tuple):
    kinds = {type(c) for c in layer}
    if kinds == {KVCache}:
        return BatchKVCache.merge(list(layer))
    if kinds == {RecordingArraysCache}:
        return RecordingArraysCache.merge(list(layer))
    names = ", ".join(sorted(k.__name__ for k in kinds - {KVCache, RecordingArraysCache}))
    raise UnsupportedTargetError(
        f"batched decoding needs KV caches or recurrent state; this model uses {names}"
    )


class BatchedRows:
    """The batching members of a family whose layers hold `KVCache`s and recurrent state."""

    def merge_rows(self, caches: list[list]) -> BatchedCache:
        """One batched cache from one-row caches (their rows, in order)."""
        return BatchedCache(_merge_layer(layer) for layer in zip(*caches, strict=True))

    def extend_rows(self, cache: BatchedCache, rows: BatchedCache) -> None:
        """Append the rows of `rows` to `cache`, in place."""
        for mine, theirs in zip(cache, rows, strict=True):
            mine.extend(theirs)

    def filter_rows(self, cache: BatchedCache, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order), in place."""
        index = mx.array(keep, dtype=mx.int32)
        for c in cache:
            c.filter(index)

    def extract_row(self, cache: BatchedCache, row: int) -> list:
        """Row `row` as a one-row cache (a copy)."""
        return [c.extract(row) for c in cache]

    def rollback_rows(self, cache: BatchedCache, n: list[int]) -> None:
        """Drop the last n[i] positions of row i."""
        common = min(n)
        extra = [k - common for k in n]
        shifts = mx.array(extra, dtype=mx.int32)[:, None] if any(extra) else None
        for c in cache:
            if isinstance(c, RecordingArraysCache):
                c.rollback_rows(n)
                continue
            if common:
                c.trim(common)
            if shifts is None:
                continue
            end = c._idx
            c.keys[..., :end, :] = dynamic_roll(c.keys[..., :end, :], shifts, axis=2)
            c.values[..., :end, :] = dynamic_roll(c.values[..., :end, :], shifts, axis=2)
            c.left_padding = c.left_padding + shifts[:, 0]
            c.offset = c.offset - shifts[:, 0]
