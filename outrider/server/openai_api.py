"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..chat.reasoning import markers_for
from ..chat.render import EFFORTS, encode_within, render_chat, template_text
from ..core.logits import Penalties, TokenLogprob
from .checks import MAX_STOPS, SEED_RANGE, CheckedRequest, check_tool_schema
from .engine import model_id
from .errors import ApiError
from .generation import (
    GenParams,
    Shaper,
    check_context,
    check_model,
    check_template,
    collect,
    events,
    failure,
    force_tool_call,
    options,
    prompt_ids,
    ready_pipeline,
    submit,
    x_outrider,
)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, never refused


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None

    _schema = field_validator("parameters")(check_tool_schema)


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Open):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any] | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Open):
    include_usage: bool = False


MAX_CHOICES = 16  # n: more choices are refused (400)


def choice_options(opts: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Options of each of n choices: choice i samples with seed + i when a seed is given, so
    the choices differ and the request stays reproducible."""
    seed = opts.get("seed")
    return [dict(opts, seed=None if seed is None else seed + i) for i in range(n)]


class Sampling(CheckedRequest):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    # The bound is on the list: one stop string may be any length.
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # outrider's own: thinking tokens before the engine closes the model's thinking
    reasoning_budget: int | None = Field(default=None, ge=0, le=1 << 30)

    @property
    def choices(self) -> int:
        """How many choices to return: each is its own generation (batched together when the
        server runs with --max-batch)."""
        n = self.n or 1
        if n > 1 and self.stream:
            raise ApiError(400, "n > 1 is supported with stream: false only", param="n")
        return n

    def params(self, max_tokens: int | None, logprobs: int | None) -> GenParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        pen = None
        if self.presence_penalty or self.frequency_penalty:
            pen = Penalties(self.presence_penalty or 0.0, self.frequency_penalty or 0.0)
        return GenParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stops,
            penalties=pen,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            reasoning_budget=self.reasoning_budget,
        )


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's field; refused unless the server trusts it
    continue_final_message: bool = False  # vLLM's: extend the last assistant message


class CompletionRequest(Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[int], Field(min_length=1)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False  # echoing the prompt back is not supported


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> list[dict]:
    def entry(tok: int, lp: float) -> dict:
        text = _token_text(tokenizer, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
        {**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps
    ]


def _usage(prompt: int, completion: int, result: Any = None) -> dict:
    """OpenAI usage; `cached_tokens` counts the prompt tokens the prefix cache supplied."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": (result.cached_tokens if result is not None else 0)
        },
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _tool_schemas(tools: list[Tool] | None) -> dict[str, dict] | None:
    if not tools:
        return None
    return {t.function.name: t.function.parameters or {} for t in tools}


