"""Several rows in one cache, for families whose layers hold plain KV caches, recurrent state
(gated-delta-net, Mamba-2) or sliding windows (Gemma-4, Muse-Glimmer).

mlx-lm's `BatchKVCache` keeps rows left-padded: every row's last position sits at the same
column, each row has its own rope offset, and its mask hides each row's padding. A verify
round writes the same number of columns for every row, but rows keep different numbers of
them. Rolling back: every row drops what all rows rejected (a trim), then a row that rejected
e more than that moves its e oldest columns into the slots its rejected ones leave at the end,
and its padding grows by e, so its mask hides exactly its rejected columns. Attention does not
depend on the order of keys (each key carries its position in its rotation), so each row's
keys, values and positions are exactly those of its own accepted tokens; `RowColumns` keeps,
on the host, which token each column holds, and a row taken out of the batch (`extract_row`)
gets its columns back in order. Moving e columns a row costs what the round wrote; rolling
every row's whole length right (what an earlier version did) cost as much as the verify
forward itself on a CPU. A row's output therefore equals what it produces alone, up to the
rounding of batched matmuls and of the order its keys are summed in.

Recurrent layers hold one state per row (no padding: a state has no length). Their rollback
replays the layer's mixer over each row's accepted prefix from the state before the round,
rows that kept the same number of tokens in one mixer call (see `RecordingArraysCache.rollback_rows`).

Quantized KV layers (`--kv-bits`) use `QuantizedRows`: mlx-lm's batched bookkeeping over the
three arrays a quantized position is stored as, so every move above applies to each of the
three alike; read as a row alone reads them on this device (core/kv_quant.py).

Sliding-window layers use `WindowRows`, mlx-lm's `BatchRotatingKVCache` with one fix (below).
Its rows are left-padded in temporal order too: a one-token update writes into a rotating
buffer of `max_size` columns and moves every row's padding one column left (the evicted
column), and a multi-token update (a verify round) puts the buffer in temporal order, keeps
its last `max_size - 1` columns and appends the new ones. Right after that update the buffer
is in temporal order and ends with the round's columns, so the same rollback applies: cut what
all rows rejected off the end, roll each row's extra rejected columns to its front (its
padding grows, its rope offset shrinks). Every row still holds at least `max_size` of its own
latest tokens (`max_size - 1` kept + the anchor + its accepted drafts), all its window needs.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, dynamic_roll

from ...core.errors import UnsupportedTargetError
from ...core.family import BatchedCache
from ...core.kv_quant import stored_quantized
from .caches import RecordingArraysCache


class WindowRows(BatchRotatingKVCache):
    """mlx-lm's `BatchRotatingKVCache`, with a multi-token update's mask built from temporal
    order.

    mlx-lm (0.32) computes that mask before the update puts a rotated buffer in temporal order,
    from the write index of the rotated buffer, so it misses the column the update then drops
    and hides one real column of every row with positive padding (a row shorter than the
    window, or one rolled back). mlx-lm's own batched generation never sends a multi-token
    update after a rotation; speculative rounds do. Putting the buffer in temporal order first
    (the update would do it next anyway, for every layer) makes mask and update agree. The
    models build one mask per layer kind, from the first cache of that kind; every sliding
    layer's cache has the same bookkeeping, so that mask is every one's.
    """

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N > 1:
            self._temporal_order()
        return super().make_mask(N, window_size=window_size, return_array=return_array)

    def rollback_rows(self, common: int, shifts: mx.array | None) -> None:
        """Cut `common` columns off the end, then roll row i right by shifts[i] (see above)."""
        if self.keys is None or self.rotated or self._idx != self.keys.shape[2]:
            raise UnsupportedTargetError(
                "a batched sliding-window cache can only be rolled back right after a verify "
                "forward"
            )
        if common:
            keep = self._idx - common
            self.keys = self.keys[..., :keep, :]
            self.values = self.values[..., :keep, :]
            self._idx = keep
            self._offset -= common
            self.offset = self.offset - common
        if shifts is not None:
            self.keys = dynamic_roll(self.keys, shifts, axis=2)
            self.values = dynamic_roll(self.values, shifts, axis=2)
            self.left_padding = self.left_padding + shifts[:, 0]
            self.offset = self.offset - shifts[:, 0]


class QuantizedRows:
    """Several rows of a quantized KV layer (`--kv-bits`): the packed values, scales and biases
    of its keys and values each kept in one mlx-lm `BatchKVCache` (`parts`), all three with
    the same padding, offsets and columns, and read dequantized into MLX's dense attention,
    as `DequantizingKVCache` rows are (a CUDA GPU's). Like that cache it has no `bits`
    attribute, which would send mlx-lm's attention to the quantized product."""

    def __init__(self, parts: list[BatchKVCache], group_size: int, bits: int, row_kind: type):
        self.parts = parts
        self.group_size, self.n_bits, self.row_kind = group_size, bits, row_kind

    @classmethod
    def merge(cls, rows: list) -> QuantizedRows:
        stored = [stored_quantized(c) for c in rows]
        parts = []
        for i in range(3):
            plain = []
            for q in stored:
                one = KVCache()
                if q.keys is not None and q.offset:
                    one.keys, one.values = (
                        q.keys[i][..., : q.offset, :],
                        q.values[i][..., : q.offset, :],
                    )
                    one.offset = q.offset
                plain.append(one)
            parts.append(BatchKVCache.merge(plain))
        return cls(parts, stored[0].group_size, stored[0].bits, type(rows[0]))

    # mlx-lm's batched bookkeeping, the same in every part
    @property
    def left_padding(self) -> mx.array:
        return self.parts[0].left_padding

    @left_padding.setter
    def left_padding(self, value: mx.array) -> None:
        for p in self.parts:
            p.left_padding = value

    @property
    def offset(self) -> mx.array:
        return self.parts[0].offset

    @offset.setter
    def offset(self, value: mx.array) -> None:
        for p in self.parts:
            p.offset = value

    @property
    def _idx(self) -> int:
        return self.parts[0]._idx

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k_parts, v_parts = self._store(keys, values)
        return self._dense(k_parts), self._dense(v_parts)

    def _store(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        """Quantize and write the new positions; every row's stored (packed, scales, biases)
        of its keys and of its values so far."""
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.n_bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.n_bits)
        fetched = [p.update_and_fetch(k, v) for p, k, v in zip(self.parts, qk, qv, strict=True)]
        k_parts, v_parts = zip(*fetched, strict=True)
        return tuple(k_parts), tuple(v_parts)

    def _dense(self, parts) -> mx.array:
        return mx.dequantize(*parts, group_size=self.group_size, bits=self.n_bits)

    def make_mask(self, *args, **kwargs):
        return self.parts[0].make_mask(*args, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return [p.trim(n) for p in self.parts][0]

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.parts[0].empty()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def filter(self, batch_indices: mx.array) -> None:
        for p in self.parts:
            p.filter(batch_indices)

    def extend(self, other: QuantizedRows) -> None:
        for mine, theirs in zip(self.parts, other.parts, strict=True):
            mine.extend(theirs)

    def extract(self, idx: int, order: mx.array | None = None):
        """Row `idx` as a one-row quantized cache of the kind the rows came in as; `order`:
        its columns in the order of its tokens (`RowColumns.in_order`), else as they sit."""
        one = self.row_kind(group_size=self.group_size, bits=self.n_bits)
        q = stored_quantized(one)
        keys, values = [], []
        for p in self.parts:
            if order is None:
                row = p.extract(idx)
                keys.append(row.keys)
                values.append(row.values)
            else:
                keys.append(mx.contiguous(mx.take(p.keys[idx : idx + 1], order, axis=2)))
                values.append(mx.contiguous(mx.take(p.values[idx : idx + 1], order, axis=2)))
        q.keys, q.values, q.offset = tuple(keys), tuple(values), keys[0].shape[2]
        return one


class QuantizedProductRows(QuantizedRows):
    """`QuantizedRows` read through MLX's quantized product over the stored arrays, as mlx-lm's
    quantized attention runs it: rows that come from mlx-lm's `QuantizedKVCache`s, read as
    each reads alone (off CUDA, core/kv_quant.py)."""

    @property
    def bits(self) -> int:  # what sends mlx-lm's attention to its quantized product
        return self.n_bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        return self._store(keys, values)


class RowColumns:
    """Which of its tokens each column of a row holds, for every row of a batch's KV layers
    (they all hold the same columns), on the host.

    Row i's tokens sit in columns [idx - len(rows[i]), idx); rows[i][c] is the position (in
    the row's own sequence) of the token in its c-th column. Only `forward_rows` writes
    columns between two family calls, the same number for every row, so each call first
    `catch_up`s with the layers' column count."""

    def __init__(self, lengths: list[int], idx: int) -> None:
        self.rows = [deque(range(n)) for n in lengths]
        self.idx = idx

    def catch_up(self, idx: int) -> None:
        """Every row got idx - self.idx new tokens, in order, at the end."""
        for row in self.rows:
            n = len(row)
            row.extend(range(n, n + idx - self.idx))
        self.idx = idx

    def rollback(self, common: int, extra: list[int]) -> mx.array | None:
        """Every row drops its last `common` columns; row i then drops extra[i] more and moves
        its oldest min(extra[i], kept) columns into the slots those leave (`tail_moves`'
        map, None when no row moves any)."""
        self.idx -= common
        starts, counts = [], []
        for row, e in zip(self.rows, extra, strict=True):
            for _ in range(common + e):
                row.pop()
            starts.append(self.idx - len(row) - e)  # its first column, before its padding grows
            counts.append(min(e, len(row)))
            row.rotate(-counts[-1])
        return tail_moves(starts, counts, self.idx)

    def in_order(self, i: int) -> list[int] | None:
        """Row i's columns in the order of its tokens (None: they already are)."""
        row = self.rows[i]
        order = np.argsort(np.fromiter(row, dtype=np.int64, count=len(row)), kind="stable")
        if np.all(order[1:] > order[:-1]):
            return None
        return (order + self.idx - len(row)).tolist()


def tail_moves(starts: list[int], counts: list[int], end: int) -> mx.array | None:
    """Row i moves its counts[i] columns from starts[i] on into its last counts[i] columns
    before `end`: for the last E columns (E the most any row moves), the column each takes its
    key from ([rows, 1, E, 1], for `gather_columns`), or None when no row moves any."""
    width = max(counts, default=0)
    if not width:
        return None
    source = np.tile(np.arange(end - width, end), (len(counts), 1))
    for i, (start, m) in enumerate(zip(starts, counts, strict=True)):
        if m:
            source[i, width - m :] = np.arange(start, start + m)
    return mx.array(source, dtype=mx.int32)[:, None, :, None]


def gather_columns(c: BatchKVCache, source: mx.array) -> tuple[mx.array, mx.array]:
    """The keys and values `tail_moves`' map puts in the last columns (before `c._idx`).

    Evaluate them before `write_columns` writes them: a write whose value still reads the
    buffer it writes makes MLX copy the whole buffer instead of updating it in place
    (`BatchedRows.rollback_rows`; the drafter's `ContextRows.begin` gathers its own ahead)."""
    return mx.take_along_axis(c.keys, source, 2), mx.take_along_axis(c.values, source, 2)


def write_columns(c: BatchKVCache, moved: tuple[mx.array, mx.array]) -> None:
    """Write `gather_columns`' keys and values into the columns that end at `c._idx`."""
    end = c._idx
    start = end - moved[0].shape[2]
    c.keys[..., start:end, :], c.values[..., start:end, :] = moved


def _first_kv(cache: list) -> BatchKVCache | QuantizedRows | None:
    return next((c for c in cache if type(c) is BatchKVCache or isinstance(c, QuantizedRows)), None)


def _merge_layer(layer: tuple):
    # By class name: a multimodal checkpoint's language tower (mlx-vlm) uses mlx-vlm's own
    # cache classes, which hold the same fields as mlx-lm's.
    kinds = {type(c).__name__ for c in layer}
    if kinds == {"KVCache"}:
        return BatchKVCache.merge(list(layer))
    if kinds == {"RotatingKVCache"}:
        if any(c.keep for c in layer):
            raise UnsupportedTargetError(
                "batched decoding needs sliding windows that keep no leading tokens"
            )
        return WindowRows.merge(list(layer))
    if kinds == {"RecordingArraysCache"}:
        return RecordingArraysCache.merge(list(layer))
    if kinds == {"QuantizedKVCache"}:
        return QuantizedProductRows.merge(list(layer))
    if kinds == {"DequantizingKVCache"}:
        return QuantizedRows.merge(list(layer))
    names = ", ".join(sorted(kinds - {"KVCache", "RotatingKVCache", "RecordingArraysCache"}))
    raise UnsupportedTargetError(
        "batched decoding needs KV caches, sliding windows or recurrent state; this model "
        f"uses {names}"
    )


def _columns(cache: BatchedCache) -> RowColumns | None:
    """The cache's column map, caught up with what forwards wrote since the last call."""
    columns = getattr(cache, "columns", None)
    if columns is not None:
        columns.catch_up(_first_kv(cache)._idx)
    return columns


class BatchedRows:
    """The batching members of a family whose layers hold `KVCache`s, rotating (sliding-window)
    caches and recurrent state."""

    def padded_rows(self, cache: list, left_padding: list[int]) -> BatchedCache | None:
        """Empty rows for one left-padded forward of several prompts (mlx-lm's batched
        prefill), shaped after the fresh one-row `cache`; None where a layer keeps recurrent
        state or a window, which the padding tokens would enter."""
        if {type(c).__name__ for c in cache} != {"KVCache"}:
            return None
        return BatchedCache(BatchKVCache(list(left_padding)) for _ in cache)

    def merge_rows(self, caches: list[list]) -> BatchedCache:
        """One batched cache from one-row caches (their rows, in order)."""
        merged = BatchedCache(_merge_layer(layer) for layer in zip(*caches, strict=True))
        kv = _first_kv(merged)
        if kv is not None:
            at = merged.index(kv)
            merged.columns = RowColumns([c[at].offset for c in caches], kv._idx)
        return merged

    def extend_rows(self, cache: BatchedCache, rows: BatchedCache) -> None:
        """Append the rows of `rows` to `cache`, in place."""
        mine_cols, theirs_cols = _columns(cache), _columns(rows)
        for mine, theirs in zip(cache, rows, strict=True):
            mine.extend(theirs)
        if mine_cols is not None and theirs_cols is not None:
            mine_cols.rows += theirs_cols.rows
            mine_cols.idx = _first_kv(cache)._idx

    def filter_rows(self, cache: BatchedCache, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order), in place."""
        columns = _columns(cache)
        index = mx.array(keep, dtype=mx.int32)
        for c in cache:
            c.filter(index)
        if columns is not None:
            columns.rows = [columns.rows[i] for i in keep]
            columns.idx = _first_kv(cache)._idx  # mlx-lm drops the padding all rows share

    def extract_row(self, cache: BatchedCache, row: int) -> list:
        """Row `row` as a one-row cache (a copy), its KV columns in the order of its tokens."""
        columns = _columns(cache)
        order = None if columns is None else columns.in_order(row)
        if order is None:
            return [c.extract(row) for c in cache]
        index = mx.array(order, dtype=mx.int32)
        out = []
        for c in cache:
            if isinstance(c, QuantizedRows):
                out.append(c.extract(row, index))
                continue
            if type(c) is not BatchKVCache:
                out.append(c.extract(row))
                continue
            one = KVCache()
            one.keys = mx.contiguous(mx.take(c.keys[row : row + 1], index, axis=2))
            one.values = mx.contiguous(mx.take(c.values[row : row + 1], index, axis=2))
            one.offset = len(order)
            out.append(one)
        return out

    def rollback_rows(self, cache: BatchedCache, n: list[int]) -> None:
        """Drop the last n[i] positions of row i.

        Every KV layer of a batch holds the same offsets and left padding (the same tokens
        went into each), so their new values are computed once and every layer takes the
        same arrays: a round's rollback costs two small ops, not three a layer. Sharing is
        safe because mlx-lm rebinds these fields on update, trim, extend and filter (a new
        array each time), never changing the array itself there."""
        if not any(n):
            return
        common = min(n)
        extra = [k - common for k in n]
        drop = mx.array(extra, dtype=mx.int32) if any(extra) else None  # beyond `common`
        shifts = None if drop is None else drop[:, None]
        columns = _columns(cache)
        source = None if columns is None else columns.rollback(common, extra)
        shared: tuple[mx.array, mx.array] | None = None  # every KV layer's offset, padding
        moves: list[tuple[BatchKVCache, tuple[mx.array, mx.array]]] = []
        for c in cache:
            if isinstance(c, RecordingArraysCache):
                c.rollback_rows(n)
                continue
            if isinstance(c, WindowRows):
                c.rollback_rows(common, shifts)
                continue
            if shared is None:  # something is dropped (n is not all zeros)
                cut = common if drop is None else drop + common if common else drop
                padding = c.left_padding if drop is None else c.left_padding + drop
                shared = (c.offset - cut, padding)
            for part in getattr(c, "parts", (c,)):  # a quantized layer: its three arrays alike
                part._idx -= common  # mlx-lm's trim, less its offset op (shared above)
                if shifts is None:
                    continue
                end = part._idx
                if columns is None:  # no column map: roll each row's whole length
                    part.keys[..., :end, :] = dynamic_roll(part.keys[..., :end, :], shifts, axis=2)
                    part.values[..., :end, :] = dynamic_roll(
                        part.values[..., :end, :], shifts, axis=2
                    )
                elif source is not None:
                    moves.append((part, gather_columns(part, source)))
            c.offset, c.left_padding = shared
        if moves:
            # The moved columns are read before any is written, in one evaluation of their
            # own: a write whose value still reads the buffer it writes (the gather queued
            # with it) makes MLX copy the whole buffer instead of updating it in place, every
            # layer, every round: at 8 rows of a long context, gigabytes a round. One small
            # evaluation here (the device is idle: the round was just read back) costs less.
            mx.eval([m for _, m in moves])
            for part, moved in moves:
                write_columns(part, moved)
