"""DFlash (z-lab, and DeepSpec's packaging): one parallel block, each slot chosen on its own."""

from __future__ import annotations

from ...core.drafter_spec import DrafterSpec
from ...core.errors import OutriderError
from ...core.hookspecs import hookimpl
from ...core.target import Target
from .block_drafter import load_block_drafter
from .block_proposer import BlockProposer, context_window


class DFlash:
    name = "dflash"
    description = "DFlash drafter: block diffusion-style parallel drafting"
    needs_drafter = True
    default_cap = 8

    def build(self, target: Target, drafter: DrafterSpec | None, options: dict) -> BlockProposer:
        if drafter is None:
            raise OutriderError("--mode dflash needs a DFlash drafter (--drafter)")
        if drafter.kind not in ("dflash", "dspark"):  # a DSpark backbone drafts as DFlash too
            raise OutriderError(
                f"this drafter is a {drafter.kind} drafter, not a block drafter; "
                f"use --mode {drafter.kind}"
            )
        model = load_block_drafter(drafter, bits=options.get("drafter_bits", 4))
        return BlockProposer(
            self.name, target, model, sequential=False, context_window=context_window(options)
        )


@hookimpl
def register_strategies(register):
    register(DFlash())
