"""Where a real generation's time goes, step by step: plain decoding against fixed caps and
`auto` on the same prompts, in one process.

`round_profile.py` times one round in isolation; this runs whole generations through the loop
(`Pipeline.stream`) and sorts their steps: drafting rounds (the drafter's), lookup copies,
plain steps taken inside a speculative generation (a parked `auto`), and the time between
steps that the loop hands back to its caller. Drafting rounds are sorted by how they ran
(queued ahead and kept, serial, serial after a dropped queued round, first after plain
steps), each with its median phases: launching its own round, queueing the next one, waiting
for its result, and the host's work after it. Every setting first runs every prompt once
untimed, so kernels a shape needs are built before anything is timed (on CUDA, MLX builds
some on first use), and the settings then run in turn over the prompts.

    python benchmarks/step_times.py                          # the demo pair, code suite
    python benchmarks/step_times.py --model HuggingFaceTB/SmolLM2-135M-Instruct \\
        --drafter D --mode dspark --suite code --prompts 5 --caps 4,7,auto
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
from outrider.api import Pipeline, load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402


@dataclass
class Tally:
    """One setting's steps over all prompts."""

    tokens: int = 0
    decode_s: float = 0.0
    rounds: list[float] = field(default_factory=list)  # drafting rounds' seconds
    kept: list[int] = field(default_factory=list)  # tokens each drafting round committed
    copies: int = 0  # rounds that verified a lookup copy
    plain: list[float] = field(default_factory=list)  # plain steps' seconds (parked auto)
    between: float = 0.0  # seconds between steps, outside the loop
    between_runs: float = 0.0  # the part of it before a plain step that followed another
    run_steps: int = 0  # such plain steps
    # drafting rounds by how they ran: queued behind the round before (pipelined), launched
    # after it was read, launched after the round before dropped the one it had queued, and
    # the first after plain steps (a model drafter catches up there)
    kinds: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in ("ahead", "serial", "after drop", "after plain")}
    )
    # the same rounds' phases (core/round.py Step.phases): kind -> phase -> seconds
    phases: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    kind_kept: dict[str, list[int]] = field(default_factory=dict)  # kind -> tokens committed

    def add(self, pipe: Pipeline, prompt: list[int], cap: int | str, max_tokens: int) -> None:
        before = getattr(pipe.proposer, "lookup_rounds", 0)
        last, previous, dropped = None, None, False
        for chunk in pipe.stream(prompt, max_tokens=max_tokens, max_draft=cap, stop_tokens=set()):
            now = time.perf_counter()
            step = chunk.step
            if last is not None:
                gap = max(0.0, now - last - step.seconds)
                self.between += gap
                if step.source == "plain" and previous == "plain":
                    self.between_runs += gap
                    self.run_steps += 1
            last = now
            if step.source == "draft" and step.drafted:
                self.rounds.append(step.seconds)
                self.kept.append(step.accepted + 1)
                kind = "ahead" if step.ahead else "after drop" if dropped else "serial"
                kind = "after plain" if previous == "plain" else kind
                self.kinds[kind].append(step.seconds)
                self.kind_kept.setdefault(kind, []).append(step.accepted + 1)
                for name, seconds in (step.phases or {}).items():
                    self.phases.setdefault(kind, {}).setdefault(name, []).append(seconds)
            elif step.source == "plain":
                self.plain.append(step.seconds)
            previous, dropped = step.source, step.dropped > 0
            if chunk.result is not None:
                self.tokens += max(0, len(chunk.result.tokens) - 1)
                self.decode_s += chunk.result.decode_seconds
        self.copies += getattr(pipe.proposer, "lookup_rounds", 0) - before

    def line(self, label: str, plain_tps: float | None) -> str:
        tps = self.tokens / self.decode_s if self.decode_s else 0.0
        ratio = f"{tps / plain_tps:5.2f}x" if plain_tps else "     -"
        med = lambda xs: f"{1e3 * statistics.median(xs):6.2f}" if xs else "     -"  # noqa: E731
        kept = statistics.mean(self.kept) if self.kept else 0.0
        steps = len(self.rounds) + len(self.plain)
        kinds = "  ".join(
            f"{k} {len(v)} x {med(v).strip()} ({statistics.mean(self.kind_kept[k]):.2f} kept)"
            for k, v in self.kinds.items()
            if v
        )
        split = "".join(
            f"\n{'':10}  {k}: "
            + ", ".join(f"{name} {med(xs).strip()}" for name, xs in self.phases[k].items())
            + " ms (medians)"
            for k in self.kinds
            if k in self.phases
        )
        return (
            f"{label:<10}{tps:8.1f} tok/s {ratio}  rounds {len(self.rounds):5d} x {med(self.rounds)}"
            f" ms, {kept:4.2f} kept (copies {self.copies:4d})  plain steps {len(self.plain):5d}"
            f" x {med(self.plain)} ms  outside {1e3 * self.between / max(1, steps):5.2f} ms/step"
            + (
                f" ({1e3 * self.between_runs / self.run_steps:4.2f} inside plain runs)"
                if self.run_steps and self.rounds
                else ""
            )
            + (f"\n{'':10}rounds: {kinds} ms" if kinds else "")
            + split
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--drafter", default="outrider-demo/dspark")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--suite", default="code")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--caps", default="4,7,auto", help="fixed caps and/or auto")
    args = ap.parse_args()
    caps: list[int | str] = [c if c == "auto" else int(c) for c in args.caps.split(",")]

    base = load(args.model, mode="baseline")
    pipe = load(args.model, args.drafter, mode=args.mode, target=base.target)
    prompts = [pipe.encode(p.text) for p in load_suite(args.suite, args.prompts)]
    settings: list[tuple[str, Pipeline, int | str]] = [("plain", base, 0)]
    settings += [(f"cap {c}", pipe, c) for c in caps]
    for _, p, cap in settings:  # warm-up: every shape a setting meets, once
        for prompt in prompts:
            Tally().add(p, prompt, cap, args.max_tokens)
    tallies = {label: Tally() for label, _, _ in settings}
    for label, p, cap in settings:
        for prompt in prompts:
            tallies[label].add(p, prompt, cap, args.max_tokens)

    import mlx.core as mx

    print(f"{args.mode} on {args.model}: {args.suite} suite, {len(prompts)} prompts, "
          f"{args.max_tokens} tokens, {mx.default_device()}, mlx {mx.__version__}")  # fmt: skip
    plain = tallies["plain"]
    plain_tps = plain.tokens / plain.decode_s if plain.decode_s else None
    for label, tally in tallies.items():
        print(tally.line(label, plain_tps))
    if pipe.cap_policy is not None:
        print("auto's policy at the end:", pipe.cap_policy.snapshot())


if __name__ == "__main__":
    main()
