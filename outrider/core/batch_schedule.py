"""DSpark's prefix scheduler on a batch's rounds (the DSpark paper, §3.2.2, Algorithm 1): after
every row has drafted, each row verifies only the drafts worth widening the batch's one padded
verify forward for, at this machine's measured costs. Each row's own cap comes first, from
`--max-draft auto`'s policy (`core/schedule.py`), whose running acceptance this reads where a
drafter has no confidence head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .schedule import PRIOR_ACCEPT


def admit(survival: list[list[float]], cost: Callable[[int, int], float]) -> list[int]:
    """How many drafts each row of a batch verifies this round (DSpark's prefix scheduler, the
    DSpark paper's §3.2.2, Algorithm 1, on this loop's padded verify).

    `survival[r][j-1]` is the chance that row r's first j drafts are all accepted (non-increasing
    in j: the confidence head's cumulative product, or the row's running acceptance);
    `cost(rows, width)` the seconds of a round whose verify forward has `rows` rows padded to
    `width`. The rows pad to the widest, so a forward's cost is set by its width alone, and a
    draft inside the width costs nothing: the choice is the width. Column j (every row's draft
    j) is taken while it raises the expected tokens per second, each row's draft adding
    survival[r][j-1] expected tokens, and the first column that does not ends the search; each
    row then verifies its drafts up to that width (those it estimates at zero left out).

    The paper's algorithm admits single drafts in order of survival; on a padded forward that
    stopped a batch at the first draft that would widen it, which alone rarely pays for a column
    every row pays for, and left the other rows' drafts inside the width unverified though
    they were free. Whether draft j of a row is verified depends only on survivals up to j
    (that row's and the others'), never on one computed from draft j itself, which keeps
    sampled output exact (the paper's Appendix A shows the distribution shifting without it).
    """
    rows = len(survival)
    if rows == 0:
        return []
    expected, width = float(rows), 1
    rate = expected / cost(rows, 1)
    for j in range(1, 1 + max(map(len, survival))):
        gain = sum(row[j - 1] for row in survival if len(row) >= j)
        if gain <= 0:
            break
        wider = (expected + gain) / cost(rows, j + 1)
        if wider <= rate:
            break
        expected, rate, width = expected + gain, wider, j + 1
    return [sum(1 for s in row[: width - 1] if s > 0) for row in survival]


def survival(conditional: list[float]) -> list[float]:
    """The chance that the first j drafts are all accepted, j = 1..len: the running product
    of per-draft acceptance (non-increasing, as `admit` needs)."""
    out, s = [], 1.0
    for p in conditional:
        s *= min(max(p, 0.0), 1.0)
        out.append(s)
    return out


@dataclass
class BatchScheduler:
    """DSpark's prefix scheduler on a batch's rounds (`admit`): once every row has drafted,
    the batch verifies only as wide as raises its expected tokens per second at this
    machine's measured costs: the round's drafter call (`calibration.draft_cost`, paid
    whatever is verified, so a round that verifies little pays it for little) and its verify
    forward (`calibration.batch_verify_cost`).

    Rows pad to the widest, so a batch's forward costs its rows times its widest row: drafts
    that are unlikely to survive widen it for little. A drafter that estimates acceptance per
    slot (DSpark's confidence head) gives the survivals; otherwise each row's running
    per-position acceptance does. Drafts are only left out, never changed, so greedy output
    is unchanged and sampled output keeps the target's distribution. One per pipeline: its
    counters say what it cut."""

    calibration: Any
    rounds: int = 0  # rounds it scheduled (some row drafted)
    proposed: int = 0  # drafts the scheduled rows of those rounds proposed
    cut: int = 0  # of them, left unverified

    def keep(
        self,
        drafted: list[int],
        asked: list[int],
        confidence: list[list[float] | None],
        accept: list[list[float]],
        context: int | None = None,
        copied: list[bool] | None = None,
    ) -> list[int]:
        """How many of its drafts each row verifies this round.

        `drafted[r]`: the drafts row r proposed; `asked[r]`: the cap it was asked for;
        `copied[r]`: its drafts are a lookup copy (`lookup_assist.py`), sized by the copy's
        match: it stays whole, and the width it sets costs the others nothing (so does any
        draft past its row's cap); `confidence[r]`: the drafter's per-slot acceptance
        estimates, or None; `accept[r]`: the row's running per-position acceptance
        (`schedule.learn_acceptance`); `context`: the longest row's context length."""
        if not any(k > 0 for k in drafted):
            return list(drafted)
        copied = copied or [False] * len(drafted)
        fixed = [k > cap or c for k, cap, c in zip(drafted, asked, copied, strict=True)]
        survivals = [
            [] if f or k == 0 else survival(_conditional(c, a, k))
            for k, f, c, a in zip(drafted, fixed, confidence, accept, strict=True)
        ]
        floor = 1 + max((k for k, f in zip(drafted, fixed) if f), default=0)

        drafting = self.calibration.draft_cost(  # this round's call, paid already
            max((k for k, f in zip(drafted, fixed) if not f and k), default=1)
        )

        def cost(rows: int, width: int) -> float:
            return drafting + self.calibration.batch_verify_cost(rows, max(width, floor), context)

        admitted = admit(survivals, cost)
        keep = [k if f else min(k, n) for k, f, n in zip(drafted, fixed, admitted)]
        self.rounds += 1
        self.proposed += sum(k for k, f in zip(drafted, fixed) if not f)
        self.cut += sum(drafted) - sum(keep)
        return keep


def _conditional(confidence: list[float] | None, accept: list[float], k: int) -> list[float]:
    """Per-draft acceptance of k drafts: the drafter's own estimates when it made them, else
    the row's running acceptance (the prior where no round has reached a position)."""
    if confidence is not None and len(confidence) >= k:
        return confidence[:k]
    return [accept[j] if j < len(accept) else PRIOR_ACCEPT for j in range(k)]
