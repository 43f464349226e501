"""Lookup mode's copies while `--max-draft auto` is parked, replayed under another machine's costs.

A parked lookup run stops for a copy when the tokens it should commit pay for its round
(`LookupProposer.copy_ready` / `copy_rate`, `AutoCap.copy_pays`). What a copy keeps depends on
the target and the text, not on the machine, so this decodes each prompt on whatever machine
runs it with the policy held parked, deciding each copy with the costs of the machine in
question: a plain step of `--plain-ms`, a copy round of `--round-ms` plus `--per-draft-ms` a
draft, and `--restart-ms` for the plain run after it. It prints, per kind of match
(`MatchRates`: 1-4 tokens, then 4-token matches by how far back they run), how many copies
were taken, the drafts they were expected to keep and the drafts they kept, and the
speed-up those costs give over plain decoding (every plain step at `--plain-ms`; a copy round
also drops the plain step queued past the run). The prompts are this repository's synthetic
mix (`scripts/smollm2/prompts.py`), never an evaluation set.

    python benchmarks/lookup_copies.py --kinds chat,code,reasoning --prompts 10 \
        --plain-ms 0.96 --round-ms 1.57 --per-draft-ms 0.05 --restart-ms 0.05   # an H100
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from parked_steps import hold_parked  # noqa: E402
from policy_replay import prompt_groups  # noqa: E402

from outrider.api import Pipeline, load  # noqa: E402
from outrider.core.schedule import MARGIN, AutoCap  # noqa: E402
from outrider.plugins.strategies.lookup import LookupProposer  # noqa: E402


def held_parked(pipe: Pipeline, costs) -> AutoCap:
    """The pipeline's policy, parked for good (`parked_steps.hold_parked`), deciding copies
    with `costs` (ms: plain, copy round of d drafts, restart)."""
    plain, copy, restart = costs
    hold_parked(pipe)
    policy = pipe._cap_policy()  # the instance hold_parked changed
    policy.copy_pays = lambda d, kept: kept / (copy(d) + plain + restart) > MARGIN / plain
    return policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--prompts", type=int, default=10, help="prompts per group")
    ap.add_argument("--kinds", default="chat,code,reasoning", help="the mix's kinds, in order")
    ap.add_argument("--prompt-file", help="your own prompts (JSON lines), a group of their own")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plain-ms", type=float, required=True)
    ap.add_argument("--round-ms", type=float, required=True, help="a copy round of one draft")
    ap.add_argument("--per-draft-ms", type=float, default=0.0)
    ap.add_argument("--restart-ms", type=float, default=0.0)
    args = ap.parse_args()

    def copy_ms(d: int) -> float:
        return args.round_ms + args.per_draft_ms * (d - 1)

    offers: list[tuple[int, float]] = []  # (kind, drafts expected kept) of each copy proposed

    class Noted(LookupProposer):
        """Lookup that notes each copy it proposes: its match's kind and what it should keep."""

        def propose(self, ctx):
            offer, proposal = self._offer, super().propose(ctx)
            if proposal.copied:
                offers.append((offer[1], min(self.rates.kept[offer[1]], proposal.k)))
            return proposal

    loaded = load(args.model, None, "lookup")
    proposer = Noted(max_draft=loaded.proposer.max_draft)
    pipe = Pipeline(loaded.target, proposer, "lookup", proposer.max_draft, auto_cap=True)
    held_parked(pipe, (args.plain_ms, copy_ms, args.restart_ms))
    priced = f"round {args.round_ms} + {args.per_draft_ms}/draft ms, restart {args.restart_ms} ms"
    print(f"{args.model}, lookup held parked, copies priced at plain {args.plain_ms} ms, {priced}")
    for group, texts in prompt_groups(args).items():
        by_kind: dict[int, list[tuple[float, int]]] = defaultdict(list)
        tokens, ms = 0, 0.0
        for text in texts:
            result = pipe.generate(pipe.encode(text), max_tokens=args.max_tokens)
            rounds = [r for r in result.rounds if r.drafted]
            for (kind, expected), r in zip(offers, rounds, strict=True):
                by_kind[kind].append((expected, r.accepted))
            offers.clear()
            committed = sum(r.accepted + 1 for r in rounds)
            ms += (len(result.tokens) - committed) * args.plain_ms
            ms += sum(copy_ms(len(r.drafted)) + args.plain_ms + args.restart_ms for r in rounds)
            tokens += len(result.tokens)
        print(f"{group}: {len(texts)} prompts, {tokens} tokens, "
              f"speed-up {tokens * args.plain_ms / ms:.3f}x")  # fmt: skip
        print("  match kind   copies   expected kept   kept")
        for kind in sorted(by_kind):
            got = by_kind[kind]
            print(f"  {kind:10d} {len(got):8d} {statistics.mean(e for e, _ in got):15.2f} "
                  f"{statistics.mean(k for _, k in got):6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
