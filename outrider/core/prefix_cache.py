"""The prefix cache: target caches (and drafter taps) kept between requests, keyed by token ids.

A request whose prompt starts like an earlier sequence gets a cache already holding the longest
usable shared prefix, and prefills only the rest (`decode(start=...)`). Layers whose cache can
be trimmed (KV) are stored once per sequence and cut to the shared prefix; layers that cannot
(recurrent state, rotating windows) are snapshotted at checkpoints (every `interval` tokens of a
prefill, at the prompt's end, and at the end of the generation), and a hit resumes from the last
checkpoint at or before the divergence. Because a hit holds exactly what a fresh prefill of
those tokens leaves, greedy output stays that of plain decoding.

Each entry also keeps the target's logits at the positions where a prompt ended (and at its
own end, when the decode loop reported them): a request whose whole prompt is such a position
(an exact repeat) gets a cache holding every prompt token plus those logits, and its first
token is drawn from them with no target forward at all. They are the very logits the fresh
prefill computed, so the output is the fresh request's (greedy: identical; sampled: the same
draw from the same key stream).

Memory is bounded by bytes with LRU eviction; a budget of 0 caches nothing. One sequence keeps
at most half the budget: past that, its checkpoints are thinned (`Entry.thin`,
core/prefix_entry.py) rather than the sequence left out. An optional disk tier
(core/prefix_disk.py: safetensors files, bounded in size) survives restarts and refuses any
file it cannot trust. One thread owns a store (the server's engine worker); it is not
thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .family import LayerSnapshot, NotSnapshottable
from .prefix_disk import DiskTier
from .prefix_entry import Entry, shared_prefix

DEFAULT_INTERVAL = 512  # tokens between recurrent / sliding-window checkpoints in a prefill
PREFILL_CHECKPOINTS = 8  # at most this many of them in one prefill (wider apart past 4k tokens)
GB = 1 << 30


def target_identity(target: Any) -> str:
    """What a cache is only valid for: the model (path, family, config) and outrider's version."""
    config = json.dumps(target.config, sort_keys=True, default=str)
    digest = hashlib.sha256(config.encode()).hexdigest()[:16]
    kv = getattr(target, "kv_bits", None)
    return f"{target.name}|{target.family.name}|{digest}" + (f"|kv{kv}" if kv else "")


@dataclass
class PrefixHit:
    """A cache holding the first `length` prompt tokens, and their taps (when tapped).

    `logits` (only when `length` is the whole prompt) is the target's raw logits row at the
    prompt's last position, as the prefill that stored it computed it: the first token is drawn
    from it, and nothing of the prompt is forwarded."""

    length: int
    cache: list
    taps: mx.array | None = None
    logits: mx.array | None = None