def router(state: Any) -> APIRouter:
    """`state` carries engine and limits (one app's, never global)."""
    r = APIRouter()

    @r.get("/models")
    def list_models() -> dict:
        pipe = state.engine.pipeline
        data = []
        if pipe is not None:
            mid = model_id(pipe)
            data.append(
                {
                    "id": mid,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "outrider",
                    "display_name": f"{mid} (outrider {pipe.mode})",
                    "x_outrider": {"mode": pipe.mode, "target": pipe.target.name},
                }
            )
        return {"object": "list", "data": data}

    @r.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        engine, limits = state.engine, state.limits
        pipe = ready_pipeline(engine)
        check_model(engine, body.model)
        top = None
        if body.logprobs:
            top = body.top_logprobs or 0
        elif body.top_logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = body.params(max_tokens, top)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        thinking = body.enable_thinking
        extra = dict(body.chat_template_kwargs or {})
        if thinking is None and "enable_thinking" in extra:
            thinking = bool(extra.pop("enable_thinking"))
        if thinking is None:
            thinking = limits.thinking
        template = check_template(limits, extra.pop("chat_template", body.chat_template))
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        rendered = await prompt_ids(
            engine,
            False,
            render_chat,
            pipe.tokenizer,
            messages,
            tools,
            thinking,
            body.reasoning_effort or limits.reasoning_effort,
            extra,
            template=template,
            continue_final=body.continue_final_message,
        )
        prompt, in_thinking = rendered.ids, rendered.opens
        tool_schemas = _tool_schemas(body.tools)
        prompt, forced = force_tool_call(
            pipe, prompt, in_thinking, body.tool_choice, list(tool_schemas or {}), "openai"
        )
        check_context(engine, len(prompt), anthropic=False)
        opts = options(engine, limits, len(prompt), params, rendered.marks)
        parse = body.tool_choice != "none"
        markers = markers_for(template_text(pipe.tokenizer))
        n = body.choices
        shapers = [
            Shaper(True, in_thinking, tool_schemas, parse, markers, forced) for _ in range(n)
        ]
        jobs = [submit(engine, prompt, o, request) for o in choice_options(opts, n)]
        rid = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        model = body.model or model_id(pipe)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _chat_stream(state, pipe, jobs[0], shapers[0], rid, created, model, usage, top)
            return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE)
        made = await asyncio.gather(
            *(_chat_choice(j, sh, pipe, limits, request, top, i) for i, (j, sh) in
              enumerate(zip(jobs, shapers)))
        )  # fmt: skip
        results = [result for _, result in made]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice for choice, _ in made],
            "usage": _usage(len(prompt), sum(len(r.tokens) for r in results), results[0]),
            "x_outrider": x_outrider(pipe, results[0]),
        }

    @r.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        engine, limits = state.engine, state.limits
        pipe = ready_pipeline(engine)
        check_model(engine, body.model)
        prompt_in = body.prompt
        if isinstance(prompt_in, list) and prompt_in and all(isinstance(t, int) for t in prompt_in):
            prompt = [int(t) for t in prompt_in]
            vocab = pipe.target.config.get("vocab_size")
            if vocab and any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        else:
            if isinstance(prompt_in, list):
                if len(prompt_in) != 1:
                    raise ApiError(
                        400, "exactly one prompt per request is supported", param="prompt"
                    )
                prompt_in = prompt_in[0]
            prompt = await prompt_ids(
                engine, False, encode_within, pipe.tokenizer, prompt_in, special=True
            )
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        check_context(engine, len(prompt), anthropic=False)
        params = body.params(body.max_tokens, body.logprobs)
        opts = options(engine, limits, len(prompt), params)
        n = body.choices
        jobs = [submit(engine, prompt, o, request) for o in choice_options(opts, n)]
        rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        model = body.model or model_id(pipe)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _completion_stream(
                state, pipe, jobs[0], rid, created, model, usage, len(prompt)
            )
            return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE)
        made = await asyncio.gather(
            *(_completion_choice(j, pipe, limits, request, body.logprobs, i)
              for i, j in enumerate(jobs))
        )  # fmt: skip
        results = [result for _, result in made]
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice for choice, _ in made],
            "usage": _usage(len(prompt), sum(len(r.tokens) for r in results), results[0]),
            "x_outrider": x_outrider(pipe, results[0]),
        }

    return r


_SSE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _chat_choice(job, shaper, pipe, limits, request, top, index: int) -> tuple[dict, Any]:
    """One chat choice, collected whole (non-streaming), and its Result."""
    lps: list[TokenLogprob] = []
    whole = await collect(
        job, limits.keepalive_s, request, shaper, lambda c: lps.extend(c.step.logprobs or [])
    )
    message: dict[str, Any] = {"role": "assistant", "content": whole.text or None}
    if not whole.calls and message["content"] is None:
        message["content"] = ""
    if whole.reasoning:
        message["reasoning_content"] = whole.reasoning
    if whole.calls:
        message["tool_calls"] = [_call(c) for c in whole.calls]
    finish = "tool_calls" if whole.calls else whole.result.finish_reason
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish}
    choice["logprobs"] = (
        {"content": _chat_logprobs(pipe.tokenizer, lps)} if top is not None else None
    )
    return choice, whole.result


async def _completion_choice(job, pipe, limits, request, logprobs, index: int):
    """One completion choice, collected whole (non-streaming), and its Result."""
    lps: list[TokenLogprob] = []
    whole = await collect(
        job, limits.keepalive_s, request, Shaper(False, False, None),
        lambda c: lps.extend(c.step.logprobs or []),
    )  # fmt: skip
    choice = {
        "index": index,
        "text": whole.text,
        "finish_reason": whole.result.finish_reason,
        "logprobs": _completion_logprobs(pipe.tokenizer, lps) if logprobs is not None else None,
    }
    return choice, whole.result


