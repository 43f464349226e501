"""The one decode loop: prefill, propose, verify in one forward, accept, roll back, observe.

Every mode runs through `decode`; a mode is only a proposer. On the greedy path each round costs
one host-device sync (the accept count and committed tokens come back together). A proposer that
never drafts (baseline) gets the pipelined plain step mlx-lm uses, so baseline costs no more
than mlx-lm's own generation.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .acceptance import accept_greedy, accept_sampled
from .errors import Cancelled
from .logits import Penalties, TokenLogprob, logprob_arrays, process_rows, read_logprobs
from .prefix_cache import PrefixHit, Record
from .proposer import DraftContext, Proposal, Proposer, propose_all
from .sampling import KeyStream, SamplingParams, greedy, probabilities, sample
from .schedule import AheadGate, AutoCap, BatchScheduler, learn_acceptance
from .stopping import Stopper
from .target import Target


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


def _choose(logits: mx.array, sampling: SamplingParams, keys: KeyStream | None) -> mx.array:
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

    @property
    def done(self) -> bool:
        return self.stopper.finish_reason is not None

    def wants_cancel(self) -> bool:
        return self.cancelled is not None and self.cancelled()


@dataclass
class Started:
    """A prefilled generation: its cache and its first token, not yet read back (so plain
    decoding can queue the next forward behind it)."""

    cache: list
    first: mx.array
    first_logprobs: tuple | None
    taps: mx.array | None
    t0: float


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
        first = _choose(last_logits, sampling, keys)
        lp = None if logprobs is None else logprob_arrays(last_logits[None], first, logprobs)
    if pending:
        mx.eval(first, lp, pending)  # with the first token: no sync of its own
    return Started(cache, first, lp, taps, t0)


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
) -> tuple[Row, Step]:
    """Read the first token back, start the proposer on the prompt, and make the row that
    speculative rounds advance; the step reports the first token."""
    proposer.start(prompt, started.taps)
    mx.eval(started.first, started.first_logprobs)
    anchor = started.first.item()
    history = list(prompt) + [anchor]
    if record is not None:  # the cache holds history but its last token (the anchor)
        record.track(started.cache, history, len(prompt), started.taps)
    row = Row(
        proposer, stopper, sampling, keys, history, anchor, cap_limit, procs, window, logprobs,
        record, cancelled,
    )  # fmt: skip
    kept = stopper.feed([anchor])
    lp = started.first_logprobs
    step_lp = None if lp is None else read_logprobs(lp, kept)
    seconds = time.perf_counter() - started.t0
    return row, Step("prefill", [], 0, kept, seconds, stopper.finish_reason, step_lp)


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

    `pipelined` rounds (greedy, with a proposer that can guess ahead, on a target whose
    rollback is a trim; `drafts_ahead`): while a round's forward runs, the next one is queued
    on the assumption that it keeps every draft, and kept when it did, so the host prepares a
    round while the device works instead of after the sync. A round queued on a wrong guess
    is rolled back unread: the output is what unpipelined rounds give.

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
    if cap_limit <= 0 and not procs and logprobs is None:  # nothing will be drafted
        fed = None  # what the cache holds, kept only for the prefix cache
        if record is not None:
            fed = list(prompt)
            record.track(started.cache, fed)
        yield from _plain_steps(target, started, stopper, sampling, keys, cancelled, fed)
        return
    row, step = begin_row(
        started, proposer, prompt, stopper, sampling, keys, cap_limit, procs, window, logprobs,
        record, cancelled,
    )  # fmt: skip
    row.policy, row.long_copies = policy, long_copies
    yield step
    rows, cache = [row], started.cache
    pipelinable = not procs and logprobs is None
    gate = None
    if pipelined and pipelinable and sampling.greedy and drafts_ahead(target, proposer):
        gate = AheadGate.for_this_device()
    inflight: Launched | None = None  # the next round, queued before this one is read
    try:
        while not row.done:
            t = time.perf_counter()
            if row.wants_cancel():
                yield Step("draft", [], 0, [], 0.0, "cancelled")
                return
            was_ahead = inflight is not None
            if was_ahead:
                launched, inflight = inflight, None
            else:
                caps = None
                if policy is not None:
                    policy.context = len(row.history)
                    k = policy.choose(max(0, min(cap_limit, stopper.remaining - 1)))
                    if k == 0 and pipelinable:
                        if not _copy_ready(row):
                            # parked: pipelined plain steps until the next probe, or until the
                            # text turns out to copy itself (then a round verifies the copy,
                            # drafter or not)
                            n = policy.plain_run(stopper.remaining)
                            taken = yield from _plain_run(target, row, cache, n)
                            policy.plain_unused(n - taken)
                            continue
                        k = 1  # the lookup copy drafts this round (strategies/lookup_assist.py)
                    elif k == 0:
                        policy.plain_run(1)
                    caps = [k]
                t_launch = t_round = time.perf_counter()
                launched = launch_round(target, rows, cache, caps)
                if gate is not None:
                    gate.timed_launch(time.perf_counter() - t_launch)
            if gate is not None and gate.wanted():
                t_launch = time.perf_counter()
                inflight = _launch_ahead(target, row, cache, launched)
                if inflight is not None:
                    gate.timed_launch(time.perf_counter() - t_launch)
            (step,), (rejected,) = settle(launched)
            step.ahead = was_ahead
            held = inflight is not None and _ahead_holds(row, step, launched, inflight)
            if gate is not None:
                if not was_ahead and inflight is None:  # a round alone: launch to result
                    gate.timed_round(time.perf_counter() - t_round)
                gate.learn(held if inflight is not None else _would_hold(row, step, launched))
            if inflight is not None and not held:
                step.dropped = inflight.width
                rejected += inflight.width  # it ran on tokens that were not committed
                inflight = None
            target.rollback(cache, rejected)
            teach(launched, [step], time.perf_counter() - t, False)
            yield from _handed(step, policy)
    finally:
        if inflight is not None:  # stopped with a round in flight: the cache drops it
            target.rollback(cache, inflight.width)


def _would_hold(row: Row, step: Step, current: Launched) -> bool | None:
    """Whether a round queued behind `current` would have held, had one been queued: the
    proposer's guess of the token after its drafts is what the round committed (None: no
    guess to check)."""
    proposal = current.proposals[0]
    if proposal.host is None or row.done:
        return None
    if step.accepted < proposal.k:
        return False
    guess = row.proposer.propose_ahead(DraftContext(row.history[:-1], 1, row.sampling)).host
    return None if not guess else guess[0] == row.anchor


def drafts_ahead(target: Target, proposer: Proposer) -> bool:
    """Whether rounds can be pipelined: the proposer guesses what follows a round before it
    is read (`propose_ahead`, `core/proposer.py`), and the target's rollback is a trim, so a
    round queued on tokens that were then rejected can be dropped along with them."""
    return callable(getattr(proposer, "propose_ahead", None)) and target.trims


def _launch_ahead(target: Target, row: Row, cache: list, current: Launched) -> Launched | None:
    """Queue the round that follows `current` if it keeps every draft and the target's token
    after them is the proposer's guess: that guess is its anchor, the proposer's further
    guesses its drafts. None when nothing would follow (the answer ends, or no guess)."""
    proposal = current.proposals[0]
    if proposal.host is None:
        return None
    room = row.stopper.remaining - (proposal.k + 1)  # tokens left after a full accept
    if room <= 0:
        return None
    assumed = row.history + proposal.host
    cap = max(0, min(row.cap_limit, room - 1))
    if row.policy is not None:
        row.policy.context = len(assumed) + 1
        cap = row.policy.choose(cap)
        if cap == 0:  # parked, or plain steps pay: the loop's own plain runs take over
            return None
    extras = {"room": room - 1 if row.long_copies else cap}
    guessed = row.proposer.propose_ahead(DraftContext(assumed, cap + 1, row.sampling, None, extras))
    if not guessed.host:
        return None
    drafts = Proposal.from_list(guessed.host[1:], guessed.copied)
    return launch_round(target, [row], cache, [cap], given=[drafts], anchors=[guessed.host[0]])


def _ahead_holds(row: Row, step: Step, current: Launched, ahead: Launched) -> bool:
    """Whether the round queued ahead ran on what `current` committed: every draft kept,
    the target's next token the guessed anchor, and the answer not finished."""
    return (
        not row.done and step.accepted == current.proposals[0].k and row.anchor == ahead.anchors[0]
    )


