"""`outrider train`: DSpark / DFlash drafters for any target, trained online with MLX.

The trainer is imported on first use, so `outrider --help` stays quick.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .trainer import TrainConfig, TrainReport, train_drafter

__all__ = ["TrainConfig", "TrainReport", "train_drafter"]


def __getattr__(name: str):
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
