"""The context a block drafter attends to: each draft layer's K/V of the target's tapped rows,
for one row (`ContextCache`) or several drafted together (`ContextRows`, `RowsLayerCache`), and
which keys a block query sees (`visibility`, `ordered_mask`). Block K/V never enter.

Rows drafted together sit in one left-padded batched cache per layer, each row roped at its
own positions and its padding masked, so each row's hidden states are those it gets alone
(block_drafter.py `ContextBackbone.backbone_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..targets.batched import gather_columns, tail_moves


class ContextCache:
    """Append-only K/V of the context rows one draft layer has seen (block K/V never enter)."""

    def __init__(self) -> None:
        self._kv = KVCache()
        self._last: tuple[mx.array | None, mx.array | None] = (None, None)

    @property
    def offset(self) -> int:
        return self._kv.offset

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._last = self._kv.update_and_fetch(keys, values)
        return self._last

    def fetch(self) -> tuple[mx.array | None, mx.array | None]:
        return self._last

    def mark(self) -> int:
        """Where the context ends now (for `rewind`)."""
        return self._kv.offset

    def rewind(self, mark: int) -> None:
        """Forget the context rows taken in since `mark`: a block drafted ahead took them in
        before its round was read, and the round did not keep them all (dflash2.py)."""
        kv = self._kv
        kv.trim(kv.offset - mark)
        self._last = (None, None)
        if kv.offset:
            self._last = (kv.keys[..., : kv.offset, :], kv.values[..., : kv.offset, :])

    def mask(self, n: int, keys: int, causal: bool, window: int | None) -> mx.array | None:
        """One row, keys in order: its context positions, then the block's."""
        return ordered_mask(self.offset, keys - n, n, causal, window)


def visibility(
    queries: mx.array, keys: mx.array, causal: bool, window: int | None
) -> mx.array | None:
    """Which keys block queries see: positions queries [..., n] and keys [..., K] -> a boolean
    [..., n, K] (None: every key). A window keeps keys fewer than `window` positions back (and,
    in a bidirectional layer, ahead), as transformers' sliding attention does."""
    if not causal and window is None:
        return None
    q, k = queries[..., :, None], keys[..., None, :]
    ok = mx.ones(q.shape[:-1] + k.shape[-1:], dtype=mx.bool_)
    if causal:
        ok = ok & (k <= q)
    if window is not None:
        ok = ok & (q - k < window)
        if not causal:
            ok = ok & (k - q < window)
    return ok


def ordered_positions(width: int, pads: list[int], dtype: mx.Dtype) -> mx.array:
    """[R, width] the positions of columns still in order: a row's column c holds position c
    less the row's left padding (its padding columns read negative)."""
    return mx.arange(width, dtype=dtype)[None] - mx.array(pads, dtype=dtype)[:, None]


def ordered_mask(
    offset: int, n_ctx: int, n: int, causal: bool, window: int | None
) -> mx.array | None:
    """The mask of one row whose keys are its last `n_ctx` context positions before `offset`,
    in order, then the block's `n` (None when every key is visible)."""
    if not causal and (window is None or n_ctx + n <= window):
        return None  # the window reaches past the first key
    keys = mx.arange(offset - n_ctx, offset + n)
    return visibility(mx.arange(offset, offset + n), keys, causal, window)


@dataclass
class _Call:
    """What one drafter call over `ContextRows` does to them, worked out on the host first.
    Every row takes in its new context; only the drafting rows (`drafting`) run a block."""

    before: mx.array  # [R] each row's context length: its new rows' first position
    block: mx.array  # [D] each drafting row's context length after the call: its block's
    shifts: mx.array | None  # [R, 1] how much each row's padding grows; None: none
    # For the last E of the call's new columns ([R, 1, E, 1]; None: no row moves any): the new
    # column each takes (`into`), or, where `older`, an older column (`RowsLayerCache.moved`)
    into: mx.array | None
    older: mx.array | None
    drop: int  # leading columns no row uses after the call, cut off
    drafting: mx.array | None  # [D] the rows that run a block (None: every row)
    mask: mx.array | None  # [D, 1, 1, keys + block] keys a drafting row sees (None: all)
    ends: list[int]  # each drafting row's context length after the call (on the host)
    seen: list[int]  # each drafting row's left padding after the call (on the host)
    positions: mx.array | None = None  # [D, 1, keys, 1] each key column's position (None:
    # the columns are in order, `ContextRows.positions`)
    masks: dict | None = None  # (causal, window) -> that kind of layer's mask, made once


