"""`tool_choice` that forces a call: `required` (any tool) or a named function.

outrider never bends the target's distribution, so it forces a call the one lossless way: the
assistant turn is begun with the opening of a call in the model's own tool-call syntax (read
from its chat template), and the model writes the rest. A named function begins the call with
its name, so only that function's arguments are left to write. A template with no syntax we
know cannot be forced, and the request is refused with a 400 naming `tool_choice`.

Where the template left a think block open, the opening closes it first: a forced call comes
before any further reasoning.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ApiError


def requested_call(choice: Any, tools: list[str], api: str) -> tuple[bool, str | None]:
    """(force a call, the function it must be) from an OpenAI, Responses or Anthropic
    `tool_choice`; refuses a forced call without tools or naming an unknown function."""
    name: str | None = None
    if choice is None or choice in ("auto", "none"):
        return False, None
    if isinstance(choice, dict):
        kind = choice.get("type")
        if api == "anthropic":
            if kind in ("auto", "none"):
                return False, None
            if kind not in ("any", "tool"):
                raise ApiError(400, f"unknown tool_choice type {kind!r}", param="tool_choice")
            name = choice.get("name") if kind == "tool" else None
            if kind == "tool" and not isinstance(name, str):
                raise ApiError(400, "tool_choice of type 'tool' needs a name", param="tool_choice")
        else:
            if kind != "function":
                raise ApiError(400, f"unsupported tool_choice type {kind!r}", param="tool_choice")
            name = (choice.get("function") or {}).get("name") or choice.get("name")
            if not isinstance(name, str):
                raise ApiError(400, "tool_choice names no function", param="tool_choice")
    elif choice != "required":
        raise ApiError(400, f"unknown tool_choice {choice!r}", param="tool_choice")
    if not tools:
        raise ApiError(400, "tool_choice forces a tool call, but no tools were given",
                       param="tool_choice")  # fmt: skip
    if name is not None and name not in tools:
        raise ApiError(
            400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    return True, name


def call_opening(template: str, name: str | None) -> str | None:
    """The start of a tool call in the syntax `template` renders calls in; None if unknown."""
    if "<|tool_call_start|>" in template or "<|tool_list_start|>" in template:
        # LiquidAI LFM2: <|tool_call_start|>[NAME(key="value")]<|tool_call_end|>
        return "<|tool_call_start|>[" + (f"{name}(" if name else "")
    if "<atem:" in template:  # Muse-Glimmer's ATEM form
        return '<atem:function_calls>\n<atem:invoke name="' + (f'{name}">' if name else "")
    if "<|tool_call>" in template:  # Gemma-4: <|tool_call>call:NAME{...}<tool_call|>
        return "<|tool_call>call:" + (f"{name}{{" if name else "")
    if "<function=" in template:  # the XML function form (Qwen3-Coder and others)
        return "<tool_call>\n<function=" + (f"{name}>" if name else "")
    if "<tool_call>" in template:  # Hermes / Qwen JSON
        if name is None:
            return "<tool_call>"
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '
    return None


def forced_opening(
    template: str, choice: Any, tools: list[str], api: str, close_thinking: str | None
) -> str:
    """The text that begins the assistant turn for `tool_choice` ("" when nothing is forced).

    `close_thinking` is the marker that closes a think block the prompt left open (None when
    none is open)."""
    force, name = requested_call(choice, tools, api)
    if not force:
        return ""
    opening = call_opening(template, name)
    if opening is None:
        raise ApiError(
            400,
            "tool_choice forces a tool call, but this model's chat template renders no tool-call "
            "syntax outrider knows (Hermes <tool_call>, Gemma-4 <|tool_call>, <function=>, "
            "LFM2 <|tool_call_start|>, ATEM <atem:invoke>)",
            param="tool_choice",
        )
    return (f"{close_thinking}\n\n" if close_thinking else "") + opening
