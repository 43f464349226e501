"""What `--max-draft auto` measured against what its steps took, on a real generation.

Runs the demo pair (or `--model`/`--drafter`) with `--max-draft auto` over a suite's prompts and
records, for every parked run of plain steps, each step's seconds against the calibrated plain
step at that context, and for every drafting round its cap, the drafts kept, its seconds against
the calibrated round, and the live scales the policy held after it. Then prints where the
policy's plain-step and drafting-round costs sat against the medians of what the steps took,
and plain decoding's own steps (mode baseline) for comparison.

    python benchmarks/policy_trace.py --modes dspark,dflash --suite chat --prompts 10 \
        --json trace.json
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
from outrider.api import load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core import calibration, schedule  # noqa: E402

DRAFTERS = {"dspark": "outrider-demo/dspark", "dflash": "outrider-demo/dflash", "lookup": None}


class Recorder:
    """Wraps one policy's observe calls (an instance's attributes; the class is untouched)."""

    def __init__(self, policy: schedule.AutoCap, events: list) -> None:
        self.policy, self.events = policy, events
        self._plain, self._observe = policy.observe_plain, policy.observe
        policy.observe_plain, policy.observe = self.observe_plain, self.observe

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--modes", default="dspark,dflash")
    ap.add_argument("--suite", default="chat")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    texts = [p.text for p in load_suite(args.suite)][: args.prompts]
    out = {}
    base = load(args.model, None, mode="baseline")
    ids = [base.encode(t) for t in texts]
    for p in ids[:2]:
        base.generate(p, max_tokens=16)  # warm-up
    steps = []
    t0 = time.perf_counter()
    for p in ids:
        last = None
        for _chunk in base.stream(p, max_tokens=args.max_tokens):
            now = time.perf_counter()
            if last is not None:
                steps.append(now - last)
            last = now
    base_s = time.perf_counter() - t0
    print(f"baseline: {len(steps)} steps, median {statistics.median(steps) * 1e3:.3f} ms "
          f"(between yields), {base_s:.2f} s in all")  # fmt: skip
    out["baseline"] = {"steps": steps, "seconds": base_s}
    for mode in [m for m in args.modes.split(",") if m]:
        pipe = load(args.model, DRAFTERS.get(mode), mode=mode)
        pipe.calibration = calibration.load(pipe) or calibration.measure(pipe)
        for p in ids[:2]:
            pipe.generate(p, max_tokens=16, max_draft="auto")  # warm-up
        pipe.cap_policy = None
        events: list = []
        policy = pipe._cap_policy()
        Recorder(policy, events)
        t0 = time.perf_counter()
        tokens = 0
        for p in ids:
            tokens += len(pipe.generate(p, max_tokens=args.max_tokens, max_draft="auto").tokens)
        seconds = time.perf_counter() - t0
        plain = [s for e in events if e["kind"] == "plain" for s in e["steps"]]
        rest = [s for e in events if e["kind"] == "plain" for s in e["steps"][1:]]
        firsts = [e["steps"][0] for e in events if e["kind"] == "plain"]
        rounds = [e for e in events if e["kind"] == "round" and e["k"] > 0]
        curve0 = [e["curve"] for e in events if e["kind"] == "plain"]
        costs = [e["plain_cost"] for e in rounds]
        print(f"{mode}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s; baseline "
              f"{len(steps) / base_s:.1f})")  # fmt: skip
        if plain:
            print(f"  plain steps {len(plain)}: median {statistics.median(plain) * 1e3:.3f} ms, "
                  f"firsts {statistics.median(firsts) * 1e3:.3f}, rest "
                  f"{statistics.median(rest) * 1e3 if rest else 0:.3f}; calibrated "
                  f"{statistics.median(curve0) * 1e3:.3f}")  # fmt: skip
            top = sorted(plain)[int(0.9 * len(plain))]
            print(f"  plain p90 {top * 1e3:.3f} ms, max {max(plain) * 1e3:.3f}")
        if rounds:
            print(f"  drafting rounds {len(rounds)}: median {statistics.median(e['seconds'] for e in rounds) * 1e3:.3f} ms, "
                  f"kept {statistics.mean(e['accepted'] for e in rounds):.2f}; calibrated "
                  f"{statistics.median(e['curve'] for e in rounds) * 1e3:.3f}; policy's plain cost at "
                  f"rounds: median {statistics.median(costs) * 1e3:.3f}, max {max(costs) * 1e3:.3f}")  # fmt: skip
        print(f"  policy at the end: {json.dumps(policy.snapshot())}")
        out[mode] = {"events": events, "tokens": tokens, "seconds": seconds,
                     "snapshot": policy.snapshot()}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
