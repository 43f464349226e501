"""What a quantized target's verify forward costs at each width, padded to 8 rows or not.

Two parts, each printed as a table (CUDA GPUs are where this matters: core/device.py):

1. **One projection.** Milliseconds of `mx.quantized_matmul` (4-bit, group 64, bf16) on each
   projection of a Qwen3-8B layer and its output head, at 1 to 8 rows; each figure is one
   call's share of 20 independent calls evaluated together (one sync, as in a forward).
2. **A whole forward.** A random-weight Qwen3 of a real shape, 4-bit, one `Target.forward` of
   width 1 to 9 at a 256-token context, each followed by the greedy choice and rolled back, with
   padding off and to 8 rows (`Target.pad_verifies`) interleaved; the ratio of each width to width 1 is what a verify costs.

    python benchmarks/quantized_verify.py [--shape 8b] [--reps 20] [--json out.json]
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

from outrider.core.sampling import greedy  # noqa: E402

PROJECTIONS = {  # (N, K) of a Qwen3-8B layer and its head
    "q/o 4096x4096": (4096, 4096),
    "k/v 1024x4096": (1024, 4096),
    "gate/up 12288x4096": (12288, 4096),
    "down 4096x12288": (4096, 12288),
    "head 151936x4096": (151936, 4096),
}
ROWS = (1, 2, 3, 4, 5, 6, 7, 8)


def timed(fn, reps: int, chain: int = 20) -> float:
    """Median ms of one fn() call, from `chain` independent calls evaluated together."""
    times = []
    for i in range(reps + 3):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(chain)])
        if i >= 3:
            times.append((time.perf_counter() - t) / chain)
    return 1e3 * statistics.median(times)


def projection(n: int, k: int, reps: int) -> dict:
    w = (mx.random.normal((n, k), key=mx.random.key(0)) * 0.02).astype(mx.bfloat16)
    w, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(w, s, b)
    out = {}
    for r in ROWS:
        x = mx.random.normal((r, k)).astype(mx.bfloat16)
        out[r] = timed(lambda x=x: mx.quantized_matmul(x, w, s, b, True, 64, 4), reps)
    return out


def forward(shape: str, reps: int) -> dict:
    from loop_efficiency import make_target  # random-weight Qwen3 of a real shape

    target = make_target(shape, "4bit")
    prompt = mx.random.randint(0, 150000, (256,), key=mx.random.key(1)).tolist()
    cache = target.make_cache()
    mx.eval(target.prefill(prompt, cache)[0])
    widths = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    times: dict = {pad: {w: [] for w in widths} for pad in (0, 8)}
    for i in range(reps + 2):
        for pad in (0, 8):  # interleaved, so drift hits both alike
            target.pad_verifies(pad)
            for w in widths:
                ids = mx.array(prompt[:w], dtype=mx.uint32)
                t = time.perf_counter()
                logits, _ = target.forward(ids, cache)
                mx.eval(greedy(logits))
                dt = time.perf_counter() - t
                target.rollback(cache, w)
                if i >= 2:
                    times[pad][w].append(dt)
    out = {}
    for pad, per in times.items():
        ms = {w: 1e3 * statistics.median(v) for w, v in per.items()}
        out[f"pad_{pad}"] = {str(w): round(v, 3) for w, v in ms.items()}
        cells = "  ".join(f"w{w} {ms[w]:.2f} ({ms[w] / ms[1]:.2f}x)" for w in widths)
        print(f"  verify_pad {pad}: {cells}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", help="random Qwen3 shape of part 2 (0.6b, 8b)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip", default="", help="parts to skip, e.g. 2")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    report: dict = {"mlx": mx.__version__, "device": str(mx.default_device())}
    if "1" not in skip:
        print("\n1. one projection, 4-bit g64 bf16, ms per call at 1..8 rows")
        report["projections"] = {}
        for name, (n, k) in PROJECTIONS.items():
            ms = projection(n, k, args.reps)
            report["projections"][name] = {str(r): round(v, 4) for r, v in ms.items()}
            cells = " ".join(f"{ms[r]:.3f}" for r in ROWS)
            print(f"  {name:<20} {cells}", flush=True)
    if "2" not in skip:
        print(f"\n2. whole verify forward, random Qwen3-{args.shape} 4-bit, context 256, ms")
        report["forward"] = forward(args.shape, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
