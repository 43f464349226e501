"""The one decode loop: prefill, propose, verify in one forward, accept, roll back, observe.

Every mode runs through `decode`; a mode is only a proposer. On the greedy path each round costs
one host-device sync (the accept count and committed tokens come back together). A proposer that
never drafts (baseline) gets the pipelined plain step mlx-lm uses, so baseline costs no more
than mlx-lm's own generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from .acceptance import accept_greedy, accept_sampled
from .errors import Cancelled
from .logits import Penalties, TokenLogprob, logprob_arrays, process_rows, read_logprobs
from .prefix_cache import PrefixHit, Record
from .proposer import DraftContext, Proposal, Proposer
from .sampling import KeyStream, SamplingParams, greedy, probabilities, sample
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


def _choose(logits: mx.array, sampling: SamplingParams, keys: KeyStream | None) -> mx.array:
    if sampling.greedy:
        return greedy(logits)
    return sample(probabilities(logits, sampling), keys.next())


def decode(
    target: Target,
    proposer: Proposer,
    prompt: list[int],
    stopper: Stopper,
    sampling: SamplingParams = SamplingParams(),
    max_draft: int | None = None,
    penalties: Penalties | None = None,
    logprobs: int | None = None,
    cancelled: Callable[[], bool] | None = None,
    prefill_progress: Callable[[int, int], None] | None = None,
    start: PrefixHit | None = None,
    record: Record | None = None,
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
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    keys = None if sampling.greedy else KeyStream(sampling.seed)
    cap_limit = proposer.max_draft if max_draft is None else min(max_draft, proposer.max_draft)
    tap_ids = tuple(proposer.tap_layer_ids)
    if tap_ids:
        target.install_taps(tap_ids)
    done = 0 if start is None else start.length
    if not 0 <= done < len(prompt):
        raise ValueError(f"a prefix hit of {done} tokens leaves nothing of the prompt to forward")
    cache = target.make_cache() if start is None else start.cache
    progress = prefill_progress
    if done and prefill_progress is not None:
        progress = lambda n, total: prefill_progress(done + n, done + total)  # noqa: E731
    stops, at_stop = (), None
    if record is not None:
        stops, at_stop = record.prefill_stops(target, cache, done, len(prompt))
    procs = penalties.processors() if penalties is not None and penalties.active else []
    window = penalties.window if procs else 0

    t0 = time.perf_counter()
    with mx.stream(target.stream):
        try:
            last_logits, taps = target.prefill(
                prompt[done:], cache, tap_ids, cancelled, progress, stops, at_stop
            )
            if done and taps is not None:
                taps = mx.concatenate([start.taps, taps], axis=0)
        except Cancelled:
            yield Step("prefill", [], 0, [], time.perf_counter() - t0, "cancelled")
            return
        last_logits = process_rows(procs, prompt, window, last_logits[None])[0]
        first = _choose(last_logits, sampling, keys)
        lp = None if logprobs is None else logprob_arrays(last_logits[None], first, logprobs)
    if cap_limit <= 0 and not tap_ids and not procs and logprobs is None:
        fed = None  # what the cache holds, kept only for the prefix cache
        if record is not None:
            fed = list(prompt)
            record.track(cache, fed)
        yield from _plain_steps(target, cache, first, stopper, sampling, keys, t0, cancelled, fed)
        return
    proposer.start(prompt, taps)
    mx.eval(first, lp)
    anchor = first.item()
    history = list(prompt) + [anchor]
    if record is not None:  # the cache holds history but its last token (the anchor)
        record.track(cache, history, len(prompt), taps)
    kept = stopper.feed([anchor])
    step_lp = None if lp is None else read_logprobs(lp, kept)
    yield Step("prefill", [], 0, kept, time.perf_counter() - t0, stopper.finish_reason, step_lp)

    while stopper.finish_reason is None:
        t = time.perf_counter()
        if cancelled is not None and cancelled():
            yield Step("draft", [], 0, [], 0.0, "cancelled")
            return
        cap = max(0, min(cap_limit, stopper.remaining - 1))
        ctx = DraftContext(history, cap, sampling, keys.next() if keys else None)
        with mx.stream(target.stream):
            proposal = proposer.propose(ctx) if cap > 0 else Proposal.empty()
            drafts = proposal.tokens
            if drafts.dtype != mx.uint32:
                drafts = drafts.astype(mx.uint32)
            if proposal.host is not None:  # host-made drafts: one copy up, no concatenation
                inputs = mx.array([anchor, *proposal.host], dtype=mx.uint32)
            else:
                inputs = mx.concatenate([mx.array([anchor], dtype=mx.uint32), drafts])
            logits, taps = target.forward(inputs, cache, tap_ids)
            if procs:
                row_drafts = proposal.host if proposal.host is not None else drafts
                logits = process_rows(procs, history, window, logits, row_drafts)
            if sampling.greedy:
                tokens = greedy(logits)
            else:
                key = keys.next()
                accepted, tokens = accept_sampled(logits, drafts, proposal.probs, sampling, key)
            lp = None if logprobs is None else logprob_arrays(logits, tokens, logprobs)
        pending = [tokens] if proposal.host is not None else [tokens, drafts]
        if not sampling.greedy:
            pending.append(accepted)
        mx.eval(*pending, lp)  # the round's one sync
        drafted = proposal.host if proposal.host is not None else drafts.tolist()
        target_tokens = tokens.tolist()
        a = accept_greedy(target_tokens, drafted) if sampling.greedy else accepted.item()
        committed = target_tokens[: a + 1]
        target.rollback(cache, proposal.k - a)
        proposer.observe(a, None if taps is None else taps[: a + 1])
        history.extend(committed)
        if record is not None:
            record.grow(a + 1, None if taps is None else taps[: a + 1])
        anchor = committed[-1]
        kept = stopper.feed(committed)
        step_lp = None if lp is None else read_logprobs(lp, kept)
        seconds = time.perf_counter() - t
        yield Step("draft", drafted, a, kept, seconds, stopper.finish_reason, step_lp)


def _plain_steps(
    target: Target,
    cache: list,
    first: mx.array,
    stopper: Stopper,
    sampling: SamplingParams,
    keys: KeyStream | None,
    t0: float,
    cancelled: Callable[[], bool] | None = None,
    fed: list[int] | None = None,
) -> Iterator[Step]:
    """Pipelined plain decoding: the next forward is queued before the current token is read.

    `fed` (when given) gets every token forwarded into the cache, for the prefix cache."""
    y = first
    mx.async_eval(y)
    source = "prefill"
    while True:
        t = time.perf_counter()
        if source == "plain" and cancelled is not None and cancelled():
            yield Step("plain", [], 0, [], 0.0, "cancelled")
            return
        with mx.stream(target.stream):
            logits, _ = target.forward(y.reshape(1).astype(mx.uint32), cache)
            next_y = _choose(logits[-1], sampling, keys)
        mx.async_eval(next_y)
        token = y.item()
        if fed is not None:
            fed.append(token)
        kept = stopper.feed([token])
        start = t0 if source == "prefill" else t
        yield Step(source, [], 0, kept, time.perf_counter() - start, stopper.finish_reason)
        if stopper.finish_reason is not None:
            return
        source = "plain"
        y = next_y
