"""The FastAPI app: OpenAI, Anthropic and operations routes over one engine, behind the guards
of `middleware.py` (API key, body limit, local-only admin, no cross-origin access unless
allowed), with errors in each API's own shape and an OpenAPI document that says what the server
really answers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from .. import __version__
from ..core.errors import PromptError
from . import admin, anthropic_api, machine, openai_api, race, responses_api, web
from .engine import Engine
from .errors import ApiError, error_response
from .generation import Limits
from .middleware import Access, ApiKey, BodyLimit, CrossOrigin, LocalAdmin
from .openapi import describe_server


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
        msg = str(e.get("msg")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid request: " + "; ".join(parts)


def create_app(
    engine: Engine,
    limits: Limits | None = None,
    api_key: str | None = None,
    plugins: Any = None,
    cors_origins: tuple[str, ...] = (),
) -> FastAPI:
    """An app serving `engine` (which the caller starts and stops). `cors_origins` are the
    web origins allowed to call it from a browser (none by default; "*" for any)."""
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

    @app.exception_handler(PromptError)  # messages that cannot be rendered (chat/render.py)
    async def prompt_error(request: Request, exc: PromptError):
        engine.metrics.error("invalid_request_error")
        return error_response(request.url.path, ApiError(400, exc.message, param=exc.param))

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
        err = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
        return error_response(request.url.path, err)

    for prefix, visible in (("/v1", True), ("", False)):
        app.include_router(openai_api.router(state), prefix=prefix, include_in_schema=visible)
        app.include_router(responses_api.router(state), prefix=prefix, include_in_schema=visible)
        app.include_router(anthropic_api.router(state), prefix=prefix, include_in_schema=visible)
    app.include_router(admin.router(state))
    app.include_router(machine.router(state))
    app.include_router(race.router(state))
    app.include_router(web.router(state))  # the page at /, its files at /ui/
    describe_server(app)
    # add_middleware wraps what is there: the last added runs first.
    app.add_middleware(BodyLimit, max_bytes=state.limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    else:
        app.add_middleware(LocalAdmin)
    app.add_middleware(CrossOrigin, allowed=tuple(cors_origins))
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(Access, metrics=engine.metrics)
    return app
