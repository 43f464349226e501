"""Text checks for what reaches a tokenizer: lone UTF-16 surrogates (valid JSON, encodable
by no tokenizer) and the stand-in line for content a text model cannot read."""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(data: Any) -> str | None:
    """The JSON path of the first string (value or key) holding a lone UTF-16 surrogate, which
    JSON allows ("\\ud800") but no tokenizer can encode; None when every string is clean.
    Iterative, so deeply nested input cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for k, v in value.items():
                key = str(k)
                if _SURROGATE.search(key):
                    return f"{path}.{key.encode('utf-8', 'backslashreplace').decode()}"
                stack.append((v, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
    return None


# What a model reads where a message held content it cannot see (`unseen`): a line saying
# so. A refusal would end the conversation: Claude Code resends a pasted screenshot, or an
# image a tool read, with every later turn. The model can then tell the user what it missed.
UNSEEN = {
    "image": "an image",
    "image_url": "an image",
    "input_image": "an image",
    "document": "a document",
    "file": "a file",
    "input_file": "a file",
    "container_upload": "a file",
    "audio": "audio",
    "input_audio": "audio",
}


def unseen(kind: str) -> str:
    """The stand-in for a content part of `kind` the target cannot read."""
    what = UNSEEN.get(kind, f"a {kind[:64]!r} part")
    return f"[{what} was attached here; this model reads text only and cannot see it]"
