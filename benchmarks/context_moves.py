"""What a batched drafter call that moves context columns costs (`ContextRows`, in
`plugins/strategies/draft_context.py`): rows that take in different numbers of context rows
move their oldest columns into their padding, in every draft layer's K/V buffer and the
positions'. This times one call's cache work (plan, each layer's append, evaluated) over
`--rows` rows of about `--columns` context columns, with the peak memory it adds: rows taking
in uneven counts (some move), and for scale the same widths taken in evenly (none moves). The
drafter's projections and attention are left out: they are the same either way. Each rep
builds its rows anew and runs one untimed call first, so the buffers have room (no growth)
and each timed call moves the same columns. Medians in ms.

Run it on two checkouts to compare them (the script uses only `ContextRows`' own calls):

    python benchmarks/context_moves.py                                 # 8 rows, 2,048 columns
    python benchmarks/context_moves.py --columns 16384 --dtype bfloat16    # a long context
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from outrider.plugins.strategies.draft_context import ContextRows  # noqa: E402


def built(args, dtype) -> ContextRows:
    """Rows of `--columns` minus a few context columns each, in every layer and positions."""
    rows = ContextRows(args.layers, positions=True)
    for i in range(args.rows):
        n = args.columns - 3 * i
        shape = (1, args.heads, n, args.dim)
        where = mx.arange(n, dtype=mx.float32)[None, None, :, None]
        layers = [(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
                  for _ in range(args.layers)]  # fmt: skip
        rows.add(layers + [(where, where)], n)
    mx.eval([(c.kv.keys, c.kv.values) for c in rows.caches])
    return rows


def call(rows: ContextRows, incoming: list[int], args, dtype) -> None:
    """One drafter call's cache work: plan it, append each layer's new K/V, evaluate."""
    shape = (len(incoming), args.heads, max(incoming), args.dim)
    new = [(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
           for _ in rows.layers]  # fmt: skip
    mx.eval(new)
    rows.begin(incoming, 8, list(range(len(incoming))))
    for layer, (k, v) in zip(rows.layers, new):
        layer.append(k, v)
    rows.end()
    mx.eval([(c.kv.keys, c.kv.values) for c in rows.caches])


def timed(incoming: list[int], args, dtype) -> tuple[float, float, float]:
    """Median ms and peak memory added (MB) of a call taking in `incoming`, and the buffers'
    size (MB)."""
    times, peaks = [], []
    for _ in range(args.reps):
        rows = built(args, dtype)
        call(rows, [max(incoming)] * args.rows, args, dtype)  # the buffers grow room (untimed)
        buffers = sum(c.kv.keys.nbytes + c.kv.values.nbytes for c in rows.caches) / 1e6
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        t = time.perf_counter()
        call(rows, incoming, args, dtype)
        mx.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        peaks.append((mx.get_peak_memory() - before) / 1e6)
        del rows
    return statistics.median(times), statistics.median(peaks), buffers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--columns", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    uneven = [1 + 4 * (i % 2) for i in range(args.rows)]  # 1 or 5: half the rows move 4
    even = [max(uneven)] * args.rows
    print(
        f"{args.rows} rows x {args.layers} layers, K/V [{args.heads}, ~{args.columns}, "
        f"{args.dim}] {args.dtype} a row · {mx.default_device()} · mlx {mx.__version__}"
    )
    for name, incoming in (("uneven (columns move)", uneven), ("even (none move)", even)):
        ms, mb, buffers = timed(incoming, args, dtype)
        print(f"{name:<24} {ms:>9.3f} ms {mb:>9.1f} MB peak added ({buffers:.1f} MB buffers)")


if __name__ == "__main__":
    main()
