"""How far n-gram lookup could go on a suite: its drafts replayed against the target's own
greedy answers, with no cost model, so the numbers are tokens a round, not speed.

For each prompt the target's greedy answer is generated once (baseline). Then each policy
drafts at every round's position from the prompt and the answer so far, the round keeps the
drafts that match the answer and one token more, and the next round starts after them:

* `latest-4`: outrider's lookup (`NGramIndex`, 1- to 4-token suffixes, the latest earlier
  occurrence of the longest one);
* `latest-8`: the same with suffixes of up to 8 tokens;
* `oracle`: of every earlier occurrence of the context's last token, the one whose
  continuation the answer repeats furthest: no n-gram lookup keeps more a round.

A round costs at least one plain step's time on any machine (on a CUDA GPU a verify of up to
16 rows costs about one to one and a half plain steps of a small model: docs/performance.md),
so `oracle`'s tokens a round bound what lookup can buy on that target's answers.

    python benchmarks/lookup_bound.py --model HuggingFaceTB/SmolLM2-135M-Instruct --suite copy
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
from outrider.api import load  # noqa: E402
from outrider.benchmark.suites import load_suite  # noqa: E402
from outrider.core.acceptance import accept_greedy  # noqa: E402
from outrider.plugins.strategies.lookup import NGramIndex  # noqa: E402

Drafter = Callable[[list[int], list[int], int], list[int]]  # (context, answer ahead, cap)


def latest(max_n: int) -> Drafter:
    """The drafts of an n-gram index of 1..max_n-token suffixes (outrider's lookup at 4)."""

    def draft(context: list[int], ahead: list[int], cap: int) -> list[int]:
        index = NGramIndex(1, max_n)
        index.extend_to(context, len(context) - 1)  # the last token matches, never is matched
        return index.peek(context, cap)

    return draft


def oracle(context: list[int], ahead: list[int], cap: int) -> list[int]:
    """Of every earlier occurrence of the last token, the continuation `ahead` repeats
    furthest (it reads the answer: a bound, not a drafter)."""
    last, best = context[-1], []
    for at in range(len(context) - 1):
        if context[at] != last:
            continue
        run = context[at + 1 : at + 1 + cap]
        kept = next((i for i, (a, b) in enumerate(zip(run, ahead)) if a != b), len(run))
        if kept > len(best):
            best = run[:kept]
    return best


def replay(answers: list[tuple[list[int], list[int]]], draft: Drafter, cap: int) -> tuple:
    """(tokens a round, rounds, rounds that kept every draft) over every answer."""
    rounds = tokens = full = 0
    for prompt, answer in answers:
        i = 0
        while i < len(answer):
            drafts = draft(prompt + answer[:i], answer[i:], cap)
            kept = accept_greedy(answer[i:], drafts)
            step = min(kept + 1, len(answer) - i)  # the answer's end takes no correction
            i += step
            rounds += 1
            tokens += step
            full += bool(drafts) and kept == len(drafts)
    return tokens / rounds, rounds, full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--suite", default="copy")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--caps", default="8,16,32")
    args = ap.parse_args()
    pipe = load(args.model, mode="baseline")
    answers = []
    for p in load_suite(args.suite)[: args.prompts]:
        ids = pipe.encode(p.text)
        answers.append((ids, pipe.generate(ids, max_tokens=args.max_tokens).tokens))
    total = sum(len(a) for _, a in answers)
    print(f"{args.model}, suite {args.suite}: {len(answers)} greedy answers, {total} tokens")
    print(f"{'policy':<10}{'cap':>5}{'tokens a round':>16}{'rounds':>8}{'kept all':>10}")
    policies = {"latest-4": latest(4), "latest-8": latest(8), "oracle": oracle}
    for cap in [int(c) for c in args.caps.split(",")]:
        for name, draft in policies.items():
            per_round, rounds, full = replay(answers, draft, cap)
            print(f"{name:<10}{cap:>5}{per_round:>16.2f}{rounds:>8}{full:>10}")


if __name__ == "__main__":
    main()
