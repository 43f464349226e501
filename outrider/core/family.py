"""The contract a target-family plugin fulfils.

A family knows how to load one kind of model, where its decoder layers are (the entries taps
wrap: each layer's output is the residual stream a drafter reads), how to embed ids and project
hidden states (for drafters that share the target's embedding and head), and how to roll each of
its cache kinds back after a partial acceptance: KV trim, rotating-window trim, recurrent state
restored to the accept point (`outrider/plugins/targets/caches.py` has all three).

Optional members: `priority` (int, default 0; families are tried highest first, so a catch-all
can sit below the specific ones) and `begin_forward(cache, verify)`, called before every target
forward; `verify` is True for a forward that `rollback` may follow (a family with recurrent state
records per-step state then) and False for prefill chunks.

Prefix caching (optional; `outrider/core/prefix_cache.py` keeps caches between requests):
`snapshot(cache)` returns one `LayerSnapshot` per layer, a real copy that later updates of the
live cache cannot reach; `restore(cache, snapshots, n)` fills a fresh cache so it holds the
first n positions (a trimmable layer is cut to n; any other layer must have been snapshotted at
exactly n). Without these members the defaults below serve plain KV caches (keys, values,
offset, trim) and refuse anything else, which turns prefix caching off for that target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn


class BatchedCache(list):
    """A cache holding several rows (one entry per layer), made by a family that batches.

    Families that batch add `merge_rows`, `extend_rows`, `filter_rows`, `extract_row` and
    `rollback_rows` (see plugins/targets/batched.py); a family without them decodes one
    row at a time."""


@runtime_checkable
class TargetFamily(Protocol):
    name: str
    description: str

    def supports(self, config: dict) -> bool:
        """True when this family can run the model that `config` (config.json) describes."""

    def load(self, path: Path, config: dict) -> tuple[nn.Module, Any]:
        """Load (model, tokenizer) from a local folder."""

    def layers(self, model: nn.Module) -> list:
        """The model's decoder layers, as the list its forward iterates (taps wrap entries)."""

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        """Input embeddings of ids, as the model computes them."""

    def project(self, model: nn.Module, hidden: mx.array) -> mx.array:
        """The model's output head applied to final-normed hidden states."""

    def make_cache(self, model: nn.Module) -> list:
        """A fresh cache for one sequence."""

    def rollback(self, cache: list, n: int) -> None:
        """Make every layer's cache what it was before the last n positions of the last
        (verify) forward, exactly."""


@dataclass
class LayerSnapshot:
    """One layer's cache as plain data: arrays (None where the cache holds nothing yet) plus
    integer fields, so a snapshot can be copied, trimmed and written to disk without knowing
    the cache class. `trimmable`: one snapshot serves every shorter prefix (KV caches);
    otherwise it is valid at exactly its length (recurrent state, rotating windows)."""

    kind: str
    arrays: list[mx.array | None]
    meta: dict[str, int] = field(default_factory=dict)
    trimmable: bool = False

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if a is not None)


class NotSnapshottable(Exception):
    """This cache kind cannot be snapshotted (prefix caching stays off for the target)."""


def snapshot_kv(c: Any) -> LayerSnapshot:
    """The default for a plain KV cache: its rows up to the offset (views, never the live
    arrays, which the cache updates in place)."""
    if type(c).__name__ != "KVCache":
        raise NotSnapshottable(f"no snapshot for a {type(c).__name__}")
    if c.keys is None:
        return LayerSnapshot("kv", [None, None], {"offset": 0}, True)
    n = c.offset
    return LayerSnapshot("kv", [c.keys[..., :n, :], c.values[..., :n, :]], {"offset": n}, True)


def restore_kv(c: Any, snap: LayerSnapshot, n: int) -> None:
    """Fill a fresh KV cache with the first n rows of a snapshot."""
    if snap.kind != "kv" or n > snap.meta["offset"]:
        raise NotSnapshottable(f"cannot restore {n} positions from a {snap.kind} snapshot")
    if n == 0 or snap.arrays[0] is None:
        return
    c.keys, c.values = snap.arrays[0][..., :n, :], snap.arrays[1][..., :n, :]
    c.offset = n


def default_snapshot(cache: list) -> list[LayerSnapshot]:
    return [snapshot_kv(c) for c in cache]


def default_restore(cache: list, snapshots: list[LayerSnapshot], n: int) -> None:
    for c, snap in zip(cache, snapshots, strict=True):
        restore_kv(c, snap, n)
