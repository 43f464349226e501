"""The FastAPI app: OpenAI, Anthropic and operations routes over one engine, with API-key
auth on every route, CORS, and errors in each API's own shape."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from .. import __version__
from . import admin, anthropic_api, openai_api
from .engine import Engine
from .errors import ApiError, error_response
from .generation import Limits


@dataclass
class State:
    engine: Engine
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    started: float = field(default_factory=time.time)
    plugins: Any = None


def _describe(errors: list) -> str:
    parts = []
    for e in errors[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}"
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts)


class _Auth:
    """ASGI middleware: every route needs the key (Bearer or x-api-key), compared in constant
    time; CORS preflights pass so browsers can ask."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        given = headers.get("x-api-key", b"")
        auth = headers.get("authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given, self.key):
            msg = (
                "invalid api key"
                if given
                else "missing api key (Authorization: Bearer or x-api-key)"
            )
            err = ApiError(401, msg, "authentication_error", code="invalid_api_key")
            return await error_response(scope["path"], err)(scope, receive, send)
        return await self.app(scope, receive, send)


class _Count:
    """ASGI middleware counting requests by matched route and status (streams untouched)."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # Our routes have no path parameters, so a matched path is a bounded label.
            route = scope["path"] if scope.get("route") is not None else "unmatched"
            self.metrics.request(route, status[0])


def create_app(
    engine: Engine,
    limits: Limits | None = None,
    api_key: str | None = None,
    plugins: Any = None,
) -> FastAPI:
    """An app serving `engine` (which the caller starts and stops)."""
    from ..core.plugins import Plugins

    state = State(engine, limits or Limits(), api_key)
    cached: dict = {}
    state.plugins = plugins or (lambda: cached.setdefault("p", Plugins()))
    app = FastAPI(title="outrider", version=__version__, summary="Lossless speculative decoding")
    app.state.outrider = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        engine.metrics.error(exc.code or exc.type)
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        engine.metrics.error("invalid_request")
        return error_response(request.url.path, ApiError(400, _describe(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = f"unknown route {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return error_response(request.url.path, ApiError(exc.status_code, message, kind))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):
        engine.metrics.error("server_error")
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
        return error_response(request.url.path, err)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def root() -> Response:
        return Response("outrider\n", media_type="text/plain")

    for prefix, visible in (("/v1", True), ("", False)):
        app.include_router(openai_api.router(state), prefix=prefix, include_in_schema=visible)
        app.include_router(anthropic_api.router(state), prefix=prefix, include_in_schema=visible)
    app.include_router(admin.router(state))
    app.add_middleware(_Count, metrics=engine.metrics)
    if api_key:
        app.add_middleware(_Auth, key=api_key)
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]
    )
    return app
