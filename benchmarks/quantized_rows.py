"""The few-row quantized product kernel (outrider/plugins/kernels/cuda_rows.py) against MLX's own,
on a CUDA GPU. Three parts, each printed as it finishes:

1. **Agreement** with `mx.quantized_matmul` over types, bits, group sizes and row counts, and
   whether each row of an M-row product is bit for bit the row computed alone.
2. **One projection** of each Qwen3-8B shape, ms per call at 1, 2, 5 and 8 rows, with the
   weights read from memory: each call of a chain of 12 uses its own copy of the matrix, so
   the L2 cache cannot hold them (the older `quantized_verify.py` table reused one copy).
3. **A whole forward** of a random-weight Qwen3 at 4 bits (context 256), widths 1-8, with MLX's
   products (unpadded and padded to 8 rows), with the kernel for each layer alone (`rows`) and
   with q, k, v and gate, up each in one launch (`grouped`, what loading installs); the host's
   share (building the graph, before evaluating it) and the kernel's agreement with MLX's
   logits.

    python benchmarks/quantized_rows.py [--shape 8b] [--skip 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
from quantized_verify import PROJECTIONS  # noqa: E402 - Qwen3-8B's (N, K) of each projection

from outrider.core import row_kernels  # noqa: E402
from outrider.core.device import PADDED_FROM  # noqa: E402
from outrider.core.sampling import greedy  # noqa: E402
from outrider.plugins.kernels import cuda_rows  # noqa: E402


def agreement(kernel: cuda_rows.CudaRows) -> list[dict]:
    # (dtype, bits, group, N, K, rows of the tensor-core form, rows of the float32 form); the
    # float32 form compiles once per row count, so it is checked at fewer
    cases = [
        (mx.bfloat16, 4, 64, 1000, 1024, (1, 2, 5, 8), (1, 5)),
        (mx.bfloat16, 4, 64, 300, 2560, (3,), ()),  # not a whole step of a warp
        (mx.bfloat16, 4, 128, 4096, 1024, (4, 8), ()),
        (mx.bfloat16, 4, 32, 257, 1024, (2,), ()),
        (mx.float16, 4, 64, 512, 1024, (5, 1), ()),
        (mx.float32, 4, 64, 512, 1024, (), (1, 5)),
        (mx.bfloat16, 8, 64, 1000, 1024, (), (1, 5)),
        (mx.float32, 8, 128, 300, 2048, (), (6,)),
    ]
    out = []
    for dtype, bits, group, n, k, mma_rows, fma_rows in cases:
        w = mx.random.normal((n, k), key=mx.random.key(0)).astype(dtype) * 0.05
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
        x_all = mx.random.normal((8, k), key=mx.random.key(1)).astype(dtype)
        for form, rows in (("mma", mma_rows), ("fma", fma_rows)):
            if not rows:
                continue
            try:
                alone = kernel(x_all[:1], wq, s, b, group, bits, form=form)
                mx.eval(alone)
            except Exception as e:
                print(f"  {form} {dtype} {bits}-bit g{group}: FAILED {type(e).__name__}: {e}")
                out.append(dict(form=form, dtype=str(dtype), error=str(e)[:2000]))
                continue
            for m in rows:
                x = x_all[:m]
                t = time.perf_counter()
                got = kernel(x, wq, s, b, group, bits, form=form)
                mx.eval(got)
                built = time.perf_counter() - t
                want = mx.quantized_matmul(x, wq, s, b, True, group, bits).astype(mx.float32)
                err = (mx.abs(got.astype(mx.float32) - want).max() / mx.abs(want).max()).item()
                same = bool(mx.array_equal(got[:1], alone).item())
                row = dict(
                    form=form,
                    dtype=str(dtype),
                    bits=bits,
                    group=group,
                    n=n,
                    k=k,
                    rows=m,
                    rel_err=err,
                    row0_equals_alone=same,
                    first_call_s=round(built, 2),
                )
                out.append(row)
                print(
                    f"  {form} {str(dtype):<14} {bits}-bit g{group:<4} {n}x{k} rows {m}: "
                    f"max rel diff {err:.2e}  row 0 as alone: {same}  ({built:.1f} s)",
                    flush=True,
                )
    return out


def chained(fn, copies: list, reps: int) -> float:
    """Median ms of one call among len(copies) calls, each on its own copy, evaluated together."""
    times = []
    for i in range(reps + 2):
        t = time.perf_counter()
        mx.eval([fn(c) for c in copies])
        if i >= 2:
            times.append((time.perf_counter() - t) / len(copies))
    return 1e3 * statistics.median(times)


def projections(kernel: cuda_rows.CudaRows, reps: int) -> dict:
    out = {}
    for name, (n, k) in PROJECTIONS.items():
        count = 4 if n > 100000 else 12
        copies = []
        for c in range(count):
            w = (mx.random.normal((n, k), key=mx.random.key(c)) * 0.02).astype(mx.bfloat16)
            copies.append(mx.quantize(w, group_size=64, bits=4))
            mx.eval(copies[-1])
        mb = (copies[0][0].nbytes + 2 * copies[0][1].nbytes) / 1e6
        cells = {}
        for m in (1, 2, 5, 8):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            cell = {
                "mlx": chained(lambda c, x=x: mx.quantized_matmul(x, *c, True, 64, 4), copies, reps)
            }
            for form in ("fma", "mma"):
                if form == "fma" and m not in (1, 5):
                    cell[form] = float("nan")  # compiled per row count: two are enough
                    continue
                try:
                    cell[form] = chained(
                        lambda c, x=x, f=form: kernel(x, *c, 64, 4, form=f), copies, reps
                    )
                except Exception as e:  # a form that does not build: the others still count
                    print(f"  {form} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    cell[form] = float("nan")
            cells[m] = {f: round(v, 4) for f, v in cell.items()}
        out[name] = dict(mb=round(mb, 1), ms=cells)
        line = "  ".join(
            f"{m}: {c['mlx']:.3f}/{c['fma']:.3f}/{c['mma']:.3f}" for m, c in cells.items()
        )
        rate = "  ".join(f"{f} 1 row {mb / cells[1][f]:.0f} GB/s" for f in ("mlx", "fma", "mma"))
        print(f"  {name:<20} {mb:6.1f} MB  ms mlx/fma/mma  {line}   {rate}", flush=True)
    return out


def forward(kernel: cuda_rows.CudaRows, shape: str, reps: int) -> dict:
    from loop_efficiency import make_target  # random-weight Qwen3 of a real shape

    target = make_target(shape, "4bit")
    model = target.model
    prompt = mx.random.randint(0, 150000, (256,), key=mx.random.key(1)).tolist()
    cache = target.make_cache()
    mx.eval(target.prefill(prompt, cache)[0])
    widths = (1, 2, 3, 4, 5, 6, 7, 8)
    arms = ("mlx", "mlx_pad8", "rows", "grouped")
    times = {a: {w: [] for w in widths} for a in arms}
    build = {a: {w: [] for w in widths} for a in arms}
    logits_of = {}

    def arm(name: str) -> None:
        row_kernels.uninstall(model)
        target.pad_verifies(8 if name == "mlx_pad8" else 0, PADDED_FROM)
        if name in ("rows", "grouped"):  # grouped: q, k, v and gate, up in one launch each
            group = name == "grouped"
            wrapped, failed = row_kernels.install(model, kernel, mx.bfloat16, group=group)
            if failed:
                print(f"  the kernel's probe failed: {failed}", flush=True)
                raise SystemExit(3)

    for i in range(reps + 2):
        for name in arms:  # interleaved, so drift hits every arm alike
            arm(name)
            for w in widths:
                ids = mx.array(prompt[:w], dtype=mx.uint32)
                t = time.perf_counter()
                logits, _ = target.forward(ids, cache)
                choice = greedy(logits)
                b = time.perf_counter() - t
                mx.eval(choice)
                dt = time.perf_counter() - t
                if i == 0 and w == 5:
                    logits_of[name] = logits.astype(mx.float32)
                target.rollback(cache, w)
                if i >= 2:
                    times[name][w].append(dt)
                    build[name][w].append(b)
    out: dict = {}
    for name in arms:
        ms = {w: 1e3 * statistics.median(v) for w, v in times[name].items()}
        host = {w: 1e3 * statistics.median(v) for w, v in build[name].items()}
        out[name] = {
            "ms": {str(w): round(v, 3) for w, v in ms.items()},
            "host_ms": {str(w): round(v, 3) for w, v in host.items()},
        }
        cells = "  ".join(f"w{w} {ms[w]:.2f} ({ms[w] / ms[1]:.2f}x)" for w in widths)
        print(f"  {name:<9} {cells}", flush=True)
        print(
            f"  {'':<9} host (graph built) ms: " + "  ".join(f"w{w} {host[w]:.2f}" for w in widths),
            flush=True,
        )
    ref = logits_of["mlx"]
    for name in ("rows", "grouped"):
        got = logits_of[name]
        rel = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
        agree = (mx.argmax(got, -1) == mx.argmax(ref, -1)).all().item()
        out[f"{name}_vs_mlx"] = dict(max_rel_diff=rel, argmax_equal=bool(agree))
        print(f"  width-5 logits, {name} vs MLX: max rel diff {rel:.2e}, argmax equal {agree}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", help="random Qwen3 shape of part 3 (0.6b, 8b)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--skip", default="", help="parts to skip, e.g. 1,2")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    report: dict = {"mlx": mx.__version__, "device": str(mx.default_device())}
    kernel = cuda_rows.CudaRows()
    if "1" not in skip:
        print("\n1. agreement with mx.quantized_matmul", flush=True)
        report["agreement"] = agreement(kernel)
    if "2" not in skip:
        print("\n2. one projection from memory, 4-bit g64 bf16, ms per call", flush=True)
        report["projections"] = projections(kernel, args.reps)
    if "3" not in skip:
        print(f"\n3. whole forward, random Qwen3-{args.shape} 4-bit, context 256, ms", flush=True)
        report["forward"] = forward(kernel, args.shape, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
