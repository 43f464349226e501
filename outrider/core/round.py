"""One speculative round of any number of rows: each row drafts, one target forward verifies
every row's drafts, each row accepts its own and rolls back what it rejected.

A round is launched (drafted, its forward queued, the device started) and settled (its one
host-device sync, acceptance, the proposer and the record fed) in two steps, so `decode`
(core/loop.py) can queue the next round between them; `verify_round` does both at once, as a
batch (core/batch.py) does. `Row` is the state a round advances, `Step` what it yields.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .acceptance import accept_greedy, accept_sampled
from .batch_schedule import BatchScheduler
from .logits import TokenLogprob, logprob_arrays, process_rows, read_logprobs, token_logprob
from .prefix_cache import Record
from .proposer import DraftContext, Proposal, Proposer, propose_all
from .sampling import KeyStream, SamplingParams, greedy, probabilities, sample
from .schedule import AutoCap, learn_acceptance
from .stopping import Stopper
from .target import Target
from .think_budget import ThinkBudget


@dataclass
class Step:
    """One unit of progress: the prefill's first token, a speculative round, or a plain step."""

    source: str  # "prefill", "draft" or "plain"
    drafted: list[int]
    accepted: int
    committed: list[int]  # tokens emitted by this step (after stop handling)
    seconds: float
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # per kept token, when requested
    cut: int = 0  # drafts the batch scheduler left unverified (core/schedule.py)
    ahead: bool = False  # a pipelined round: queued before the round before it was read
    dropped: int = 0  # positions of the round queued behind this one, dropped unread
    closed: bool = False  # a reasoning budget cut this step and began its closing
    # where a single row's round spent its seconds (core/loop.py `decode`): recomputing the
    # rows of a parked run's untapped steps (core/parked.py `retap`; 0 after a round),
    # launching its own round, queueing the next, waiting for its result, and the host's work
    # after it; a batched round's (`verify_round`, one dict for all its rows): launch, wait,
    # after
    phases: dict[str, float] | None = None


def choose(logits: mx.array, sampling: SamplingParams, keys: KeyStream | None) -> mx.array:
    if sampling.greedy:
        return greedy(logits)
    return sample(probabilities(logits, sampling), keys.next())


@dataclass
class Row:
    """One generation between rounds: what the round needs of it, and what it has made.

    A batch holds several; `decode` holds one. `history` is the prompt plus every committed
    token and ends with `anchor`, the one token the target has not yet seen.
    """

    proposer: Proposer
    stopper: Stopper
    sampling: SamplingParams
    keys: KeyStream | None
    history: list[int]
    anchor: int
    cap_limit: int
    procs: list = field(default_factory=list)
    window: int = 0
    logprobs: int | None = None
    record: Record | None = None
    cancelled: Callable[[], bool] | None = None
    policy: AutoCap | None = None  # --max-draft auto: the cap of each round
    long_copies: bool = True  # a lookup copy may run past the cap (false: the cap was given)
    accept: list[float] = field(default_factory=list)  # per position, for the batch scheduler
    budget: ThinkBudget | None = None  # a reasoning budget (core/think_budget.py)
    retap: int | None = None  # parked steps past this many tap nothing (core/parked.py)
    untapped: list[int] = field(default_factory=list)  # their tokens, rows not yet recomputed

    @property
    def done(self) -> bool:
        return self.stopper.finish_reason is not None

    @property
    def closing(self) -> bool:
        """Whether a reasoning budget has closing tokens for this row's next round."""
        return self.budget is not None and bool(self.budget.pending)

    def wants_cancel(self) -> bool:
        return self.cancelled is not None and self.cancelled()


def _row_inputs(
    anchor: int | mx.array, proposal: Proposal, drafts: mx.array, width: int
) -> mx.array:
    """A row's verify input: its anchor, its drafts, padding to the round's width. The anchor
    of a drafter's round queued ahead is an array not yet computed (core/loop.py)."""
    if isinstance(anchor, mx.array):
        first = anchor.reshape(1).astype(mx.uint32)
    elif proposal.host is not None:  # host-made drafts: one copy up, no concatenation
        ids = [anchor, *proposal.host]
        return mx.array(ids + [0] * (width - len(ids)), dtype=mx.uint32)
    else:
        first = mx.array([anchor], dtype=mx.uint32)
    parts = [first, drafts]
    if width > proposal.k + 1:  # a shorter row of a batch: padding the round rolls back
        parts.append(mx.zeros((width - proposal.k - 1,), dtype=mx.uint32))
    return mx.concatenate(parts)


