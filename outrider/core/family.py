"""The contract a target-family plugin fulfils.

A family knows how to load one kind of model, where its decoder layers are (the entries taps
wrap: each layer's output is the residual stream a drafter reads), how to embed ids and project
hidden states (for drafters that share the target's embedding and head), and how to roll each of
its cache kinds back after a partial acceptance: KV trim, rotating-window trim, recurrent state
restored to the accept point (`outrider/plugins/targets/caches.py` has all three).

Optional members: `priority` (int, default 0; families are tried highest first, so a catch-all
can sit below the specific ones) and `begin_forward(cache, verify)`, called before every target
forward; `verify` is True for a forward that `rollback` may follow (a family with recurrent state
records per-step state then) and False for prefill chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn


@runtime_checkable
class TargetFamily(Protocol):
    name: str
    description: str

    def supports(self, config: dict) -> bool:
        """True when this family can run the model that `config` (config.json) describes."""

    def load(self, path: Path, config: dict) -> tuple[nn.Module, Any]:
        """Load (model, tokenizer) from a local folder."""

    def layers(self, model: nn.Module) -> list:
        """The model's decoder layers, as the list its forward iterates (taps wrap entries)."""

    def embed(self, model: nn.Module, ids: mx.array) -> mx.array:
        """Input embeddings of ids, as the model computes them."""

    def project(self, model: nn.Module, hidden: mx.array) -> mx.array:
        """The model's output head applied to final-normed hidden states."""

    def make_cache(self, model: nn.Module) -> list:
        """A fresh cache for one sequence."""

    def rollback(self, cache: list, n: int) -> None:
        """Make every layer's cache what it was before the last n positions of the last
        (verify) forward, exactly."""
