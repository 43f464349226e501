"""Turning a user's prompt into the ids the target sees."""

from __future__ import annotations

from typing import Any

from .chat.reasoning import close_thinking, markers_for
from .chat.render import render_chat
from .core.errors import OutriderError, PromptError


def encode_messages(
    tokenizer: Any, messages: list[dict], thinking: bool | None = None, **template_kwargs: Any
) -> list[int]:
    """Apply the model's chat template (with `enable_thinking` where the template reads it;
    with thinking off, a think block the template opens anyway is closed empty)."""
    if not getattr(tokenizer, "chat_template", None):
        text = "\n\n".join(str(m.get("content", "")) for m in messages)
        return list(tokenizer.encode(text))
    kwargs = dict(template_kwargs)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    if thinking is False:
        text = close_thinking(text, markers_for(str(tokenizer.chat_template)))
    return list(tokenizer.encode(text, add_special_tokens=False))


Prompt = str | list[int] | list[dict]  # a user turn, token ids, or a conversation's messages


def is_conversation(prompt: Prompt) -> bool:
    """Whether `prompt` is a list of chat messages (dicts with a role and content)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _conversation(system: str | None, messages: list[dict]) -> list[dict]:
    """`messages` after the system message `system`, where one is given."""
    return ([{"role": "system", "content": system}] if system else []) + list(messages)


def render_prompt(
    tokenizer: Any,
    prompt: Prompt,
    system: str | None = None,
    raw: bool = False,
    thinking: bool | None = None,
) -> tuple[list[int], tuple[int, ...]]:
    """The ids of `prompt` (`encode_prompt`) and the places a prefix-cache snapshot serves
    the prompts that follow it (`Rendered.marks`: where the system message ended and where the
    last message did; empty for token ids, raw text, or a template whose rendering does not
    say): what the server sets for each chat request, for Python callers alike."""
    if isinstance(prompt, str) and not raw:  # a user turn: rendered as its conversation is
        conversation = _conversation(system, [{"role": "user", "content": prompt}])
        ids = encode_prompt(tokenizer, prompt, system=system, thinking=thinking)
        rendered = _rendered(tokenizer, conversation, thinking, quiet=True)
        marks = rendered.marks if rendered is not None and rendered.ids == ids else ()
        return ids, marks
    if not is_conversation(prompt) or raw:
        return encode_prompt(tokenizer, prompt, system=system, raw=raw, thinking=thinking), ()
    rendered = _rendered(tokenizer, _conversation(system, prompt), thinking)
    return rendered.ids, rendered.marks


def _rendered(
    tokenizer: Any, messages: list[dict], thinking: bool | None, quiet: bool = False
) -> Any:
    """`render_chat`'s rendering, its refusals as OutriderError (None when `quiet`)."""
    try:
        return render_chat(tokenizer, messages, thinking=thinking)
    except PromptError as e:
        if quiet:
            return None
        raise OutriderError(f"the conversation cannot be rendered: {e.message}") from None


def encode_prompt(
    tokenizer: Any,
    prompt: Prompt,
    system: str | None = None,
    raw: bool = False,
    thinking: bool | None = None,
) -> list[int]:
    """A single user turn (chat-templated unless raw), or a conversation's messages (OpenAI
    style: role and content, a system prompt first where `system` is given) rendered by the
    chat template as the server renders a chat request; a list of ints passes through."""
    if is_conversation(prompt):
        if raw:
            raise OutriderError("raw takes a text prompt, not a list of messages")
        return render_prompt(tokenizer, prompt, system=system, thinking=thinking)[0]
    if isinstance(prompt, list):
        if not all(hasattr(t, "__index__") for t in prompt):  # ints, numpy's included
            raise OutriderError("a list prompt is token ids (ints) or chat messages (dicts)")
        return [int(t) for t in prompt]
    if not prompt.strip():  # one rule for the CLI, the Python API and the server's completions
        raise OutriderError("the prompt is empty")
    if raw:
        return list(tokenizer.encode(prompt))
    messages = _conversation(system, [{"role": "user", "content": prompt}])
    return encode_messages(tokenizer, messages, thinking=thinking)
