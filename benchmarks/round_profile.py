"""Where a speculative round's time goes: graph building on the host vs waiting for the device.

For one loaded pair, times (medians over many repeats, after warm-up):

* one sync of a trivial graph (the fixed cost of any `mx.eval`);
* the target's verify forward at widths 1, 5, 8: Python graph build, then eval;
* each drafter's proposal at each cap (`--caps`, default 4 and 7): build, then eval; where
  the drafter runs compiled (a CUDA GPU), op by op too (`eager`);
* whole greedy rounds on a real prompt, split into propose / verify build / eval / host work,
  as the loop runs them and with the drafter's graph started ahead of the verify graph.

    python benchmarks/round_profile.py                     # the demo pair
    python benchmarks/round_profile.py --model M --dspark-drafter D --dflash-drafter D
    python benchmarks/round_profile.py --model HuggingFaceTB/SmolLM2-135M-Instruct \
        --dspark-drafter D --dflash-drafter none --eagle3-drafter E --caps 1,4,7

A drafter given as `none` is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402

from outrider.api import load  # noqa: E402
from outrider.core.acceptance import accept_greedy  # noqa: E402
from outrider.core.proposer import DraftContext  # noqa: E402
from outrider.core.sampling import SamplingParams, greedy  # noqa: E402
from outrider.plugins.strategies import compiled_drafter  # noqa: E402


def ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):7.3f}"


def timed(build, reps: int, after=None) -> tuple[list[float], list[float]]:
    """(build seconds, eval seconds) per repeat; `after` undoes what a repeat changed."""
    b, e = [], []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        if after is not None:
            after()
        b.append(t1 - t0)
        e.append(t2 - t1)
    return b[3:], e[3:]


def _arms(proposer) -> list[str]:
    """The drafter's paths to time: as loaded, and op by op where it loaded compiled."""
    drafter = getattr(proposer, "drafter", None)
    return ["", "eager"] if getattr(drafter, "compiled_chain", False) else [""]


def _drafter_path(proposer, arm: str):
    """The drafter op by op (`compiled_drafter.bypassed`) for the "eager" arm."""
    if arm == "eager":
        return compiled_drafter.bypassed(proposer.drafter)
    return contextlib.nullcontext()


def rounds(pipe, ids: list[int], n: int, cap: int, ahead: bool) -> dict[str, list[float]]:
    """The loop's greedy round (core/loop.py), with a timer between its phases. `ahead`
    starts the drafter's graph computing before the verify graph is built (the loop does not:
    on the H200 such rounds were no faster, docs/performance.md); without it everything is
    evaluated at the round's one sync."""
    target, proposer = pipe.target, pipe.proposer
    tap_ids = tuple(proposer.tap_layer_ids)
    cache = target.make_cache()
    phases: dict[str, list[float]] = {k: [] for k in ("propose", "verify", "eval", "host")}
    with mx.stream(target.stream):
        last, taps = target.prefill(ids, cache, tap_ids)
        first = greedy(last)
        proposer.start(ids, taps)
        mx.eval(first)
        history = ids + [first.item()]
        for _ in range(n):
            t0 = time.perf_counter()
            proposal = proposer.propose(DraftContext(history, cap, SamplingParams(), None))
            if proposal.host is None:
                inputs = mx.concatenate(
                    [mx.array([history[-1]], dtype=mx.uint32), proposal.tokens.astype(mx.uint32)]
                )
            else:
                inputs = mx.array([history[-1], *proposal.host], dtype=mx.uint32)
            if ahead and proposal.host is None:
                mx.async_eval(proposal.tokens)
            t1 = time.perf_counter()
            logits, vtaps = target.forward(inputs, cache, tap_ids)
            tokens = greedy(logits)
            t2 = time.perf_counter()
            mx.eval(tokens, proposal.tokens)
            t3 = time.perf_counter()
            drafted = proposal.host if proposal.host is not None else proposal.tokens.tolist()
            got = tokens.tolist()
            a = accept_greedy(got, drafted)
            target.rollback(cache, proposal.k - a)
            proposer.observe(a, None if vtaps is None else vtaps[: a + 1])
            history.extend(got[: a + 1])
            t4 = time.perf_counter()
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[k].append(dt)
    return phases


