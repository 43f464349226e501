"""A Pipeline: a target bound to one drafting strategy, which generates, streams and batches.

`outrider.api.load` builds one; this module is what it builds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from .chat.reasoning import markers_for
from .chat.render import template_text
from .core import loop
from .core.ahead_gate import AheadGate
from .core.batch import Batch, fork
from .core.batch_schedule import BatchScheduler
from .core.calibration import Calibration
from .core.drafter_spec import DrafterSpec
from .core.errors import Cancelled, OutriderError
from .core.events import Result
from .core.logits import Penalties
from .core.loop import begin_row, decode, prefill
from .core.parked import retap_from
from .core.prefix_cache import GB, PrefixCache, Record
from .core.proposer import Proposer
from .core.round import Row, Step
from .core.sampling import KeyStream, SamplingParams
from .core.schedule import AutoCap
from .core.stopping import Stopper
from .core.target import Target
from .core.think_budget import DEFAULT_MESSAGE, ThinkBudget, make_budget
from .prompts import Prompt, encode_prompt, render_prompt
from .registry import Pair
from .streaming import Chunk, Collector, TextAssembler

WARM_UP_TEXT = "def hello(name):\n    return 'Hello, ' + name\n\nprint(hello("
WARM_UP_TOKENS = 16  # enough rounds for every cap the first requests will use


@dataclass
class RowStart:
    """A generation prefilled alone, ready to join a batch: `row` is None when its first
    token already ended it (`first.result` is then set)."""

    row: Row | None
    cache: list
    collector: Collector
    first: Chunk


@dataclass
class Pipeline:
    """A target bound to one drafting strategy, ready to generate."""

    target: Target
    proposer: Proposer
    mode: str
    max_draft: int
    drafter: DrafterSpec | None = None
    pair: Pair | None = None
    options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # warnings: a fallback, an ignored flag
    drafter_ref: str | None = None  # the drafter's folder or repo id, as given or as resolved
    prefix_cache: PrefixCache | None = None  # kept caches of earlier calls (opt-in)
    auto_cap: bool = False  # max_draft "auto": each round's cap measured (core/schedule.py)
    cap_policy: AutoCap | None = None  # what "auto" has measured so far (kept across calls)
    calibration: Calibration | None = None  # this machine's measured costs (auto uses them)
    cap_given: bool = False  # load() was given a cap: lookup copies stay within it too
    # batched rounds verify what DSpark's prefix scheduler admits (needs a calibration)
    schedule_batches: bool = True
    # greedy rounds of a proposer that guesses ahead are pipelined (core/loop.py `decode`)
    pipelined_rounds: bool = True
    # a parked run's steps past this many forward no taps (core/parked.py; None: all tap)
    retap_parked: int | None = field(default_factory=retap_from)
    scheduler: BatchScheduler | None = None  # the batches' scheduler and what it has cut
    # whether queueing a round ahead pays here, as timed so far (kept across calls)
    ahead_gate: AheadGate | None = None
    # what the load did that is worth saying once, not a warning (a calibration measured,
    # kernels compiled): `outrider generate` and `serve` print these as `note:` lines
    info: list[str] = field(default_factory=list)

    def enable_prefix_cache(
        self, gb: float = 2.0, directory: str | Path | None = None, **options: Any
    ) -> PrefixCache:
        """Keep target caches between calls (up to `gb` of memory; `directory` adds a disk tier),
        so a prompt that starts like an earlier one prefills only what is new."""
        self.prefix_cache = PrefixCache(int(gb * GB), directory, **options)
        return self.prefix_cache

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def encode(
        self,
        prompt: Prompt,
        system: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
    ) -> list[int]:
        """The ids the target sees for `prompt`: a user turn (chat-templated unless `raw`), a
        conversation's messages, or token ids as they are."""
        return encode_prompt(self.tokenizer, prompt, system=system, raw=raw, thinking=thinking)

    def warm_up(self, tokens: int = WARM_UP_TOKENS) -> float:
        """One short throwaway generation at this pipeline's cap, so that the first request
        does not pay for building the kernels its shapes need (minutes on a cold CUDA
        machine, a second or two on Metal). What it timed is forgotten (a kernel's first
        build is no cost of a round) and the prefix cache keeps nothing of it. Returns its
        seconds."""
        t0 = time.perf_counter()
        ids = list(self.tokenizer.encode(WARM_UP_TEXT)) or [0]
        window = self.target.context_window
        if window is not None:  # a small model's window holds the prompt and the tokens
            ids, tokens = ids[: max(1, window // 2)], min(tokens, max(0, window // 2 - 1))
        store, self.prefix_cache = self.prefix_cache, None  # nothing of it is worth keeping
        try:
            self.generate(ids, max_tokens=tokens, max_draft=self.max_draft, stop_tokens=set())
        finally:
            self.prefix_cache, self.ahead_gate = store, None
        return time.perf_counter() - t0

    def _encode_marked(
        self, prompt: Prompt, system: str | None, raw: bool, thinking: bool | None
    ) -> tuple[list[int], tuple[int, ...]]:
        """`encode`'s ids and, with the prefix cache on, where the chat's system message and
        last message ended, where the cache snapshots state it cannot cut back (a server sets
        the same for each chat request)."""
        if self.prefix_cache is None:
            return self.encode(prompt, system=system, raw=raw, thinking=thinking), ()
        return render_prompt(self.tokenizer, prompt, system=system, raw=raw, thinking=thinking)

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_tokens: set[int] | None = None,
        system: str | None = None,
        raw: bool = False,
        thinking: bool | None = None,
        max_draft: int | str | None = None,
        penalties: Penalties | None = None,
        logprobs: int | None = None,
        cancelled: Callable[[], bool] | None = None,
        prefill_progress: Callable[[int, int], None] | None = None,
        snapshot_at: Sequence[int] = (),
        reasoning_budget: int | None = None,
        budget_message: str | None = None,
    ) -> Iterator[Chunk]:
        """Yield text as rounds land; the last chunk carries the full Result.

        `prompt` is a user turn (chat-templated unless `raw`; `system` puts a system prompt
        before it), a conversation's messages (`[{"role": "user", "content": ...}, ...]`,
        rendered as the server renders a chat request), or token ids.
        `penalties` (presence/frequency, mlx-lm semantics) change the target distribution the
        output follows; `logprobs` = n attaches each token's log-probability and n alternatives
        to `Chunk.step.logprobs`. Closing the iterator stops generation after the current round;
        `cancelled` (asked between prefill chunks and rounds) stops it from another thread,
        with finish reason "cancelled"; `prefill_progress(done, total)` hears after each
        prefill chunk. `snapshot_at`: prompt positions where the prefix cache (when on) also
        snapshots what it cannot cut back, besides where a chat prompt's system message and
        last message ended (which it marks by itself). `reasoning_budget`: after that many
        thinking tokens the model's thinking is closed for it, with `budget_message` before the
        closer (core/think_budget.py; `Result.budget_forced` says whether it was); a model
        whose think markers are not single tokens is not budgeted.
        """
        if max_tokens < 0:
            raise OutriderError(f"max_tokens must be >= 0, got {max_tokens}")
        sampling = SamplingParams(temperature, top_p, top_k, seed)
        ids, marks = self._encode_marked(prompt, system, raw, thinking)
        if not ids:
            raise OutriderError("the prompt is empty")
        tokenizer = self.tokenizer
        stopper = self._stopper(max_tokens, stop, stop_tokens)
        result = Result(text="", prompt_tokens=ids, tokens=[], mode=self.mode)
        cap_ceiling = self.proposer.max_draft
        if max_draft is None and self.auto_cap:
            max_draft = "auto"
        if max_draft == "auto":
            result.max_draft, result.auto_cap = cap_ceiling, True  # the most any round drafts
            if self.calibration is not None:
                result.calibration = self.calibration.summary()
        else:
            result.max_draft = self.max_draft if max_draft is None else min(max_draft, cap_ceiling)
        if max_tokens == 0:
            result.finish_reason = "length"
            yield Chunk("", [], Step("prefill", [], 0, [], 0.0, "length"), result)
            return
        record, hit = self._prefix(ids, self.proposer, (*snapshot_at, *marks))
        result.cached_tokens = hit.length if hit is not None else 0  # prompt tokens not prefilled
        mx.reset_peak_memory()
        text = TextAssembler(tokenizer, stopper)
        steps = decode(
            self.target,
            self.proposer,
            ids,
            stopper,
            sampling,
            "auto" if max_draft == "auto" else result.max_draft,
            penalties=penalties,
            logprobs=logprobs,
            cancelled=cancelled,
            prefill_progress=prefill_progress,
            start=hit,
            record=record,
            policy=self._cap_policy() if max_draft == "auto" else None,
            long_copies=not self._cap_given(max_draft),
            pipelined=self.pipelined_rounds,
            gate=self._ahead_gate(),
            retap=self.retap_parked,
            budget=self.think_budget(ids, reasoning_budget, budget_message),
        )
        failed = False
        try:
            yield from self._chunks(steps, result, text)
        except GeneratorExit:  # the consumer stopped early: the cache is as of the last step
            raise
        except BaseException:
            failed = True  # the cache may be mid-round: never keep it
            raise
        finally:
            steps.close()
            if record is not None and not failed:
                self.prefix_cache.put(self.target, record)

    @staticmethod
    def _chunks(steps: Iterator[Step], result: Result, text: TextAssembler) -> Iterator[Chunk]:
        collector = Collector(result, text)
        for step in steps:
            chunk = collector.add(step)
            yield chunk
            if chunk.result is not None:
                return

    def generate(self, prompt: Prompt, **kwargs: Any) -> Result:
        """Generate to completion; same keywords as `stream`."""
        for chunk in self.stream(prompt, **kwargs):
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("generation ended without a result")  # pragma: no cover

    def generate_batch(
        self, prompts: Sequence[Prompt], *, system: str | None = None,
        raw: bool = False, thinking: bool | None = None, max_batch: int | None = None,
        **kwargs: Any,
    ) -> list[Result]:  # fmt: skip
        """Generate for several prompts together: their rows share every target forward, and
        each result is what `generate` gives for that prompt alone (the keywords of
        `start_row`; `seed` seeds every row alike). With `max_batch`, at most that many rows
        decode at once and the next prompt joins (after its own prefill) the round a row
        finishes, as the server's continuous batching does. Needs a target family that
        batches. Where the batch scheduler cuts drafts (`batch_scheduler`), a sampled row
        follows the same distribution but no longer draws the same tokens for the same seed."""
        if max_batch is not None and max_batch < 1:
            raise OutriderError(f"max_batch must be >= 1, got {max_batch}")
        width = len(prompts) if max_batch is None else max_batch
        batch = self.make_batch()
        waiting = list(enumerate(prompts))[::-1]
        collectors: dict[int, Collector] = {}
        results: list[Result | None] = [None] * len(prompts)

        def admit() -> None:
            while waiting and len(batch) < width:
                i, prompt = waiting.pop()
                ids, marks = self._encode_marked(prompt, system, raw, thinking)
                snapshot_at = (*kwargs.get("snapshot_at", ()), *marks)
                start = self.start_row(ids, **{**kwargs, "snapshot_at": snapshot_at})
                results[i] = start.collector.result
                if start.row is not None:
                    collectors[id(start.row)] = start.collector
                    batch.join(start.row, start.cache)

        admit()
        while len(batch):
            for row, step in batch.round():
                collectors[id(row)].add(step)
                if row.done:
                    del collectors[id(row)]
            admit()
        for result in results:
            result.decode_seconds = sum(r.seconds for r in result.rounds)
        return results

    def make_batch(self) -> Batch:
        """An empty batch on this target, with the prefix scheduler when it runs here."""
        return Batch(self.target, self.batch_scheduler())

    def batch_scheduler(self) -> BatchScheduler | None:
        """The scheduler of batched rounds: on (`schedule_batches`) where a calibration says
        what a verify of each width costs and the proposer drafts; kept across batches."""
        cal = self.calibration
        if not self.schedule_batches or cal is None or not self.proposer.max_draft:
            return None
        if self.scheduler is None or self.scheduler.calibration is not cal:
            self.scheduler = BatchScheduler(cal)
        return self.scheduler

    def start_row(
        self,
        ids: list[int],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_tokens: set[int] | None = None,
        max_draft: int | str | None = None,
        penalties: Penalties | None = None,
        logprobs: int | None = None,
        cancelled: Callable[[], bool] | None = None,
        prefill_progress: Callable[[int, int], None] | None = None,
        snapshot_at: Sequence[int] = (),
        reasoning_budget: int | None = None,
        budget_message: str | None = None,
    ) -> RowStart:
        """Prefill one generation alone (its prompt ids; the keywords of `stream`) and make
        the row a `Batch` advances. The prompt's cache goes into the prefix cache (when on)
        before the row joins, and a prefix hit shortens the prefill."""
        if max_tokens < 0:
            raise OutriderError(f"max_tokens must be >= 0, got {max_tokens}")
        if not ids:
            raise OutriderError("the prompt is empty")
        sampling = SamplingParams(temperature, top_p, top_k, seed)
        stopper = self._stopper(max_tokens, stop, stop_tokens)
        if max_draft is None or max_draft == "auto":
            # with the batch scheduler choosing each round's widths from measured costs, a row
            # drafts what its proposer can and the scheduler cuts; else the default cap
            scheduled = not self._cap_given(max_draft) and self.batch_scheduler() is not None
            cap = self.proposer.max_draft if scheduled else self.max_draft
        else:
            cap = min(max_draft, self.proposer.max_draft)
        result = Result(text="", prompt_tokens=ids, tokens=[], mode=self.mode, max_draft=cap)
        collector = Collector(result, TextAssembler(self.tokenizer, stopper))
        if max_tokens == 0:
            stopper.finish_reason = "length"
            return RowStart(
                None, [], collector, collector.add(Step("prefill", [], 0, [], 0.0, "length"))
            )
        procs = penalties.processors() if penalties is not None and penalties.active else []
        window = penalties.window if procs else 0
        keys = None if sampling.greedy else KeyStream(sampling.seed)
        proposer = fork(self.proposer)
        record, hit = self._prefix(ids, proposer, snapshot_at)
        result.cached_tokens = hit.length if hit is not None else 0
        try:
            started = prefill(
                self.target, proposer, ids, sampling, keys, procs, window, logprobs, cancelled,
                prefill_progress, hit, record,
            )  # fmt: skip
        except Cancelled:
            step = Step("prefill", [], 0, [], 0.0, "cancelled")
            return RowStart(None, [], collector, collector.add(step))
        budget = self.think_budget(ids, reasoning_budget, budget_message)
        row, step = begin_row(
            started, proposer, ids, stopper, sampling, keys, cap, procs, window, logprobs,
            record, cancelled, budget,
        )  # fmt: skip
        row.long_copies = not self._cap_given(max_draft)
        if record is not None:
            self.prefix_cache.put(self.target, record)
            row.record = None  # a batched row's cache is not one the prefix cache can keep
        first = collector.add(step)
        return RowStart(None if row.done else row, started.cache, collector, first)

    def think_budget(
        self, ids: list[int], limit: int | None, message: str | None = None
    ) -> ThinkBudget | None:
        """A reasoning budget of `limit` thinking tokens for the prompt `ids` (None: no limit,
        or the model's think markers are not single tokens of its vocabulary)."""
        if limit is None or self.tokenizer is None:
            return None
        if limit < 0:
            raise OutriderError(f"the reasoning budget must be >= 0 tokens, got {limit}")
        markers = markers_for(template_text(self.tokenizer))
        text = DEFAULT_MESSAGE if message is None else message
        return make_budget(self.tokenizer, limit, markers, ids, text)

    def _prefix(
        self, ids: list[int], proposer: Proposer, marks: Sequence[int] = ()
    ) -> tuple[Record | None, Any]:
        """A record for the prefix cache to keep this generation (snapshotting also at the
        prompt positions `marks`), and its longest cached prefix of `ids` (None, None when
        the cache is off)."""
        if self.prefix_cache is None:
            return None, None
        tap_ids = tuple(proposer.tap_layer_ids)
        record = self.prefix_cache.record(self.target, tap_ids)
        if record is not None:
            record.marks = tuple(marks)
        hit = None if record is None else self.prefix_cache.lookup(self.target, ids, tap_ids)
        return record, hit

    def _cap_given(self, max_draft: int | str | None) -> bool:
        """Whether a number bounds this generation's drafts: given here, or to `load` when
        nothing is given here. Without one, lookup copies may run past the cap, and a batch
        scheduler chooses each round's widths."""
        return max_draft != "auto" and (max_draft is not None or self.cap_given)

    def _ahead_gate(self) -> AheadGate:
        """The gate pipelined rounds are queued by (decode sets it as the environment says)."""
        if self.ahead_gate is None:
            self.ahead_gate = AheadGate()
        return self.ahead_gate

    def _cap_policy(self) -> AutoCap:
        if self.cap_policy is None:
            self.cap_policy = loop.AutoCap(
                self.proposer.max_draft, start=self.max_draft or 4, calibration=self.calibration
            )
        return self.cap_policy

    def _stopper(self, max_tokens: int, stop: Sequence[str], stop_tokens: set[int] | None):
        tokenizer = self.tokenizer
        if stop and tokenizer is None:
            raise OutriderError("stop strings need a tokenizer")
        return Stopper(
            max_tokens,
            self.target.eos_token_ids if stop_tokens is None else set(stop_tokens),
            stop,
            decode=(lambda t: tokenizer.decode(t)) if stop else None,
        )
