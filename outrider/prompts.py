"""Turning a user's prompt into the ids the target sees."""

from __future__ import annotations

from typing import Any

from .core.errors import OutriderError
from .server.reasoning import close_thinking, markers_for


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


def encode_prompt(
    tokenizer: Any,
    prompt: str | list[int],
    system: str | None = None,
    raw: bool = False,
    thinking: bool | None = None,
) -> list[int]:
    """A single user turn (chat-templated unless raw); a list of ints passes through."""
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    if not prompt.strip():  # one rule for the CLI, the Python API and the server's completions
        raise OutriderError("the prompt is empty")
    if raw:
        return list(tokenizer.encode(prompt))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return encode_messages(tokenizer, messages, thinking=thinking)