def _call(c) -> dict:
    return {
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments_json},
    }


def _completion_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> dict:
    tokens = [_token_text(tokenizer, x.token) for x in lps]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{_token_text(tokenizer, t): v for t, v in x.top} for x in lps],
        "text_offset": offsets,
    }


class _StepReport:
    """Outrider's per-frame telemetry for the chat stream (clients ignore unknown fields):
    `x_outrider.tokens`, the tokens generated since the last report, and `x_outrider.ribbon`,
    one [drafted, accepted] pair per speculative round since then. Text the stream holds back
    (a possible tool call, a split think marker) carries its report forward to the next frame;
    chunks that queued up behind a slow client arrive merged, every round still listed."""

    def __init__(self) -> None:
        self.tokens, self.ribbon = 0, []

    def add(self, value: Any) -> None:
        self.tokens += len(value.tokens)
        for step in (*value.earlier, value.step):
            if step.source == "draft":
                self.ribbon.append([len(step.drafted), step.accepted])

    def take(self) -> dict[str, Any] | None:
        if not self.tokens and not self.ribbon:
            return None
        out = {"tokens": self.tokens, "ribbon": self.ribbon}
        self.tokens, self.ribbon = 0, []
        return out


async def _chat_stream(state, pipe, job, shaper, rid, created, model, include_usage, top):
    report = _StepReport()

    def chunk(delta: dict, finish: str | None = None, lp: Any = None, **extra: Any) -> str:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}],
        }
        body.update(extra)
        if (delta or finish) and (steps := report.take()) is not None:
            body["x_outrider"] = {**steps, **body.get("x_outrider", {})}
        return _sse(body)

    yield chunk({"role": "assistant", "content": ""})
    result = None
    async for kind, value in events(job, state.limits.keepalive_s):
        if kind == "keepalive":  # an empty delta: SDK idle timers see it, unlike a comment
            yield chunk({})
        elif kind == "chunk":
            lp = None
            if top is not None and value.step.logprobs:
                lp = {"content": _chat_logprobs(pipe.tokenizer, value.step.logprobs)}
            report.add(value)
            pieces = shaper.feed(value.text)
            for i, (k, text) in enumerate(pieces):  # logprobs ride on the chunk's last frame
                key = "reasoning_content" if k == "reasoning" else "content"
                yield chunk({key: text}, lp=lp if i == len(pieces) - 1 else None)
            if lp is not None and not pieces:
                yield chunk({}, lp=lp)
        elif kind == "error":
            yield _error_frame(value)
            return
        elif kind == "end":
            result = value
    if result is None:
        return
    pieces, calls = shaper.finish()
    for k, text in pieces:
        yield chunk({"reasoning_content" if k == "reasoning" else "content": text})
    if calls:
        deltas = [{"index": i, **_call(c)} for i, c in enumerate(calls)]
        yield chunk({"tool_calls": deltas})
    finish = "tool_calls" if calls else result.finish_reason
    yield chunk({}, finish, x_outrider=x_outrider(pipe, result))
    if include_usage:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": _usage(len(result.prompt_tokens), len(result.tokens), result),
        }
        yield _sse(body)
    yield "data: [DONE]\n\n"


def _error_frame(error: BaseException) -> str:
    """The SSE frame that ends a stream whose generation failed."""
    return _sse({"error": {"message": failure(error), "type": "server_error"}})


async def _completion_stream(state, pipe, job, rid, created, model, include_usage, n_prompt):
    def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        }
        body.update(extra)
        return _sse(body)

    # Mid-stream frames differ only in their text: serialise the rest once.
    head, tail = chunk("\x00").split(json.dumps("\x00"))

    def text_frame(text: str) -> str:
        return head + json.dumps(text, ensure_ascii=False) + tail

    result = None
    async for kind, value in events(job, state.limits.keepalive_s):
        if kind == "keepalive":
            yield ": keepalive\n\n"
        elif kind == "chunk" and value.text:
            yield text_frame(value.text)
        elif kind == "error":
            yield _error_frame(value)
            return
        elif kind == "end":
            result = value
    if result is None:
        return
    yield chunk("", result.finish_reason, x_outrider=x_outrider(pipe, result))
    if include_usage:
        yield _sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(n_prompt, len(result.tokens), result),
            }
        )
    yield "data: [DONE]\n\n"
