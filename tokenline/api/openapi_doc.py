"""What ``/openapi.json`` says each route answers, kept true to what the server sends.

Every error leaves the server in OpenAI's shape (``gateway/errors.py``), request validation
errors included — they are 400s, never FastAPI's 422 — so the document lists the error statuses
with one ``ErrorResponse`` schema, drops the 422 FastAPI adds on its own, and gives each generating
route its JSON body and its ``text/event-stream`` alternative. A schema-conformance fuzzer
(schemathesis) checks the server against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

__all__ = ["ERROR_RESPONSES", "ErrorResponse", "HealthStatus", "install_openapi", "success"]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(title="ErrorDetail")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    """/health and /ping: 200 when an engine is ready, 503 (same shape) while it is not."""

    status: str  # "ok", "loading", "restarting" (a dead engine is coming back), "failed"
    error: str | None = None
    engine_pid: int | None = None  # the engine process, where it runs locally
    engine_restarts: int = 0  # engines started after a death since the server started


_REQUEST_ID = {"X-Request-Id": {"description": "The request's id (the caller's, sanitized, or assigned)",
                                "schema": {"type": "string"}}}


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description, "headers": _REQUEST_ID}


# Statuses any route may answer with: the door's (key, body size, connection cap, address),
# validation's, the gateway's (model access, limits, rate limits, a reused request id) and the
# last-resort 500. Shared by every route through FastAPI(responses=...).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("Invalid request: a field is wrong (param names it), the body is not valid JSON, or not valid Unicode"),
    401: _error("Missing or wrong API key"),
    403: _error("The key may not use this endpoint"),
    404: _error("Unknown model, route or object"),
    409: _error("A request with this X-Request-Id is still in progress"),
    413: _error("The request body is larger than the server accepts"),
    429: _error("Rate limit reached (Retry-After says when to retry)"),
    500: _error("Server error"),
    503: _error("The model is loading, the engine is restarting, or the server is at its connection limit"),
    504: _error("The request took longer than the server's request timeout"),
}


def success(model: type[BaseModel] | None = None, *, stream: bool = False,
            description: str = "Success") -> dict[int | str, dict[str, Any]]:
    """A route's 200: ``model`` as JSON (or the route's ``response_class``), and with ``stream``
    also server-sent events (``stream: true``)."""
    entry: dict[str, Any] = {"description": description, "headers": _REQUEST_ID}
    if model is not None:
        entry["model"] = model
    content: dict[str, Any] = {}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": "data: {chunk}\\n\\n ... data: [DONE]"}}
    if content:
        entry["content"] = content
    return {200: entry}


def install_openapi(app: FastAPI) -> None:
    """Build the document as FastAPI does, then drop what the server never sends: the 422 it adds
    to every route with parameters (our validation errors are 400s) and that 422's schemas."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    if isinstance(operation, dict):
                        operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
