"""Rows that decode together: each round verifies every row's drafts in one target forward.

A row joins after its own prefill (alone, so a long prompt never stalls the others' rounds)
and leaves the moment it finishes; its cache rows are merged into, and filtered out of, one
batched cache. The rounds are the loop's own (`verify_round`), so every mode, sampling rule,
penalty and stop works per row exactly as it does for a single generation.
"""

from __future__ import annotations

import copy

from .batch_schedule import BatchScheduler
from .errors import UnsupportedTargetError
from .proposer import Proposer
from .round import Row, Step, verify_round
from .target import Target


def fork(proposer: Proposer) -> Proposer:
    """A proposer for one more row: the same weights, its own per-generation state (which
    `start` resets). A proposer may define `fork` when a shallow copy is not enough."""
    own = getattr(proposer, "fork", None)
    return own() if callable(own) else copy.copy(proposer)


class Batch:
    """The rows decoding on one target, and the batched cache that holds them. A `scheduler`
    cuts each round's drafts to what DSpark's prefix scheduler admits (`core/batch_schedule.py`)."""

    def __init__(self, target: Target, scheduler: BatchScheduler | None = None) -> None:
        if not target.batches:
            raise UnsupportedTargetError(
                f"the {target.family.name} family decodes one row at a time (no batched caches)"
            )
        self.target = target
        self.scheduler = scheduler
        self.rows: list[Row] = []
        self.cache: list | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, row: Row, cache: list) -> None:
        """Add a prefilled row (its one-row cache) before the next round."""
        if self.rows and tuple(row.proposer.tap_layer_ids) != self._tap_ids:
            raise ValueError("rows of one batch must tap the same target layers")
        merged = self.target.merge_rows([cache])
        if self.cache is None:
            self.cache = merged
        else:
            self.target.extend_rows(self.cache, merged)
        self.rows.append(row)

    @property
    def _tap_ids(self) -> tuple[int, ...]:
        return tuple(self.rows[0].proposer.tap_layer_ids)

    def round(self) -> list[tuple[Row, Step]]:
        """One round for every row. Cancelled rows end without one; every row that is done
        after it leaves the batch."""
        out: list[tuple[Row, Step]] = []
        for row in self.rows:
            if row.wants_cancel():
                row.stopper.finish_reason = "cancelled"
                out.append((row, Step("draft", [], 0, [], 0.0, "cancelled")))
        live = [r for r in self.rows if not r.done]
        if live:
            if len(live) < len(self.rows):
                self._keep(live)
            steps = verify_round(self.target, live, self.cache, scheduler=self.scheduler)
            out += zip(live, steps)
        self._keep([r for r in self.rows if not r.done])
        return out

    def _keep(self, rows: list[Row]) -> None:
        if len(rows) == len(self.rows):
            return
        if not rows:
            self.rows, self.cache = [], None
            return
        index = {id(r): i for i, r in enumerate(self.rows)}
        self.target.filter_rows(self.cache, [index[id(r)] for r in rows])
        self.rows = rows
