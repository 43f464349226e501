"""Parked runs: plain steps inside a speculative generation.

Where `--max-draft auto` finds that no cap beats plain decoding (`core/schedule.py`), the loop
parks the drafter and takes pipelined plain steps instead (`plain_run`), feeding the proposer
each step's taps so drafting can resume where they stop, checking a host proposer's would-be
drafts against the tokens that arrive (`Shadow`), and stopping early where the text starts
copying itself (`copy_ready`). On a CUDA GPU a long run's later steps take no taps; the next
round recomputes their rows in one forward (`retap`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx

from .device import on_cuda_gpu, retap_choice
from .proposer import DraftContext
from .round import Row, Step, choose
from .schedule import handed
from .target import PREFILL_CHUNK, Target

# A parked run's steps past this many forward no taps: where the run ends, one forward of those
# tokens recomputes their rows for the drafter (`plain_run`). On a CUDA GPU a small target's
# plain step is bound by the host (benchmarks/plain_step.py: the device waited 2 µs a step on an
# H100), and the taps' wrappers made the demo target's step 3% slower; the rows of the tapped
# steps are joined where drafting resumes, a few copy kernels a step, inside that round. On an
# H200 the first round after a run took a median 22.8 ms with 32 tapped steps against 10.5 with
# 8 and 8.8 with none (docs/performance.md, "Where parked runs stop tapping"); below 8 steps a
# run costs no recompute at all. On the CPU every row of a forward costs, so never there
# (OUTRIDER_RETAP, core/device.py).
RETAP_FROM = 8


def retap_from() -> int | None:
    """RETAP_FROM where a parked run's taps are cheaper recomputed (a CUDA GPU, or
    OUTRIDER_RETAP=on), else None."""
    choice = retap_choice()
    return RETAP_FROM if choice == "on" or (choice == "auto" and on_cuda_gpu()) else None


def copy_ready(row: Row) -> bool:
    """Whether the row's proposer holds a lookup copy of the text worth a round now (asked
    while `auto` has parked the drafter; see `Proposer`): one it would verify, and, under a
    cap policy, one whose expected tokens (the proposer's `copy_rate` of its drafts) pay for
    the round and for breaking the plain steps (`AutoCap.copy_pays`)."""
    ready = getattr(row.proposer, "copy_ready", None)
    if ready is None or not row.long_copies:
        return False
    drafts = ready(row.history, max(0, row.stopper.remaining - 1))
    if not drafts or row.policy is None:
        return bool(drafts)
    rate = getattr(row.proposer, "copy_rate", None)
    return rate is None or row.policy.copy_pays(int(drafts), 1.0 + rate * drafts)


def plain_run(target: Target, row: Row, cache: list, n: int) -> Iterator[Step]:
    """Up to n plain steps inside a speculative generation, pipelined as `loop._plain_steps` (the
    next forward is queued before the current token is read). Each forwarded token's taps go
    to the proposer and the record, and the cache ends holding the history but its anchor,
    as after a round, so drafting resumes where these steps stop. They stop early where the
    proposer finds a lookup copy (`copy_ready`); returns the steps taken.

    With `row.retap`, the steps past that many forward no taps: the proposer observes them
    without rows, and where the run ends with the generation going on, their tokens wait in
    `row.untapped` for the next round, which first recomputes their rows in one forward
    (`retap`; `RETAP_FROM` says why). Timed with that round, the recompute is a cost of what
    ended the run (a probe, a lookup copy), which the policy weighs."""
    tap_ids = tuple(row.proposer.tap_layer_ids)
    tapped = n  # forwards from this one on take no taps
    if (
        tap_ids
        and row.retap is not None
        and row.record is None  # a prefix-cache record holds every step's rows as it goes
        and target.trims  # the untapped positions are dropped and forwarded again
        and hasattr(row.proposer, "add_rows")
    ):
        tapped = row.retap

    def step(y: mx.array, j: int) -> tuple[mx.array, mx.array | None]:
        taps_now = tap_ids if j < tapped else ()
        with mx.stream(target.stream):
            logits, taps = target.forward(y.reshape(1).astype(mx.uint32), cache, taps_now)
            nxt = choose(logits[-1], row.sampling, row.keys)
        mx.async_eval(nxt)
        return nxt, taps

    shadow = Shadow(row) if getattr(row.proposer, "drafts_on_host", False) else None
    cur, cur_taps = step(mx.array([row.anchor], dtype=mx.uint32), 0)
    timed: list[float] = []  # each step's seconds, told to the policy when the run ends
    first: float | None = None  # the first step's, told apart (`AutoCap.observe_restart`)
    try:
        for i in range(n):
            t = time.perf_counter()
            last = i == n - 1
            if i and row.wants_cancel():
                row.stopper.finish_reason = "cancelled"
                yield Step("plain", [], 0, [], 0.0, "cancelled")
                return i
            if not last:
                following = step(cur, i + 1)  # queued before cur is read
            token = cur.item()
            closed = False
            if row.budget is not None:  # where it fires, its closing takes this token's place
                (token,), closed = row.budget.close([token])
            row.proposer.observe(0, cur_taps)
            if row.record is not None:
                row.record.grow(1, cur_taps)
            if shadow is not None:
                shadow.check(token)
            row.history.append(token)
            row.anchor = token
            kept = row.stopper.feed([token])
            seconds = time.perf_counter() - t
            if row.policy is not None and not closed:
                timed.append(seconds)
                if i == 0:  # waited for a forward launched just now, not a step ago
                    first = seconds
            stop = row.done or closed or (not last and copy_ready(row))
            if stop and not last:
                target.rollback(cache, 1)  # the forward queued past where these steps end
            done = Step("plain", [], 0, kept, seconds, row.stopper.finish_reason, closed=closed)
            yield from handed(done, row.policy)
            if stop or last:
                untapped = i + 1 - tapped  # the last forwards, of the tokens before the anchor
                if untapped > 0 and not row.done:  # recomputed by the caller's next round
                    row.untapped = row.history[-untapped - 1 : -1]
                return i + 1
            cur, cur_taps = following
        return n
    finally:
        if timed:
            row.policy.observe_plain(timed)
        if first is not None:
            row.policy.observe_restart(first)


def retap(target: Target, row: Row, cache: list) -> None:
    """Give the proposer the rows of a parked run's untapped steps (`row.untapped`): their
    positions are dropped from the cache and their tokens forwarded again with taps, as a
    prompt is. The cache then holds what it held, its values recomputed in one forward (as a
    verify's rows are)."""
    tokens, row.untapped = row.untapped, []
    tap_ids = tuple(row.proposer.tap_layer_ids)
    target.rollback(cache, len(tokens))
    with mx.stream(target.stream):
        if len(tokens) <= PREFILL_CHUNK:  # one forward, nothing waited for
            _, taps = target.forward(mx.array(tokens, dtype=mx.uint32), cache, tap_ids)
        else:
            _, taps = target.prefill(tokens, cache, tap_ids)
        # Scheduled now, on its own, cache writes and all: left lazy, the layers past the
        # deepest tap were computed at the head of the next round's verify, whose kernels then
        # fell into other CUDA graphs than a steady round's, made anew (the round after a
        # parked run launched in 7-14 ms against 2.7 on an H100; `BlockProposer._forward`
        # schedules its catch-up's join apart for the same reason)
        mx.async_eval(taps, [c.state for c in cache])
    row.proposer.add_rows(taps)


class Shadow:
    """Drafts a host proposer would make during parked plain steps, checked as the tokens
    arrive and never verified: what the auto policy learns acceptance from while parked."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.draft: list[int] = []
        self.matched = 0

    def check(self, token: int) -> None:
        """`token` follows the history: score the pending draft, or draft anew from here."""
        if not self.draft:  # draft what would follow the history's last token
            ctx = DraftContext(self.row.history, self.row.policy.ceiling, self.row.sampling)
            host = getattr(self.row.proposer, "propose_host", None)
            drafts = host(ctx) if host is not None else self.row.proposer.propose(ctx).host
            self.draft, self.matched = list(drafts or []), 0
            if not self.draft:
                return
        if token == self.draft[self.matched]:
            self.matched += 1
            if self.matched < len(self.draft):
                return
        self.row.policy.observe_unverified(len(self.draft), self.matched)
        self.draft = []
