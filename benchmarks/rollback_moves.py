"""What a batched rollback's column moves cost, written in place or through a copy.

A batched rollback moves a few columns of each K/V buffer into other slots of the same buffer
(`plugins/targets/batched.py`, `BatchedRows.rollback_rows`). Written as one lazy graph, the
gather still holds the buffer when the write runs, and MLX copies the whole buffer instead of
updating it in place; gathered and evaluated first, the write is in place. This times both on
one buffer of `--rows` x `--heads` x `--columns` x `--dim`, with the peak memory each adds,
and one elementwise pass over the buffer (a copy's memory traffic, in place) for scale.
Medians in ms.

    python benchmarks/rollback_moves.py                               # 8 rows, 2,048 columns
    python benchmarks/rollback_moves.py --columns 16384 --dtype bfloat16   # a long context
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


class Layer:
    """A stand-in for one cache layer: the buffer, held by nothing else."""

    def __init__(self, keys: mx.array) -> None:
        self.keys = keys


def lazy(layer: Layer, source: mx.array, end: int) -> None:
    """The gather and the write in one graph (what the rollback did)."""
    layer.keys[..., end - source.shape[2] : end, :] = mx.take_along_axis(layer.keys, source, 2)


def gathered_first(layer: Layer, source: mx.array, end: int) -> None:
    """The gather evaluated first, then the write (what the rollback does)."""
    moved = mx.take_along_axis(layer.keys, source, 2)
    mx.eval(moved)
    layer.keys[..., end - source.shape[2] : end, :] = moved


def whole_pass(layer: Layer, source: mx.array, end: int) -> None:
    """Read and write every element once (in place): the memory traffic of a copy."""
    layer.keys = layer.keys * 1


def timed(fn, layer: Layer, source: mx.array, end: int, reps: int) -> tuple[float, float]:
    """Median ms of `fn` then the buffer evaluated, and the peak memory it added (MB)."""
    times, peaks = [], []
    for _ in range(reps):
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        t = time.perf_counter()
        fn(layer, source, end)
        mx.eval(layer.keys)
        mx.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        peaks.append((mx.get_peak_memory() - before) / 1e6)
    return statistics.median(times), statistics.median(peaks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--columns", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--moved", type=int, default=3, help="columns each row moves")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    shape = (args.rows, args.heads, args.columns, args.dim)
    layer = Layer(mx.random.normal(shape).astype(dtype))
    mx.eval(layer.keys)
    end = args.columns
    columns = [list(range(r, r + args.moved)) for r in range(args.rows)]  # each row's oldest
    source = mx.array(columns, dtype=mx.int32)[:, None, :, None]
    print(
        f"buffer {shape} {args.dtype}, {layer.keys.nbytes / 1e6:.1f} MB, {args.moved} columns "
        f"a row moved · {mx.default_device()} · mlx {mx.__version__}"
    )
    for name, fn in (("gather and write, one graph", lazy),
                     ("gathered first", gathered_first),
                     ("one pass over it, for scale", whole_pass)):  # fmt: skip
        ms, mb = timed(fn, layer, source, end, args.reps)
        print(f"{name:<30} {ms:>9.3f} ms {mb:>9.1f} MB peak added")


if __name__ == "__main__":
    main()
