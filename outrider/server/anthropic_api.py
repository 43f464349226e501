"""Anthropic Messages API: /v1/messages (streaming events as Anthropic's SDK expects them)
and /v1/messages/count_tokens. Requests are translated to OpenAI-shaped chat messages (the
shape chat templates know); the model's `<think>` output becomes thinking blocks."""

from __future__ import annotations

import secrets
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..chat.reasoning import markers_for
from ..chat.render import EFFORTS, Rendered, render_chat, template_text
from ..chat.text import UNSEEN, unseen
from .checks import MAX_STOPS, CheckedRequest, check_tool_schema
from .engine import model_id
from .generation import (
    GenParams,
    Shaper,
    check_context,
    check_model,
    collect,
    events,
    failure,
    force_tool_call,
    matched_stop,
    options,
    prompt_ids,
    ready_pipeline,
    sse_event,
    submit,
    x_outrider,
)

SIGNATURE = "outrider"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Open):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class AMessage(_Open):
    # "system" mid-conversation: Claude Code sends it (its mid-conversation-system beta) to any
    # custom base URL; it is folded into the prompt as the OpenAI route folds a late system.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ATool(_Open):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})

    _schema = field_validator("input_schema")(check_tool_schema)


class Thinking(_Open):
    type: Literal["enabled", "disabled", "adaptive"]
    # after this many thinking tokens the engine closes the thinking (core/think_budget.py)
    budget_tokens: int | None = Field(default=None, ge=0, le=1 << 30)


class CountRequest(CheckedRequest):
    model: str | None = None
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ATool] | None = None
    thinking: Thinking | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tool_choice: dict[str, Any] | None = None


# Blocks the model need not see again: its own earlier reasoning.
SKIPPED = ("thinking", "redacted_thinking")


def block_text(block: dict[str, Any]) -> str:
    """A content block as the text the model reads: text as it is, a text document or a search
    result as its text, an image (or any content it cannot see) as a line saying so
    (`chat.text.unseen`); other blocks (reasoning, server tool blocks) as nothing."""
    kind = str(block.get("type"))
    if kind == "text":
        return str(block.get("text") or "")
    if kind == "document":
        text = _document_text(block.get("source"))
        if text is not None:
            return "\n".join(str(x) for x in (block.get("title"), text) if x)
    if kind == "search_result":
        head = " - ".join(str(x) for x in (block.get("title"), block.get("source")) if x)
        return "\n".join(x for x in (head, _block_text(block.get("content"))) if x)
    return unseen(kind) if kind in UNSEEN else ""


def _document_text(source: Any) -> str | None:
    """A document's text where its source is text (plain text, or text blocks), else None."""
    if not isinstance(source, dict):
        return None
    if source.get("type") == "text":
        return str(source.get("data") or "")
    if source.get("type") == "content":
        content = source.get("content")
        return _block_text(content)
    return None


def _block_text(content: Any) -> str:
    """Content given as a string or as blocks (a tool result's, a document's, a search
    result's) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(block_text(b) for b in content if isinstance(b, dict))


def to_chat(body: CountRequest) -> list[dict]:
    """Anthropic messages -> OpenAI-shaped chat messages (tool_use -> tool_calls,
    tool_result -> tool messages before the turn's text, system entries kept in place for
    `normalize` to fold; thinking dropped; what the model cannot see noted, `block_text`)."""
    out: list[dict] = []
    if body.system:
        system = (
            body.system
            if isinstance(body.system, str)
            else "".join(b.text or "" for b in body.system if b.type == "text")
        )
        if system:
            out.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls = [], []
        for b in m.content:
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type in ("document", "search_result") or b.type in UNSEEN:
                texts.append(block_text(b.model_dump(exclude_none=True)))
            elif b.type == "tool_use" and m.role == "assistant":
                fn = {"name": b.name or "", "arguments": b.input or {}}
                calls.append({"id": b.id, "type": "function", "function": fn})
            elif b.type == "tool_result" and m.role == "user":
                text = _block_text(b.content)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.tool_use_id,
                        "content": f"Error: {text}" if b.is_error else text,
                    }
                )
        if m.role == "system":
            if texts:
                out.append({"role": "system", "content": "".join(texts)})
            continue
        if texts or calls or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def client_tools(body: CountRequest) -> list[ATool]:
    """The tools the model may call: Anthropic's own server tools (web search and the like,
    marked by a versioned `type`) run on Anthropic's side and are dropped."""
    return [t for t in body.tools or [] if (t.model_extra or {}).get("type") in (None, "custom")]


def _tools(body: CountRequest) -> list[dict] | None:
    if not client_tools(body):
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema,
            },
        }
        for t in client_tools(body)
    ]


def _budget(body: CountRequest) -> int | None:
    """The request's thinking budget (`thinking.budget_tokens` with thinking enabled)."""
    thinking = body.thinking
    if thinking is None or thinking.type != "enabled":
        return None
    return thinking.budget_tokens


def _thinking(body: CountRequest, limits: Any) -> tuple[bool | None, str | None]:
    """(enable_thinking, reasoning_effort) for the template: the request's, else the
    server's defaults."""
    if body.thinking is not None and body.thinking.type == "disabled":
        return False, None
    thinking = True if body.thinking is not None else limits.thinking
    effort = (body.output_config or {}).get("effort")
    return thinking, effort if effort in EFFORTS else limits.reasoning_effort


