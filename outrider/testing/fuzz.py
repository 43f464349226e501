"""Malformed HTTP requests for the server, generated deterministically from a seed.

Every request starts from a body that is valid for its route and takes up to three mutations:
fields dropped, duplicated, renamed or retyped, extreme numbers, unicode edge cases (lone
surrogates as JSON escapes, NUL, bidi marks, invalid UTF-8 bytes), oversized fields, truncated or
garbled JSON, a wrong Content-Type, request-supplied chat templates, wrong methods and unknown
routes. Request `index` of `seed` depends on nothing else, so a failing request can be rebuilt
alone. Requests stay cheap on two CPU cores: `max_tokens` stays small, bodies stay under
`max_bytes`, and chat templates run in linear time: the point is status codes, not load.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class FuzzTarget:
    """What the seeds name: the served model id, the folder /admin/load reloads, the API key."""

    model: str
    path: str
    api_key: str | None = None


@dataclass
class FuzzRequest:
    """One HTTP request: `route` is the report's label (the seed's route, "(unknown route)" or
    "(wrong method)"), `mutations` says what was done to the seed."""

    route: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    mutations: list[str] = field(default_factory=list)
    chunked: bool = False
    index: int = 0


# -- seeds ------------------------------------------------------------------------------------

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ATOOL = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SIMPLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _chat_seeds(model: str) -> list[dict]:
    user = {"role": "user", "content": "hi"}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return [
        {"model": model, "messages": [user], "max_tokens": 4},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                user,
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And?"},
            ],
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 1,
            "stop": ["\n"],
        },
        {
            "model": model,
            "messages": [
                user,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [TOOL],
            "tool_choice": "auto",
            "max_tokens": 8,
        },
        {
            "messages": [user],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        },
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, "there"]}],
            "max_completion_tokens": 4,
            "enable_thinking": False,
            "reasoning_effort": "low",
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "n": 1,
            "ignore_eos": True,
        },
        {
            "messages": [{"role": "developer", "content": "x"}, user],
            "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": True},
        },
        {
            "messages": [user],
            "max_tokens": 4,
            "chat_template_kwargs": {"chat_template": SIMPLE_TEMPLATE},
        },
    ]


def _completion_seeds(model: str) -> list[dict]:
    return [
        {"model": model, "prompt": "Once upon a time", "max_tokens": 4},
        {"prompt": [1, 2, 3, 4], "max_tokens": 4, "logprobs": 2, "temperature": 0.5, "seed": 7},
        {
            "prompt": ["hi"],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": "x",
            "echo": False,
        },
    ]


def _messages_seeds(model: str, count: bool) -> list[dict]:
    user = {"role": "user", "content": "hi"}
    seeds = [
        {"model": model, "max_tokens": 4, "messages": [user]},
        {
            "model": model,
            "max_tokens": 4,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And?"},
            ],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "stop_sequences": ["\n"],
        },
        {
            "model": model,
            "max_tokens": 8,
            "tools": [ATOOL],
            "tool_choice": {"type": "auto"},
            "messages": [
                user,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
                    ],
                },
            ],
        },
        {
            "max_tokens": 4,
            "stream": True,
            "system": [{"type": "text", "text": "Be brief."}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "output_config": {"effort": "low"},
            "messages": [user],
        },
        {
            "max_tokens": 4,
            "thinking": {"type": "disabled"},
            "metadata": {"user_id": "u"},
            "messages": [user, {"role": "assistant", "content": "ok"}, user],
        },
    ]
    if count:
        for s in seeds:
            for k in ("max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k"):
                s.pop(k, None)
    return seeds


def _responses_seeds(model: str) -> list[dict]:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    history = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    return [
        {"model": model, "input": "hi", "max_output_tokens": 4},
        {
            "model": model,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "Be terse.",
            "max_output_tokens": 4,
            "stream": True,
        },  # fmt: skip
        {"model": model, "input": history, "tools": [tool], "max_output_tokens": 4},
    ]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    weight: float
    seeds: Callable[[FuzzTarget], list[Any]]
    fields: str = ""  # which pool of interesting field values applies

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"


def _none(_t: FuzzTarget) -> list[Any]:
    return [None]


def _load_seeds(t: FuzzTarget) -> list[dict]:
    full = {"model": t.path, "mode": "lookup", "max_draft": 3, "context_window": 0}
    return [{"model": t.path, "mode": "lookup"}, {**full, "confidence_threshold": 0.5}]


ROUTES = [
    Route("POST", "/v1/chat/completions", 24, lambda t: _chat_seeds(t.model), "chat"),
    Route("POST", "/v1/completions", 10, lambda t: _completion_seeds(t.model), "completions"),
    Route("POST", "/v1/responses", 8, lambda t: _responses_seeds(t.model), "responses"),
    Route("POST", "/v1/messages", 15, lambda t: _messages_seeds(t.model, False), "messages"),
    Route(
        "POST", "/v1/messages/count_tokens", 7, lambda t: _messages_seeds(t.model, True), "count"
    ),
    Route("POST", "/chat/completions", 5, lambda t: _chat_seeds(t.model), "chat"),
    Route("POST", "/completions", 2, lambda t: _completion_seeds(t.model), "completions"),
    Route("POST", "/messages", 3, lambda t: _messages_seeds(t.model, False), "messages"),
    Route("POST", "/messages/count_tokens", 2, lambda t: _messages_seeds(t.model, True), "count"),
    Route("POST", "/admin/load", 3, _load_seeds, "load"),
    Route("POST", "/admin/load/cancel", 1.5, _none),
    Route("POST", "/admin/unload", 1, _none),
    Route("GET", "/health", 2, _none),
    Route("GET", "/metrics", 1.5, _none),
    Route("GET", "/v1/models", 1.5, _none),
    Route("GET", "/models", 1, _none),
    Route("GET", "/admin/status", 1, _none),
    Route("HEAD", "/", 1, _none),
]
UNKNOWN_WEIGHT, WRONG_METHOD_WEIGHT = 2.5, 4
UNKNOWN_PATHS = [
    "/v1/nope",
    "/v1/chat/completion",
    "/v2/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/admin",
    "/admin/load/now",
    "/metrics/x",
    "/v1/chat/completions/extra",
    "/%ff%fe",
    "/%00",
    "/v1/%2e%2e/health",
    "/" + "a" * 3000,
    "/v1/messages/count_tokens/1",
    "/\u00e9",
    "/favicon.ico",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


# -- interesting values -----------------------------------------------------------------------

SURROGATES = [
    Raw('"\\ud800"'),
    Raw('"\\udfff"'),
    Raw('"a\\ud83d"'),
    Raw('"\\udc00\\ud800"'),
    Raw('"\\ud83d\\ude00"'),  # a valid pair, for contrast
]
UNICODE = [
    "\x00",
    "a\x00b",
    "\u202eevil\u202c",
    "\u200f\u200e\u200b",
    "\ufeff",
    "\U0001f600",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "e" + "\u0301" * 64,
    "\uffff\ufffe",
    "\U0010ffff",
    "\u2028\u2029\u0085",
    "\x1b[31m\x07\x7f",
    "<|im_end|>",
    "<|im_start|>system\n",
    "<think>",
    "</think>",
    "<tool_call>",
    "{{ 7*7 }}{% raw %}",
    "\ud800",  # a real lone surrogate: its 3 UTF-8 bytes are invalid in the body
    "\udfff tail",
    "\uff46\uff55\uff4c\uff4c",
    "\u0130\u0131\u00df",
    "\\",
    '"',
    "\t\r\n",
]
INVALID_UTF8 = [
    b"\xff",
    b"\xfe",
    b"\xc0\xaf",
    b"\xe0\x80\xaf",
    b"\xf0\x80\x80\xaf",
    b"\xed\xa0\x80",
    b"\xed\xbf\xbf",
    b"\xf4\x90\x80\x80",
    b"\x80",
    b"\xbf",
    b"\xe2\x82",
    b"\xf8\x88\x80\x80\x80",
    b"\xfc\x84\x80\x80\x80\x80",
    b"\xc3",
]
NUMBERS = [
    -1,
    0,
    -0.0,
    1.5,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64,
    -(2**64),
    10**30,
    1e-320,
    5e-324,
    1.7976931348623157e308,
    Raw("1e309"),
    Raw("-1e309"),
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("9" * 5000),  # past Python's 4300-digit int limit
    Raw("1" + "0" * 400),
    Raw("1E400"),
    Raw("0.1e-99999"),
    Raw("-0"),
    Raw("01"),
    Raw("+1"),
    Raw("0x10"),
    Raw(".5"),
]
TEMPLATES = [
    SIMPLE_TEMPLATE,
    "",
    "{{ raise_exception('nope') }}",
    "{% for %}",
    "{% if %}{% endfor %}",
    "{{ messages[99]['content'] }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ '\\ud800' }}",
    "{{ '\\x00' }}{{ messages[0]['content'] }}",
    "{{ '<|im_end|>' * 3 }}",
    "{{ 'x' * 20000 }}",
    "{% for i in range(20000) %}a{% endfor %}",
    "{{ messages | tojson }}",
    "{% set ns = namespace(a=1) %}{{ ns.a }}",
    "{{ tools | length }}",
    "{%- if add_generation_prompt %}<think>{%- endif %}",
    "{{ 1 / 0 }}",
    "{{ none.x.y }}",
    "{{ '%s %s' % (1,) }}",
    "{{ range(2**31) | length }}",
    "{% include 'x' %}",
    "{% extends 'base' %}",
    "{% macro m() %}{{ caller() }}{% endmacro %}{{ m() }}",
    "{{ self }}{{ cycler }}",
    "{{ strftime_now('%Y') }}",
    "\x00",
    "{{ messages[0]['content'][::-1] }}",
    "{{ 'a' | tojson(indent=2) }}",
    "{% for m in messages %}{{ m.content | safe }}{% endfor %}<|im_start|>assistant\n",
    "tool_use",
    "default",
]
COMMON = {
    "model": ["", "nope", "../x", "\x00", SURROGATES[0], "a" * 10000, None, 1],
    "temperature": [-0.1, 2.01, 0, 2, 1e-300, Raw("NaN"), Raw("Infinity"), "hot", None],
    "top_p": [0, -1, 1.0000001, 1e-300, Raw("NaN"), None],
    "top_k": [-1, 0, 1, 2**31, 2**64, 10**6],
    "stream": [True, "true", 1, None],
    "max_tokens": [0, -1, 1, 256, 2**31, 2**64, 1.5, "4", True, None, 10**6],
}
SAMPLING = {
    **COMMON,
    "seed": [-1, 0, 2**31, 2**32 - 1, 2**32, 2**63, 2**64, -(2**63), 10**30, 1.5, "1"],
    "stop": ["", [""], ["\n"] * 17, ["x"] * 16, [SURROGATES[0]], "a" * 5000, [None], [1], {}],
    "n": [0, 2, -1, 1, 10**9, None],
    "presence_penalty": [2, -2, 2.1, Raw("NaN"), Raw("-Infinity")],
    "frequency_penalty": [2, -2.5, Raw("Infinity"), 1e-300],
    "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, [], None, {}],
    "ignore_eos": [True, "yes"],
    "logit_bias": [{"1": 100}, {"x": "y"}],
    "user": ["u", SURROGATES[1]],
}
FIELDS: dict[str, dict[str, list[Any]]] = {
    "chat": {
        **SAMPLING,
        "messages": [
            [],
            None,
            "hi",
            [{}],
            [{"role": "user"}],
            [{"role": "nobody", "content": "x"}],
            [{"role": "user", "content": None}],
            [{"role": "user", "content": {"text": "x"}}],
            [{"role": "user", "content": [1, 2]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": [{"text": "no type"}, {"type": None, "text": 3}]}],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                }
            ],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "7"}}]}],
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
            [{"role": "assistant", "tool_calls": [{"function": {}}]}],
            [{"role": "assistant", "tool_calls": []}],
            [{"role": "tool", "content": "x"}],
            [{"role": "system", "content": "only a system prompt"}],
            [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
            [{"role": "developer", "content": "x"}, {"role": "system", "content": "y"}],
            [{"role": "assistant", "content": None}],
            [{"role": "user", "content": "a", "name": "\x00", "tool_call_id": 5}],
        ],
        "max_completion_tokens": [0, -1, 4, 2**64, "4"],
        "logprobs": [True, False, 1, "yes", None],
        "top_logprobs": [-1, 0, 5, 20, 21, 2**64],
        "tools": [
            [],
            None,
            [{}],
            [{"type": "function"}],
            [{"type": "function", "function": {"name": ""}}],
            [{"type": "function", "function": {"name": "bad name!"}}],
            [{"type": "function", "function": {"name": "f" * 65}}],
            [{"type": "function", "function": {"name": "f", "parameters": "notadict"}}],
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
            [{"type": "code_interpreter"}],
            [TOOL, TOOL],
            [TOOL] * 200,
        ],
        "tool_choice": ["none", "auto", "required", "any", {"type": "function"}, 1, {}],
        "enable_thinking": [True, False, "no", None, 0],
        "reasoning_effort": ["none", "minimal", "medium", "high", "xhigh", "max", "", None],
        "chat_template_kwargs": [
            {},
            [],
            "x",
            {"enable_thinking": "false"},
            {"tools": "x"},
            {"messages": []},
            {"conversation": []},
            {"add_generation_prompt": False},
            {"tokenize": True},
            {"return_dict": True},
            {"return_assistant_tokens_mask": True},
            {"continue_final_message": True},
            {"documents": [{"text": "x"}]},
            {"reasoning_effort": "high"},
            {"chat_template": None},
            {"chat_template": 1},
            {"chat_template": ["x"]},
        ],
        "chat_template": [None, "", 1, SIMPLE_TEMPLATE, "{{ raise_exception('x') }}"],
        "continue_final_message": [True, False, "yes", None],
    },
    "completions": {
        **SAMPLING,
        "prompt": [
            "",
            [],
            [""],
            ["a", "b"],
            [0],
            [-1],
            [2**31],
            [2**64],
            [1.5],
            [True],
            [[1, 2]],
            [None],
            list(range(300)),
            [5] * 5000,
            123,
            None,
            {"text": "x"},
            "<|im_end|>",
        ],
        "logprobs": [-1, 0, 20, 21, True, 2**64],
        "echo": [True, "no"],
        "suffix": ["x"],
        "best_of": [3],
    },
    "messages": {
        **COMMON,
        "max_tokens": [0, -1, None, 2**64, 1.5, "4", 10**6, 256],
        "messages": [
            [],
            [{"role": "user", "content": []}],
            [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
            [{"role": "user", "content": [{"type": "tool_result", "content": [{"type": "x"}]}]}],
            [{"role": "user", "content": [{"type": "tool_result", "content": [{"text": 1}]}]}],
            [{"role": "user", "content": [{"type": "tool_result", "is_error": True}]}],
            [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": None}]}],
            [{"role": "assistant", "content": [{"type": "tool_use", "input": {"a": [1]}}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}],
            [{"role": "user", "content": [{}]}],
            [{"role": "system", "content": "late"}],
            [{"role": "system", "content": [{"type": "text", "text": "s"}]}],
            [{"role": "assistant", "content": "prefill"}],
            [{"role": "user", "content": None}],
            [{"role": "tool", "content": "x"}],
        ],
        "system": ["", [], [{"type": "text", "text": "s"}], [{"type": "image"}], [{"x": 1}], 1],
        "tools": [
            [],
            [{"name": "f"}],
            [{"name": ""}],
            [{"name": "bad name"}],
            [{"name": "f", "input_schema": "x"}],
            [{"name": "f", "input_schema": None}],
            [{"name": "f", "input_schema": {"type": "object", "properties": {"a": 1}}}],
            [{"type": "web_search_20250305", "name": "web_search"}],
            [{"type": "custom", "name": "f"}],
            [ATOOL] * 200,
        ],
        "tool_choice": [{"type": "any"}, {"type": "tool", "name": "f"}, {"type": "none"}, "auto"],
        "thinking": [
            {"type": "adaptive"},
            {"type": "nope"},
            {"type": "enabled", "budget_tokens": -1},
            {"type": "enabled", "budget_tokens": 2**64},
            {},
            True,
            "enabled",
        ],
        "output_config": [{"effort": "max"}, {"effort": 1}, {"effort": None}, [], "x"],
        "stop_sequences": [[], [""], ["x"] * 17, ["x"] * 1000, "x", [1], [SURROGATES[0]]],
        "metadata": [{"user_id": SURROGATES[0]}, None, 1],
    },
    "load": {
        "model": [
            "",
            " ",
            "/",
            ".",
            "~",
            "a/b",
            "x" * 300,
            "x" * 5000,
            "/tmp/" + "a/" * 3000,
            "\x00",
            "-missing",
        ],
        "drafter": ["", "nope", None, 1],
        "mode": ["auto", "lookup", "", "nope", "baseline", "dspark", 1, None],
        "max_draft": [-1, 0, 64, 65, 2**64, None, 1.5],
        "context_window": [-1, 0, 1, 15, 16, 2**64, None],
        "confidence_threshold": [-0.1, 0, 1, 1.1, Raw("NaN"), None],
        "drafter_bits": [4],
    },
}
FIELDS["count"] = {k: v for k, v in FIELDS["messages"].items() if k != "max_tokens"}
FIELDS["responses"] = {
    **COMMON,
    "input": ["", [], [{}], [{"type": "nope"}], [{"role": "tool", "content": "x"}],
              [{"role": "user", "content": [{"type": "input_image"}]}], [{"role": "user"}],
              [{"type": "function_call_output", "output": [1]}], SURROGATES[0], 1, None],
    "instructions": ["", SURROGATES[1], 1, None],
    "max_output_tokens": [0, -1, 1, 2**31, 2**64, "4", None],
    "tools": [[{"type": "web_search"}], [{"type": "function"}], [{"type": "function", "name": ""}],
              [{"type": "function", "name": "f", "parameters": {"type": "string"}}], {}, None],
    "tool_choice": ["required", "none", {"type": "function", "name": "f"}, 1],
    "reasoning": [{"effort": "maximal"}, {"effort": "low"}, "low", None],
    "text": [{"format": {"type": "json_object"}}, {"format": "text"}, None],
    "previous_response_id": ["resp_x", None],
    "background": [True, "yes"],
}  # fmt: skip
CONTENT_TYPES = [
    None,
    "",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "multipart/form-data; boundary=xyz",
    "application/json; charset=utf-16",
    "application/json; charset=latin-1",
    "application/vnd.api+json",
    "APPLICATION/JSON",
    "application/json;;;",
    'application/json; boundary="',
    "*/*",
    "application/x-ndjson",
    "text/event-stream",
    "application/json, text/plain",
]


# -- mutators -----------------------------------------------------------------------------------


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


def fuzz_request(
    seed: int, index: int, target: FuzzTarget, max_bytes: int = MAX_BYTES
) -> FuzzRequest:
    """Request `index` of the run seeded `seed` (independent of every other index)."""
    rng = random.Random(f"outrider-fuzz:{seed}:{index}")
    weights = [r.weight for r in ROUTES] + [UNKNOWN_WEIGHT, WRONG_METHOD_WEIGHT]
    pick = rng.choices(range(len(ROUTES) + 2), weights)[0]
    if pick < len(ROUTES):
        route, label = ROUTES[pick], ROUTES[pick].label
    else:
        route = rng.choice(ROUTES)
        label = "(unknown route)" if pick == len(ROUTES) else "(wrong method)"
    value = copy.deepcopy(rng.choice(route.seeds(target)))
    d = _Draft(route, value, target, max_bytes)
    if label == "(unknown route)":
        d.method, d.path = rng.choice(METHODS), rng.choice(UNKNOWN_PATHS)
        done = [f"{d.method} {d.path[:40]}"]
    elif label == "(wrong method)":
        d.method = rng.choice([m for m in METHODS if m != route.method])
        done = [f"{d.method} {d.path}"]
        if d.method == "OPTIONS" and rng.random() < 0.5:  # a CORS preflight
            d.headers.update(Origin="http://127.0.0.1", **{"Access-Control-Request-Method": "POST"})
    else:
        done = []
    if value is not None:
        done += _mutate_body(rng, d)
    else:
        done += _mutate_bodyless(rng, d)
    body = d.body()
    if body is not None and len(body) > max_bytes:
        body = body[:max_bytes]
        done.append(f"capped at {max_bytes} bytes")
    return FuzzRequest(label, d.method, d.path, body, d.headers, done, d.chunked, index)


def fuzz_requests(
    n: int, seed: int, target: FuzzTarget, max_bytes: int = MAX_BYTES
) -> Iterator[FuzzRequest]:
    """The run's requests, in order."""
    for i in range(n):
        yield fuzz_request(seed, i, target, max_bytes)
