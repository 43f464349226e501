"""What both APIs share: request limits, submitting a job, waiting for its events (with
keep-alive ticks and disconnect checks), and shaping the text into reasoning, answer and tool
calls."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ..chat.reasoning import CHANNELS, THINK, ChannelSplitter, ThinkSplitter, markers_for
from ..chat.render import PromptTooLong, template_text
from ..core.events import Result
from ..core.generation_config import GREEDY, SamplingDefaults
from ..core.logits import Penalties
from ..pipeline import Pipeline
from ..streaming import Chunk
from .engine import Engine, Job, NotReady
from .errors import ApiError
from .tool_choice import forced_opening
from .tools import ToolCall, ToolGate


@dataclass
class Limits:
    """Server-wide request limits and defaults (set from `outrider serve` flags)."""

    default_max_tokens: int = 2048
    max_tokens_cap: int = 131072
    keepalive_s: float = 15.0
    thinking: bool | None = None  # server default for enable_thinking (None: the template's)
    reasoning_effort: str | None = None  # server default for templates that read one
    # thinking tokens before the engine closes the model's thinking, where a request sets no
    # budget (--reasoning-budget; None: no limit), and the message it writes before the closer
    reasoning_budget: int | None = None
    budget_message: str | None = None
    max_body_bytes: int = 4 << 20  # larger request bodies are refused with 413
    trust_request_chat_template: bool = False  # a request's own template (sandboxed) allowed
    # sampling where a request sets none (--default-temperature ...), over the model's own
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def sampling_for(self, engine: Engine) -> SamplingDefaults:
        """The sampling that fills what a request leaves unset: these flags, then what the
        served model recommends (core/generation_config.py)."""
        pipe = engine.pipeline
        model = pipe.target.sampling_defaults if pipe is not None else SamplingDefaults()
        return self.sampling.over(model)


@dataclass
class GenParams:
    max_tokens: int | None = None
    temperature: float | None = None  # None: the server's, the model's, else greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    penalties: Penalties | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    reasoning_budget: int | None = None  # the request's thinking budget (None: the server's)


def ready_pipeline(engine: Engine) -> Pipeline:
    pipe = engine.pipeline
    if pipe is None or engine.state != "ready":
        if engine.state == "loading":
            raise ApiError(503, "a model is loading; try again in a moment", "service_unavailable")
        raise ApiError(
            503, "no model is loaded; load one with POST /admin/load", "service_unavailable"
        )
    return pipe


def check_model(engine: Engine, requested: str | None) -> None:
    """Unknown model names are refused (the served id and the path it was loaded from pass)."""
    if not requested:
        return
    from .engine import model_id

    pipe = engine.pipeline
    names = {model_id(pipe), pipe.target.name} if pipe else set()
    if requested not in names:
        raise ApiError(
            404,
            f"model {requested!r} is not served here (this server serves "
            f"{', '.join(sorted(n for n in names if n)) or 'no model'})",
            code="model_not_found",
            param="model",
        )


def check_context(engine: Engine, n_prompt: int, anthropic: bool) -> None:
    """Refuse an over-long prompt before any work, in the words clients act on."""
    window = engine.context_window
    if window is None or n_prompt < window:
        return
    if anthropic:  # Claude Code's compact-and-retry matches this exact wording
        raise ApiError(400, f"prompt is too long: {n_prompt} tokens > {window} maximum")
    raise ApiError(
        400,
        f"This model's maximum context length is {window} tokens. However, your messages "
        f"resulted in {n_prompt} tokens. Please reduce the length of the messages.",
        code="context_length_exceeded",
        param="messages",
    )


async def prompt_ids(
    engine: Engine, anthropic: bool, encode: Any, *args: Any, **kwargs: Any
) -> Any:
    """Run a templating / tokenizing step off the event loop (a long conversation takes a
    while), with the context window as its cheap length bound: a prompt that cannot fit is
    refused as `check_context` words it, before the tokenizer runs."""
    try:
        return await run_in_threadpool(encode, *args, window=engine.context_window, **kwargs)
    except PromptTooLong as e:
        check_context(engine, e.tokens, anthropic)
        raise ApiError(400, "prompt is too long") from None  # pragma: no cover - refused above


def check_template(limits: Limits, template: Any) -> str | None:
    """A request's own chat template, if the server trusts requests with one."""
    if template is None:
        return None
    if not limits.trust_request_chat_template:
        raise ApiError(
            400,
            "request-supplied chat templates are refused by this server (start it with "
            "--trust-request-chat-template to allow them; they render in a sandbox)",
            param="chat_template",
        )
    if not isinstance(template, str) or not template:
        raise ApiError(400, "chat_template must be a non-empty string", param="chat_template")
    return template


