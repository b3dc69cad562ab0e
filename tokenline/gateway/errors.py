"""The API's error shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that
turn every failure (our own, FastAPI's validation, Starlette's routing, unexpected bugs) into it.

Clients (the `openai` SDK among them) pick an exception class from the status code and show
`message`; `param` tells them which request field to fix, so every 400 names one where it can.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "install_error_handlers", "shorten", "validation_error"]

logger = logging.getLogger(__name__)

# How much of a caller's value an error message quotes: enough to recognise it, never the whole
# of a 100k-character "model name" sent back to its sender (or into every log that shows errors).
ECHO_LIMIT = 64


def shorten(value: object, limit: int = ECHO_LIMIT) -> str:
    """A caller's value as an error message quotes it: its first ``limit`` characters, then "…"."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit] + "…"

# Error `type` by status for errors that arrive as bare HTTP statuses (routing, middleware).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the API reports to the client; raise it anywhere in a request's handling."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field is called `type`
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        # For Retry-After on 429/503, WWW-Authenticate on 401.
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"APIError({self.status_code}, {self.message!r}, type={self.type!r}, param={self.param!r})"

    def to_dict(self) -> dict[str, Any]:
        """The JSON body; also what an SSE stream sends as its error event once headers are out."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers or None)

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, "invalid_request_error", param, code)

    @classmethod
    def invalid_request(cls, exc: Exception) -> APIError:
        """A 400 from a lower layer's error that names its ``param`` (and maybe a ``code``)."""
        return cls.bad_request(str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))

    @classmethod
    def unauthorized(cls, message: str = "Invalid API key.", code: str | None = "invalid_api_key") -> APIError:
        return cls(401, message, "authentication_error", None, code, {"WWW-Authenticate": "Bearer"})

    @classmethod
    def forbidden(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(403, message, "permission_error", param, code)

    @classmethod
    def not_found(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(404, message, "not_found_error", param, code)

    @classmethod
    def conflict(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(409, message, "invalid_request_error", param, code)

    @classmethod
    def payload_too_large(cls, message: str, param: str | None = None) -> APIError:
        return cls(413, message, "invalid_request_error", param, "payload_too_large")

    @classmethod
    def rate_limited(cls, message: str, retry_after_s: float | None = None, code: str | None = None) -> APIError:
        headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
        return cls(429, message, "rate_limit_error", None, code or "rate_limit_exceeded", headers)

    @classmethod
    def server_error(cls, message: str = "The server had an error while processing your request.") -> APIError:
        return cls(500, message, "server_error")

    @classmethod
    def unavailable(cls, message: str, retry_after_s: float | None = None) -> APIError:
        headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
        return cls(503, message, "service_unavailable", None, None, headers)

    @classmethod
    def timeout(cls, message: str = "The request timed out before the model finished.") -> APIError:
        # 504, not 408: 408 says the *client* was too slow sending its request, while here the
        # client did its part and the server (a gateway in front of the engine) ran out of time.
        # The openai SDK retries both, so nothing is lost for clients that retry.
        return cls(504, message, "timeout_error")


# --- request validation errors -> one readable 400 ------------------------------------------

_LOC_ROOTS = ("body", "query", "path", "header", "cookie")
# Pydantic adds the union member's name to an error's location ("str", "list[str]",
# "function-after[...]", "literal['text']", "[key]"); they are not fields a client can fix.
_NOT_A_FIELD = re.compile(r"[^A-Za-z0-9_]")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none", "tuple", "set"})
_PREFIXES = ("Value error, ", "Assertion failed, ")


def _param_path(loc: Sequence[Any]) -> str | None:
    """`("body", "messages", 0, "content")` -> `"messages[0].content"`."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in _LOC_ROOTS else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            else:
                parts.append(f"[{item}]")
        elif isinstance(item, str) and not _NOT_A_FIELD.search(item) and item not in _TYPE_TAGS:
            parts.append(item)
    return ".".join(parts) or None


def _short(value: Any) -> str | None:
    """The offending value, for the message, when it is small enough to be worth showing."""
    if value is None or isinstance(value, (bool, int, float)):
        return shorten(repr(value)) if value is not None else "null"  # an int may have 4,000 digits
    if isinstance(value, str) and len(value) <= 40:
        return repr(value)
    return None


def _one_error(error: Mapping[str, Any]) -> APIError:
    kind = error.get("type", "")
    loc = tuple(error.get("loc", ()))
    msg = str(error.get("msg", "invalid value"))
    for prefix in _PREFIXES:
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "could not parse")
        where = f" (at character {loc[-1]})" if loc and isinstance(loc[-1], int) else ""
        return APIError.bad_request(f"invalid JSON in request body: {detail}{where}")
    param = _param_path(loc)
    if param is not None:
        param = shorten(param)  # a path may hold a caller's key (an unknown field's name)
    if param is None:
        # The body as a whole is wrong: missing, not an object, or not sent as JSON at all.
        if kind == "missing":
            return APIError.bad_request("request body is missing; send a JSON object")
        if isinstance(error.get("input"), (bytes, bytearray)):
            # FastAPI only parses JSON when the Content-Type says so (`curl -d` sends form data).
            return APIError.bad_request(
                "request body must be a JSON object sent with 'Content-Type: application/json'"
            )
        if kind == "model_attributes_type":
            return APIError.bad_request("request body must be a JSON object")
        return APIError.bad_request(f"invalid request body: {msg}")
    if kind == "extra_forbidden":
        return APIError.bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return APIError.bad_request(f"Missing required parameter: '{param}'.", param)
    got = _short(error.get("input"))
    suffix = f" (got {got})" if got is not None else ""
    return APIError.bad_request(f"{param}: {msg}{suffix}", param)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """Pydantic's error list -> one 400 naming the first offending field, as OpenAI reports one."""
    if not errors:
        return APIError.bad_request("invalid request")
    first = _one_error(errors[0])
    others = len(errors) - 1
    if others and first.param is not None:
        # Further errors usually follow from the first; say they exist without burying it.
        first.message += f" (and {others} more error{'s' if others > 1 else ''})"
    return first


# --- handlers ---------------------------------------------------------------------------


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).to_response()


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    error_type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    # Keep Starlette's headers: 405 carries `Allow`, 401 may carry `WWW-Authenticate`.
    return APIError(status, message, error_type, headers=exc.headers).to_response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug, never bad input: log everything here, tell the client nothing about our internals.
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return APIError.server_error().to_response()


async def _on_invalid_request(request: Request, exc: Exception) -> JSONResponse:
    return APIError.invalid_request(exc).to_response()


def install_error_handlers(app: FastAPI, invalid_request_errors: Sequence[type[Exception]] = ()) -> None:
    """Make every error the app returns look like OpenAI's. ``invalid_request_errors``: exception
    types of the layers below (a prompt the model cannot take, …) that mean a 400 naming ``param``.

    Note: Starlette re-raises an unexpected exception after the 500 is sent (so the ASGI server
    logs it too), and `TestClient` re-raises it unless built with `raise_server_exceptions=False`.
    Errors after a streaming response has started cannot change its status; the stream must send
    `APIError.to_dict()` as an event instead.
    """
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    for error_type in invalid_request_errors:
        app.add_exception_handler(error_type, _on_invalid_request)
    app.add_exception_handler(Exception, _on_unexpected)
