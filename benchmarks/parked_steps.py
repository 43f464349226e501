"""What a parked plain step costs against plain decoding's own step, on the same prompts.

`--max-draft auto` parks a drafter that does not pay and decodes plainly (`parked.plain_run`),
but those steps still forward the drafter's tap layers, hand the taps to the drafter, look for
a lookup copy and time themselves for the policy. Plain decoding (`loop._plain_steps`) does none
of that. This runs, per prompt and interleaved (each arm first in turn): plain decoding (mode
baseline), the mode with its policy held parked (every step a parked one), and the same with
lookup copies off (and with `--every-step-taps`, the mode with every parked step tapped, as
before parked runs recomputed their taps where they end: core/parked.py `RETAP_FROM`), and
prints each arm's median time between steps. Then the target's forward
alone, pipelined, without taps and with them dropped, held unevaluated or evaluated with each
step (`--forwards`): what the taps cost the device.

    python benchmarks/parked_steps.py --modes dspark,dflash --suite chat --prompts 10
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

from outrider.api import Pipeline, load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core import calibration  # noqa: E402


def hold_parked(pipe: Pipeline) -> None:
    """Make the pipeline's policy park for good (its instance's methods; the class is
    untouched): every step after the first token is a parked plain step."""
    policy = pipe._cap_policy()
    policy.choose = lambda limit: 0
    policy.plain_run = lambda remaining: remaining
    policy.plain_unused = lambda steps: None


def steps_of(pipe: Pipeline, ids: list[int], max_tokens: int, **kw) -> list[float]:
    """Seconds between the yields of one generation (the first token's excluded)."""
    out, last = [], None
    for _chunk in pipe.stream(ids, max_tokens=max_tokens, **kw):
        now = time.perf_counter()
        if last is not None:
            out.append(now - last)
        last = now
    return out


def forwards_alone(pipe: Pipeline, ids: list[int], steps: int, how: str) -> float:
    """Median seconds of a pipelined plain step driving the target's forward directly (no
    loop, no policy, no drafter): `how` is "plain" (no taps), "dropped" (tapped, the taps
    thrown away), "kept" (tapped, the taps held unevaluated, as a parked run hands them to
    the drafter) or "evaluated" (tapped, the taps computed with the step's token)."""
    target = pipe.target
    tap_ids = () if how == "plain" else tuple(pipe.proposer.tap_layer_ids)
    cache = target.make_cache()
    logits, _ = target.forward(mx.array(ids, dtype=mx.uint32), cache)
    y = mx.argmax(logits[-1])
    held: list = []

    def step(y: mx.array) -> tuple[mx.array, mx.array | None]:
        with mx.stream(target.stream):
            logits, taps = target.forward(y.reshape(1).astype(mx.uint32), cache, tap_ids)
            nxt = mx.argmax(logits[-1])
        mx.async_eval(*([nxt, taps] if how == "evaluated" else [nxt]))
        return nxt, taps

    cur, taps = step(y)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        following = step(cur)
        cur.item()
        if how in ("kept", "evaluated"):
            held.append(taps)
        times.append(time.perf_counter() - t)
        cur, taps = following
    cur.item()
    mx.eval(held)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--modes", default="dspark,dflash")
    ap.add_argument("--suite", default="chat")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument(
        "--forwards", type=int, default=128, help="steps of each forward-alone arm (0: none)"
    )
    ap.add_argument(
        "--every-step-taps",
        action="store_true",
        help="an arm of each mode whose parked steps all tap (no recompute where runs end; "
        "the default on the CPU, where the other arms do the same)",
    )
    args = ap.parse_args()
    texts = [p.text for p in load_suite(args.suite)][: args.prompts]
    base = load(args.model, None, mode="baseline")
    arms: dict[str, tuple[Pipeline, dict]] = {"baseline": (base, {})}
    for mode in [m for m in args.modes.split(",") if m]:
        drafter = f"outrider-demo/{mode}" if args.model == "outrider-demo/target" else None
        for lookup, retap in ((True, True), (False, True), (True, False)):
            if not retap and not args.every_step_taps:
                continue
            pipe = load(args.model, drafter, mode=mode, target=base.target, lookup_drafts=lookup)
            pipe.calibration = calibration.load(pipe) or calibration.measure(pipe)
            if not retap:
                pipe.retap_parked = None
            hold_parked(pipe)
            name = f"{mode} parked" + ("" if lookup else ", no lookup")
            name += "" if retap else ", taps each step"
            arms[name] = (pipe, {"max_draft": "auto"})
    ids = [base.encode(t) for t in texts]
    for pipe, kw in arms.values():  # warm-up: every arm meets every prompt once
        for p in ids:
            pipe.generate(p, max_tokens=args.max_tokens, **kw)
    times: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list[list[int]]] = {name: [] for name in arms}
    names = list(arms)
    for n in range(args.passes):
        for i, p in enumerate(ids):
            turn = (n * len(ids) + i) % len(names)  # each arm goes first in turn
            for name in names[turn:] + names[:turn]:
                pipe, kw = arms[name]
                times[name] += steps_of(pipe, p, args.max_tokens, **kw)
                tokens[name].append(pipe.generate(p, max_tokens=8, **kw).tokens)
    plain = statistics.median(times["baseline"])
    print(f"{args.suite}, {len(ids)} prompts x {args.passes} passes, {args.max_tokens} tokens")
    for name, secs in times.items():
        med = statistics.median(secs)
        same = "" if tokens[name] == tokens["baseline"] else "  OUTPUT DIFFERS"
        print(f"  {name:30s} {len(secs):5d} steps  median {med * 1e3:.3f} ms  "
              f"({med / plain:.3f}x baseline){same}")  # fmt: skip
    if not args.forwards:
        return
    tapped = next(pipe for pipe, _ in arms.values() if pipe.proposer.tap_layer_ids)
    hows = ("plain", "dropped", "kept", "evaluated")
    alone: dict[str, list[float]] = {how: [] for how in hows}
    for n in range(2 * len(hows)):  # each arm first in turn, twice
        for how in hows[n % len(hows) :] + hows[: n % len(hows)]:
            alone[how].append(forwards_alone(tapped, ids[n % len(ids)], args.forwards, how))
    first = statistics.median(alone["plain"])
    print(f"the forward alone, {args.forwards} pipelined steps x {2 * len(hows)}:")
    for how, meds in alone.items():
        med = statistics.median(meds)
        print(f"  taps {how:10s} median {med * 1e3:.3f} ms  ({med / first:.3f}x no taps)")


if __name__ == "__main__":
    main()
