"""Valid requests for every route of the server: where each fuzzed request starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .requests import FuzzTarget

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
