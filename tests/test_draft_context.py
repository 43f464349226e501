"""Rows drafted together (`ContextRows`): a call that pads some rows moves their oldest
columns into their trailing slots. The moved columns are gathered before the call's one write
of each buffer, so the buffers hold exactly what a write followed by the moves left there,
and MLX updates them in place instead of copying each one whole."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from outrider.plugins.strategies.draft_context import ContextRows, RowsLayerCache
from outrider.plugins.targets.batched import gather_columns, tail_moves, write_columns

HEADS, DIM = 2, 8


def fresh(rng: np.random.Generator, n_layers: int, rows: int, n: int) -> list[tuple]:
    """Random K/V of n new columns for each layer, [rows, HEADS, n, DIM] each."""
    shape = (rows, HEADS, n, DIM)
    return [
        (mx.array(rng.standard_normal(shape, np.float32)),
         mx.array(rng.standard_normal(shape, np.float32)))
        for _ in range(n_layers)
    ]  # fmt: skip


def copied(cache: RowsLayerCache) -> BatchKVCache:
    """The cache's rows as a separate mlx-lm cache: the old append runs on it."""
    kv, ref = cache.kv, BatchKVCache([0])
    if kv.keys is not None:
        ref.keys, ref.values = mx.array(kv.keys), mx.array(kv.values)
    ref._idx = kv._idx
    return ref


def old_append(ref: BatchKVCache, keys, values, source, drop: int) -> tuple[mx.array, mx.array]:
    """What `RowsLayerCache.append` wrote before: the new columns, then the moves read from
    and written into the same buffer, then the leading columns no row uses cut off."""
    ref.update_and_fetch(keys, values)
    if source is not None:
        write_columns(ref, gather_columns(ref, source))
    return ref.keys[..., drop : ref._idx, :], ref.values[..., drop : ref._idx, :]


def one_call(rows: ContextRows, incoming: list[int], rng, history: list[list]) -> tuple:
    """A call adding incoming[i] context rows to row i (every row drafting), checked against
    the old append on copies of the caches; each row's new keys are recorded in `history`.
    Returns whether a row moved columns from before the call, and whether a row moved some of
    the call's own (it moved more than it held)."""
    widest = max(incoming)
    shifts = [widest - n for n in incoming]
    moved = [min(s, length + n) for s, length, n in zip(shifts, rows.lengths, incoming)]
    source = tail_moves(rows.pads, moved, rows.width + widest)
    drop = min(p + s for p, s in zip(rows.pads, shifts))
    kinds = (
        any(m and length for m, length in zip(moved, rows.lengths)),
        any(m > length for m, length in zip(moved, rows.lengths)),
    )
    start = list(rows.lengths)
    refs = [copied(c) for c in rows.caches]
    new = fresh(rng, len(rows.layers), len(incoming), widest)
    positions = mx.array(start, dtype=mx.int32)[:, None] + mx.arange(widest, dtype=mx.int32)
    positions = positions[:, None, :, None].astype(mx.float32)
    rows.begin(incoming, 4, list(range(len(incoming))))
    if widest:  # no context rows: the layers only fetch
        for layer, (k, v) in zip(rows.layers, new):
            layer.append(k, v)
    rows.end()
    if not widest:
        return kinds
    for i, n in enumerate(incoming):
        history[i].append(np.array(new[0][0][i, :, :n]))
    wanted = new + [(positions, positions)]
    for cache, ref, (k, v) in zip(rows.caches, refs, wanted, strict=True):
        want = old_append(ref, k, v, source, drop)
        got = cache.kv.keys_and_values()
        for a, b in zip(got, want):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
    return kinds


def in_order(rows: ContextRows, i: int) -> np.ndarray:
    """Row i's first-layer keys, its padding left out, in the order of their positions."""
    pad, width = rows.pads[i], rows.width
    where = np.array(rows.positions.kv.keys[i, 0, pad:width, 0])
    assert sorted(where.tolist()) == list(range(rows.lengths[i]))
    keys = np.array(rows.layers[0].kv.keys[i, :, pad:width])
    return keys[:, np.argsort(where, kind="stable")]


def test_calls_that_move_columns_leave_what_the_old_write_then_move_left():
    """Rows of different lengths take in different numbers of context rows, call after call
    (one row empty, one whose padding grows past what it held, rows joining and leaving):
    every buffer equals, bit for bit, what the update then the moves in one graph left, and
    each row holds exactly the keys it took in."""
    rng, pick = np.random.default_rng(0), random.Random(0)
    rows = ContextRows(2, positions=True)
    history: list[list] = []
    for length in (6, 1, 0):
        if not length:
            rows.add(None, 0)
            history.append([])
            continue
        kv = fresh(rng, 2, 1, length)
        where = mx.arange(length, dtype=mx.float32)[None, None, :, None]
        rows.add(kv + [(where, where)], length)
        history.append([np.array(kv[0][0][0])])
    kinds = [one_call(rows, [5, 1, 0], rng, history)]  # row 1 moves 2 columns, holding 1
    for step in range(12):
        if step == 5:  # row 1 leaves; a row of 3 joins
            rows.keep([0, 2])
            history = [history[0], history[2]]
            kv = fresh(rng, 2, 1, 3)
            where = mx.arange(3, dtype=mx.float32)[None, None, :, None]
            rows.add(kv + [(where, where)], 3)
            history.append([np.array(kv[0][0][0])])
        incoming = [pick.choice([0, 0, 1, 2, 5]) for _ in rows.lengths]
        kinds.append(one_call(rows, incoming, rng, history))
    assert all(any(kind) for kind in zip(*kinds))  # both kinds of move ran
    for i, taken in enumerate(history):
        np.testing.assert_array_equal(in_order(rows, i), np.concatenate(taken, axis=1))


