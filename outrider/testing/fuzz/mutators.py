"""The mutations: each takes a draft request and changes one thing about it, saying what."""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from typing import Any

from .json_text import Pairs, Raw, dumps, encode
from .requests import FuzzTarget
from .seeds import Route
from .values import (
    CONTENT_TYPES,
    FIELDS,
    INVALID_UTF8,
    NUMBERS,
    SURROGATES,
    TEMPLATES,
    UNICODE,
)


class _Draft:
    """A request being mutated: the JSON value until a byte-level mutation serialises it."""

    def __init__(self, route: Route, value: Any, target: FuzzTarget, max_bytes: int) -> None:
        self.route, self.value, self.target, self.max_bytes = route, value, target, max_bytes
        self.method, self.path = route.method, route.path
        self.raw: bytes | None = None
        self.headers: dict[str, str] = {}
        if value is not None:
            self.headers["Content-Type"] = "application/json"
        if target.api_key:
            self.headers["Authorization"] = f"Bearer {target.api_key}"
        self.chunked = False

    def body(self) -> bytes | None:
        if self.raw is None and self.value is not None:
            self.raw = encode(dumps(self.value))
        return self.raw


def _sites(value: Any, parent: Any = None, key: Any = None, depth: int = 0) -> list[tuple]:
    """(parent, key) for every value in the tree; (None, None) is the root."""
    out = [(parent, key)]
    if depth > 8:
        return out
    if type(value) is dict:
        for k, v in value.items():
            out += _sites(v, value, k, depth + 1)
    elif type(value) is list:
        for i, v in enumerate(value[:20]):
            out += _sites(v, value, i, depth + 1)
    return out


def _get(d: _Draft, site: tuple) -> Any:
    parent, key = site
    return d.value if parent is None else parent[key]


def _set(d: _Draft, site: tuple, new: Any) -> None:
    parent, key = site
    if parent is None:
        d.value = new
    else:
        parent[key] = new


def _pick_site(rng: random.Random, d: _Draft, want: Callable[[Any], bool]) -> tuple:
    sites = _sites(d.value)
    fitting = [s for s in sites if want(_get(d, s))]
    return rng.choice(fitting or sites)


def _is_dict(v: Any) -> bool:
    return type(v) is dict and bool(v)


def _drop(rng: random.Random, d: _Draft) -> str:
    site = _pick_site(rng, d, _is_dict)
    obj = _get(d, site)
    if not _is_dict(obj):
        _set(d, site, None)
        return "drop: value -> null"
    k = rng.choice(list(obj))
    del obj[k]
    return f"drop {k!r}"


def _duplicate(rng: random.Random, d: _Draft) -> str:
    site = _pick_site(rng, d, _is_dict)
    obj = _get(d, site)
    if not _is_dict(obj):
        _set(d, site, [obj, obj])
        return "duplicate value in a list"
    k = rng.choice(list(obj))
    other = rng.choice([None, "dup", -1, [], obj[k]])
    pairs = list(obj.items()) + [(k, other)]
    if rng.random() < 0.5:
        pairs = [(k, other)] + list(obj.items())
    _set(d, site, Pairs(pairs))
    return f"duplicate key {k!r} ({dumps(other)[:20]})"


def _rename(rng: random.Random, d: _Draft) -> str:
    site = _pick_site(rng, d, _is_dict)
    obj = _get(d, site)
    if not _is_dict(obj):
        return _swap_type(rng, d)
    k = rng.choice(list(obj))
    ways = [
        k[:-1],
        k.upper(),
        k + "_",
        " " + k,
        k.replace("_", "") or "x",
        "\u0430" + k[1:],  # Cyrillic a: a homoglyph
        k + "\x00",
        Raw(json.dumps(k)[:-1] + '\\ud800"'),
        "",
    ]
    new = rng.choice(ways)
    obj[new] = obj.pop(k)
    return f"rename {k!r} -> {dumps(new) if isinstance(new, Raw) else repr(new)}"


