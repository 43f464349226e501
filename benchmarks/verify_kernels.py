"""The parts of a verify forward, one at a time, at widths 1 to 8 (what makes width > 1 dear).

Times build + eval (medians) of: the attention kernel with a growing key length (as decoding
grows the cache) under each mask form, one target projection's matmul (float32, 8-bit, 4-bit),
and the whole target forward (mlx-lm's own call, its own "causal" mask) at each width.

    python benchmarks/verify_kernels.py [--model M] [--reps 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.base import create_causal_mask  # noqa: E402

from outrider.api import load  # noqa: E402


def med(fn, reps: int) -> float:
    times = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        mx.eval(fn(i))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    reps = args.reps
    pipe = load(args.model, mode="baseline")
    target = pipe.target
    print(f"device {mx.default_device()}, mlx {mx.__version__}; ms, medians of {reps}")

    print("\nattention (4 q heads, 2 kv heads, head 64, fp32), key length 300 + i each call")
    k_all = mx.random.normal((1, 2, 600, 64))
    v_all = mx.random.normal((1, 2, 600, 64))
    mx.eval(k_all, v_all)
    for w in (1, 5, 8):
        q = mx.random.normal((1, 4, w, 64))
        forms = {"none": None} if w == 1 else {"causal": "causal", "array": True}
        for name, form in forms.items():

            def run(i, q=q, form=form, w=w):
                n = 300 + i
                k, v = k_all[:, :, :n], v_all[:, :, :n]
                mask = form
                if form is True:
                    mask = create_causal_mask(w, n - w)
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

            fixed = med(lambda i, run=run: run(0), reps)
            print(f"  w{w} mask {name:<7} growing {med(run, reps):7.3f}   fixed {fixed:7.3f}")

    print("\nmatmul of one projection (256 -> 768)")
    lin = nn.Linear(256, 768, bias=False)
    q8 = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=8)
    q4 = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
    mx.eval(lin.parameters(), q8.parameters(), q4.parameters())
    for w in (1, 5, 8):
        x = mx.random.normal((1, w, 256))
        mx.eval(x)
        row = [
            f"{name} {med(lambda i, m=m, x=x: m(x), reps):7.3f}"
            for name, m in (("fp32", lin), ("8-bit", q8), ("4-bit", q4))
        ]
        print(f"  w{w}  " + "   ".join(row))

    print("\nwhole target forward (cache at 300 tokens), as mlx-lm calls it")
    with mx.stream(target.stream):
        cache = target.make_cache()
        target.prefill(list(range(5, 305)), cache)
        mx.eval([c.state for c in cache])
        for w in (1, 5, 8):
            ids = mx.array(list(range(7, 7 + w)), dtype=mx.uint32)

            times = []
            for _ in range(reps + 3):
                t0 = time.perf_counter()
                mx.eval(target.model(ids[None], cache=cache))
                times.append(time.perf_counter() - t0)
                target.rollback(cache, w)
            print(f"  w{w}  model(ids) {1e3 * statistics.median(times[3:]):7.3f}")


if __name__ == "__main__":
    main()