class ContextRows:
    """The context K/V of rows drafted together, for every draft layer: one mlx-lm
    `BatchKVCache` a layer, rows left-padded (every row's last context row in the same column).

    A call appends each row's new context rows, padded to the widest with the padding after the
    row's own rows; a padded row moves its oldest columns into those trailing slots and its
    left padding grows by as many (the trick `BatchedRows.rollback_rows` plays on the target's
    cache: a row's keys in another order are the same keys to attention, each roped at its own
    position, and the context is never cut back, so the order never matters); leading columns
    that are padding in every row are dropped. Each row's padding is masked, so a row attends to
    exactly the keys it has alone. Rows move in (`add`) and out (`take`, `keep`) between
    calls; lengths and padding are kept on the host, so none of this waits for the device.

    The moves go in with the new columns, in one write a buffer: a moved column the call does
    not write itself is gathered by `begin` from the buffer as it was, in one evaluation of
    every cache's before the call. Gathered in the write's own graph, it made MLX copy the
    whole buffer instead of updating it in place, every layer, every call that moves columns.

    Sliding-window layers and a context limit must know each column's position, which after a
    move is not its order. Until a call moves columns (never, for one sequence) a row's column
    c holds position c less the row's padding, and masks work that out; the first call that
    moves columns starts `positions`, one more cache holding each column's position, moved,
    dropped and handed over exactly as the keys are. Kept from the start it cost a one-row
    DFlash call on a 2-core CPU about 80 us of graph building (120 against 37 for `begin`).
    """

    def __init__(self, n_layers: int, positions: bool = False, limit: int | None = None) -> None:
        self.layers = [RowsLayerCache(self) for _ in range(n_layers)]
        # Blocks see at most the last `limit` context rows (the drafter's context window;
        # None: all of them).
        self.limit = limit
        # Whether masks read positions (sliding-window layers, a limit), and the cache of them
        # once a call has moved columns (None until then: each column's position is its order)
        self.track = positions or limit is not None
        self.positions: RowsLayerCache | None = None
        self.lengths: list[int] = []  # context rows each row holds
        self.pads: list[int] = []  # each row's left padding
        self.call: _Call | None = None

    @property
    def caches(self) -> list[RowsLayerCache]:
        """Every cache a row has a column in: the layers', then the positions'."""
        return self.layers + ([self.positions] if self.positions is not None else [])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Columns in use: every row's padding plus its context rows."""
        return self.pads[0] + self.lengths[0] if self.lengths else 0

    def begin(self, incoming: list[int], block: int, drafting: list[int]) -> None:
        """Plan a call that adds incoming[i] context rows to row i and runs a block of `block`
        slots for each row of `drafting` (in that order)."""
        widest = max(incoming)
        shifts = [widest - n for n in incoming]
        pads = [p + s for p, s in zip(self.pads, shifts, strict=True)]
        drop = min(pads)
        pads = [p - drop for p in pads]
        width = self.width + widest - drop
        after = [n + m for n, m in zip(self.lengths, incoming)]
        every = drafting == list(range(len(after)))
        mask = None
        seen = [pads[i] for i in drafting]
        if any(seen):
            keys = mx.arange(width + block)[None, :] >= mx.array(seen)[:, None]
            mask = keys[:, None, None, :]
        moved = [min(e, n) for e, n in zip(shifts, after)]
        source = tail_moves(self.pads, moved, self.width + widest)
        into = older = None
        if source is not None:  # the call's new columns start at the old width
            into, older = mx.maximum(source - self.width, 0), source < self.width
            if self.track and self.positions is None:
                self._start_positions()  # from here on a column's position is not its order
        self.call = _Call(
            mx.array(self.lengths, dtype=mx.int32),
            mx.array([after[i] for i in drafting], dtype=mx.int32),
            mx.array(shifts, dtype=mx.int32)[:, None] if any(shifts) else None,
            into,
            older,
            drop,
            None if every else mx.array(drafting, dtype=mx.int32),
            mask,
            [after[i] for i in drafting],
            seen,
        )
        if any(m and n for m, n in zip(moved, self.lengths)):  # some row moves older columns
            self._gather_older(source)
        for layer in self.caches:  # context rows go in at `before`; no context: the block
            layer.offset = self.call.before if widest else self.call.block
        self.lengths, self.pads = after, pads
        if self.positions is not None:
            if widest:
                new = self.call.before[:, None] + mx.arange(widest, dtype=mx.int32)
                self.positions.append(*[new[:, None, :, None].astype(mx.float32)] * 2)
            self.call.positions = self.positions.fetch()[0]

    def _start_positions(self) -> None:
        """The positions cache, from the columns' order (every row's still in order)."""
        self.positions = RowsLayerCache(self)
        if not self.lengths:
            return
        kv = BatchKVCache(self.pads)
        if self.width:
            kv.keys, kv.values = (
                ordered_positions(self.width, self.pads, mx.float32)[:, None, :, None]
                for _ in range(2)
            )  # two arrays: a cache writes its keys and values in place, one after the other
        kv._idx = self.width
        kv.offset = mx.array(self.lengths)
        self.positions.kv = kv

    def _gather_older(self, source: mx.array) -> None:
        """Read each cache's columns that `source` ([R, 1, E, 1], `tail_moves`) takes from
        before this call into its `moved`, all in one evaluation now, before any cache is
        written (the device is idle between rounds); entries that take one of the call's own
        columns read some older column, unused."""
        inside = mx.minimum(source, self.width - 1)
        for layer in self.caches:
            layer.moved = gather_columns(layer.kv, inside)
        mx.eval([layer.moved for layer in self.caches])

    def end(self) -> None:
        self.call = None
        for layer in self.caches:
            layer.moved = None

    def add(self, row: list[tuple[mx.array, mx.array] | None] | None, length: int) -> None:
        """Append one row: its K/V per layer ([1, kv, length, D], None when empty), then
        optionally its columns' positions as `take` gives them (None or absent: in order;
        row None: an empty row)."""
        width = max(self.width, length)
        n = len(self.layers)
        row = [None] * n if row is None else list(row)
        where = row[n] if len(row) > n else None
        if where is not None and self.positions is None and self.track:
            self._start_positions()
        if self.positions is not None:
            if where is None and length:  # one row, no padding: in order
                where = tuple(
                    ordered_positions(length, [0], mx.float32)[:, None, :, None] for _ in range(2)
                )
            row = row[:n] + [where]
        else:
            row = row[:n]
        for layer, kv in zip(self.caches, row, strict=True):
            piece = BatchKVCache([0])
            if kv is not None:
                piece.keys, piece.values = kv
                piece._idx = length
                piece.offset = piece.offset + length
            if layer.kv is None:
                layer.kv = piece
            else:
                layer.kv.extend(piece)
        self.pads = [p + width - self.width for p in self.pads] + [width - length]
        self.lengths = self.lengths + [length]

    def take(self, i: int) -> tuple[list[tuple[mx.array, mx.array] | None], int]:
        """Row i's K/V per cache (`caches`: the layers', then its positions' once they are
        kept; compact copies, computed now) and its length; `add` takes them."""
        length, pad, width = self.lengths[i], self.pads[i], self.width
        row = []
        for layer in self.caches:
            kv = layer.kv
            if not length or kv.keys is None:
                row.append(None)
                continue
            k = mx.contiguous(kv.keys[i : i + 1, :, pad:width])
            v = mx.contiguous(kv.values[i : i + 1, :, pad:width])
            row.append((k, v))
        if length:
            mx.eval(row)  # copies now: they hold no reference to the old cache
        return row, length

    def trim_last(self, n: int) -> None:
        """Drop the last n context rows of a group of one row: a round drafted ahead took
        them in before its own round was read, and that round did not keep them all
        (`BlockProposer.draft_ahead`). One row has no padding, so its newest rows are its
        last columns."""
        if len(self.lengths) != 1:
            raise ValueError("only a group of one row drops its latest context rows")
        for layer in self.caches:
            if layer.kv is not None:
                layer.kv.trim(n)
        self.lengths = [self.lengths[0] - n]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); columns that become padding in every row go."""
        if not rows:
            for layer in self.caches:
                layer.kv = None
            self.lengths, self.pads = [], []
            return
        pads = [self.pads[i] for i in rows]
        drop = min(pads)
        index = mx.array(rows, dtype=mx.int32)
        for layer in self.caches:
            kv = layer.kv
            if kv.keys is not None:
                kv.keys = kv.keys[index][..., drop:, :]
                kv.values = kv.values[index][..., drop:, :]
                kv._idx -= drop
            kv.offset = kv.offset[index]
            kv.left_padding = kv.left_padding[index] - drop
        self.lengths = [self.lengths[i] for i in rows]
        self.pads = [p - drop for p in pads]


class RowsLayerCache:
    """One draft layer's K/V in `ContextRows`: what `DraftAttention` appends to and reads."""

    def __init__(self, rows: ContextRows) -> None:
        self.rows = rows
        self.kv: BatchKVCache | None = None
        self.offset: mx.array | None = None  # the positions of what comes next, a row
        # The older columns this call moves (`ContextRows.begin`; None: none), K and V
        self.moved: tuple[mx.array, mx.array] | None = None

    def append(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the call's new columns (keys, values [R, kv, widest, D]), each padded row's
        trailing slots already holding the columns it moves there, then grow the padding and
        drop what no row uses -> the K/V of the rows that draft."""
        call = self.rows.call
        kv = self.kv
        if call.into is not None:
            keys, values = self._with_moves(keys, values)
        kv.update_and_fetch(keys, values)  # one write, reading nothing of the buffer
        end = kv._idx
        if call.shifts is not None:
            kv.left_padding = kv.left_padding + call.shifts[:, 0]
            kv.offset = kv.offset - call.shifts[:, 0]
        if call.drop:  # a view: the next write that needs room copies what is left
            kv.keys = kv.keys[..., call.drop :, :]
            kv.values = kv.values[..., call.drop :, :]
            kv._idx = end - call.drop
            kv.left_padding = kv.left_padding - call.drop
        self.offset = call.block
        return self._drafting(*kv.keys_and_values())

    def _with_moves(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The new columns with their last E replaced by what the call's moves put there: one
        of the new columns themselves, or an older column `begin` gathered (`moved`). What the
        write then the moves left, written once, so the write never reads its own buffer."""
        call, moved = self.rows.call, self.moved
        self.moved = None
        tail = call.into.shape[2]
        out = []
        for i, new in enumerate((keys, values)):
            taken = mx.take_along_axis(new, call.into, 2)
            if moved is not None:
                taken = mx.where(call.older, moved[i], taken)
            kept = new[..., : new.shape[2] - tail, :]
            out.append(mx.concatenate([kept, taken], axis=2) if kept.shape[2] else taken)
        return out[0], out[1]

    def fetch(self) -> tuple[mx.array | None, mx.array | None]:
        kv = self.kv
        if kv is None or kv.keys is None or kv._idx == 0:
            return None, None
        return self._drafting(*kv.keys_and_values())

    def _drafting(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The K/V of the rows that run a block this call."""
        rows = self.rows.call.drafting
        if rows is None:
            return keys, values
        return keys[rows], values[rows]

    def mask(self, n: int, keys: int, causal: bool, window: int | None) -> mx.array | None:
        """The keys (`keys` columns, the block's `n` last) each drafting row's block queries
        see: its own columns, not its padding, of those the last `ContextRows.limit` context
        rows, and what the layer's causality and window allow."""
        call, limit = self.rows.call, self.rows.limit
        longest = max(call.ends)
        if (
            not causal
            and (window is None or longest + n <= window)
            and (limit is None or longest <= limit)
        ):
            return call.mask  # the window and the limit reach past every row's first position
        made = call.masks = call.masks or {}
        if (causal, window) not in made:
            block = call.block[:, None] + mx.arange(n, dtype=mx.int32)  # [D, n] positions
            if window is None and (limit is None or longest <= limit):
                seen = visibility(block, block, causal, None)  # [D, n, n]: only the block's
                context = mx.ones((block.shape[0], n, keys - n), dtype=mx.bool_)
                ok = mx.concatenate([context, seen], axis=-1)
            else:
                if call.positions is not None:  # [D, keys - n]
                    context = call.positions[:, 0, :, 0].astype(mx.int32)
                else:  # the columns are in order (`ContextRows`)
                    context = ordered_positions(keys - n, call.seen, mx.int32)
                positions = mx.concatenate([context, block], axis=-1)
                # None only for a bidirectional, windowless layer, here because the limit bites
                ok = visibility(block, positions, causal, window)
                if limit is not None and longest > limit:  # the last `limit` context rows
                    recent = positions >= (call.block - limit)[:, None]  # [D, keys]
                    ok = recent[:, None, :] if ok is None else ok & recent[:, None, :]
                ok = mx.broadcast_to(ok, (block.shape[0], n, keys))
            ok = ok[:, None]  # [D, 1, n, keys]
            made[(causal, window)] = ok if call.mask is None else ok & call.mask
        return made[(causal, window)]