def _swap_type(rng: random.Random, d: _Draft) -> str:
    site = _pick_site(rng, d, lambda v: True)
    old = _get(d, site)
    pool = ["4", 4, 4.5, True, False, None, [], {}, "", 0, -1, "true", "null", [old], {"v": old}]
    new = rng.choice([p for p in pool if type(p) is not type(old)] or pool)
    _set(d, site, new)
    return f"swap {type(old).__name__} at {site[1]!r} -> {dumps(new)[:40]}"


def _number(rng: random.Random, d: _Draft) -> str:
    numeric = lambda v: type(v) in (int, float)  # noqa: E731
    site = _pick_site(rng, d, numeric if rng.random() < 0.8 else lambda v: True)
    new = rng.choice(NUMBERS)
    _set(d, site, new)
    return f"number at {site[1]!r} -> {dumps(new)[:24]}"


def _unicode(rng: random.Random, d: _Draft) -> str:
    site = _pick_site(rng, d, lambda v: type(v) is str)
    old = _get(d, site)
    edge = rng.choice(SURROGATES + UNICODE + UNICODE)
    if type(old) is str and old and rng.random() < 0.6:
        cut = rng.randrange(len(old) + 1)
        if isinstance(edge, Raw):  # splice the escape inside the string's JSON text
            new: Any = Raw(json.dumps(old[:cut])[:-1] + edge[1:-1] + json.dumps(old[cut:])[1:])
        else:
            new = old[:cut] + edge + old[cut:]
    else:
        new = edge
    _set(d, site, new)
    return f"unicode at {site[1]!r}: {ascii(str(edge))[:30]}"