def test_a_call_that_moves_columns_writes_the_buffers_in_place():
    """A call whose rows take in different counts moves columns inside every layer's K/V
    buffer. Gathered before the write, the moves leave MLX free to update each buffer in
    place; gathered in the write's own graph, they made it copy every layer's whole buffer,
    every call. Peak memory tells the two apart."""
    rng = np.random.default_rng(1)
    n_layers, heads, dim = 3, 4, 64
    rows = ContextRows(n_layers)
    for length in (2000, 1990):
        shape = (1, heads, length, dim)
        rows.add(
            [(mx.array(rng.standard_normal(shape, np.float32)),
              mx.array(rng.standard_normal(shape, np.float32)))
             for _ in range(n_layers)],
            length,
        )  # fmt: skip

    def call(incoming: list[int]) -> None:
        widest = max(incoming)
        rows.begin(incoming, 4, [0, 1])
        for layer in rows.layers:
            shape = (2, heads, widest, dim)
            layer.append(mx.random.normal(shape), mx.random.normal(shape))
        rows.end()
        mx.eval([(c.kv.keys, c.kv.values) for c in rows.caches])

    call([4, 4])  # the buffers grow room for what follows (a copy of its own)
    buffers = sum(c.kv.keys.nbytes + c.kv.values.nbytes for c in rows.caches)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    call([1, 5])  # row 0 moves its 4 oldest columns
    grew = mx.get_peak_memory() - before
    assert grew < buffers / 10, (grew, buffers)  # a copy would take a layer's buffers again
    assert rows.pads == [0, 6]


def test_positions_are_kept_only_once_a_call_moves_columns():
    """Masks under a context limit and a sliding window read each column's position. Until a
    call moves columns a position is the column's order, so no positions are kept (one
    sequence never keeps any); the first move starts them. Every mask equals that of rows that
    kept positions from the start, before and after the first move and for a row handed to
    another group, and the kept positions equal the eager twin's."""
    rng = np.random.default_rng(3)
    kinds = [(False, None), (True, None), (False, 3), (True, 3)]

    def grouped(lengths: list[int], eager: bool) -> ContextRows:
        rows = ContextRows(1, limit=5)
        if eager:
            rows._start_positions()
        for length in lengths:
            rows.add([tuple(mx.ones((1, HEADS, length, DIM)) for _ in range(2))], length)
        return rows

    def call(rows: ContextRows, incoming: list[int], new: list) -> list:
        drafting = list(range(len(incoming)))
        rows.begin(incoming, 4, drafting)
        rows.layers[0].append(*new)
        keys = rows.width + 4
        masks = [rows.layers[0].mask(4, keys, c, w) for c, w in kinds]
        rows.end()
        return [None if m is None else np.array(m) for m in masks]

    def same(lazy: ContextRows, eager: ContextRows, incoming: list[int]) -> None:
        shape = (len(incoming), HEADS, max(incoming), DIM)
        new = [mx.array(rng.standard_normal(shape, np.float32)) for _ in range(2)]
        for a, b in zip(call(lazy, incoming, new), call(eager, incoming, new), strict=True):
            assert (a is None and b is None) or np.array_equal(a, b)

    one, one_eager = grouped([0], False), grouped([0], True)
    for incoming in ([7], [2], [1], [3]):
        same(one, one_eager, incoming)
    assert one.positions is None

    lazy, eager = grouped([6, 2], False), grouped([6, 2], True)
    for incoming in ([3, 3], [2, 2]):
        same(lazy, eager, incoming)
    assert lazy.positions is None
    same(lazy, eager, [1, 4])  # row 0 moves its oldest column
    assert lazy.positions is not None
    for incoming in ([3, 0], [2, 5]):
        same(lazy, eager, incoming)
    got, want = (rows.positions.kv.keys_and_values() for rows in (lazy, eager))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))

    # a row that moved, handed to a group still in order, which then keeps positions too
    row, other = lazy.take(0), grouped([4], False)
    other_eager = grouped([4], True)
    other.add(*row)
    other_eager.add(*eager.take(0))
    assert other.positions is not None
    same(other, other_eager, [2, 2])
