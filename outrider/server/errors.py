"""One error type for the HTTP layer, rendered in the shape of the API the request came in on."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """A request the server refuses: HTTP status, message, OpenAI type and code."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )


def is_anthropic(path: str) -> bool:
    return path.rstrip("/").split("?")[0].endswith(("/messages", "/messages/count_tokens"))


def error_response(path: str, err: ApiError) -> JSONResponse:
    if is_anthropic(path):
        kind = ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else err.type)
        body = {"type": "error", "error": {"type": kind, "message": err.message}}
    else:
        body = {
            "error": {
                "message": err.message,
                "type": err.type,
                "param": err.param,
                "code": err.code,
            }
        }
    return JSONResponse(body, status_code=err.status)
