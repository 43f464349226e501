"""Plain decoding through the same loop: the reference every speed-up is measured against."""

from __future__ import annotations

import mlx.core as mx

from ...core.hookspecs import hookimpl
from ...core.proposer import DraftContext, Proposal
from ...core.target import Target


class PlainProposer:
    name = "baseline"
    tap_layer_ids: tuple[int, ...] = ()
    max_draft = 0

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Proposal:
        return Proposal.empty()

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        pass


class Baseline:
    name = "baseline"
    description = "plain target decoding (no speculation)"
    needs_drafter = False
    default_cap = 0

    def build(self, target: Target, drafter, options: dict) -> PlainProposer:
        return PlainProposer()


@hookimpl
def register_strategies(register):
    register(Baseline())
