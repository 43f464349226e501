"""What a model drafter's call costs by the context rows it takes in.

A drafter takes in the target's hidden states of every token it has not seen: the prompt at
the first round, the tokens a round committed at every later one, and after a parked run of
plain steps (`--max-draft auto`) all of that run's tokens. This times each drafter call of real
generations (its graph built and evaluated, synced) and sorts them by the rows taken in, so
the cost of a catch-up (`AutoCap`'s first round after plain steps) reads against a steady one.

    python benchmarks/drafter_intake.py --mode dspark --suite chat --prompts 10 --caps 4,auto

`--cold` times the first pass instead of a second one, so the calls that met a row count for
the first time (kernels and plans built on first use) count too; the table then also gives
each bucket's slowest call. `--rows 17,45,90` instead times a drafter call taking in that
many rows of made-up taps, each count twice in turn (after a 1-row warm-up): the first call of
a count against the second shows what meeting a row count for the first time costs; and the
same for the target's recompute of that many untapped parked steps (`parked.retap`), the other
half of the first round after a long parked run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from outrider.api import load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core import calibration, parked  # noqa: E402
from outrider.core.proposer import DraftContext  # noqa: E402
from outrider.core.sampling import SamplingParams  # noqa: E402

DRAFTERS = {"dspark": "outrider-demo/dspark", "dflash": "outrider-demo/dflash"}
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bucket(rows: int) -> str:
    """The row-count bucket `rows` falls in: "1", "2", "3-4", ... "513-1024", ">1024"."""
    low = 0
    for top in BUCKETS:
        if rows <= top:
            return str(top) if top == low + 1 else f"{low + 1}-{top}"
        low = top
    return f">{low}"


def first_use(proposer, counts: list[int], width: int) -> None:
    """Time a 4-draft call taking in each of `counts` rows of made-up taps, first then again."""
    ctx = DraftContext([1, 2, 3], 4, SamplingParams())

    def call(rows: int) -> float:
        taps = mx.random.normal((rows, width)).astype(mx.bfloat16)
        proposer.start([1] * rows, taps)
        mx.eval(taps)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(proposer.propose(ctx).tokens)
        mx.synchronize()
        return time.perf_counter() - t0

    call(1)
    first = {n: call(n) for n in counts}
    again = {n: call(n) for n in counts}
    print(f"  {'rows in':>8} {'first ms':>9} {'again ms':>9}")
    for n in counts:
        print(f"  {n:>8} {first[n] * 1e3:>9.3f} {again[n] * 1e3:>9.3f}")


def first_recompute(pipe, counts: list[int]) -> None:
    """Time the target's recompute of a parked run's untapped steps (`parked.retap`, as the loop
    calls it: the run's last n positions dropped and forwarded again with taps, over a
    128-token context), each count first then again: a width the recompute meets for the
    first time may cost kernels and plans that a second call reuses."""
    target = pipe.target
    cache = target.make_cache()
    target.prefill([(7 * i) % 1000 + 10 for i in range(128)], cache)
    mx.eval([c.state for c in cache])
    held: list = []
    proposer = SimpleNamespace(tap_layer_ids=pipe.proposer.tap_layer_ids, add_rows=held.append)

    def call(n: int) -> float:
        tokens = [(11 * i) % 1000 + 10 for i in range(n)]
        with mx.stream(target.stream):  # the run's steps, untapped, into the cache
            target.forward(mx.array(tokens, dtype=mx.uint32), cache)
        mx.eval([c.state for c in cache])
        mx.synchronize()
        t0 = time.perf_counter()
        parked.retap(target, SimpleNamespace(untapped=tokens, proposer=proposer), cache)
        mx.eval(held, [c.state for c in cache])
        mx.synchronize()
        seconds = time.perf_counter() - t0
        target.rollback(cache, n)
        held.clear()
        return seconds

    call(1)
    first = {n: call(n) for n in counts}
    again = {n: call(n) for n in counts}
    print("the target's recompute of a parked run's untapped steps:")
    print(f"  {'rows':>8} {'first ms':>9} {'again ms':>9}")
    for n in counts:
        print(f"  {n:>8} {first[n] * 1e3:>9.3f} {again[n] * 1e3:>9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--drafter")
    ap.add_argument("--suite", default="chat")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--caps", default="4,auto")
    ap.add_argument("--cold", action="store_true", help="time the first pass (no warm-up)")
    ap.add_argument("--rows", help="made-up intakes of these row counts instead (comma list)")
    args = ap.parse_args()
    pipe = load(args.model, args.drafter or DRAFTERS[args.mode], mode=args.mode)
    pipe.calibration = calibration.load(pipe) or calibration.measure(pipe)
    proposer = getattr(pipe.proposer, "inner", pipe.proposer)  # under lookup assist
    calls: list[tuple[int, int, float, float]] = []  # entries, rows, build s, total s
    forward = proposer._forward

    def timed(group, anchors, drafting, width):  # the instance's attribute; class untouched
        pending = [t for p in group.members for t in p._pending]
        rows = sum(t.shape[0] for t in pending)
        mx.eval(pending)  # what the plain steps left is computed before the clock starts
        mx.synchronize()
        t0 = time.perf_counter()
        out = forward(group, anchors, drafting, width)
        t1 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        calls.append((len(pending), rows, t1 - t0, time.perf_counter() - t0))
        return out

    if args.rows:
        width = len(proposer.tap_layer_ids) * pipe.target.hidden_size
        counts = [int(n) for n in args.rows.split(",")]
        print(f"{args.model} + {args.mode} · made-up intakes · {mx.default_device()}")
        first_use(proposer, counts, width)
        first_recompute(pipe, counts)
        return
    proposer._forward = timed
    texts = [p.text for p in load_suite(args.suite)][: args.prompts]
    ids = [pipe.encode(t) for t in texts]
    print(f"{args.model} + {args.mode} · {args.suite} · {len(ids)} prompts · "
          f"{mx.default_device()} · mlx {mx.__version__}")  # fmt: skip
    for cap in [c.strip() for c in args.caps.split(",") if c.strip()]:
        max_draft = cap if cap == "auto" else int(cap)
        if not args.cold:
            for p in ids:  # every shape once, untimed (kernels built on first use)
                pipe.generate(p, max_tokens=args.max_tokens, max_draft=max_draft)
        calls.clear()
        for p in ids:
            pipe.generate(p, max_tokens=args.max_tokens, max_draft=max_draft)
        print(f"\ncap {cap}: {len(calls)} drafter calls")
        print(f"  {'rows in':>9} {'calls':>6} {'build ms':>9} {'call ms':>8} {'pending':>8}"
              f"{'  slowest ms' if args.cold else ''}")  # fmt: skip
        groups: dict[str, list] = {}
        for c in calls:
            groups.setdefault(bucket(c[1]), []).append(c)
        for name in sorted(groups, key=lambda g: min(c[1] for c in groups[g])):
            g = groups[name]
            print(f"  {name:>9} {len(g):>6} {statistics.median(c[2] for c in g) * 1e3:>9.3f} "
                  f"{statistics.median(c[3] for c in g) * 1e3:>8.3f} "
                  f"{statistics.median(c[0] for c in g):>8.0f}"
                  f"{f'{max(c[3] for c in g) * 1e3:>12.3f}' if args.cold else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