def _oversize(rng: random.Random, d: _Draft) -> str:
    budget = max(1000, d.max_bytes - len(dumps(d.value)) - 100)
    size = min(budget, int(10 ** rng.uniform(3, math.log10(d.max_bytes))))
    if rng.random() < 0.25:  # near the largest body allowed (a server's body limit is near)
        size = int(budget * rng.uniform(0.6, 1.0))
    kind = rng.choice(["string", "string", "list", "nest", "keys", "messages"])
    site = _pick_site(rng, d, lambda v: type(v) in (str, list))
    old = _get(d, site)
    if kind == "string":
        unit = rng.choice(["a", "word ", "\U0001f642", "\u00e9", "<|im_end|>"])
        n = max(1, size // len(encode(unit)))
        new: Any = unit * n
        if rng.random() < 0.2:
            new = Raw('"' + "\\u0000" * max(1, size // 6) + '"')
    elif kind == "list":
        elem = old[0] if type(old) is list and old else old
        n = max(2, min(20_000, size // max(1, len(encode(dumps(elem))) + 1)))
        new = [elem] * n
    elif kind == "nest":
        depth = max(2, min(size // 2, rng.choice([100, 1000, 10_000, 100_000])))
        new = Raw("[" * depth + "]" * depth)
        if rng.random() < 0.5:
            depth = max(2, min(size // 6, depth))
            new = Raw('{"a":' * depth + "1" + "}" * depth)
    elif kind == "keys":
        new = {f"k{i}": i for i in range(min(20_000, size // 12))}
    else:
        if type(d.value) is not dict or "messages" not in d.value:
            return _oversize(rng, d) if rng.random() < 0.5 else "oversize: none"
        n = max(2, min(5000, size // 40))
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        d.value["messages"] = msgs * (n // 2) + [{"role": "user", "content": "hi"}]
        return f"oversize: {n} messages"
    _set(d, site, new)
    return f"oversize {kind} at {site[1]!r} (~{len(dumps(new))} bytes)"


def _set_field(rng: random.Random, d: _Draft) -> str:
    pool = FIELDS.get(d.route.fields)
    if not pool:
        return _swap_type(rng, d)
    if type(d.value) is not dict:
        d.value = {}
    name = rng.choice(sorted(pool))
    new = rng.choice(pool[name])
    if name == "model" and new == "-missing":
        new = d.target.path + "-missing"
    d.value[name] = copy.deepcopy(new)
    return f"set {name} = {dumps(new)[:60]}"


def _chat_template(rng: random.Random, d: _Draft) -> str:
    if type(d.value) is not dict:
        d.value = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tpl = rng.choice(TEMPLATES)
    if rng.random() < 0.7:
        d.value["chat_template_kwargs"] = {"chat_template": tpl}
    else:  # vLLM's top-level field
        d.value["chat_template"] = tpl
    return f"chat_template {tpl[:50]!r}"


def _add_unknown(rng: random.Random, d: _Draft) -> str:
    if type(d.value) is not dict:
        return _swap_type(rng, d)
    name = rng.choice(["x", "extra_body", "__proto__", "constructor", "\u202ename", "a" * 1000])
    d.value[name] = rng.choice([1, "x", None, {"nested": [1]}, SURROGATES[2]])
    return f"unknown field {name[:20]!r}"


def _root(rng: random.Random, d: _Draft) -> str:
    new = rng.choice([[], [d.value], "str", 1, None, True, Raw("NaN"), {}])
    d.value = new
    return f"root -> {dumps(new)[:30]}"


def _truncate(rng: random.Random, d: _Draft) -> str:
    body = d.body() or b""
    cut = rng.randrange(len(body)) if body else 0
    d.raw = body[:cut]
    return f"truncate at {cut}/{len(body)}"


def _garble(rng: random.Random, d: _Draft) -> str:
    body = bytearray(d.body() or b"{}")
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(body) + 1)
        how = rng.random()
        if how < 0.4 and body:
            body[min(i, len(body) - 1)] = rng.randrange(256)
        elif how < 0.7:
            body[i:i] = rng.choice([b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"\x00"])
        else:
            del body[i : i + rng.randint(1, 16)]
    d.raw = bytes(body)
    return "garble"


def _invalid_utf8(rng: random.Random, d: _Draft) -> str:
    body = d.body() or b"{}"
    quotes = [i + 1 for i, b in enumerate(body) if b == 0x22] or [0]
    i = rng.choice(quotes) if rng.random() < 0.8 else rng.randrange(len(body) + 1)
    bad = rng.choice(INVALID_UTF8)
    d.raw = body[:i] + bad + body[i:]
    return f"invalid utf-8 {bad!r} at {i}"


def _control_chars(rng: random.Random, d: _Draft) -> str:
    body = d.body() or b"{}"
    quotes = [i + 1 for i, b in enumerate(body) if b == 0x22] or [0]
    i = rng.choice(quotes)
    bad = rng.choice([b"\x00", b"\x01", b"\n", b"\x1f", b"\t", b"\r\n"])
    d.raw = body[:i] + bad + body[i:]
    return f"raw control char {bad!r} at {i}"


def _reencode(rng: random.Random, d: _Draft) -> str:
    text = dumps(d.value) if d.raw is None else d.raw.decode("utf-8", "surrogatepass")
    how = rng.choice(["utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1"])
    d.raw = text.encode(how, "surrogatepass" if how.startswith("utf") else "replace")
    return f"body encoded {how}"


def _trailing(rng: random.Random, d: _Draft) -> str:
    extra = rng.choice([b"}", b",", b"garbage", b"\x00", b"{}", b"\n" * 1000, b" " * 10000])
    d.raw = (d.body() or b"") + extra
    return f"trailing {extra[:10]!r}"


def _replace_body(rng: random.Random, d: _Draft) -> str:
    new = rng.choice(
        [b"", b"", b"null", b"[]", b"1", b'"x"', b"true", b"a=1&b=2", b"<xml/>", b"{", b"}"]
        + [b"\x00" * 10, b"\xff\xfe", b"{}" * 3, b"NaN", b"--xyz\r\n\r\n--xyz--"]
    )
    d.raw = new
    return f"body = {new[:20]!r}"


def _content_type(rng: random.Random, d: _Draft) -> str:
    ct = rng.choice(CONTENT_TYPES)
    if ct is None:
        d.headers.pop("Content-Type", None)
    else:
        d.headers["Content-Type"] = ct
    return f"content-type {ct!r}"


def _auth(rng: random.Random, d: _Draft) -> str:
    if not d.target.api_key:
        return _content_type(rng, d)
    key = d.target.api_key
    d.headers.pop("Authorization", None)
    how = rng.choice(["none", "wrong", "empty", "lower", "x-api-key", "x-api-key-space", "long"])
    if how == "wrong":
        d.headers["Authorization"] = "Bearer " + key + "x"
    elif how == "empty":
        d.headers["Authorization"] = "Bearer "
    elif how == "lower":
        d.headers["Authorization"] = "bearer " + key
    elif how == "x-api-key":
        d.headers["x-api-key"] = key
    elif how == "x-api-key-space":
        d.headers["x-api-key"] = key + " "
    elif how == "long":
        d.headers["Authorization"] = "Bearer " + "k" * 6000
    return f"auth {how}"


def _origin(rng: random.Random, d: _Draft) -> str:
    origin = rng.choice(["http://evil.example", "null", "http://localhost", "file://", "\x7f"])
    d.headers["Origin"] = origin
    return f"origin {origin!r}"


def _path(rng: random.Random, d: _Draft) -> str:
    how = rng.choice(["slash", "beta", "query", "bad-query", "double", "upper", "long-query"])
    p = d.path
    d.path = {
        "slash": p + "/",
        "beta": p + "?beta=true",
        "query": p + "?stream=true&max_tokens=-1",
        "bad-query": p + "?%ff=%fe&a=%00",
        "double": "/" + p,
        "upper": p.upper(),
        "long-query": p + "?q=" + "x" * 4000,
    }[how]
    return f"path {how}"


def _chunked(rng: random.Random, d: _Draft) -> str:
    d.chunked = True
    return "chunked transfer"


TREE, BYTES, HTTP = 0, 1, 2
MUTATORS: list[tuple[str, int, float, Callable[[random.Random, _Draft], str]]] = [
    ("drop", TREE, 8, _drop),
    ("duplicate", TREE, 5, _duplicate),
    ("rename", TREE, 5, _rename),
    ("swap_type", TREE, 12, _swap_type),
    ("number", TREE, 10, _number),
    ("unicode", TREE, 12, _unicode),
    ("oversize", TREE, 4, _oversize),
    ("set_field", TREE, 18, _set_field),
    ("chat_template", TREE, 4, _chat_template),
    ("unknown_field", TREE, 2, _add_unknown),
    ("root", TREE, 1.5, _root),
    ("truncate", BYTES, 4, _truncate),
    ("garble", BYTES, 3, _garble),
    ("invalid_utf8", BYTES, 6, _invalid_utf8),
    ("control_chars", BYTES, 2, _control_chars),
    ("reencode", BYTES, 2, _reencode),
    ("trailing", BYTES, 1.5, _trailing),
    ("replace_body", BYTES, 3, _replace_body),
    ("content_type", HTTP, 5, _content_type),
    ("auth", HTTP, 1.5, _auth),
    ("origin", HTTP, 1, _origin),
    ("path", HTTP, 1.5, _path),
    ("chunked", HTTP, 0.5, _chunked),
]
BODYLESS = [("replace_body", _replace_body), ("content_type", _content_type), ("auth", _auth)]
BODYLESS += [("origin", _origin), ("path", _path), ("chunked", _chunked)]


def _mutate_body(rng: random.Random, d: _Draft) -> list[str]:
    k = rng.choices([0, 1, 2, 3], [5, 55, 28, 12])[0]
    names = [m for m in MUTATORS if m[0] != "chat_template" or d.route.fields == "chat"]
    chosen = rng.choices(names, [m[2] for m in names], k=k)
    if sum(m[1] == BYTES for m in chosen) > 1:  # one byte-level change; the rest on the tree
        first = next(i for i, m in enumerate(chosen) if m[1] == BYTES)
        chosen = [m for i, m in enumerate(chosen) if m[1] != BYTES or i == first]
    done = []
    for _name, _phase, _w, fn in sorted(chosen, key=lambda m: m[1]):
        done.append(fn(rng, d))
    return done


def _mutate_bodyless(rng: random.Random, d: _Draft) -> list[str]:
    k = rng.choices([0, 1, 2], [30, 55, 15])[0]
    done = []
    for _name, fn in rng.sample(BODYLESS, k):
        if fn is _replace_body and rng.random() < 0.5:  # a JSON body where none belongs
            d.value = {"model": d.target.model, "x": [1, None, SURROGATES[0]]}
            done.append("json body")
            continue
        done.append(fn(rng, d))
    return done
