"""The contract a drafting-strategy plugin fulfils: build a proposer for one target."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .proposer import Proposer
from .target import Target


@runtime_checkable
class Strategy(Protocol):
    name: str
    description: str
    needs_drafter: bool  # True: a drafter checkpoint is required (dspark, dflash)

    def build(self, target: Target, drafter: Any | None, options: dict) -> Proposer:
        """A proposer bound to `target` (and the loaded `drafter`, if the strategy has one)."""
