"""Tool calls in each model family's own syntax, parsed into one neutral form.

Syntaxes: Hermes/Qwen JSON (`<tool_call>{"name": …, "arguments": …}</tool_call>`), Gemma-4
(`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`) and the XML function form
(`<function=NAME><parameter=K>value</parameter></function>`, optionally inside `<tool_call>`).
A call is reported only once it is complete and valid (a known tool, arguments an object);
anything else stays text. `ToolGate` streams answer text until the first call marker and holds
the rest for parsing at the end.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

MARKERS = ("<tool_call>", "<|tool_call>", "<function=")
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_GEMMA = re.compile(r"<\|tool_call>call:([\w.\-]+)\{(.*?)\}<tool_call\|>", re.S)
_XML = re.compile(
    r"(?:<tool_call>\s*)?<function=([\w.\-]+)>(.*?)</function>(?:\s*</tool_call>)?", re.S
)
_XML_PARAM = re.compile(r"<parameter=([\w.\-]+)>\n?(.*?)\n?</parameter>", re.S)
_GEMMA_STR = '<|"|>'


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _scalar(text: str, kind: str | None = None):
    """A bare value: typed by the tool's schema where known, else JSON if it parses."""
    text = text.strip()
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _gemma_args(body: str, types: dict[str, str]) -> dict | None:
    args: dict = {}
    i, n = 0, len(body)
    while i < n:
        colon = body.find(":", i)
        if colon < 0:
            return None if body[i:].strip() else args
        key = body[i:colon].strip().strip(",").strip()
        j = colon + 1
        if body.startswith(_GEMMA_STR, j):
            end = body.find(_GEMMA_STR, j + len(_GEMMA_STR))
            if end < 0:
                return None
            args[key] = body[j + len(_GEMMA_STR) : end]
            i = end + len(_GEMMA_STR)
        else:
            end = body.find(",", j)
            end = n if end < 0 else end
            args[key] = _scalar(body[j:end], types.get(key))
            i = end
        i = body.find(",", i) + 1 if body.find(",", i) >= 0 else n
    return args


def parse_tool_calls(
    text: str, schemas: dict[str, dict] | None = None
) -> tuple[str, list[ToolCall]]:
    """(text with the calls cut out, the calls). `schemas` maps tool name -> JSON schema of its
    parameters; a call to a tool not in `schemas` (when given) is not a call."""
    calls: list[tuple[int, int, ToolCall]] = []

    def known(name: str) -> bool:
        return schemas is None or name in schemas

    def types(name: str) -> dict[str, str]:
        props = ((schemas or {}).get(name) or {}).get("properties") or {}
        return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}

    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                continue
        name = obj.get("name") if isinstance(obj, dict) else None
        if isinstance(name, str) and isinstance(args, dict) and known(name):
            calls.append((m.start(), m.end(), ToolCall(name, args)))
    for m in _GEMMA.finditer(text):
        args = _gemma_args(m.group(2), types(m.group(1)))
        if args is not None and known(m.group(1)):
            calls.append((m.start(), m.end(), ToolCall(m.group(1), args)))
    for m in _XML.finditer(text):
        if any(s <= m.start() < e for s, e, _ in calls):
            continue
        kinds = types(m.group(1))
        args = {k: _scalar(v, kinds.get(k)) for k, v in _XML_PARAM.findall(m.group(2))}
        if known(m.group(1)):
            calls.append((m.start(), m.end(), ToolCall(m.group(1), args)))
    calls.sort(key=lambda c: c[0])
    kept, last = [], 0
    for start, end, _ in calls:
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    return "".join(kept).strip(), [c for _, _, c in calls]


class ToolGate:
    """Passes answer text through until a tool-call marker could be starting, then holds the
    rest; `finish` parses what was held into calls (invalid markup is released as text)."""

    def __init__(self, schemas: dict[str, dict] | None) -> None:
        self.schemas = schemas
        self._held = ""
        self._gated = False

    def feed(self, text: str) -> str:
        self._held += text
        if not self._gated:
            hits = [i for m in MARKERS if (i := self._held.find(m)) >= 0]
            if hits:
                self._gated = True
                cut = min(hits)
                out, self._held = self._held[:cut], self._held[cut:]
                return out
            keep = max(_prefix_len(self._held, m) for m in MARKERS)
            out = self._held[: len(self._held) - keep]
            self._held = self._held[len(self._held) - keep :]
            return out
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text not yet released, complete valid calls)."""
        held, self._held = self._held, ""
        if not self._gated:
            return held, []
        rest, calls = parse_tool_calls(held, self.schemas)
        return (rest if calls else held), calls


def _prefix_len(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
