"""Chat messages (OpenAI shape) -> the token ids the target sees, through its chat template."""

from __future__ import annotations

import json
from typing import Any

from .errors import ApiError
from .reasoning import markers_for, prompt_opens_thinking

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _text(content: Any) -> str:
    """Message content as text: strings pass, content-part lists are joined (text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", None):
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                raise ApiError(400, f"content parts of type {part.get('type')!r} are not supported")
        return "".join(parts)
    raise ApiError(400, "message content must be a string or a list of content parts")


def normalize(messages: list[dict]) -> list[dict]:
    """What chat templates can render: text content, tool-call arguments as objects, and
    system messages only at the start (later ones are folded into the next user turn as a
    <system-reminder>, which templates that insist on a leading system message accept)."""
    out: list[dict] = []
    reminders: list[str] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        msg = {"role": role, "content": _text(m.get("content"))}
        if role in ("system", "developer"):
            if out and all(o["role"] == "system" for o in out):
                out[0]["content"] += "\n\n" + msg["content"]
            elif not out:
                out.append({"role": "system", "content": msg["content"]})
            else:
                reminders.append(msg["content"])
            continue
        if reminders and role == "user":
            notes = "".join(f"<system-reminder>{r}</system-reminder>\n" for r in reminders)
            msg["content"] = notes + msg["content"]
            reminders = []
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise ApiError(
                            400, f"tool call arguments of message {i} are not valid JSON"
                        ) from None
                fn["arguments"] = args or {}
                calls.append({"id": tc.get("id"), "type": "function", "function": fn})
            msg["tool_calls"] = calls
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    if reminders:
        notes = "".join(f"<system-reminder>{r}</system-reminder>" for r in reminders)
        out.append({"role": "user", "content": notes})
    return out


def template_text(tokenizer: Any) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    return tpl if isinstance(tpl, str) else json.dumps(tpl or "")


def capabilities(tokenizer: Any) -> dict[str, bool]:
    tpl = template_text(tokenizer)
    return {
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "tools": "tools" in tpl,
        "thinking": "enable_thinking" in tpl or "<think>" in tpl,
        "enable_thinking": "enable_thinking" in tpl,
        "reasoning_effort": "reasoning_effort" in tpl,
    }


def nearest_efforts(effort: str | None) -> list[str | None]:
    """`effort`, then the other levels by distance, ties toward less thinking: templates know
    different words (one has low / medium / xhigh and refuses "high")."""
    if effort not in EFFORTS:
        return [effort]
    i = EFFORTS.index(effort)
    return sorted(EFFORTS, key=lambda e: (abs(EFFORTS.index(e) - i), EFFORTS.index(e) > i))


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    thinking: bool | None = None,
    reasoning_effort: str | None = None,
    extra: dict | None = None,
) -> tuple[list[int], bool]:
    """(prompt ids, whether the prompt leaves a think block open)."""
    msgs = normalize(messages)
    if not getattr(tokenizer, "chat_template", None):
        text = "\n\n".join(m["content"] for m in msgs)
        return list(tokenizer.encode(text)), False
    caps = capabilities(tokenizer)
    kwargs: dict[str, Any] = dict(extra or {})
    if thinking is not None and caps["enable_thinking"]:
        kwargs["enable_thinking"] = thinking
    if reasoning_effort is not None and caps["reasoning_effort"]:
        kwargs["reasoning_effort"] = reasoning_effort
    if tools:
        kwargs["tools"] = tools
    efforts = nearest_efforts(kwargs.get("reasoning_effort"))
    for i, effort in enumerate(efforts):
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        try:
            text = tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **kwargs
            )
            break
        except Exception as e:
            if i + 1 < len(efforts):
                continue  # a template that knows other effort words: try the nearest next
            raise ApiError(400, f"could not apply chat template: {e}") from None
    opens = prompt_opens_thinking(text, markers_for(template_text(tokenizer)))
    return list(tokenizer.encode(text, add_special_tokens=False)), opens
