"""JSON text as the fuzzer writes it: verbatim pieces, duplicate keys, non-finite numbers and
lone surrogates, which `json.dumps` would refuse or escape."""

from __future__ import annotations

import json
import math
from typing import Any

MAX_BYTES = 2_000_000


class Raw(str):
    """JSON text written into the body verbatim (NaN, 1e309, "\\ud800", deep nesting)."""


class Pairs(list):
    """A JSON object as (key, value) pairs, so that a key can appear twice."""


def dumps(value: Any) -> str:
    """JSON text for `value`: Raw pieces verbatim, Pairs with their duplicate keys, non-finite
    floats as NaN / Infinity literals, strings unescaped (lone surrogates stay surrogates)."""
    if isinstance(value, Raw):
        return str(value)
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return repr(value) if math.isfinite(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (Pairs, dict)):
        items = list(value) if isinstance(value, Pairs) else list(value.items())
        return "{" + ",".join(f"{_key(k)}:{dumps(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def _key(k: Any) -> str:
    return str(k) if isinstance(k, Raw) else json.dumps(str(k), ensure_ascii=False)


def encode(text: str) -> bytes:
    """UTF-8, with any lone surrogate written as its 3-byte (invalid UTF-8) form."""
    return text.encode("utf-8", "surrogatepass")
