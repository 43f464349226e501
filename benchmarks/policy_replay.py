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

`--kinds chat,code,reasoning` replays the mix's prompts grouped by kind in that order (one
policy across them all, as a pipeline serving a chat and then code would), printing each
group's speed-up; `--prompt-file F` adds your own prompts as a group named after the file, and
`--traces F` keeps what was recorded (a JSON file), so other costs replay without decoding:

    python benchmarks/policy_replay.py --model HuggingFaceTB/SmolLM2-135M-Instruct \
        --drafter D --kinds chat,code_tasks,reasoning --prompts 8 \
        --prompt-file benchmarks/data/code_tasks.jsonl --traces traces.json \
        --plain-ms 5.1 --round-ms 8 --per-draft-ms 0.33

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
from outrider.benchmark.suites import read_user_prompts  # noqa: E402
from outrider.core.schedule import AutoCap  # noqa: E402


def synthetic_rows(count: int) -> list[dict]:
    spec = importlib.util.spec_from_file_location("mix", ROOT / "scripts/smollm2/prompts.py")
    mix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mix)
    return mix.prompt_mix(count, seed=7)


def synthetic_prompts(count: int) -> list[str]:
    return [row["turns"][0] for row in synthetic_rows(count)]


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


def replay(traces, cost, ceiling: int, start: int, fixed: int | None = None):
    """Tokens per (simulated) second of each trace, one policy carried across them all (a
    new generation each), and the share of tokens committed by drafting rounds."""
    policy = AutoCap(ceiling, start=start)
    rates, drafted, tokens = [], 0, 0
    for trace in traces:
        policy.new_generation()
        total, t, seconds = trace[2], 0, 0.0
        while t < total:
            left = total - t - 1
            k = min(fixed, left) if fixed is not None else policy.choose(left)
            if k == 0:
                n = 1 if fixed is not None else policy.plain_run(total - t)
                for _ in range(n):
                    policy.observe(0, 0, cost(0))
                t, seconds = t + n, seconds + n * cost(0)
                continue
            a = min(k, run_length(trace, t))
            policy.observe(k, a, cost(k))
            t, seconds, drafted = t + a + 1, seconds + cost(k), drafted + a + 1
        rates.append((total, seconds))
        tokens += total
    return rates, drafted / max(1, tokens)


def linear_cost(plain_ms: float, round_ms: float, per_draft_ms: float):
    """Seconds of a plain step (k = 0) or of a round drafting k tokens."""

    def cost(k: int) -> float:
        return (plain_ms if k == 0 else round_ms + per_draft_ms * (k - 1)) / 1e3

    return cost


def speed(rates) -> float:
    """Tokens per second over several traces' (tokens, seconds)."""
    return sum(n for n, _ in rates) / max(1e-12, sum(s for _, s in rates))


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


def prompt_groups(args) -> dict[str, list[str]]:
    """The prompts to record, by group: the mix's kinds in `--kinds` order, and a
    `--prompt-file`'s prompts under the file's name (where `--kinds` names it, else last)."""
    own = {}
    if args.prompt_file:
        own[Path(args.prompt_file).stem] = [
            p.text for p in read_user_prompts(args.prompt_file, args.prompts)
        ]
    if not args.kinds:
        return own or {"mix": synthetic_prompts(args.prompts)}
    mix = synthetic_rows(args.prompts * 60)
    groups = {}
    for kind in args.kinds.split(","):
        if kind in own:
            groups[kind] = own.pop(kind)
        else:
            groups[kind] = [r["turns"][0] for r in mix if r["kind"] == kind][: args.prompts]
            if not groups[kind]:
                raise SystemExit(f"--kinds: no prompt of kind {kind!r} in the mix")
    return groups | own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--drafter", default="outrider-demo/dspark")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--prompts", type=int, default=12, help="prompts (per group with --kinds)")
    ap.add_argument("--kinds", help="the mix's kinds, grouped in this order (chat,code,...)")
    ap.add_argument("--prompt-file", help="your own prompts (JSON lines), a group of their own")
    ap.add_argument("--traces", help="a JSON file: read the traces from it if it exists, else "
                    "record them and write it")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plain-ms", type=float, required=True)
    ap.add_argument("--round-ms", type=float, required=True, help="a round drafting one token")
    ap.add_argument("--per-draft-ms", type=float, default=0.0)
    ap.add_argument("--start", type=int, default=4, help="the policy's first cap")
    ap.add_argument("--json")
    args = ap.parse_args()

    if args.traces and Path(args.traces).exists():
        saved = json.loads(Path(args.traces).read_text())
        groups, ceiling = saved["groups"], saved["ceiling"]
        args.model, args.drafter, args.mode = saved["model"], saved["drafter"], saved["mode"]
    else:
        # lookup copies inside model rounds are another mechanism: the drafter's rounds here
        pipe = load(args.model, args.drafter, args.mode, lookup_drafts=False)
        ceiling = pipe.proposer.max_draft
        groups = {
            g: record(pipe, texts, args.max_tokens) for g, texts in prompt_groups(args).items()
        }
        if args.traces:
            saved = {"model": args.model, "drafter": args.drafter, "mode": args.mode}
            saved |= {"ceiling": ceiling, "groups": groups}
            Path(args.traces).write_text(json.dumps(saved))
    traces = [t for g in groups.values() for t in g]
    sizes = {g: len(v) for g, v in groups.items()}

    cost = linear_cost(args.plain_ms, args.round_ms, args.per_draft_ms)
    plain = 1e3 / args.plain_ms
    rows = []
    for k in [*range(ceiling + 1), None]:
        rates, share = replay(traces, cost, ceiling, args.start, k)
        per, i = {}, 0
        for g, n in sizes.items():
            per[g], i = speed(rates[i : i + n]) / plain, i + n
        rows.append(("auto" if k is None else f"fixed cap {k}", speed(rates), share, per))
    rounds = sum(len(t[0]) for t in traces)
    mean = sum(a for t in traces for a in t[1]) / max(1, rounds)
    print(
        f"{args.mode} on {args.model}: {len(traces)} generations, {rounds} recorded rounds at "
        f"cap {ceiling}, {mean:.2f} drafts accepted a round"
    )
    for g, v in groups.items():
        r = sum(len(t[0]) for t in v)
        print(f"  {g}: {len(v)} generations, {sum(a for t in v for a in t[1]) / max(1, r):.2f}")
    print(
        f"costs: plain {args.plain_ms} ms, round {args.round_ms} + {args.per_draft_ms} ms a draft"
    )
    for name, tps, share, per in rows:
        groups_x = "  ".join(f"{g} {x:4.2f}x" for g, x in per.items()) if len(per) > 1 else ""
        print(
            f"  {name:<12} {tps:9.1f} tok/s  {tps / plain:5.2f}x plain  drafted {share:4.0%}  "
            + groups_x
        )
    full = {k: full_acceptance(traces, k) for k in range(1, ceiling + 1)}
    print("rounds accepting every draft, by fixed cap (a pipelined round's next draft kept):")
    print("  " + "  ".join(f"cap {k}: {share:.0%}" for k, share in full.items()))
    if args.json:
        out = {"args": vars(args), "rows": rows, "full_acceptance": full}
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
