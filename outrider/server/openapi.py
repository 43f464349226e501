"""The OpenAPI document, made to describe what the server answers: refusals are 400 (FastAPI
would list 422, which this server never sends) in each API's error shape, and the generation
routes answer either JSON or, with `stream: true`, server-sent events."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/messages")

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _error(path: str, why: str) -> dict[str, Any]:
    shape = ANTHROPIC_ERROR if "/messages" in path else OPENAI_ERROR
    return {"description": why, "content": {"application/json": {"schema": shape}}}


def describe_server(app: FastAPI) -> None:
    """Replace the app's `openapi()` with one whose responses match the server's."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            for path, ops in doc.get("paths", {}).items():
                for method, op in ops.items():
                    _fix(path, method, op["responses"])
            doc.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            doc.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _fix(path: str, method: str, responses: dict[str, Any]) -> None:
    if responses.pop("422", None) is not None:
        responses["400"] = _error(path, "Refused: malformed or invalid request")
    if path in STREAMING and "200" in responses:
        content = responses["200"].setdefault("content", {})
        content["text/event-stream"] = {"schema": {"type": "string"}}
    if path.startswith("/admin"):
        responses.setdefault("403", _error(path, "Refused: not a local client (no --api-key)"))
    if method == "post":
        responses.setdefault("413", _error(path, "Refused: request body over the size limit"))
