"""What `--max-draft auto` measured against what its steps took, on a real generation.

Runs the demo pair (or `--model`/`--drafter`) with `--max-draft auto` over a suite's prompts and
records, for every parked run of plain steps, each step's seconds against the calibrated plain
step at that context, and for every drafting round its cap, the drafts kept, its seconds against
the calibrated round, and the live scales the policy held after it. Then prints where the
policy's plain-step and drafting-round costs sat against the medians of what the steps took,
and plain decoding's own steps (mode baseline) for comparison, and where the drafting rounds after
a prefill or plain steps spent their time against the rest (`Step.phases`: recomputing the
rows of a parked run's untapped steps, launching the round, queueing the next, waiting for the
result, the host's work after), with each such round listed after the run of plain steps it
ends: where that round's cost comes from (a run's length sets the widths of its recompute and
of the drafter's catch-up, and a width not seen before may cost a trace or new kernels).

    python benchmarks/policy_trace.py --modes dspark,dflash --suite chat --prompts 10 \
        --json trace.json
    python benchmarks/policy_trace.py --modes dspark --suite chat --retap-from 0
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

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
from parked_steps import steps_of  # noqa: E402 - benchmarks/ is on the path as this script's folder

from outrider.api import load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core import calibration, schedule  # noqa: E402

DRAFTERS = {"dspark": "outrider-demo/dspark", "dflash": "outrider-demo/dflash", "lookup": None}


class Recorder:
    """Wraps one policy's observe calls (an instance's attributes; the class is untouched)."""

    def __init__(self, policy: schedule.AutoCap, events: list) -> None:
        self.policy, self.events = policy, events
        self._plain, self._observe = policy.observe_plain, policy.observe
        self._copy = policy.observe_copy
        policy.observe_plain, policy.observe = self.observe_plain, self.observe
        policy.observe_copy = self.observe_copy

    def observe_copy(self, drafts: int, seconds: float) -> None:
        self._copy(drafts, seconds)
        self.events.append({"kind": "copy", "drafts": drafts, "seconds": seconds})

    def observe_plain(self, seconds: list[float]) -> None:
        curve = self.policy._curve(0)
        self._plain(seconds)
        self.events.append({"kind": "plain", "context": self.policy.context, "curve": curve,
                            "steps": seconds, "scale": dict(self.policy.scale)})  # fmt: skip

    def observe(self, k: int, accepted: int, seconds: float) -> None:
        curve = self.policy._curve(k)
        catching = self.policy.catching_up
        self._observe(k, accepted, seconds)
        self.events.append({"kind": "round", "k": k, "accepted": accepted, "seconds": seconds,
                            "curve": curve, "catching_up": catching, "context": self.policy.context,
                            "scale": dict(self.policy.scale),
                            "plain_cost": self.policy.cost(0)})  # fmt: skip


def report(events: list) -> None:
    """Medians of the plain steps, the drafting rounds after plain steps (where a model drafter
    catches up on the plain tokens) and the rest, and what the policy believed a plain step
    cost when it drafted."""
    plain = [s for e in events if e["kind"] == "plain" for s in e["steps"]]
    if plain:
        firsts = [e["steps"][0] for e in events if e["kind"] == "plain"]
        curve0 = [e["curve"] for e in events if e["kind"] == "plain"]
        top = sorted(plain)[int(0.9 * len(plain))]
        print(f"  plain steps {len(plain)}: median {ms(statistics.median(plain))}, firsts "
              f"{ms(statistics.median(firsts))}, p90 {ms(top)}, max {ms(max(plain))}; calibrated "
              f"{ms(statistics.median(curve0))}; {ms(sum(plain))} in all")  # fmt: skip
    copies = [e for e in events if e["kind"] == "copy"]
    if copies:
        print(f"  lookup copies {len(copies)}: median {ms(statistics.median(e['seconds'] for e in copies))}, "
              f"{ms(sum(e['seconds'] for e in copies))} in all, {sum(e['drafts'] for e in copies)} drafts")  # fmt: skip
    for name, after in (("after plain steps", True), ("the rest", False)):
        rounds = [e for e in events if e["kind"] == "round" and e["k"] > 0
                  and e["catching_up"] == after]  # fmt: skip
        if not rounds:
            continue
        secs = [e["seconds"] for e in rounds]
        print(f"  drafting rounds {name} {len(rounds)}: median {ms(statistics.median(secs))}, "
              f"{ms(sum(secs))} in all for {sum(e['accepted'] + 1 for e in rounds)} tokens; "
              f"calibrated {ms(statistics.median(e['curve'] for e in rounds))}; the policy's "
              f"plain step {ms(statistics.median(e['plain_cost'] for e in rounds))}")  # fmt: skip


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--modes", default="dspark,dflash")
    ap.add_argument("--suite", default="chat")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--passes", type=int, default=1, help="run the prompts this many times (each reported)"
    )
    ap.add_argument(
        "--retap-from",
        help="a parked run's steps past this many forward no taps, recomputed where the run "
        "ends (`Pipeline.retap_parked`; `off`: every step tapped; default: the device's)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    retap = None if args.retap_from in (None, "off") else int(args.retap_from)
    texts = [p.text for p in load_suite(args.suite)][: args.prompts]
    out = {}
    base = load(args.model, None, mode="baseline")
    ids = [base.encode(t) for t in texts]
    for p in ids[:2]:
        base.generate(p, max_tokens=16)  # warm-up
    steps = []
    t0 = time.perf_counter()
    for p in ids:
        steps += steps_of(base, p, args.max_tokens)
    base_s = time.perf_counter() - t0
    print(f"baseline: {len(steps)} steps, median {statistics.median(steps) * 1e3:.3f} ms "
          f"(between yields), {base_s:.2f} s in all")  # fmt: skip
    out["baseline"] = {"steps": steps, "seconds": base_s}
    for mode in [m for m in args.modes.split(",") if m]:
        pipe = load(args.model, DRAFTERS.get(mode), mode=mode)
        if args.retap_from is not None:
            pipe.retap_parked = retap
        pipe.calibration = calibration.load(pipe) or calibration.measure(pipe)
        for p in ids[:2]:
            pipe.generate(p, max_tokens=16, max_draft="auto")  # warm-up
        pipe.cap_policy = None
        policy = pipe._cap_policy()
        out[mode] = []
        for n in range(args.passes):
            events: list = []
            Recorder(policy, events)
            t0 = time.perf_counter()
            tokens = 0
            phases: dict[bool, list[dict]] = {True: [], False: []}  # after plain steps or not
            restarts: list[dict] = []  # each drafting round after plain steps, with its run
            for p in ids:
                before, run = "prefill", 0
                for chunk in pipe.stream(p, max_tokens=args.max_tokens, max_draft="auto"):
                    step = chunk.step
                    tokens += len(step.committed)
                    if step.source == "draft" and step.drafted and step.phases:
                        phases[before != "draft"].append(step.phases)
                        if before == "plain":
                            restarts.append({"run": run, "seconds": step.seconds,
                                             "drafted": step.drafted, **step.phases})  # fmt: skip
                    run = run + 1 if step.source == "plain" else 0
                    before = step.source
            seconds = time.perf_counter() - t0
            print(f"{mode}, pass {n + 1}: {tokens} tokens in {seconds:.2f} s "
                  f"({tokens / seconds:.1f} tok/s; baseline {len(steps) / base_s:.1f})")  # fmt: skip
            report(events)
            timed = sum(e.get("seconds", 0.0) for e in events) + sum(
                s for e in events if e["kind"] == "plain" for s in e["steps"]
            )
            print(
                f"  outside what the policy timed (prefills, untold steps): {ms(seconds - timed)}"
            )
            for after, rounds in phases.items():
                if rounds:
                    parts = ", ".join(f"{k} {ms(statistics.median(r[k] for r in rounds))}"
                                      for k in rounds[0])  # fmt: skip
                    kind = "after a prefill or plain steps" if after else "after a round"
                    print(
                        f"  phases of the drafting rounds {kind} ({len(rounds)}), median: {parts}"
                    )
            if restarts:
                print("  each drafting round after plain steps: plain steps before it, its ms "
                      "(recompute / launch / wait)")  # fmt: skip
                for r in restarts:
                    print(f"    {r['run']:4d} steps  {r['seconds'] * 1e3:7.3f} ms  ("
                          + " / ".join(f"{r.get(k, 0.0) * 1e3:.3f}"
                                       for k in ("recompute", "launch", "wait")) + ")")  # fmt: skip
            print(f"  policy at the end: {json.dumps(policy.snapshot())}")
            out[mode].append({"events": events, "tokens": tokens, "seconds": seconds,
                              "snapshot": policy.snapshot(), "restarts": restarts})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
