"""ASGI middlewares, outermost first: the access record (metrics + log line), the cross-origin
guard, the body-size limit, the local-only admin rule, and the API key.

Each refuses in the shape of the API the request came in on (`errors.error_response`), before
the request reaches a route, so a refused request costs no parsing, no tokenizing and no model
time."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from typing import Any

from .errors import ApiError, error_response

access_log = logging.getLogger("outrider.access")

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def _headers(scope: dict) -> dict[str, bytes]:
    return {k.decode("latin-1").lower(): v for k, v in scope["headers"]}


async def _refuse(scope: dict, receive: Any, send: Any, err: ApiError) -> None:
    await error_response(scope["path"], err)(scope, receive, send)


def is_loopback(host: str | None) -> bool:
    """Whether a client address is this machine (a Unix socket, which has none, counts)."""
    if host is None:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


class Access:
    """Counts every request by matched route and status, and writes one access-log line
    (client, method, path, status, duration, prompt and completion tokens) when it ends."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]
        started = time.perf_counter()
        recorded = False

        def record() -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            # Our routes have no path parameters, so a matched path is a bounded label.
            route = scope["path"] if scope.get("route") is not None else "unmatched"
            self.metrics.request(route, status[0] or 500)
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(_line(scope, status[0], time.perf_counter() - started))

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                record()  # before the last bytes go out: a client that saw them sees the line
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            record()


def _line(scope: dict, status: int, seconds: float) -> str:
    client = (scope.get("client") or ("-",))[0]
    path = scope["path"] + (
        f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
    )
    line = f'{client} "{scope["method"]} {path}" {status or "-"} {seconds * 1000:.1f}ms'
    job = (scope.get("state") or {}).get("job")
    if job is not None:
        line += f" prompt={len(job.prompt)} completion={job.tokens}"
    return line


class CrossOrigin:
    """Refuses state-changing requests a browser sends from another origin (a web page driving
    a local server), unless that origin was allowed with --cors-origin. Same-origin requests and
    clients that are not browsers (no Origin header) pass."""

    def __init__(self, app: Any, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed = {o.rstrip("/") for o in allowed}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        origin = headers.get("origin", b"").decode("latin-1").rstrip("/")
        if not origin or "*" in self.allowed or origin in self.allowed:
            return await self.app(scope, receive, send)
        host = headers.get("host", b"").decode("latin-1")
        if origin.split("://", 1)[-1] == host:  # the server's own pages
            return await self.app(scope, receive, send)
        err = ApiError(
            403,
            f"cross-origin request from {origin[:100]} refused; start the server with "
            "--cors-origin ORIGIN to allow a web app",
            "permission_error",
            code="cross_origin",
        )
        return await _refuse(scope, receive, send, err)


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413, by its Content-Length before keeping
    any of it, or, for a chunked body, as soon as the bytes kept pass the limit. The rest of a
    refused body is read and thrown away (up to a bound), so the client, still sending, gets
    the 413 instead of a reset connection. A body within the limit is handed on to the route,
    so it is read once."""

    DRAIN_FACTOR = 64  # read and discard at most this many times the limit

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE_METHODS:
            return await self.app(scope, receive, send)
        declared = _headers(scope).get("content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                err = ApiError(400, "malformed Content-Length header")
                return await _refuse(scope, receive, send, err)
            if too_big:
                await self._drain(receive)
                return await _refuse(scope, receive, send, self._error(int(declared)))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                chunks.clear()
                if message.get("more_body", False):
                    await self._drain(receive)
                return await _refuse(scope, receive, send, self._error(size, at_least=True))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then disconnects, as the route's stream listens for them

        await self.app(scope, replay, send)

    async def _drain(self, receive: Any) -> None:
        left = self.max_bytes * self.DRAIN_FACTOR
        while left > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            left -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _error(self, size: int, at_least: bool = False) -> ApiError:
        more = "more than " if at_least else ""
        return ApiError(
            413,
            f"request body of {more}{size} bytes is over this server's limit of "
            f"{self.max_bytes} bytes (outrider serve --max-request-mb)",
            "request_too_large",
            code="request_too_large",
        )


# Routes that control the server or show this machine's paths (`/doctor`: the interpreter,
# caches, plugins; `/calibration`: where calibrations are kept).
LOCAL_ONLY = ("/admin", "/doctor", "/calibration")


class LocalAdmin:
    """Keeps /admin/*, /doctor and /calibration to clients on this machine when the server has
    no API key."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(LOCAL_ONLY)
            and not is_loopback((scope.get("client") or (None,))[0])
        ):
            err = ApiError(
                403,
                "/admin, /doctor and /calibration answer only clients on this machine unless "
                "the server is started with --api-key",
                "permission_error",
                code="admin_local_only",
            )
            return await _refuse(scope, receive, send, err)
        return await self.app(scope, receive, send)


class ApiKey:
    """Every route needs the key (Bearer or x-api-key), compared in constant time, except
    reading `/` (Claude Code probes it with `HEAD /`; a browser gets the web page there), the
    page's files under `/ui/` (they hold no secrets: the page asks its user for the key) and
    CORS preflights."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or (
                scope["method"] in ("GET", "HEAD")
                and (scope["path"] == "/" or scope["path"].startswith("/ui/"))
            )
        ):
            return await self.app(scope, receive, send)
        headers = _headers(scope)
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
            return await _refuse(scope, receive, send, err)
        return await self.app(scope, receive, send)
