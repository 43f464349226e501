"""Tool calls in each model family's own syntax, parsed into one neutral form.

Syntaxes: Hermes/Qwen JSON (`<tool_call>{"name": …, "arguments": …}</tool_call>`), Gemma-4
(`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`), the XML function form
(`<function=NAME><parameter=K>value</parameter></function>`, optionally inside `<tool_call>`),
LiquidAI LFM2's Python calls (`<|tool_call_start|>[get_weather(city="Paris", days=3)]
<|tool_call_end|>`, read with `ast`, never run; positional arguments take the schema's order)
Muse-Glimmer's ATEM form (`<atem:function_calls><atem:invoke name="N"><atem:parameter
name="K">value</atem:parameter></atem:invoke></atem:function_calls>`) and MiniCPM5's
(`<function name="N"><param name="K">value</param></function>`).
A call is reported only once it is complete and valid (a known tool, arguments an object);
anything else stays text. `ToolGate` streams answer text until the first call marker and holds
the rest for parsing at the end.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field

MARKERS = ("<tool_call>", "<|tool_call>", "<function=", "<|tool_call_start|>")
MARKERS += ("<atem:function_calls>", "<atem:invoke", '<function name="')
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_GEMMA = re.compile(r"<\|tool_call>call:([\w.\-]+)\{(.*?)\}<tool_call\|>", re.S)
_XML = re.compile(
    r"(?:<tool_call>\s*)?<function=([\w.\-]+)>(.*?)</function>(?:\s*</tool_call>)?", re.S
)
_XML_PARAM = re.compile(r"<parameter=([\w.\-]+)>\n?(.*?)\n?</parameter>", re.S)
_GEMMA_STR = '<|"|>'
_LFM2 = re.compile(r"<\|tool_call_start\|>(.*?)<\|tool_call_end\|>", re.S)
_ATEM = re.compile(
    r"(?:<atem:function_calls>\s*)?((?:<atem:invoke name=\"[^\"]+\">.*?</atem:invoke>\s*)+)"
    r"(?:</atem:function_calls>)?",
    re.S,
)
_ATEM_INVOKE = re.compile(r'<atem:invoke name="([^"]+)">(.*?)</atem:invoke>', re.S)
_ATEM_PARAM = re.compile(r'<atem:parameter name="([^"]+)">(.*?)</atem:parameter>', re.S)
_MINICPM = re.compile(
    r'(?:<tool_call>\s*)?<function name="([\w.\-]+)">(.*?)</function>(?:\s*</tool_call>)?', re.S
)
_MINICPM_PARAM = re.compile(r'<param name="([^"]+)">\n?(.*?)\n?</param>', re.S)
_PY_WORDS = {"true": True, "false": False, "null": None}  # JSON spellings in a Python call


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


def _python_value(node: ast.expr):
    """A literal argument of a Python-syntax call (no names, no calls: nothing is evaluated)."""
    if isinstance(node, ast.Name) and node.id in _PY_WORDS:
        return _PY_WORDS[node.id]
    return ast.literal_eval(node)


def _python_calls(body: str, order) -> list[ToolCall] | None:
    """LFM2's `[f(a=1), g("x")]` as calls, or None when it is not a list of plain calls with
    literal arguments; `order(name)` lists a tool's parameters for positional arguments."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
        items = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for item in items:
            if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name):
                return None
            names = order(item.func.id)
            if len(item.args) > len(names) or any(k.arg is None for k in item.keywords):
                return None
            args = {k: _python_value(v) for k, v in zip(names, item.args)}
            args.update({k.arg: _python_value(k.value) for k in item.keywords})
            calls.append(ToolCall(item.func.id, args))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


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

    def typed(name: str, pairs: list[tuple[str, str]]) -> dict:
        """Tag-delimited (key, text) arguments, each typed by the tool's schema."""
        kinds = types(name)
        return {k: _scalar(v, kinds.get(k)) for k, v in pairs}

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
        if known(m.group(1)):
            args = typed(m.group(1), _XML_PARAM.findall(m.group(2)))
            calls.append((m.start(), m.end(), ToolCall(m.group(1), args)))
    for m in _MINICPM.finditer(text):
        if known(m.group(1)):
            args = typed(m.group(1), _MINICPM_PARAM.findall(m.group(2)))
            calls.append((m.start(), m.end(), ToolCall(m.group(1), args)))
    for m in _LFM2.finditer(text):
        found = _python_calls(m.group(1), lambda name: list(types(name)))
        if found and all(known(c.name) for c in found):  # one block: all of it, or text
            calls.extend((m.start(), m.end(), c) for c in found)
    for m in _ATEM.finditer(text):
        found = [
            ToolCall(name, typed(name, _ATEM_PARAM.findall(body)))
            for name, body in _ATEM_INVOKE.findall(m.group(1))
        ]
        if found and all(known(c.name) for c in found):
            calls.extend((m.start(), m.end(), c) for c in found)
    calls.sort(key=lambda c: c[0])
    kept, last = [], 0
    for start, end, _ in calls:
        kept.append(text[last : max(start, last)])  # a block of several calls is cut once
        last = max(last, end)
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