class Record:
    """What one generation leaves behind; `decode` keeps it equal to what its cache holds."""

    def __init__(self, trimmable: list[bool], interval: int, tap_ids: tuple[int, ...]) -> None:
        self.trimmable = trimmable
        self.interval = interval
        self.tap_ids = tap_ids
        self.cache: list | None = None
        self.tokens: list[int] = []
        self.length: int | None = None  # None: all of `tokens` (plain decoding)
        self.taps: list[mx.array] = []
        self.checkpoints: dict[int, list[LayerSnapshot | None]] = {}
        self.ends: dict[int, mx.array] = {}  # held length -> the target's logits row there
        self.last: tuple[int, mx.array] | None = None  # the same for the current end, if known
        self.marks: tuple[int, ...] = ()  # prompt positions to snapshot at besides the interval

    def prefill_stops(self, target: Any, cache: list, done: int, total: int):
        """Positions (relative to the prefill's start) where the prefill snapshots the layers
        that cannot be trimmed, and the callback that does it (the prompt's end: `prompt_end`)."""
        if all(self.trimmable):
            return (), None
        # at most PREFILL_CHECKPOINTS of them: a long prompt spaces them wider (multiples of
        # the interval), since each costs a whole recurrent state until the entry is thinned
        spacing = self.interval * max(
            1, -(-(total - done) // (self.interval * PREFILL_CHECKPOINTS))
        )
        every = range((done // spacing + 1) * spacing, total, spacing)
        stops = {p - done for p in (*every, *self.marks) if done < p < total}

        def at_stop(n: int) -> None:
            snaps = target.snapshot(cache)
            keep = [None if t else s for s, t in zip(snaps, self.trimmable, strict=True)]
            mx.eval([s.arrays for s in keep if s is not None])
            self.checkpoints[done + n] = keep

        return stops, at_stop

    def prompt_end(
        self, target: Any, cache: list, n: int, logits: mx.array, restored: bool = False
    ) -> list:
        """The prefill of an n-token prompt ended with `logits` (raw, [V]): keep them, and a
        snapshot of the layers that cannot be trimmed, so that an exact repeat of the prompt
        needs no forward. `restored`: the cache came whole from the prefix cache, whose entry
        already has both. Returns the snapshot's arrays, to evaluate with the first token
        before anything updates the cache."""
        self.ends[n] = logits
        if restored or all(self.trimmable):
            return []
        keep = [None if t else s for s, t in zip(target.snapshot(cache), self.trimmable)]
        self.checkpoints[n] = keep
        return [s.arrays for s in keep if s is not None]

    def track(
        self, cache: list, tokens: list[int], length: int | None = None, taps: Any = None
    ) -> None:
        self.cache, self.tokens, self.length = cache, tokens, length
        self.last = None
        if taps is not None:
            self.taps = [taps]

    def grow(self, n: int, taps: mx.array | None, logits: mx.array | None = None) -> None:
        """The cache holds n more tokens. `logits`: the target's raw row at the new end (the
        one the next token is chosen from), when the caller has it; the entry then keeps it,
        so a prompt equal to everything held starts with no forward."""
        self.length += n
        if taps is not None and self.taps:
            self.taps.append(taps)
        self.last = None if logits is None else (self.length, logits)

    def end_logits(self, n: int) -> dict[int, mx.array]:
        """The logits rows known for positions 1..n of what the cache holds."""
        rows = {p: row for p, row in self.ends.items() if p <= n}
        if self.last is not None and self.last[0] == n:
            rows[n] = self.last[1]
        return rows

    @property
    def held(self) -> list[int]:
        """The token ids the cache holds."""
        return self.tokens if self.length is None else self.tokens[: self.length]


class PrefixCache:
    """Longest-prefix store of target caches: memory (LRU by bytes), optionally disk."""

    def __init__(
        self,
        max_bytes: int = 2 * GB,
        directory: str | Path | None = None,
        disk_bytes: int = 20 * GB,
        interval: int = DEFAULT_INTERVAL,
    ) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.interval = max(1, int(interval))
        self.identity: str | None = None
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self._trimmable: list[bool] | None = None
        self._disabled: str | None = None
        self.stats = {
            "hits": 0,
            "whole_hits": 0,
            "misses": 0,
            "hit_tokens": 0,
            "evictions": 0,
            "disk_hits": 0,
            "disk_writes": 0,
            "disk_refused": 0,
            "checkpoints_dropped": 0,  # snapshots let go to keep a sequence in budget
        }
        self.disk = DiskTier(Path(directory), int(disk_bytes), self.stats) if directory else None

    @classmethod
    def from_gb(cls, gb: float, directory: str | Path | None = None, **kw: Any) -> PrefixCache:
        return cls(int(gb * GB), directory, **kw)

    # -- state -------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def disabled_reason(self) -> str | None:
        """Why caching is off for the bound model (None: it is not)."""
        return self._disabled

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self._disabled is None

    def snapshot_stats(self) -> dict[str, int]:
        return {**self.stats, "bytes": self.bytes, "entries": self.entries}

    def clear(self) -> None:
        """Forget every in-memory entry (the disk tier stays)."""
        self._entries.clear()
        self._trimmable = None
        self._disabled = None

    def bind(self, target: Any) -> None:
        """Serve `target`: entries made for another model are dropped; the disk index is read."""
        identity = target_identity(target)
        if identity == self.identity:
            return
        self.clear()
        self.identity = identity
        if self.disk is not None:
            self.disk.scan(identity)

    # -- one request -------------------------------------------------------------------------
    def record(self, target: Any, tap_ids: tuple[int, ...]) -> Record | None:
        """A record for the next generation on `target` (None when caching is off)."""
        if not self.enabled:
            return None
        self.bind(target)
        if self._trimmable is None:
            try:
                self._trimmable = [s.trimmable for s in target.snapshot(target.make_cache())]
            except NotSnapshottable as e:
                self._disabled = str(e)
                warnings.warn(f"prefix cache off for this model: {e}", stacklevel=2)
                return None
        return Record(self._trimmable, self.interval, tuple(tap_ids))

    def lookup(self, target: Any, prompt: list[int], tap_ids: tuple[int, ...] = ()) -> PrefixHit:
        """The longest usable cached prefix of `prompt`, or None. It is the whole prompt when
        an entry holds it and kept the logits of its last position (then `PrefixHit.logits`
        carries them); otherwise it leaves at least the last prompt token to forward."""
        if not self.enabled or not prompt:
            return None
        self.bind(target)
        ids = np.asarray(prompt, dtype=np.int64)
        tap_ids = tuple(tap_ids)
        best, best_n = self._best(ids, tap_ids)
        disk = self.disk.best(ids) if self.disk_on and best_n < len(ids) else None
        if disk is not None and disk[1] > best_n and self._load_disk(disk[0]):
            self.stats["disk_hits"] += 1
            best, best_n = self._best(ids, tap_ids)
        if best is None or best_n == 0:
            self.stats["misses"] += 1
            return None
        entry = self._entries[best]
        self._entries.move_to_end(best)
        cache = target.restore(entry.layers(best_n), best_n)
        taps = entry.taps[:best_n] if tap_ids and entry.taps is not None else None
        logits = entry.logits[best_n] if best_n == len(ids) else None
        self.stats["hits"] += 1
        self.stats["whole_hits"] += logits is not None
        self.stats["hit_tokens"] += best_n
        return PrefixHit(best_n, cache, taps, logits)

    def _best(self, ids: np.ndarray, tap_ids: tuple[int, ...]):
        whole = len(ids)
        best, best_n = None, 0
        for key, e in self._entries.items():
            if tap_ids and (e.tap_ids != tap_ids or e.taps is None):
                continue
            shared = shared_prefix(e.tokens, ids)
            n = whole if shared == whole and e.whole(whole) else e.usable(min(shared, whole - 1))
            if n >= best_n and n > 0:
                best, best_n = key, n
        return best, best_n

    def put(self, target: Any, record: Record | None) -> None:
        """Keep what `record` holds; merge it with entries it extends or that extend it."""
        if record is None or record.cache is None or not self.enabled:
            return
        held = record.held
        if not held:
            return
        try:
            final = target.snapshot(record.cache)
        except NotSnapshottable as e:
            self._disabled = str(e)
            return
        n = len(held)
        taps = None
        if record.tap_ids and record.taps:
            taps = mx.concatenate(record.taps, axis=0)[:n]
            if taps.shape[0] != n:
                taps = None
        logits = record.end_logits(n)
        mx.eval([s.arrays for s in final], taps, list(logits.values()))
        tokens = np.asarray(held, dtype=np.int64)
        trims = all(s.trimmable for s in final)
        checkpoints = {} if trims else {p: c for p, c in record.checkpoints.items() if p < n}
        tap_ids = record.tap_ids if taps is not None else ()
        entry = Entry(tokens, final, checkpoints, taps, tap_ids, logits)
        entry.marks = {p for p in record.marks if p in checkpoints}
        for key, old in list(self._entries.items()):
            shared = shared_prefix(old.tokens, tokens)
            if shared == len(old.tokens) and (old.tap_ids == entry.tap_ids or not old.tap_ids):
                self._absorb(entry, old)  # the new sequence extends the old one
                del self._entries[key]
                if self.disk is not None:
                    self.disk.forget(old.tokens)
            elif shared == n and (entry.tap_ids == old.tap_ids or not entry.tap_ids):
                self._absorb(old, entry)  # already held by a longer sequence
                self._thin(old)
                self._entries.move_to_end(key)
                self._fit(key)
                return
        self._thin(entry)
        if entry.nbytes > self.max_bytes:
            return
        key = self._next
        self._next += 1
        self._entries[key] = entry
        self._fit(key)
        if key in self._entries and self.disk_on:
            self.disk.write(entry)

    @staticmethod
    def _absorb(into: Entry, other: Entry) -> None:
        """Add `other`'s checkpoints and logits rows (`other` holds a prefix of `into`'s
        tokens) to `into`."""
        for p, row in other.logits.items():
            into.logits.setdefault(p, row)
        into.marks |= other.marks
        if not into.all_trimmable:
            for p, ck in other.checkpoints.items():
                into.checkpoints.setdefault(p, ck)
            end = len(other.tokens)
            if end < len(into.tokens):
                keep = [None if s.trimmable else s for s in other.final]
                into.checkpoints.setdefault(end, keep)
        into.nbytes = into._count()

    def _thin(self, entry: Entry) -> None:
        """One sequence keeps at most half the budget (`Entry.thin`), so a long conversation
        is cached with fewer checkpoints instead of not at all, and leaves room for others."""
        self.stats["checkpoints_dropped"] += entry.thin(self.max_bytes // 2)

    def _fit(self, protect: int) -> None:
        """Evict least recently used entries until the budget holds."""
        total = self.bytes
        for key in list(self._entries):
            if total <= self.max_bytes:
                break
            if key == protect and len(self._entries) > 1:
                continue
            total -= self._entries.pop(key).nbytes
            self.stats["evictions"] += 1

    # -- disk tier (core/prefix_disk.py) -------------------------------------------------------
    @property
    def disk_on(self) -> bool:
        return self.disk is not None and self.disk.on

    @property
    def directory(self) -> Path | None:
        """The disk tier's folder (None: memory only, or the tier turned itself off)."""
        return self.disk.directory if self.disk is not None else None

    def _load_disk(self, stem: str) -> bool:
        """Take one file's entry into memory, thinned to this budget (it may have been written
        under a larger one)."""
        entry = self.disk.load(stem)
        if entry is None:
            return False
        self._thin(entry)
        if entry.nbytes > self.max_bytes:
            return False
        key = self._next
        self._next += 1
        self._entries[key] = entry
        self._fit(key)
        return True
