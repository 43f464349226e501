"""What a batched rollback costs: B rows of different lengths on the demo target, a verify
forward of W columns, then each row dropping its rejected columns, timed apart (medians).

`equal`: every row rejects the same count (a trim). `uneven`: each row rejects 2..W-1 at
random, so rows also move columns into their padding (plugins/targets/batched.py).

    python benchmarks/batch_rollback.py                  # B = 8, W = 8, ~250-340 tokens a row
    python benchmarks/batch_rollback.py --rows 16 --context 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import outrider  # noqa: F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx

from outrider.demo import demo_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--context", type=int, default=250, help="the shortest row's tokens")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()

    target = outrider.load(demo_target(), None, mode="baseline").target
    rng = random.Random(0)
    vocab = int(target.config["vocab_size"])
    print(f"{mx.default_device()} · mlx {mx.__version__} · B = {args.rows} · W = {args.width}")
    print(f"{'rejections':<11} {'forward (ms)':>13} {'rollback (ms)':>14}")
    for label, uneven in (("equal", False), ("uneven", True)):
        caches = []
        for i in range(args.rows):
            cache = target.make_cache()
            n = args.context + 13 * i
            target.prefill([rng.randrange(2, vocab) for _ in range(n)], cache)
            caches.append(cache)
        batched = target.merge_rows(caches)
        mx.eval([c.state for c in batched])
        block = mx.array(
            [[rng.randrange(2, vocab) for _ in range(args.width)] for _ in range(args.rows)],
            dtype=mx.uint32,
        )
        forward, rollback = [], []
        for r in range(args.rounds):
            mx.synchronize()
            t0 = time.perf_counter()
            logits, _ = target.forward_rows(block, batched)
            mx.eval(logits)
            t1 = time.perf_counter()
            w = args.width
            n = [rng.randrange(2, w) for _ in range(args.rows)] if uneven else [w - 3] * args.rows
            target.rollback_rows(batched, n)
            mx.eval([a for c in batched for a in c.state if isinstance(a, mx.array)])
            t2 = time.perf_counter()
            if r >= 5:  # warm-up
                forward.append(t1 - t0)
                rollback.append(t2 - t1)
        f, b = statistics.median(forward), statistics.median(rollback)
        print(f"{label:<11} {1e3 * f:>13.3f} {1e3 * b:>14.3f}")


if __name__ == "__main__":
    main()