def _columns(taps: mx.array, have: tuple[int, ...], want: tuple[int, ...], hidden: int):
    """The columns of `want`'s layers out of taps captured for the layers `have`."""
    if have == want:
        return taps
    parts = [taps[:, have.index(j) * hidden : (have.index(j) + 1) * hidden] for j in want]
    return mx.concatenate(parts, axis=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--dspark-drafter", default="outrider-demo/dspark")
    ap.add_argument("--dflash-drafter", default="outrider-demo/dflash")
    ap.add_argument("--eagle3-drafter", default="none")
    ap.add_argument("--caps", default="4,7", help="the caps proposals and rounds run at")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]

    # on a fresh CUDA machine loading can take minutes (MLX builds kernels on first use): say
    # so at once, so a run cut short by a time limit still shows where it stood
    print(f"loading {args.model} and its drafters…", flush=True)
    started = time.perf_counter()
    base = load(args.model, mode="baseline")
    target = base.target
    drafters = {
        "dspark": args.dspark_drafter,
        "dflash": args.dflash_drafter,
        "eagle3": args.eagle3_drafter,
    }
    pipes = {
        mode: load(args.model, path, mode=mode, target=target)
        for mode, path in drafters.items()
        if path and path != "none"
    }
    drafting = list(pipes)
    pipes["lookup"] = load(args.model, mode="lookup", target=target)
    tap_ids = tuple(sorted({j for p in pipes.values() for j in p.proposer.tap_layer_ids}))
    prompt = base.encode("Write a Python function that returns the n-th Fibonacci number.")
    print(f"loaded in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, reps {args.reps} (medians, ms)")

    with mx.stream(target.stream):
        x = mx.array([1.0])
        b, e = timed(lambda: x + 1, args.reps)
        print(f"\ntrivial eval            build {ms(b)}  eval {ms(e)}")

        cache = target.make_cache()
        last, taps = target.prefill(prompt, cache, tap_ids)
        mx.eval(taps)
        context = prompt + [greedy(last).item()]  # what a round after the prefill sees
        print()
        for w in (1, 5, 8):
            ids = mx.array(list(range(3, 3 + w)), dtype=mx.uint32)
            for tapped in (False, True):
                b, e = timed(
                    lambda ids=ids, t=tapped: target.forward(ids, cache, tap_ids if t else ())[0],
                    args.reps,
                    after=lambda w=w: target.rollback(cache, w),
                )
                label = f"verify w{w}" + (" +taps" if tapped else "")
                print(f"{label:<24}build {ms(b)}  eval {ms(e)}")

        print()
        for mode in drafting:
            proposer = pipes[mode].proposer
            own = tuple(proposer.tap_layer_ids)
            mine = None if taps is None else _columns(taps, tap_ids, own, target.hidden_size)
            for cap, arm in [(c, a) for c in caps for a in _arms(proposer)]:
                with _drafter_path(proposer, arm):
                    proposer.start(prompt, mine)
                    ctx = DraftContext(context, cap, SamplingParams(), None)
                    mx.eval(proposer.propose(ctx).tokens)
                    proposer.observe(0, None)  # a chained drafter drops its speculative rows
                    b, e = timed(
                        lambda p=proposer, ctx=ctx: p.propose(ctx).tokens,
                        args.reps,
                        after=lambda p=proposer: p.observe(0, None),
                    )
                label = f"{mode} propose cap {cap}" + (f" {arm}" if arm else "")
                print(f"{label:<30}build {ms(b)}  eval {ms(e)}")

    print("\nwhole greedy rounds: propose | verify build | eval | host (ms, medians)")
    print(
        "('ahead': the drafter's graph starts before the verify graph is built; the loop does "
        "not; 'eager': the drafter op by op where it runs compiled)"
    )
    runs = [
        (m, c, a, arm)
        for m in drafting
        for c in caps
        for a, arm in [(False, x) for x in _arms(pipes[m].proposer)] + [(True, "")]
    ] + [("lookup", 6, False, "")]
    for mode, cap, ahead, arm in runs:
        with _drafter_path(pipes[mode].proposer, arm):
            rounds(pipes[mode], prompt, 8, cap, ahead)  # warm-up
            ph = rounds(pipes[mode], prompt, 60, cap, ahead)
        total = statistics.median([sum(x) for x in zip(*ph.values())])
        parts = " | ".join(ms(v) for v in ph.values())
        label = f"{mode} cap {cap}" + (" ahead" if ahead else "") + (f" {arm}" if arm else "")
        print(f"{label:<20}{parts}  = {1e3 * total:7.3f}")


if __name__ == "__main__":
    main()
