"""DSpark (DeepSeek): parallel block backbone + sequential Markov head + confidence head."""

from __future__ import annotations

from ...core.drafter_spec import DrafterSpec
from ...core.errors import OutriderError
from ...core.hookspecs import hookimpl
from ...core.target import Target
from .block_drafter import load_block_drafter
from .block_proposer import BlockProposer, context_window


class DSpark:
    name = "dspark"
    description = "DSpark drafter: block backbone, Markov head, confidence truncation"
    needs_drafter = True
    default_cap = 4

    def build(self, target: Target, drafter: DrafterSpec | None, options: dict) -> BlockProposer:
        if drafter is None:
            raise OutriderError("--mode dspark needs a DSpark drafter (--drafter)")
        if drafter.kind != "dspark":
            other = "dflash" if drafter.kind == "dflash" else drafter.kind
            raise OutriderError(
                f"this drafter is a {drafter.kind} drafter without DSpark heads; use --mode {other}"
            )
        model = load_block_drafter(drafter, bits=options.get("drafter_bits", 4))
        return BlockProposer(
            self.name,
            target,
            model,
            sequential=True,
            confidence_threshold=options.get("confidence_threshold") or 0.0,
            context_window=context_window(options),
        )


@hookimpl
def register_strategies(register):
    register(DSpark())