@dataclass
class Launched:
    """A round whose forward is queued on the device but not yet read back: what `settle`
    needs to accept each row's drafts. `decode` may queue the next round behind it."""

    rows: list[Row]
    proposals: list[Proposal]
    asked: list[int]  # each row's cap this round
    cuts: list[int]  # drafts the batch scheduler left out, per row
    width: int  # the rows' common width: 1 + the most drafts of any row
    # (target tokens, sampled accept count, logprobs, the logits where a reasoning budget may
    # need another token's log-probability), lazy
    per_row: list[tuple]
    taps: mx.array | None
    batched: bool
    pending: list[mx.array]  # everything `settle` reads back, queued by `launch_round`
    anchors: list  # the token each row's round starts from (an array: not read back yet)
    inputs: mx.array  # [rows, width]: each row's verify input (anchor, drafts, padding)
    # [rows, width]: the target's greedy token at every position of every row, one argmax for
    # the round, where some row draws greedily with nothing to process its logits
    table: mx.array | None = None
    tabled: list[bool] = field(default_factory=list)  # the rows whose tokens `table` holds
    waited: float = 0.0  # seconds `settle` waited for the device (its one sync)


def launch_round(
    target: Target,
    rows: list[Row],
    cache: list,
    caps: list[int] | None = None,
    scheduler: BatchScheduler | None = None,
    given: list[Proposal] | None = None,
    anchors: list | None = None,
) -> Launched:
    """Draft (unless `given` proposals, with the caps they were drafted at in `caps`), queue the
    verify forward of every row and what each row's acceptance needs, and start the device on
    it without waiting. `anchors` stand in for the rows' own: a round drafted ahead runs on
    the token the round before it is expected to end with (`_launch_ahead`)."""
    batched = target.is_batched(cache)
    if not batched and len(rows) != 1:
        raise ValueError("a one-row cache verifies one row")
    tap_ids = tuple(rows[0].proposer.tap_layer_ids)
    anchors = anchors or [row.anchor for row in rows]
    drafts, pending, per_row = [], [], []
    with mx.stream(target.stream):
        if given is None:
            ctxs, asked = [], []
            for row in rows:
                cap = max(0, min(row.cap_limit, row.stopper.remaining - 1))
                if caps is not None:
                    cap = caps[len(ctxs)]
                if row.closing:
                    cap = 0  # the closing drafts this round; the drafter only takes in context
                key = row.keys.next() if row.keys is not None and cap > 0 else None
                # drafts that could still count (a given cap bounds even a lookup copy)
                room = max(0, row.stopper.remaining - 1) if row.long_copies else cap
                extras = {"room": room}
                if scheduler is not None and len(rows) > 1:
                    extras["confidence"] = True  # a drafter's own acceptance estimates, if any
                ctxs.append(DraftContext(row.history, cap, row.sampling, key, extras))
                asked.append(cap)
            # rows sharing a drafter draft in one call (propose_all), every other row alone
            proposals = propose_all([row.proposer for row in rows], ctxs)
            proposals = [_forced(row) if row.closing else p for row, p in zip(rows, proposals)]
            scheduled = _schedule(scheduler, rows, proposals, asked)
            cuts = [p.k - s.k for p, s in zip(proposals, scheduled)]
            proposals = scheduled
        else:
            proposals, asked, cuts = given, list(caps or [p.k for p in given]), [0] * len(given)
        for proposal in proposals:
            tokens = proposal.tokens
            drafts.append(tokens if tokens.dtype == mx.uint32 else tokens.astype(mx.uint32))
        if given is None and any(p.k for p in proposals):
            # the device starts on the drafter's work while the host builds the verify
            mx.async_eval(*[d for d, p in zip(drafts, proposals) if p.k])
        width = 1 + max(p.k for p in proposals)
        inputs = [_row_inputs(a, p, d, width) for a, p, d in zip(anchors, proposals, drafts)]
        if batched:
            stacked = mx.stack(inputs)
            all_logits, all_taps = target.forward_rows(stacked, cache, tap_ids)
        else:
            stacked = inputs[0][None]
            logits, taps = target.forward(inputs[0], cache, tap_ids)
            all_logits, all_taps = logits[None], None if taps is None else taps[None]
        # rows drawing greedily from their raw logits take their tokens from one argmax of
        # the whole round, not one each: launches cost on a GPU, and a batch has many rows
        tabled = [
            row.sampling.greedy and not row.procs and not p.forced
            for row, p in zip(rows, proposals)
        ]
        table = greedy(all_logits) if any(tabled) else None
        pending.append(stacked)  # the drafts `settle` reads, every row's at once
        if table is not None:
            pending.append(table)
        for i, (row, proposal, row_drafts) in enumerate(zip(rows, proposals, drafts)):
            logits = all_logits[i, : proposal.k + 1]
            if row.procs:
                shown = proposal.host if proposal.host is not None else row_drafts
                logits = process_rows(row.procs, row.history, row.window, logits, shown)
            accepted = None
            if tabled[i]:
                tokens = table[i, : proposal.k + 1]
            elif proposal.forced:  # every draft kept, the target's token after them drawn
                after = choose(logits[proposal.k], row.sampling, row.keys).reshape(1)
                tokens = mx.concatenate([row_drafts, after.astype(row_drafts.dtype)])
                accepted = mx.array(proposal.k)
            elif row.sampling.greedy:
                tokens = greedy(logits)
            elif proposal.k == 0:  # a plain step, drawn as plain decoding draws it
                tokens = choose(logits[0], row.sampling, row.keys).reshape(1)
                accepted = mx.array(0)
            else:
                accepted, tokens = accept_sampled(
                    logits, row_drafts, proposal.probs, row.sampling, row.keys.next()
                )
            lp = None if row.logprobs is None else logprob_arrays(logits, tokens, row.logprobs)
            pending += [x for x in (None if tabled[i] else tokens, accepted, lp) if x is not None]
            budgeted = lp is not None and row.budget is not None and not row.budget.fired
            per_row.append((tokens, accepted, lp, logits if budgeted else None))
    mx.async_eval(*pending)
    return Launched(
        rows, proposals, asked, cuts, width, per_row, all_taps, batched, pending,
        anchors, stacked, table, tabled,
    )  # fmt: skip


