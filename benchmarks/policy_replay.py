"""Replay `--max-draft auto` on recorded acceptance under another machine's costs.

Greedy acceptance depends on the target, the drafter and the text, not on the machine. This
records, on whatever machine runs it, how many drafts a round starting at each position of each
generation gets accepted (at the drafter's full cap), then replays the cap policy
(`core/schedule.py`) over those traces with the costs of the machine in question: a plain step
of `--plain-ms`, a drafting round of `--round-ms` plus `--per-draft-ms` a draft. It prints the
tokens per second the policy reaches against plain decoding and against every fixed cap, which
is what a machine's benchmark would show, minus the noise of its clock.

The prompts are this repository's synthetic training mix (`scripts/smollm2/prompts.py`, seed 7),
never an evaluation set.

    python benchmarks/policy_replay.py --plain-ms 1.38 --round-ms 2.2 --per-draft-ms 0.1
    python benchmarks/policy_replay.py --plain-ms 10 --round-ms 35 --per-draft-ms 8   # a CPU

It also prints, per fixed cap, the share of rounds that accept every draft: how often a
pipelined round (one that drafts the next block while the verify runs, assuming all drafts are
kept) would keep what it drafted ahead.
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from outrider.api import load  # noqa: E402
from outrider.core.schedule import AutoCap  # noqa: E402


def synthetic_prompts(count: int) -> list[str]:
    spec = importlib.util.spec_from_file_location("mix", ROOT / "scripts/smollm2/prompts.py")
    mix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mix)
    return [row["turns"][0] for row in mix.prompt_mix(count, seed=7)]


def record(pipe, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int], int]]:
    """Per generation: where its fixed-cap rounds started, what each accepted, its length."""
    traces = []
    for text in prompts:
        result = pipe.generate(text, max_tokens=max_tokens, max_draft=pipe.proposer.max_draft)
        starts, accepted, pos = [], [], 0
        for r in result.rounds:
            starts.append(pos)
            accepted.append(r.accepted)
            pos += len(r.committed)
        traces.append((starts, accepted, len(result.tokens)))
    return traces


def run_length(trace, t: int) -> int:
    """Drafts a round starting at position t gets accepted: the rest of the recorded run."""
    starts, accepted, _ = trace
    i = bisect.bisect_right(starts, t) - 1
    if i < 0:
        return 0
    return max(0, accepted[i] - (t - starts[i]))


def replay(traces, cost, ceiling: int, start: int, fixed: int | None = None) -> float:
    """Tokens per (simulated) second over every trace, one policy carried across them."""
    policy = AutoCap(ceiling, start=start)
    tokens = seconds = 0.0
    for trace in traces:
        total, t = trace[2], 0
        while t < total:
            left = total - t - 1
            k = min(fixed, left) if fixed is not None else policy.choose(left)
            if k == 0:
                n = 1 if fixed is not None else policy.plain_run(total - t)
                for _ in range(n):
                    policy.observe(0, 0, cost(0))
                t, tokens, seconds = t + n, tokens + n, seconds + n * cost(0)
                continue
            a = min(k, run_length(trace, t))
            policy.observe(k, a, cost(k))
            t, tokens, seconds = t + a + 1, tokens + a + 1, seconds + cost(k)
    return tokens / seconds


def full_acceptance(traces, k: int) -> float:
    """The share of fixed-cap-k rounds whose k drafts are all accepted: how often a pipelined
    round, which drafts the next block before the verify returns on the assumption that every
    draft is kept, would keep that next block."""
    full = rounds = 0
    for trace in traces:
        total, t = trace[2], 0
        while t < total - 1:
            cap = min(k, total - t - 1)
            a = min(cap, run_length(trace, t))
            full += a == cap
            rounds += 1
            t += a + 1
    return full / max(1, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--drafter", default="outrider-demo/dspark")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plain-ms", type=float, required=True)
    ap.add_argument("--round-ms", type=float, required=True, help="a round drafting one token")
    ap.add_argument("--per-draft-ms", type=float, default=0.0)
    ap.add_argument("--start", type=int, default=4, help="the policy's first cap")
    ap.add_argument("--json")
    args = ap.parse_args()

    # lookup copies inside model rounds are another mechanism: the drafter's own rounds here
    pipe = load(args.model, args.drafter, args.mode, lookup_drafts=False)
    traces = record(pipe, synthetic_prompts(args.prompts), args.max_tokens)
    ceiling = pipe.proposer.max_draft

    def cost(k: int) -> float:
        if k == 0:
            return args.plain_ms / 1e3
        return (args.round_ms + args.per_draft_ms * (k - 1)) / 1e3

    plain = 1e3 / args.plain_ms
    rows = [
        (f"fixed cap {k}", replay(traces, cost, ceiling, args.start, k)) for k in range(ceiling + 1)
    ]
    rows.append(("auto", replay(traces, cost, ceiling, args.start)))
    rounds = sum(len(t[0]) for t in traces)
    mean = sum(a for t in traces for a in t[1]) / max(1, rounds)
    print(
        f"{args.mode} on {args.model}: {len(traces)} generations, {rounds} recorded rounds at "
        f"cap {ceiling}, {mean:.2f} drafts accepted a round"
    )
    print(
        f"costs: plain {args.plain_ms} ms, round {args.round_ms} + {args.per_draft_ms} ms a draft"
    )
    for name, tps in rows:
        print(f"  {name:<12} {tps:9.1f} tok/s  {tps / plain:5.2f}x plain")
    full = {k: full_acceptance(traces, k) for k in range(1, ceiling + 1)}
    print("rounds accepting every draft, by fixed cap (a pipelined round's next draft kept):")
    print("  " + "  ".join(f"cap {k}: {share:.0%}" for k, share in full.items()))
    if args.json:
        out = {"args": vars(args), "rows": rows, "full_acceptance": full}
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