def _copy_ready(row: Row) -> bool:
    """Whether the row's proposer holds a lookup copy of the text worth a round now (asked
    while `auto` has parked the drafter; see `Proposer`)."""
    ready = getattr(row.proposer, "copy_ready", None)
    if ready is None or not row.long_copies:
        return False
    return ready(row.history, max(0, row.stopper.remaining - 1))


def _plain_run(target: Target, row: Row, cache: list, n: int) -> Iterator[Step]:
    """Up to n plain steps inside a speculative generation, pipelined as `_plain_steps` (the
    next forward is queued before the current token is read). Each forwarded token's taps go
    to the proposer and the record, and the cache ends holding the history but its anchor,
    as after a round, so drafting resumes where these steps stop. They stop early where the
    proposer finds a lookup copy (`_copy_ready`); returns the steps taken."""
    tap_ids = tuple(row.proposer.tap_layer_ids)

    def step(y: mx.array) -> tuple[mx.array, mx.array | None]:
        with mx.stream(target.stream):
            logits, taps = target.forward(y.reshape(1).astype(mx.uint32), cache, tap_ids)
            nxt = _choose(logits[-1], row.sampling, row.keys)
        mx.async_eval(nxt)
        return nxt, taps

    shadow = Shadow(row) if getattr(row.proposer, "drafts_on_host", False) else None
    cur, cur_taps = step(mx.array([row.anchor], dtype=mx.uint32))
    for i in range(n):
        t = time.perf_counter()
        last = i == n - 1
        if i and row.wants_cancel():
            row.stopper.finish_reason = "cancelled"
            yield Step("plain", [], 0, [], 0.0, "cancelled")
            return i
        if not last:
            following = step(cur)  # queued before cur is read
        token = cur.item()
        row.proposer.observe(0, cur_taps)
        if row.record is not None:
            row.record.grow(1, cur_taps)
        if shadow is not None:
            shadow.check(token)
        row.history.append(token)
        row.anchor = token
        kept = row.stopper.feed([token])
        seconds = time.perf_counter() - t
        if row.policy is not None:
            row.policy.observe(0, 0, seconds)
        stop = row.done or (not last and _copy_ready(row))
        if stop and not last:
            target.rollback(cache, 1)  # the forward queued past where these steps end
        yield from _handed(
            Step("plain", [], 0, kept, seconds, row.stopper.finish_reason), row.policy
        )
        if stop or last:
            return i + 1
        cur, cur_taps = following
    return n


