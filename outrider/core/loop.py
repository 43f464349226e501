"""The one decode loop: prefill, propose, verify in one forward, accept, roll back, observe.

Every mode runs through `decode`; a mode is only a proposer. On the greedy path each round costs
one host-device sync (the accept count and committed tokens come back together). A proposer that
never drafts (baseline) gets the pipelined plain step mlx-lm uses, so baseline costs no more
than mlx-lm's own generation.

A round itself (draft, verify, accept, roll back, for any number of rows) is `core/round.py`'s,
and the plain steps `--max-draft auto` takes while it parks a drafter are `core/parked.py`'s;
this module prefills, decides between rounds and plain steps, and pipelines them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from . import parked
from .ahead_gate import AheadGate
from .errors import Cancelled
from .logits import Penalties, logprob_arrays, process_rows, read_logprobs, token_logprob
from .prefix_cache import PrefixHit, Record
from .proposer import DraftContext, Proposal, Proposer
from .round import Launched, Row, Step, choose, launch_round, settle, teach
from .sampling import KeyStream, SamplingParams
from .schedule import AutoCap, handed
from .stopping import Stopper
from .target import Target
from .think_budget import ThinkBudget


@dataclass
class Started:
    """A prefilled generation: its cache and its first token, not yet read back (so plain
    decoding can queue the next forward behind it)."""

    cache: list
    first: mx.array
    first_logprobs: tuple | None
    taps: mx.array | None
    t0: float
    logits: mx.array | None = None  # the processed row the first token was chosen from


def prefill(
    target: Target,
    proposer: Proposer,
    prompt: list[int],
    sampling: SamplingParams,
    keys: KeyStream | None,
    procs: list,
    window: int,
    logprobs: int | None,
    cancelled: Callable[[], bool] | None = None,
    prefill_progress: Callable[[int, int], None] | None = None,
    start: PrefixHit | None = None,
    record: Record | None = None,
) -> Started:
    """Forward the prompt (all of it, or what a prefix hit leaves) into a one-row cache and
    choose the first token. Raises `Cancelled` when `cancelled` says so between chunks.

    A hit holding the whole prompt with its last position's logits (an exact repeat) forwards
    nothing: the first token is chosen from those logits, as the fresh prefill would."""
    if not prompt:
        raise ValueError("the prompt is empty")
    tap_ids = tuple(proposer.tap_layer_ids)
    if tap_ids:
        target.install_taps(tap_ids)
    done = 0 if start is None else start.length
    whole = start is not None and start.logits is not None and done == len(prompt)
    if not (0 <= done < len(prompt) or whole):
        raise ValueError(f"a prefix hit of {done} tokens leaves nothing of the prompt to forward")
    cache = target.make_cache() if start is None else start.cache
    progress = prefill_progress
    if done and prefill_progress is not None:
        progress = lambda n, total: prefill_progress(done + n, done + total)  # noqa: E731
    stops, at_stop = (), None
    if record is not None:
        stops, at_stop = record.prefill_stops(target, cache, done, len(prompt))
    t0 = time.perf_counter()
    pending = []  # prefix-cache snapshots to evaluate before anything updates the cache
    with mx.stream(target.stream):
        if whole:
            raw, taps = start.logits, start.taps
        else:
            raw, taps = target.prefill(
                prompt[done:], cache, tap_ids, cancelled, progress, stops, at_stop, done > 0
            )
            if done and taps is not None:
                taps = mx.concatenate([start.taps, taps], axis=0)
        if record is not None:
            pending = record.prompt_end(target, cache, len(prompt), raw, whole)
        last_logits = process_rows(procs, prompt, window, raw[None])[0]
        first = choose(last_logits, sampling, keys)
        lp = None if logprobs is None else logprob_arrays(last_logits[None], first, logprobs)
    if pending:
        mx.eval(first, lp, pending)  # with the first token: no sync of its own
    return Started(cache, first, lp, taps, t0, last_logits)


def begin_row(
    started: Started,
    proposer: Proposer,
    prompt: list[int],
    stopper: Stopper,
    sampling: SamplingParams,
    keys: KeyStream | None,
    cap_limit: int,
    procs: list,
    window: int,
    logprobs: int | None,
    record: Record | None = None,
    cancelled: Callable[[], bool] | None = None,
    budget: ThinkBudget | None = None,
) -> tuple[Row, Step]:
    """Read the first token back, start the proposer on the prompt, and make the row that
    speculative rounds advance; the step reports the first token. A reasoning `budget` that
    fires at once (no thinking allowed) puts its closing's first token in the first's place."""
    proposer.start(prompt, started.taps)
    mx.eval(started.first, started.first_logprobs)
    anchor = started.first.item()
    closed = False
    if budget is not None:  # a budget of 0 inside the prompt's block fires at once
        (anchor,), closed = budget.close([anchor])
    history = list(prompt) + [anchor]
    if record is not None:  # the cache holds history but its last token (the anchor)
        record.track(started.cache, history, len(prompt), started.taps)
    row = Row(
        proposer, stopper, sampling, keys, history, anchor, cap_limit, procs, window, logprobs,
        record, cancelled, budget=budget,
    )  # fmt: skip
    kept = stopper.feed([anchor])
    lp = started.first_logprobs
    step_lp = None if lp is None else read_logprobs(lp, kept)
    if closed and step_lp:  # the closing's first token, not the one the target chose
        step_lp[0] = token_logprob(started.logits, anchor, logprobs)
    seconds = time.perf_counter() - started.t0
    return row, Step("prefill", [], 0, kept, seconds, stopper.finish_reason, step_lp, closed=closed)


def decode(
    target: Target,
    proposer: Proposer,
    prompt: list[int],
    stopper: Stopper,
    sampling: SamplingParams = SamplingParams(),
    max_draft: int | str | None = None,
    penalties: Penalties | None = None,
    logprobs: int | None = None,
    cancelled: Callable[[], bool] | None = None,
    prefill_progress: Callable[[int, int], None] | None = None,
    start: PrefixHit | None = None,
    record: Record | None = None,
    policy: AutoCap | None = None,
    long_copies: bool = True,
    pipelined: bool = True,
    gate: AheadGate | None = None,
    budget: ThinkBudget | None = None,
    retap: int | None = None,
) -> Iterator[Step]:
    """Generate from `prompt` until `stopper` says stop, yielding each step as it lands.

    `penalties` apply mlx-lm's presence/frequency processors to every verified row against its
    own history; `logprobs` (the number of top alternatives, 0 for none) attaches each kept
    token's log-probability to its step. `cancelled` is asked between prefill chunks and
    before each round; a yes ends generation with finish reason "cancelled".
    `prefill_progress(done, total)` hears after each prefill chunk (long prompts take a while).

    `start` (a prefix-cache hit) hands over a cache already holding the first `start.length`
    prompt tokens and their taps: only the rest is prefilled, and the proposer still starts on
    the whole prompt. `record`, when given, is kept equal to what the cache holds at every
    yield (tokens, cache, taps, prefill checkpoints) so the prefix cache can store it after.
    `max_draft="auto"` picks each round's cap from measured costs and acceptance
    (`core/schedule.py`), drafting nothing while plain decoding is faster; `policy` is the
    one to use (a pipeline keeps one across generations), else a fresh one.

    `pipelined` rounds (greedy, with a proposer that can guess ahead or a drafter that can
    draft ahead, on a target whose rollback is a trim; `drafts_ahead`): while a round's
    forward runs, the next one is queued on the assumption that it keeps every draft, and
    kept when it did, so the host prepares a round while the device works instead of after
    the sync. A round queued on a wrong guess
    is rolled back unread: the output is what unpipelined rounds give. Whether to queue is
    `gate`'s call (a pipeline keeps one across generations: what it timed carries over).

    `budget` (core/think_budget.py) closes the model's thinking after that many tokens.

    `retap`: a parked run's steps past this many forward no taps, their rows recomputed where
    the run ends (`parked.plain_run`; None: every step taps, as on the CPU).

    This is a batch of one row: the rounds are `verify_round`'s, as for a `Batch` of many.
    """
    keys = None if sampling.greedy else KeyStream(sampling.seed)
    if max_draft != "auto" or not proposer.max_draft:
        policy = None
    elif policy is None:
        policy = AutoCap(proposer.max_draft)
    if max_draft == "auto" or max_draft is None:
        cap_limit = proposer.max_draft
    else:
        cap_limit = min(max_draft, proposer.max_draft)
    if policy is not None:
        policy.context = len(prompt)
        policy.new_generation()
        if policy.hopeless(cap_limit):  # plain decoding outright: no taps, no drafter upkeep
            cap_limit = 0
    procs = penalties.processors() if penalties is not None and penalties.active else []
    window = penalties.window if procs else 0
    try:
        started = prefill(
            target, proposer, prompt, sampling, keys, procs, window, logprobs, cancelled,
            prefill_progress, start, record,
        )  # fmt: skip
    except Cancelled:
        yield Step("prefill", [], 0, [], 0.0, "cancelled")
        return
    if cap_limit <= 0 and not procs and logprobs is None and budget is None:  # no drafts
        fed = None  # what the cache holds, kept only for the prefix cache
        if record is not None:
            fed = list(prompt)
            record.track(started.cache, fed)
        yield from _plain_steps(target, started, stopper, sampling, keys, cancelled, fed)
        return
    row, step = begin_row(
        started, proposer, prompt, stopper, sampling, keys, cap_limit, procs, window, logprobs,
        record, cancelled, budget,
    )  # fmt: skip
    row.policy, row.long_copies, row.retap = policy, long_copies, retap
    yield step
    rows, cache = [row], started.cache
    pipelinable = not procs and logprobs is None
    kept, gate = gate, None
    if pipelined and pipelinable and sampling.greedy and drafts_ahead(target, proposer):
        gate = AheadGate.for_this_device(kept)
    inflight: Launched | None = None  # the next round, queued before this one is read
    dropped = False  # the round before queued one for nothing (it ran on the device anyway)
    after_plain = True  # no round since plain steps: a drafter catches up, the round is not timed
    try:
        while not row.done:
            t = time.perf_counter()
            if row.wants_cancel():
                yield Step("draft", [], 0, [], 0.0, "cancelled")
                return
            t_recomputed = t
            if row.untapped:  # what ended the parked run pays for them: timed with it
                parked.retap(target, row, cache)
                t_recomputed = time.perf_counter()
            was_ahead = inflight is not None
            if was_ahead:
                launched, inflight = inflight, None
            else:
                caps = None
                if cap_limit <= 0 and pipelinable and not row.closing and target.trims:
                    # nothing is drafted (a reasoning budget routed plain decoding here):
                    # pipelined plain steps until the budget fires or the answer ends (where
                    # the cache can drop the step queued past the cut; elsewhere one-token
                    # rounds, which a cut never rolls back)
                    yield from parked.plain_run(target, row, cache, row.stopper.remaining)
                    after_plain, dropped = True, False
                    continue
                if policy is not None and not row.closing:
                    policy.context = len(row.history)
                    k = policy.choose(max(0, min(cap_limit, stopper.remaining - 1)))
                    if k == 0 and pipelinable:
                        if not parked.copy_ready(row):
                            # parked: pipelined plain steps until the next probe, or until the
                            # text turns out to copy itself (then a round verifies the copy,
                            # drafter or not)
                            n = policy.plain_run(stopper.remaining)
                            taken = yield from parked.plain_run(target, row, cache, n)
                            policy.plain_unused(n - taken)
                            after_plain, dropped = True, False
                            continue
                        k = 1  # the lookup copy drafts this round (strategies/lookup_assist.py)
                    elif k == 0:
                        policy.plain_run(1)
                    caps = [k]
                t_launch = t_round = time.perf_counter()
                launched = launch_round(target, rows, cache, caps)
                if gate is not None:
                    gate.timed_launch(time.perf_counter() - t_launch)
            t_ahead = time.perf_counter()
            if gate is not None and gate.wanted():
                inflight = _launch_ahead(target, row, cache, launched)
                if inflight is not None:
                    gate.timed_launch(time.perf_counter() - t_ahead)
            t_wait = time.perf_counter()
            (step,), (rejected,) = settle(launched)
            t_read = time.perf_counter()
            step.ahead = was_ahead
            held = inflight is not None and _ahead_holds(row, step, launched, inflight)
            if gate is not None:
                if not was_ahead and inflight is None:  # a round alone: launch to result
                    gate.timed_round(time.perf_counter() - t_round)
                gate.learn(held if inflight is not None else _would_hold(row, step, launched))
            queued = inflight is not None
            if inflight is not None and not held:
                step.dropped = inflight.width
                rejected += inflight.width  # it ran on tokens that were not committed
                inflight = None
            target.rollback(cache, rejected)
            seconds = time.perf_counter() - t
            step.phases = {
                "recompute": t_recomputed - t, "launch": t_ahead - t_recomputed,
                "ahead": t_wait - t_ahead, "wait": t_read - t_wait, "after": t + seconds - t_read,
            }  # fmt: skip
            teach(launched, [step], seconds, False)
            if gate is not None:
                began = "held" if was_ahead else "dropped" if dropped else "alone"
                # steady rounds only: queueing on after a held or dropped one, not alone
                if not after_plain and queued == (began != "alone"):
                    gate.timed(began, seconds)
            dropped, after_plain = queued and not held, False
            yield from handed(step, policy)
    finally:
        if inflight is not None:  # stopped with a round in flight: the cache drops it
            target.rollback(cache, inflight.width)


def _would_hold(row: Row, step: Step, current: Launched) -> bool | None:
    """Whether a round queued behind `current` would have held, had one been queued: the
    proposer's guess of the token after its drafts is what the round committed (None: no
    guess to check)."""
    proposal = current.proposals[0]
    if row.done or step.closed or proposal.forced:
        return None
    if proposal.host is None:  # a drafter's block: it holds when every draft is kept
        return step.accepted == proposal.k if _drafts_unread(row.proposer) and proposal.k else None
    if step.accepted < proposal.k:
        return False
    guess = row.proposer.propose_ahead(DraftContext(row.history[:-1], 1, row.sampling)).host
    return None if not guess else guess[0] == row.anchor


def drafts_ahead(target: Target, proposer: Proposer) -> bool:
    """Whether rounds can be pipelined: the proposer guesses what follows a round before it
    is read (`propose_ahead`) or drafts the next block from it unread (`draft_ahead`,
    `core/proposer.py`), and the target's rollback is a trim, so a round queued on tokens
    that were then rejected can be dropped along with them."""
    guesses = callable(getattr(proposer, "propose_ahead", None))
    return (guesses or _drafts_unread(proposer)) and target.trims


def _drafts_unread(proposer: Proposer) -> bool:
    return callable(getattr(proposer, "draft_ahead", None))


def _launch_ahead(target: Target, row: Row, cache: list, current: Launched) -> Launched | None:
    """Queue the round that follows `current` if it keeps every draft and the target's token
    after them is the proposer's guess: that guess is its anchor, the proposer's further
    guesses its drafts. A model drafter's round is followed by the drafter's next drafts,
    made from `current`'s hidden states and the target's token after its drafts, neither
    read back yet (`draft_ahead`, core/proposer.py). None when nothing would follow (the
    answer ends, no guess, no drafts)."""
    proposal = current.proposals[0]
    room = row.stopper.remaining - (proposal.k + 1)  # tokens left after a full accept
    if room <= 0 or proposal.forced:
        return None
    drafter = proposal.host is None
    if drafter and not (_drafts_unread(row.proposer) and current.taps is not None and proposal.k):
        return None
    cap = max(0, min(row.cap_limit, room - 1))
    if row.policy is not None:
        row.policy.context = len(row.history) + proposal.k + 1
        cap = row.policy.choose(cap)
        if cap == 0:  # parked, or plain steps pay: the loop's own plain runs take over
            return None
    extras = {"room": room - 1 if row.long_copies else cap}
    if drafter:  # a drafter makes no drafts at cap 0 (`draft_ahead` says None)
        anchor = current.per_row[0][0][proposal.k]  # the target's token after the drafts
        ctx = DraftContext(row.history, cap, row.sampling, None, extras)
        drafts = row.proposer.draft_ahead(ctx, anchor, current.taps[0, : proposal.k + 1])
        if drafts is None or drafts.k == 0:
            return None
    else:
        assumed = row.history + proposal.host
        ctx = DraftContext(assumed, cap + 1, row.sampling, None, extras)
        guessed = row.proposer.propose_ahead(ctx)
        if not guessed.host:
            return None
        drafts = Proposal.from_list(guessed.host[1:], guessed.copied)
        anchor = guessed.host[0]
    return launch_round(target, [row], cache, [cap], given=[drafts], anchors=[anchor])


def _ahead_holds(row: Row, step: Step, current: Launched, ahead: Launched) -> bool:
    """Whether the round queued ahead ran on what `current` committed: every draft kept,
    the target's next token the guessed anchor (a drafter's round ahead starts from that
    token itself), and the answer not finished."""
    if row.done or step.closed or step.accepted != current.proposals[0].k:
        return False
    anchor = ahead.anchors[0]
    return isinstance(anchor, mx.array) or row.anchor == anchor


def _plain_steps(
    target: Target,
    started: Started,
    stopper: Stopper,
    sampling: SamplingParams,
    keys: KeyStream | None,
    cancelled: Callable[[], bool] | None = None,
    fed: list[int] | None = None,
) -> Iterator[Step]:
    """Pipelined plain decoding: the next forward is queued before the current token is read.

    The first token is read before anything else is queued, so time to first token is the
    prefill alone (a GPU may not hand back one token while a later forward is queued).
    `fed` (when given) gets every token forwarded into the cache, for the prefix cache."""
    cache, y, t0 = started.cache, started.first, started.t0

    def step(y: mx.array) -> mx.array:
        with mx.stream(target.stream):
            logits, _ = target.forward(y.reshape(1).astype(mx.uint32), cache)
            nxt = choose(logits[-1], sampling, keys)
        mx.async_eval(nxt)
        return nxt

    token = y.item()
    kept = stopper.feed([token])
    yield Step("prefill", [], 0, kept, time.perf_counter() - t0, stopper.finish_reason)
    if stopper.finish_reason is not None:
        return
    y = step(y)
    if fed is not None:
        fed.append(token)
    while True:
        t = time.perf_counter()
        if cancelled is not None and cancelled():
            yield Step("plain", [], 0, [], 0.0, "cancelled")
            return
        next_y = step(y)  # queued before y is read: the device never waits for the host
        token = y.item()
        if fed is not None:
            fed.append(token)
        kept = stopper.feed([token])
        yield Step("plain", [], 0, kept, time.perf_counter() - t, stopper.finish_reason)
        if stopper.finish_reason is not None:
            return
        y = next_y
