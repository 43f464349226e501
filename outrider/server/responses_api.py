"""OpenAI's Responses API: `POST /v1/responses`, whole or streamed as typed events.

A request becomes a chat conversation (`instructions` the system message; `input` a string or
a list of message, `function_call` and `function_call_output` items) and runs exactly as a
chat completion does: the same template, thinking split, tool-call parsing and engine. The
answer comes back as output items: a `reasoning` item (the model's thinking, as
`reasoning_text`), a `message` with one `output_text` part, and one `function_call` item per
tool call. Nothing is stored: `previous_response_id`, `conversation` and `background` are
refused (400, naming the field), as are tools other than functions and text formats other than
plain text.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ..chat.reasoning import markers_for
from ..chat.render import EFFORTS, render_chat, template_text
from ..chat.text import UNSEEN, unseen
from .checks import CheckedRequest
from .engine import model_id
from .errors import ApiError
from .generation import (
    GenParams,
    Shaper,
    check_context,
    check_model,
    collect,
    events,
    failure,
    force_tool_call,
    options,
    prompt_ids,
    ready_pipeline,
    submit,
)
from .openai_api import Tool, _tool_schemas

UNSUPPORTED = {
    "previous_response_id": "responses are not stored: send the whole conversation as input",
    "conversation": "conversations are not stored: send the whole conversation as input",
    "prompt": "stored prompts are not supported",
}


class ResponsesRequest(CheckedRequest):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    parallel_tool_calls: bool | None = None
    ignore_eos: bool = False  # outrider's, as on the other routes
    reasoning_budget: int | None = Field(default=None, ge=0, le=1 << 30)  # outrider's too


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts (an image
    or a file part becomes a line saying the model cannot see it, `chat.text.unseen`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNSEEN:
            texts.append(unseen(kind))
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise ApiError(
                400, f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                param=f"{where}.content",
            )  # fmt: skip
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's conversation as chat-completion messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role {role!r} is not supported", param=where)
            text = _content_text(item.get("content", ""), where)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key, ""), str):
                    raise ApiError(400, f"{where}.{key} must be a string", param=where)
            call = {
                "id": item.get("call_id") or item.get("id") or f"call_{i}",
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id", ""), str):
                raise ApiError(400, f"{where}.call_id must be a string", param=where)
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # earlier thinking is not sent back to the model (as chat templates do)
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported",
                           param=where)  # fmt: skip
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    """Responses' flat function tools as chat-completion tools (validated the same way)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ApiError(
                400, f"tools[{i}]: only function tools are supported, got {t.get('type')!r}",
                param="tools",
            )  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        try:
            out.append(Tool.model_validate({"type": "function", "function": fn}))
        except ValueError as e:
            raise ApiError(400, f"tools[{i}]: {e.errors()[0]['msg']}", param="tools") from None
    return out


def check_supported(body: ResponsesRequest) -> None:
    extra = body.model_extra or {}
    for name, why in UNSUPPORTED.items():
        if extra.get(name) is not None:
            raise ApiError(400, f"{name} is not supported: {why}", param=name)
    if body.background:
        raise ApiError(400, "background responses are not supported", param="background")
    fmt = (body.text or {}).get("format") or {}
    if not isinstance(fmt, dict):
        raise ApiError(400, "text.format must be an object", param="text.format")
    if fmt.get("type", "text") != "text":
        raise ApiError(400, f"text.format {fmt.get('type')!r} is not supported (only text)",
                       param="text.format")  # fmt: skip