def _handed(step: Step, policy: AutoCap | None) -> Iterator[Step]:
    """Yield `step`, and tell the policy how long the caller kept it (`observe_outside`)."""
    t = time.perf_counter()
    yield step
    if policy is not None:
        policy.observe_outside(time.perf_counter() - t)


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
            self.draft, self.matched = list(self.row.proposer.propose(ctx).host or []), 0
            if not self.draft:
                return
        if token == self.draft[self.matched]:
            self.matched += 1
            if self.matched < len(self.draft):
                return
        self.row.policy.observe_unverified(len(self.draft), self.matched)
        self.draft = []


def _row_inputs(anchor: int, proposal: Proposal, drafts: mx.array, width: int) -> mx.array:
    if proposal.host is not None:  # host-made drafts: one copy up, no concatenation
        ids = [anchor, *proposal.host]
        return mx.array(ids + [0] * (width - len(ids)), dtype=mx.uint32)
    parts = [mx.array([anchor], dtype=mx.uint32), drafts]
    if width > proposal.k + 1:  # a shorter row of a batch: padding the round rolls back
        parts.append(mx.zeros((width - proposal.k - 1,), dtype=mx.uint32))
    return mx.concatenate(parts)


@dataclass
class Launched:
    """A round whose forward is queued on the device but not yet read back: what `settle`
    needs to accept each row's drafts. `decode` may queue the next round behind it."""

    rows: list[Row]
    proposals: list[Proposal]
    drafts: list[mx.array]
    asked: list[int]  # each row's cap this round
    cuts: list[int]  # drafts the batch scheduler left out, per row
    width: int  # the rows' common width: 1 + the most drafts of any row
    per_row: list[tuple]  # (target tokens, sampled accept count, logprobs), lazy
    taps: mx.array | None
    batched: bool
    pending: list[mx.array]  # everything `settle` reads back, queued by `launch_round`
    anchors: list[int]  # the token each row's round starts from