def options(
    engine: Engine, limits: Limits, n_prompt: int, p: GenParams, marks: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Pipeline.stream keywords for a request (max_tokens checked, then fitted to the window).
    `marks` (`chat.render.Rendered.marks`): prompt positions where a prefix-cache snapshot serves
    later requests (the last message's end, the system message's)."""
    max_tokens = limits.default_max_tokens if p.max_tokens is None else p.max_tokens
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > limits.max_tokens_cap:
        raise ApiError(
            400,
            f"max_tokens is {max_tokens}, above this server's limit of {limits.max_tokens_cap}",
            param="max_tokens",
        )
    window = engine.context_window
    if window is not None:
        max_tokens = max(1, min(max_tokens, window - n_prompt))
    # field by field: the request's, the server's flags, the model's, else greedy
    sampling = SamplingDefaults(p.temperature, p.top_p, p.top_k)
    sampling = sampling.over(limits.sampling_for(engine)).over(GREEDY)
    opts: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=p.seed,
        stop=tuple(s for s in p.stop if s),
        penalties=p.penalties,
        logprobs=p.logprobs,
    )
    if p.ignore_eos:
        opts["stop_tokens"] = set()
    budget = limits.reasoning_budget if p.reasoning_budget is None else p.reasoning_budget
    if budget is not None:
        opts["reasoning_budget"] = budget
        if limits.budget_message is not None:
            opts["budget_message"] = limits.budget_message
    if marks:
        opts["snapshot_at"] = tuple(marks)
    return opts


def submit(
    engine: Engine,
    prompt: list[int],
    opts: dict[str, Any],
    request: Request | None = None,
    pipeline: Any = None,
) -> Job:
    """Queue a generation (through `pipeline` over the loaded target, when given: a race arm
    of another mode); the request's access-log line reads its token counts."""
    job = Job(prompt, opts, asyncio.get_running_loop(), pipeline=pipeline)
    if request is not None:
        request.state.job = job
    try:
        engine.submit(job)
    except NotReady:
        ready_pipeline(engine)
        raise
    return job


async def events(
    job: Job, keepalive_s: float, request: Request | None = None
) -> AsyncIterator[tuple[str, Any]]:
    """("chunk", Chunk) … then ("end", Result | None) or ("error", exc); ("keepalive", None)
    whenever nothing happened for `keepalive_s`. Chunks that piled up while the consumer was
    busy come as one. Leaving early (a disconnect cancels the consuming task) cancels the job:
    the engine stops it at the next round."""
    held: tuple[str, Any] | None = None
    checked = time.monotonic()
    try:
        while True:
            if request is not None and time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if held is not None:
                (kind, value), held = held, None
            elif not job.events.empty():  # the common case mid-stream: no timer needed
                kind, value = job.events.get_nowait()
            else:
                try:
                    wait = keepalive_s if request is None else min(keepalive_s, 0.5)
                    kind, value = await asyncio.wait_for(job.events.get(), wait)
                except asyncio.TimeoutError:
                    if request is not None:  # non-streaming callers only poll for disconnects
                        if await request.is_disconnected():
                            return
                        continue
                    kind, value = "keepalive", None
            while kind == "chunk" and not job.events.empty():
                nxt = job.events.get_nowait()
                if nxt[0] != "chunk":
                    held = nxt
                    break
                value = merge(value, nxt[1])
            yield kind, value
            if kind in ("end", "error"):
                return
    finally:
        job.cancel.set()


@dataclass
class Whole:
    """A generation collected whole (a non-streaming answer): its shaped text and tool calls."""

    reasoning: str
    text: str
    calls: list
    result: Any


async def collect(
    job: Job,
    keepalive_s: float,
    request: Request | None,
    shaper: Shaper,
    on_chunk: Callable[[Any], None] | None = None,
    error_type: str = "server_error",
) -> Whole:
    """Run `job` to its end through `shaper` (`on_chunk` sees every chunk too). An engine
    error is a 500 of `error_type`; a client that left, 499."""
    reasoning: list[str] = []
    text: list[str] = []
    result = None
    async for kind, value in events(job, keepalive_s, request):
        if kind == "chunk":
            if on_chunk is not None:
                on_chunk(value)
            for k, piece in shaper.feed(value.text):
                (reasoning if k == "reasoning" else text).append(piece)
        elif kind == "error":
            raise ApiError(500, failure(value), error_type)
        elif kind == "end":
            result = value
    if result is None:
        raise ApiError(499, "client closed the request")
    pieces, calls = shaper.finish()
    for k, piece in pieces:
        (reasoning if k == "reasoning" else text).append(piece)
    return Whole("".join(reasoning), "".join(text), calls, result)


def merge(a: Chunk, b: Chunk) -> Chunk:
    """Two consecutive chunks as one (text, tokens and log-probabilities joined)."""
    lps = None
    if a.step.logprobs is not None or b.step.logprobs is not None:
        lps = (a.step.logprobs or []) + (b.step.logprobs or [])
    step = replace(b.step, committed=a.step.committed + b.step.committed, logprobs=lps)
    earlier = (*a.earlier, a.step, *b.earlier)  # every round stays countable (the ribbon)
    return Chunk(a.text + b.text, a.tokens + b.tokens, step, b.result, earlier)


class Shaper:
    """Model text -> ("reasoning" | "content", text) pieces, then tool calls at the end."""

    def __init__(
        self,
        split_thinking: bool,
        in_thinking: bool,
        tools: dict[str, dict] | None,
        parse_tools: bool = True,
        markers: tuple[str, str] = THINK,
        forced: str = "",
    ) -> None:
        """`forced` is text the server began the answer with (a forced tool call's opening):
        it is shaped as if the model had written it."""
        self._think: ThinkSplitter | ChannelSplitter | None = None
        if split_thinking:
            split = ChannelSplitter(in_thinking) if markers == CHANNELS else None
            self._think = split or ThinkSplitter(in_thinking, markers)
        self._gate = ToolGate(tools) if tools and parse_tools else None
        self._early = self._shape(forced) if forced else []

    def feed(self, text: str) -> list[tuple[str, str]]:
        early, self._early = self._early, []
        return early + self._shape(text)

    def _shape(self, text: str) -> list[tuple[str, str]]:
        pieces = self._think.feed(text) if self._think else [("content", text)]
        return self._gate_pieces(pieces)

    def finish(self) -> tuple[list[tuple[str, str]], list[ToolCall]]:
        early, self._early = self._early, []
        pieces = early + (self._gate_pieces(self._think.finish()) if self._think else [])
        calls: list[ToolCall] = []
        if self._gate is not None:
            rest, calls = self._gate.finish()
            if rest:
                pieces.append(("content", rest))
        return pieces, calls

    def _gate_pieces(self, pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if self._gate is None:
            return pieces
        out = []
        for kind, text in pieces:
            if kind == "content":
                text = self._gate.feed(text)
            if text:
                out.append((kind, text))
        return out


def force_tool_call(
    pipe: Pipeline,
    prompt: list[int],
    in_thinking: bool,
    choice: Any,
    tools: list[str],
    api: str,
) -> tuple[list[int], str]:
    """(prompt, forced opening): the prompt extended with the opening of the tool call that
    `tool_choice` forces, if it forces one (see `tool_choice.py`)."""
    template = template_text(pipe.tokenizer)
    close = markers_for(template)[1] if in_thinking else None
    opening = forced_opening(template, choice, tools, api, close)
    if not opening:
        return prompt, ""
    return prompt + list(pipe.tokenizer.encode(opening, add_special_tokens=False)), opening


def sse_event(event: str, data: dict) -> str:
    """One server-sent event with a name (Anthropic's stream, the race)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def failure(exc: BaseException) -> str:
    """What a client is told when the engine raised during its generation."""
    return f"generation failed: {type(exc).__name__}: {exc}"


def x_outrider(pipe: Pipeline, result: Result | None) -> dict[str, Any]:
    """The per-response speculation report."""
    out: dict[str, Any] = {"mode": pipe.mode, "max_draft": pipe.max_draft}
    if result is not None:
        fresh = len(result.prompt_tokens) - result.cached_tokens
        seconds = result.prefill_seconds + result.decode_seconds
        out.update(
            mean_accept_len=round(result.mean_accept_len, 4),
            decode_tokens_per_sec=round(result.decode_tps, 2),
            # end to end, the prefill included: what the client saw
            tokens_per_sec=round(len(result.tokens) / seconds, 2) if seconds else 0.0,
            prefill_seconds=round(result.prefill_seconds, 6),
            ttft_seconds=round(result.prefill_seconds, 6),  # the first token ends the prefill
            decode_seconds=round(result.decode_seconds, 6),
            rounds=len(result.rounds),
            target_forwards=result.target_forwards,
            prompt_tokens=len(result.prompt_tokens),
            cached_tokens=result.cached_tokens,
            completion_tokens=len(result.tokens),
            # the context the conversation now fills (prompt and answer), against the window
            context_tokens=len(result.prompt_tokens) + len(result.tokens),
            # each round's cap measured (max_draft is then the ceiling), and the plain steps
            # it took while speculation did not pay
            auto_cap=result.auto_cap,
            plain_steps=result.plain_steps,
            # a reasoning budget closed the model's thinking (core/think_budget.py)
            budget_forced=result.budget_forced,
        )
        if fresh >= 16 and result.prefill_seconds > 0:  # fewer say nothing of prefill speed
            out["prefill_tokens_per_sec"] = round(fresh / result.prefill_seconds, 1)
    return out


def matched_stop(pipe: Pipeline, result: Result | None, stops: list[str]) -> str | None:
    """Which stop string ended the generation (None if none did)."""
    if result is None or result.finish_reason != "stop" or not stops:
        return None
    text = pipe.tokenizer.decode(result.tokens)
    hits = [(i, s) for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits)[1] if hits else None