def _render(state: Any, body: CountRequest, window: int | None = None) -> tuple[Rendered, bool]:
    """(the rendered prompt, whether thinking output is kept). A final assistant message with
    text is continued (Anthropic's prefill), not closed."""
    pipe = ready_pipeline(state.engine)
    check_model(state.engine, body.model)
    thinking, effort = _thinking(body, state.limits)
    chat = to_chat(body)
    last = chat[-1] if chat else {}
    prefill = last.get("role") == "assistant" and bool(last["content"].strip())
    prefill = prefill and not last.get("tool_calls")
    rendered = render_chat(
        pipe.tokenizer,
        chat,
        _tools(body),
        thinking,
        effort,
        continue_final=prefill,
        window=window,
    )
    return rendered, thinking is not False


def _stop_reason(finish: str, calls: list, stop_seq: str | None) -> str:
    if calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_seq else "end_turn"


def _usage(n_prompt: int, result: Any) -> dict:
    """Anthropic usage: prompt tokens the prefix cache supplied are `cache_read_input_tokens`,
    the rest `input_tokens` (their sum is the prompt, as Anthropic counts it)."""
    cached = result.cached_tokens if result is not None else 0
    return {
        "input_tokens": n_prompt - cached,
        "output_tokens": len(result.tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def router(state: Any) -> APIRouter:
    r = APIRouter()

    @r.post("/messages/count_tokens")
    def count_tokens(body: CountRequest) -> dict:
        rendered, _ = _render(state, body)
        return {"input_tokens": len(rendered.ids)}

    @r.post("/messages")
    async def messages(body: MessagesRequest, request: Request):
        engine, limits = state.engine, state.limits
        rendered, keep_thinking = await prompt_ids(engine, True, _render, state, body)
        prompt, in_thinking = rendered.ids, rendered.opens
        pipe = engine.pipeline
        schemas = {t.name: t.input_schema for t in client_tools(body)} or None
        prompt, forced = force_tool_call(
            pipe, prompt, in_thinking, body.tool_choice, list(schemas or {}), "anthropic"
        )
        check_context(engine, len(prompt), anthropic=True)
        stops = list(body.stop_sequences or [])
        params = GenParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=stops,
            reasoning_budget=_budget(body),
        )
        opts = options(engine, limits, len(prompt), params, rendered.marks)
        markers = markers_for(template_text(pipe.tokenizer))
        shaper = Shaper(True, in_thinking, schemas, markers=markers, forced=forced)
        job = submit(engine, prompt, opts, request)
        mid = "msg_" + secrets.token_hex(12)
        model = body.model or model_id(pipe)
        if body.stream:
            gen = _stream(state, pipe, job, shaper, mid, model, len(prompt), keep_thinking, stops)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(gen, media_type="text/event-stream", headers=headers)
        whole = await collect(job, limits.keepalive_s, request, shaper, error_type="api_error")
        thinking, text, calls, result = whole.reasoning, whole.text, whole.calls, whole.result
        content: list[dict] = []
        if thinking and keep_thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": SIGNATURE})
        if text or not (calls or content):
            content.append({"type": "text", "text": text})
        for c in calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + c.id[5:],
                    "name": c.name,
                    "input": c.arguments,
                }
            )
        stop_seq = matched_stop(pipe, result, stops)
        return {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": _stop_reason(result.finish_reason, calls, stop_seq),
            "stop_sequence": stop_seq,
            "usage": _usage(len(prompt), result),
            "x_outrider": x_outrider(pipe, result),
        }

    return r


async def _stream(state, pipe, job, shaper, mid, model, n_prompt, keep_thinking, stops):
    """message_start, ping, content blocks (opened once their kind is known), tool_use blocks
    whole at the end, message_delta, message_stop; a ping every keep-alive period."""
    start = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0},
    }
    yield sse_event("message_start", {"type": "message_start", "message": start})
    yield sse_event("ping", {"type": "ping"})
    index, open_kind = -1, None

    def close() -> list[str]:
        out = []
        if open_kind == "reasoning":
            sig = {"type": "signature_delta", "signature": SIGNATURE}
            out.append(
                sse_event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": sig},
                )
            )
        if open_kind is not None:
            out.append(
                sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
            )
        return out

    def emit(kind: str, text: str) -> list[str]:
        nonlocal index, open_kind
        if kind == "reasoning" and not keep_thinking:
            return []
        out = []
        if kind != open_kind:
            out += close()
            index += 1
            open_kind = kind
            block = (
                {"type": "thinking", "thinking": ""}
                if kind == "reasoning"
                else {"type": "text", "text": ""}
            )
            out.append(
                sse_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": block},
                )
            )
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "reasoning"
            else {"type": "text_delta", "text": text}
        )
        out.append(
            sse_event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        )
        return out

    result = None
    async for kind, value in events(job, state.limits.keepalive_s):
        if kind == "keepalive":
            yield sse_event("ping", {"type": "ping"})
        elif kind == "chunk":
            for k, text in shaper.feed(value.text):
                for frame in emit(k, text):
                    yield frame
        elif kind == "error":
            err = {
                "type": "api_error",
                "message": failure(value),
            }
            yield sse_event("error", {"type": "error", "error": err})
            return
        elif kind == "end":
            result = value
    if result is None:
        return
    pieces, calls = shaper.finish()
    for k, text in pieces:
        for frame in emit(k, text):
            yield frame
    if index < 0 and not calls:
        for frame in emit("content", ""):
            yield frame
    for frame in close():
        yield frame
    for c in calls:
        index += 1
        block = {"type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name, "input": {}}
        yield sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )
        delta = {"type": "input_json_delta", "partial_json": c.arguments_json}
        yield sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
    stop_seq = matched_stop(pipe, result, stops)
    delta = {
        "stop_reason": _stop_reason(result.finish_reason, calls, stop_seq),
        "stop_sequence": stop_seq,
    }
    usage = _usage(n_prompt, result)
    yield sse_event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": delta,
            "usage": usage,
            "x_outrider": x_outrider(pipe, result),
        },
    )
    yield sse_event("message_stop", {"type": "message_stop"})
