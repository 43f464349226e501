"""Quantized products of many rows (a prefill's chunks): MLX's own quantized matmul against
dequantizing the weight first and multiplying in half precision, per weight shape and row
count, and a whole prefill of a random-weight target each way (its peak memory too).

MLX 0.32's CUDA backend computes a quantized product of hundreds of rows several times slower
than the half-precision product of the same shape; a prefill chunk can instead dequantize each
weight (reading it once, writing it once in bf16) and use the half-precision product. This
measures whether that pays, where, and how far the results part. Where outrider's rows kernel
runs (CUDA), products of up to 64 rows are timed through its tensor-core form too, and past 16
rows through its gemm form at the configurations `--gemm` names (whatever its own choice for the
shape), with the gemm form's error against MLX's product and whether its first row equals that
row computed alone.

    python benchmarks/quantized_prefill.py                        # 8B and 32B shapes, 4-bit
    python benchmarks/quantized_prefill.py --rows 64,512 --prefill 4096 --shape 8b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).parent))

from loop_efficiency import SHAPES  # noqa: E402


def timeit(fn, reps: int, *args) -> float:
    mx.eval(fn(*args))
    out = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def quantized(x, qw, sc, bi, bits):
    return mx.quantized_matmul(x, qw, sc, bi, True, 64, bits)


def dequantized(x, qw, sc, bi, bits):
    return x @ mx.dequantize(qw, sc, bi, 64, bits).astype(x.dtype).T


def prefill(target, ids):
    cache = target.make_cache()
    logits, _ = target.prefill(ids, cache)
    return logits


def dense_route(model: nn.Module, rows: int | None, queue_bytes: int | None = None) -> int:
    """Send products of `rows` rows or more through the dequantized weight (None: never), as
    `QuantizedRows.dense_from` does, waiting for the device every `queue_bytes` of dense
    weights (None: never); layers without a wrapper get one. Returns the layers."""
    from outrider.core.row_kernels import DenseQueue, QuantizedRows

    wrapped = [m for _, m in model.named_modules() if isinstance(m, QuantizedRows)]
    if not wrapped:  # no rows kernel here: every quantized layer gets a wrapper
        swap = [(n, QuantizedRows(m, NoKernel(), rows)) for n, m in model.named_modules()
                if type(m) is nn.QuantizedLinear]  # fmt: skip
        model.update_modules(nn.utils.tree_unflatten(swap))
    wrapped = [m for _, m in model.named_modules() if isinstance(m, QuantizedRows)]
    queue = None if queue_bytes is None else DenseQueue(queue_bytes)
    for m in wrapped:
        m.dense_from, m.queue = rows, queue
    return len(wrapped)


class NoKernel:
    """A rows kernel that takes no products (so a wrapper only routes wide ones)."""

    name, min_rows, max_rows = "none", 1, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b,32b")
    ap.add_argument("--rows", default="16,64,128,512,2048")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=4096, help="tokens of the whole prefill")
    ap.add_argument("--dense-from", type=int, default=512, help="rows the dense arm starts at")
    ap.add_argument(
        "--gemm",
        default="2x8x1,2x8,4x8",
        help="gemm form configurations: (8-row weight fragments a warp)x(warps)[x(shares of "
        "the input width); without it, the shares `cuda_rows.shares` picks for the shape]",
    )
    ap.add_argument("--queue-gb", default="0,2,1", help="dense arms' queue bounds (0: none)")
    args = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}  {args.bits}-bit, group 64, bf16 rows")
    rows = [int(r) for r in args.rows.split(",")]
    from outrider.plugins.kernels.cuda_rows import MMA_ROWS, CudaRows, shares

    GEMM_CONFIGS = [tuple(int(v) for v in c.split("x")) for c in args.gemm.split(",") if c]

    kernel: CudaRows | None = CudaRows()
    if not kernel.available():
        kernel = None  # the third column only where it runs
    for shape in args.shape.split(","):
        s = SHAPES[shape]
        h, i = s["hidden_size"], s["intermediate_size"]
        mats = {"q/o": (h, h), "gate/up": (i, h), "down": (h, i)}
        print(f"\n{shape}: ms per product (quantized | dequantize + bf16 | ratio | max rel diff)")
        for name, (out_f, in_f) in mats.items():
            w = (mx.random.normal((out_f, in_f)) * 0.02).astype(mx.bfloat16)
            qw, sc, bi = mx.quantize(w, 64, args.bits)
            for m in rows:
                x = mx.random.normal((m, in_f)).astype(mx.bfloat16)
                inputs = (x, qw, sc, bi, args.bits)
                ta, tb = (
                    timeit(quantized, args.reps, *inputs),
                    timeit(dequantized, args.reps, *inputs),
                )
                ya = quantized(*inputs).astype(mx.float32)
                yb = dequantized(*inputs).astype(mx.float32)
                rel = (mx.abs(ya - yb).max() / mx.abs(ya).max()).item()
                rows_ms = ""
                mma = kernel is not None and kernel.form(in_f, args.bits, x.dtype) == "mma"
                if mma and m <= MMA_ROWS:  # the tensor-core form, whatever `rows_up_to` says
                    tk = timeit(lambda *a: kernel(*a[:4], 64, args.bits, "mma", 1), args.reps,
                                *inputs)  # fmt: skip
                    rows_ms += f" | mma {tk * 1e3:7.3f} ({ta / tk:5.2f}x)"
                # the gemm form, as (8-row weight fragments a warp, warps a block, shares)
                for nt, kw, *ks in GEMM_CONFIGS if mma and 16 < m <= MMA_ROWS else ():
                    ks = ks[0] if ks else shares(out_f, in_f)
                    run = lambda *a, c=(nt, kw, ks): kernel(*a[:4], 64, args.bits, "gemm", c)  # noqa: E731
                    tk = timeit(run, args.reps, *inputs)
                    yt = run(*inputs).astype(mx.float32)
                    err = (mx.abs(yt - ya).max() / mx.abs(ya).max()).item()
                    same = mx.array_equal(run(x[:1], qw, sc, bi).astype(mx.float32), yt[:1]).item()
                    rows_ms += (f" | gemm {nt}x{kw}x{ks} {tk * 1e3:7.3f} ({ta / tk:5.2f}x, "
                                f"{err:.0e}{'' if same else ' ROW0 DIFFERS'})")  # fmt: skip
                print(f"  {name:<8} {out_f:>6}x{in_f:<6} rows {m:>5}  {ta * 1e3:8.3f} | "
                      f"{tb * 1e3:8.3f} | {ta / tb:5.2f}x | {rel:.1e}{rows_ms}")  # fmt: skip
    if args.prefill:
        from loop_efficiency import make_target

        for shape in args.shape.split(","):
            target = make_target(shape, "4bit")
            ids = list(range(10, 10 + args.prefill))
            print(f"\n{shape} 4-bit prefill of {args.prefill} tokens, dense from "
                  f"{args.dense_from} rows: ms, peak GB")  # fmt: skip
            arms = [("quantized", None, None)]
            for gb in args.queue_gb.split(","):
                limit = None if float(gb) <= 0 else int(float(gb) * (1 << 30))
                arms.append((f"dense, queue {gb} GiB" if limit else "dense, unbounded", 1, limit))
            base = None
            for how, dense, limit in arms:
                layers = dense_route(target.model, dense and args.dense_from, limit)
                mx.clear_cache()
                mx.reset_peak_memory()
                took = timeit(prefill, 3, target, ids)
                base = base or took
                print(f"  {how:<24} {took * 1e3:9.1f} ms  peak {mx.get_peak_memory() / 1e9:6.2f}"
                      f" GB  ({base / took:.2f}x; {layers} layers)")  # fmt: skip


if __name__ == "__main__":
    main()