def _forced(row: Row) -> Proposal:
    """The rest of a reasoning budget's closing, as drafts the round keeps unverified."""
    ids, row.budget.pending = row.budget.pending, []
    return Proposal.from_list(ids, forced=True)


def settle(launched: Launched) -> tuple[list[Step], list[int]]:
    """Read a launched round back (its one sync) and accept each row's drafts: commit, feed
    the proposer, the record and the stopper. Returns the steps and how many positions each
    row's cache must drop (what it rejected); the caller rolls back."""
    rows, proposals = launched.rows, launched.proposals
    t = time.perf_counter()
    mx.eval(*launched.pending)  # the round's one sync
    launched.waited = time.perf_counter() - t
    inputs = launched.inputs.tolist()
    table = None if launched.table is None else launched.table.tolist()
    steps, rejected = [], []
    for i, (row, proposal, (tokens, accepted, lp, logits)) in enumerate(
        zip(rows, proposals, launched.per_row)
    ):
        k = proposal.k
        drafted = proposal.host if proposal.host is not None else inputs[i][1 : k + 1]
        target_tokens = table[i][: k + 1] if launched.tabled[i] else tokens.tolist()
        if row.sampling.greedy and not proposal.forced:
            a = accept_greedy(target_tokens, drafted)
        else:
            a = accepted.item()
        committed = target_tokens[: a + 1]
        closed = False
        if row.budget is not None:  # where it fires, the closing replaces the rest
            committed, closed = row.budget.close(committed)
            a = len(committed) - 1
        rejected.append(launched.width - 1 - a)
        row_taps = None if launched.taps is None else launched.taps[i, : a + 1]
        row.proposer.observe(a, row_taps)
        row.history.extend(committed)
        if row.record is not None:
            row.record.grow(a + 1, row_taps)
        row.anchor = committed[-1]
        kept = row.stopper.feed(committed)
        step_lp = None if lp is None else read_logprobs(lp, kept)
        if closed and step_lp is not None and len(step_lp) > a:  # the closing's first token
            step_lp[a] = token_logprob(logits[a], committed[a], row.logprobs)
        steps.append(
            Step(
                "draft", drafted, a, kept, 0.0, row.stopper.finish_reason, step_lp,
                launched.cuts[i], closed=closed,
            )
        )  # fmt: skip
    return steps, rejected