class Output:
    """The response's output items as the generation makes them, for both shapes."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.calls: list[dict] = []

    def item(self, kind: str, status: str = "completed") -> dict[str, Any]:
        if kind == "reasoning":
            body = "".join(self.reasoning) if status == "completed" else ""
            return {"id": f"rs_{self.rid}", "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": body}], "status": status}  # fmt: skip
        body = "".join(self.text) if status == "completed" else ""
        part = {"type": "output_text", "text": body, "annotations": [], "logprobs": []}
        return {"id": f"msg_{self.rid}", "type": "message", "role": "assistant",
                "status": status, "content": [part]}  # fmt: skip

    def items(self) -> list[dict[str, Any]]:
        out = [self.item("reasoning")] if self.reasoning else []
        if self.text or not self.calls:
            out.append(self.item("message"))
        return out + self.calls


def _call_item(call: Any, i: int, rid: str) -> dict[str, Any]:
    args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
    return {"id": f"fc_{rid}_{i}", "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": args, "status": "completed"}  # fmt: skip


def response_object(body, rid, created, model, output: Output, result, status="completed"):
    usage = None
    if result is not None:
        n_in, n_out = len(result.prompt_tokens), len(result.tokens)
        usage = {
            "input_tokens": n_in,
            "input_tokens_details": {
                "cached_tokens": result.cached_tokens,
                "cache_write_tokens": 0,
            },  # fmt: skip
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_in + n_out,
        }
    incomplete = result is not None and result.finish_reason == "length" and not output.calls
    if incomplete and status == "completed":
        status = "incomplete"
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output.items() if status != "in_progress" else [],
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "store": False,
        "text": {"format": {"type": "text"}},
        "error": None,
        "usage": usage,
    }


def router(state: Any) -> APIRouter:
    r = APIRouter()

    @r.post("/responses")
    async def responses(body: ResponsesRequest, request: Request):
        engine, limits = state.engine, state.limits
        pipe = ready_pipeline(engine)
        check_model(engine, body.model)
        check_supported(body)
        tools = chat_tools(body.tools)
        effort = (body.reasoning or {}).get("effort")
        if effort is not None and effort not in EFFORTS:
            raise ApiError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}",
                           param="reasoning.effort")  # fmt: skip
        messages = chat_messages(body)
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        rendered = await prompt_ids(
            engine, False, render_chat, pipe.tokenizer, messages, tool_dicts, limits.thinking,
            effort or limits.reasoning_effort, {},
        )  # fmt: skip
        prompt, in_thinking = rendered.ids, rendered.opens
        schemas = _tool_schemas(tools)
        prompt, forced = force_tool_call(
            pipe, prompt, in_thinking, body.tool_choice, list(schemas or {}), "responses"
        )
        check_context(engine, len(prompt), anthropic=False)
        params = GenParams(
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=None,
            stop=[],
            penalties=None,
            logprobs=None,
            ignore_eos=body.ignore_eos,
            reasoning_budget=body.reasoning_budget,
        )
        opts = options(engine, limits, len(prompt), params, rendered.marks)
        parse = body.tool_choice != "none"
        markers = markers_for(template_text(pipe.tokenizer))
        shaper = Shaper(True, in_thinking, schemas, parse, markers, forced)
        job = submit(engine, prompt, opts, request)
        rid = secrets.token_hex(12)
        created = int(time.time())
        model = body.model or model_id(pipe)
        output = Output(rid)
        if body.stream:
            frames = _stream(state, body, job, shaper, output, "resp_" + rid, created, model)
            return StreamingResponse(frames, media_type="text/event-stream", headers=_SSE)
        whole = await collect(job, limits.keepalive_s, request, shaper)
        output.reasoning = [whole.reasoning] if whole.reasoning else []
        output.text = [whole.text] if whole.text else []
        output.calls = [_call_item(c, i, rid) for i, c in enumerate(whole.calls)]
        result = whole.result
        return response_object(body, "resp_" + rid, created, model, output, result)

    return r


_SSE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _stream(state, body, job, shaper, output: Output, rid, created, model):
    """The typed events of a streamed response, in the order OpenAI sends them."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    opened: list[str] = []  # "reasoning" / "message", in the order they were opened

    def open_item(kind: str) -> list[str]:
        frames = []
        if opened and opened[-1] != kind:
            frames += close_item(opened[-1])
        if kind not in opened:
            opened.append(kind)
            index = len(opened) - 1
            item = output.item(kind, "in_progress")
            frames.append(event("response.output_item.added", output_index=index, item=item))
            part = item["content"][0]
            frames.append(event("response.content_part.added", item_id=item["id"],
                                output_index=index, content_index=0, part=part))  # fmt: skip
        return frames

    closed: set[str] = set()

    def close_item(kind: str) -> list[str]:
        if kind in closed or kind not in opened:
            return []
        closed.add(kind)
        index = opened.index(kind)
        item = output.item(kind)
        part = item["content"][0]
        done = (
            "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        )
        return [
            event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                  **({"logprobs": []} if kind == "message" else {})),
            event("response.content_part.done", item_id=item["id"], output_index=index,
                  content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def delta(kind: str, text: str) -> list[str]:
        frames = open_item(kind) if kind not in closed else []
        (output.reasoning if kind == "reasoning" else output.text).append(text)
        index = opened.index(kind)
        item_id = output.item(kind, "in_progress")["id"]
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        return frames + [event(name, item_id=item_id, output_index=index, content_index=0,
                               delta=text, **extra)]  # fmt: skip

    start = response_object(body, rid, created, model, output, None, "in_progress")
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    result = None
    async for kind, value in events(job, state.limits.keepalive_s):
        if kind == "keepalive":
            yield ": keep-alive\n\n"
        elif kind == "chunk":
            for k, text in shaper.feed(value.text):
                for frame in delta("reasoning" if k == "reasoning" else "message", text):
                    yield frame
        elif kind == "error":
            failed = response_object(body, rid, created, model, output, None, "failed")
            failed["error"] = {"code": "server_error", "message": failure(value)}
            yield event("response.failed", response=failed)
            return
        elif kind == "end":
            result = value
    if result is None:
        return
    pieces, calls = shaper.finish()
    for k, text in pieces:
        for frame in delta("reasoning" if k == "reasoning" else "message", text):
            yield frame
    if not opened and not calls:
        for frame in open_item("message"):
            yield frame
    for kind in list(opened):
        for frame in close_item(kind):
            yield frame
    for i, call in enumerate(calls):
        item = _call_item(call, i, rid.removeprefix("resp_"))
        output.calls.append(item)
        index = len(opened) + i
        pending = {**item, "arguments": "", "status": "in_progress"}
        yield event("response.output_item.added", output_index=index, item=pending)
        yield event("response.function_call_arguments.delta", item_id=item["id"],
                    output_index=index, delta=item["arguments"])  # fmt: skip
        yield event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, arguments=item["arguments"], name=item["name"])  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    final = response_object(body, rid, created, model, output, result)
    done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(done, response=final)