def launch_round(
    target: Target,
    rows: list[Row],
    cache: list,
    caps: list[int] | None = None,
    scheduler: BatchScheduler | None = None,
    given: list[Proposal] | None = None,
    anchors: list[int] | None = None,
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
            scheduled = _schedule(scheduler, rows, proposals, asked)
            cuts = [p.k - s.k for p, s in zip(proposals, scheduled)]
            proposals = scheduled
        else:
            proposals, asked, cuts = given, list(caps or [p.k for p in given]), [0] * len(given)
        for proposal in proposals:
            tokens = proposal.tokens
            drafts.append(tokens if tokens.dtype == mx.uint32 else tokens.astype(mx.uint32))
        width = 1 + max(p.k for p in proposals)
        inputs = [_row_inputs(a, p, d, width) for a, p, d in zip(anchors, proposals, drafts)]
        if batched:
            all_logits, all_taps = target.forward_rows(mx.stack(inputs), cache, tap_ids)
        else:
            logits, taps = target.forward(inputs[0], cache, tap_ids)
            all_logits, all_taps = logits[None], None if taps is None else taps[None]
        for i, (row, proposal, row_drafts) in enumerate(zip(rows, proposals, drafts)):
            logits = all_logits[i, : proposal.k + 1]
            if row.procs:
                shown = proposal.host if proposal.host is not None else row_drafts
                logits = process_rows(row.procs, row.history, row.window, logits, shown)
            accepted = None
            if row.sampling.greedy:
                tokens = greedy(logits)
            elif proposal.k == 0:  # a plain step, drawn as plain decoding draws it
                tokens = _choose(logits[0], row.sampling, row.keys).reshape(1)
                accepted = mx.array(0)
            else:
                accepted, tokens = accept_sampled(
                    logits, row_drafts, proposal.probs, row.sampling, row.keys.next()
                )
            lp = None if row.logprobs is None else logprob_arrays(logits, tokens, row.logprobs)
            pending += [tokens] if proposal.host is not None else [tokens, row_drafts]
            pending += [x for x in (accepted, lp) if x is not None]
            per_row.append((tokens, accepted, lp))
    mx.async_eval(*pending)
    return Launched(
        rows, proposals, drafts, asked, cuts, width, per_row, all_taps, batched, pending,
        anchors,
    )  # fmt: skip


def settle(launched: Launched) -> tuple[list[Step], list[int]]:
    """Read a launched round back (its one sync) and accept each row's drafts: commit, feed
    the proposer, the record and the stopper. Returns the steps and how many positions each
    row's cache must drop (what it rejected); the caller rolls back."""
    rows, proposals, drafts = launched.rows, launched.proposals, launched.drafts
    mx.eval(*launched.pending)  # the round's one sync
    steps, rejected = [], []
    for i, (row, proposal, (tokens, accepted, lp)) in enumerate(
        zip(rows, proposals, launched.per_row)
    ):
        drafted = proposal.host if proposal.host is not None else drafts[i].tolist()
        target_tokens = tokens.tolist()
        if row.sampling.greedy:
            a = accept_greedy(target_tokens, drafted)
        else:
            a = accepted.item()
        committed = target_tokens[: a + 1]
        rejected.append(launched.width - 1 - a)
        row_taps = None if launched.taps is None else launched.taps[i, : a + 1]
        row.proposer.observe(a, row_taps)
        row.history.extend(committed)
        if row.record is not None:
            row.record.grow(a + 1, row_taps)
        row.anchor = committed[-1]
        kept = row.stopper.feed(committed)
        step_lp = None if lp is None else read_logprobs(lp, kept)
        steps.append(
            Step(
                "draft", drafted, a, kept, 0.0, row.stopper.finish_reason, step_lp,
                launched.cuts[i],
            )
        )  # fmt: skip
    return steps, rejected


def teach(launched: Launched, steps: list[Step], seconds: float, scheduler: bool) -> None:
    """Time the round's steps and tell each row's cap policy (and, under a batch scheduler,
    its running acceptance) what the round did."""
    for row, proposal, step, cap in zip(launched.rows, launched.proposals, steps, launched.asked):
        step.seconds = seconds
        if scheduler and 0 < proposal.k <= cap and not proposal.copied:
            learn_acceptance(row.accept, proposal.k, step.accepted)
        if row.policy is None or proposal.copied:  # a lookup copy says nothing of the drafter
            continue
        if step.cut:  # the scheduler chose this width, not the policy: acceptance only
            row.policy.observe_unverified(proposal.k, step.accepted)
        # a round that was asked for drafts but got none (a lookup with no match) is neither
        # a drafting round nor a pipelined plain step: it teaches the policy nothing
        elif proposal.k > 0 or cap == 0:
            row.policy.observe(proposal.k, step.accepted, seconds)


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
    `scheduler` (a batch's) cuts the proposals of two or more drafting rows to what DSpark's
    prefix scheduler admits before the forward (`_schedule`).
    """
    t = time.perf_counter()
    launched = launch_round(target, rows, cache, caps, scheduler)
    steps, rejected = settle(launched)
    if launched.batched:
        target.rollback_rows(cache, rejected)
    else:
        target.rollback(cache, rejected[0])
    teach(launched, steps, time.perf_counter() - t, scheduler is not None)
    return steps


def _schedule(
    scheduler: BatchScheduler | None, rows: list[Row], proposals: list[Proposal], asked: list[int]
) -> list[Proposal]:
    """Each row's proposal cut to the drafts DSpark's prefix scheduler admits, when two or more
    rows draft. Survivals come from the drafter's confidences (read back in one wait) or the
    rows' running acceptance, never from a draft they would admit: sampling stays exact.

    Sampled rows with one seed draw their drafts from the same keys, so one row's drafts say
    something about the other's: their confidences (which read their drafts) would let one
    row's cut depend on the other's draft it admits. They use running acceptance instead."""
    if scheduler is None or sum(1 for p in proposals if p.k > 0) < 2:
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
    return [p.first(n) for p, n in zip(proposals, keep)]


def _own_keys(rows: list[Row]) -> list[bool]:
    """Whether each row's random draws are its own: greedy, unseeded, or a seed no other
    sampled row of the round has."""
    seeds = Counter(r.sampling.seed for r in rows if not r.sampling.greedy)
    return [
        r.sampling.greedy or r.sampling.seed is None or seeds[r.sampling.seed] == 1 for r in rows
    ]


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
            nxt = _choose(logits[-1], sampling, keys)
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