def teach(launched: Launched, steps: list[Step], seconds: float, scheduler: bool) -> None:
    """Time the round's steps and tell each row's cap policy (and, under a batch scheduler,
    its running acceptance) what the round did."""
    for row, proposal, step, cap in zip(launched.rows, launched.proposals, steps, launched.asked):
        step.seconds = seconds
        if scheduler and 0 < proposal.k <= cap and not (proposal.copied or proposal.forced):
            learn_acceptance(row.accept, proposal.k, step.accepted)
        # a lookup copy says nothing of the drafter; nor does a round a reasoning budget cut
        # or forced
        policy = row.policy
        if policy is None:
            continue
        if proposal.copied and not step.closed:
            policy.observe_copy(proposal.k, seconds)  # what a copy's round costs here
        if proposal.copied or proposal.forced or step.closed:
            pass
        elif step.cut:  # the scheduler chose this width, not the policy: acceptance only
            policy.observe_unverified(proposal.k, step.accepted)
        # a round that was asked for drafts but got none (a lookup with no match) is neither
        # a drafting round nor a pipelined plain step: it teaches the policy nothing
        elif proposal.k > 0 or cap == 0:
            policy.observe(proposal.k, step.accepted, seconds)
        policy.untold()  # a probe chosen for a round `observe` was not told of did not run


def verify_round(
    target: Target,
    rows: list[Row],
    cache: list,
    caps: list[int] | None = None,
    scheduler: BatchScheduler | None = None,
) -> list[Step]:
    """One speculative round for every row: each proposes, one target forward verifies all
    drafts of all rows, each accepts its own, and each row's cache rolls back by what it
    rejected. `cache` is one row's cache, or a batched cache whose rows are `rows`.

    Rows draft different numbers of tokens; shorter rows are padded to the widest, and the
    padding is rejected like any draft. On the greedy path a round costs one host-device sync
    whatever the batch width. `caps` (one per row) overrides the rows' own caps this round.
    `scheduler` (a batch's) cuts the proposals of the drafting rows to what DSpark's
    prefix scheduler admits before the forward (`_schedule`).
    """
    t = time.perf_counter()
    launched = launch_round(target, rows, cache, caps, scheduler)
    t_launched = time.perf_counter()
    steps, rejected = settle(launched)
    if launched.batched:
        target.rollback_rows(cache, rejected)
    else:
        target.rollback(cache, rejected[0])
    seconds = time.perf_counter() - t
    phases = {  # as a single row's (core/loop.py), one dict for every row of the round
        "launch": t_launched - t,
        "wait": launched.waited,
        "after": seconds - (t_launched - t) - launched.waited,
    }
    for step in steps:
        step.phases = phases
    teach(launched, steps, seconds, scheduler is not None)
    return steps


def _schedule(
    scheduler: BatchScheduler | None, rows: list[Row], proposals: list[Proposal], asked: list[int]
) -> list[Proposal]:
    """Each row's proposal cut to the drafts DSpark's prefix scheduler admits, when any row
    drafts. Survivals come from the drafter's confidences (read back in one wait) or the
    rows' running acceptance, never from a draft they would admit: sampling stays exact.

    Sampled rows with one seed draw their drafts from the same keys, so one row's drafts say
    something about the other's: their confidences (which read their drafts) would let one
    row's cut depend on the other's draft it admits. They use running acceptance instead."""
    if scheduler is None or not any(p.k > 0 for p in proposals):
        return proposals
    own = _own_keys(rows)
    estimates = [p.confidence for p, o in zip(proposals, own) if o and p.confidence is not None]
    if estimates:
        mx.eval(*estimates)
    confidence = [
        p.confidence.tolist() if o and p.confidence is not None else None
        for p, o in zip(proposals, own)
    ]
    accept = [row.accept for row in rows]
    context = max(len(row.history) for row in rows)
    copied = [p.copied for p in proposals]
    keep = scheduler.keep([p.k for p in proposals], asked, confidence, accept, context, copied)
    return [p if p.forced else p.first(n) for p, n in zip(proposals, keep)]


def _own_keys(rows: list[Row]) -> list[bool]:
    """Whether each row's random draws are its own: greedy, unseeded, or a seed no other
    sampled row of the round has."""
    seeds = Counter(r.sampling.seed for r in rows if not r.sampling.greedy)
    return [
        r.sampling.greedy or r.sampling.seed is None or seeds[r.sampling.seed] == 1 for r in rows
    ]
