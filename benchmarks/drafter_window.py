"""Acceptance by drafter window (`--drafter-window`) at a long context.

One long prompt (a text file, cut to --context tokens), greedy generation at a fixed cap, once
per window: mean tokens accepted per drafting round, rounds, seconds, and whether the output
equals the first run's (it must: the window changes drafts, never output).

    python benchmarks/drafter_window.py --windows 0,4096,2048,1024 --context 6000
    python benchmarks/drafter_window.py -m MODEL -d DRAFTER --text long.txt --context 32000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import outrider


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="target (default: the demo pair's)")
    ap.add_argument("-d", "--drafter", default=None)
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--text", default=str(Path(__file__).parents[1] / "docs" / "performance.md"))
    ap.add_argument("--context", type=int, default=6000, help="prompt tokens")
    ap.add_argument("--windows", default="0,4096,2048,1024", help="0: the whole context")
    ap.add_argument("--cap", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    if args.model is None:
        from outrider.demo import demo_target

        args.model = demo_target()
    first = None
    print(
        f"{'window':>8} {'context':>8} {'rounds':>7} {'accepted/round':>15} {'seconds':>8}  output"
    )
    for window in [int(w) for w in args.windows.split(",")]:
        pipe = outrider.load(
            args.model, args.drafter, args.mode, max_draft=args.cap,
            drafter_window=window, lookup_drafts=False,
        )  # fmt: skip
        ids = pipe.encode(Path(args.text).read_text())[: args.context]
        start = time.perf_counter()
        run = pipe.generate(ids, max_tokens=args.max_tokens, stop_tokens=set())
        seconds = time.perf_counter() - start
        rounds = [r for r in run.rounds if r.drafted]
        accepted = sum(r.accepted for r in rounds) / max(1, len(rounds))
        first = first or run.tokens
        same = "same" if run.tokens == first else "DIFFERS"
        print(
            f"{window:>8} {len(ids):>8} {len(rounds):>7} {accepted:>15.2f} {seconds:>8.1f}  {same}"
        )
        if run.tokens != first:
            raise SystemExit("the window changed the output: a bug")


if __name__ == "__main__":
    main()
