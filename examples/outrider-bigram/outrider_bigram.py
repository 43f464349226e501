"""An example third-party outrider plugin: the `bigram` drafting strategy.

It drafts by following the chain of most recent successors: after token a, propose whatever
followed a the last time it appeared, then whatever followed that, and so on. No drafter, no
taps; the loop's verification keeps the output identical to the target's.

Installed, it is found through the `outrider` entry-point group (see pyproject.toml) and shows
up in `outrider plugins`; `outrider generate --mode bigram` runs it.
"""

from __future__ import annotations

import mlx.core as mx

from outrider.core.hookspecs import hookimpl
from outrider.core.proposer import DraftContext, Proposal


class BigramChainProposer:
    name = "bigram"
    tap_layer_ids: tuple[int, ...] = ()

    def __init__(self, max_draft: int = 6) -> None:
        self.max_draft = max_draft
        self._next: dict[int, int] = {}
        self._seen = 0

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self._next, self._seen = {}, 0

    def propose(self, ctx: DraftContext) -> Proposal:
        tokens = ctx.tokens
        for i in range(max(self._seen - 1, 0), len(tokens) - 1):
            self._next[tokens[i]] = tokens[i + 1]
        self._seen = len(tokens)
        drafts, tok = [], tokens[-1]
        while len(drafts) < ctx.cap and tok in self._next:
            tok = self._next[tok]
            drafts.append(tok)
        return Proposal.from_list(drafts)

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        pass


class BigramChain:
    name = "bigram"
    description = "follow the chain of most recent successors (example plugin)"
    needs_drafter = False
    default_cap = 4

    def build(self, target, drafter, options: dict) -> BigramChainProposer:
        return BigramChainProposer()


@hookimpl
def register_strategies(register):
    register(BigramChain())
