"""One engine request as an upstream's ``/v1/completions`` stream, and that stream back as ``EngineOutput``s.

The router speaks tokens to its upstreams, in vLLM's protocol: the prompt goes as token ids with
the resolved sampling parameters (never stop strings — the router's ``RequestState`` applies them
and aborts), ``stream`` with usage, and ``return_token_ids`` (vLLM >= 0.10.2, and tokenline) so each
streamed choice carries its delta ``token_ids``. ``StreamDecoder`` turns the parsed SSE chunks into
the outputs a local engine would have sent: the tokens as they come, then one final output with
the finish reason and the counts of the usage chunk (prompt, cached, generated tokens).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tokenline.engine.messages import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestTimings,
    TokenLogprobs,
)

FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
                  "error": FinishReason.ERROR}
# Upstream statuses that are the request's own fault: passed to the caller, never retried. Anything
# else (401/403: the router's key, 404: its model name, 429, 5xx) is the upstream's and is retried.
REQUEST_ERROR_STATUSES = frozenset({400, 413, 422})
TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids spelling of a logprobs token


class UnmappableRequest(ValueError):
    """The request has something the upstream protocol cannot carry; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class UpstreamError(Exception):
    """The upstream refused or failed the request (an HTTP error status or an error event)."""

    status: int
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    @property
    def request_error(self) -> bool:
        """The request's own fault (pass it on), not the upstream's (retry elsewhere)."""
        return self.status in REQUEST_ERROR_STATUSES

    @classmethod
    def from_body(cls, status: int, body: bytes | str | dict[str, Any]) -> UpstreamError:
        """From an OpenAI-shaped error body (``{"error": {message, param, code}}``) or any text."""
        data: Any = body
        if isinstance(body, (bytes, str)):
            try:
                data = json.loads(body)
            except ValueError:
                text = body.decode(errors="replace") if isinstance(body, bytes) else body
                return cls(status, text.strip()[:500] or f"HTTP {status}")
        error = data.get("error", data) if isinstance(data, dict) else {}
        if not isinstance(error, dict):
            return cls(status, str(error)[:500])
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code  # vLLM's error events carry the status as "code"
        elif error.get("type") in ("invalid_request_error", "BadRequestError") and status >= 500:
            status = 400  # an error event without a status (tokenline's): its type says whose fault
        message = str(error.get("message") or f"HTTP {status}")
        param = error.get("param")
        return cls(status, message, param if isinstance(param, str) else None)


def completion_body(request: EngineRequest, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body for one engine request (its ``n`` is always 1)."""
    params = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "ignore_eos": params.ignore_eos,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if params.prompt_logprobs is not None or params.max_tokens == 0:
        raise UnmappableRequest("prompt_logprobs", "prompt logprobs (and echo's scoring) cannot be sent to an upstream yet")
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if request.cache_salt is not None:
        # vLLM's field: the upstream salts the prompt's first block with it (and names it in its
        # KV events), so this router's prefix keys are the upstream's.
        body["cache_salt"] = request.cache_salt
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        value = getattr(params, name)
        if value is not None:
            body[name] = value
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
        body["return_tokens_as_token_ids"] = True  # the top alternatives come back as ids
    if request.priority:
        body["priority"] = request.priority
    spec = params.structured_outputs
    if spec is not None:
        if spec.start_after_token_id is not None:
            raise UnmappableRequest(
                "structured_outputs",
                "a constraint that starts after a token (reasoning models) cannot be sent to an upstream yet",
            )
        value: Any = True if spec.kind == "json_object" else getattr(spec, spec.kind)
        body["structured_outputs"] = {spec.kind: value}
    return body


class StreamDecoder:
    """The chunks of one upstream stream, as ``EngineOutput``s for ``request``."""

    def __init__(self, request: EngineRequest, clock: Any = time.monotonic) -> None:
        self.request = request
        self._clock = clock
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.usage: dict[str, Any] | None = None
        self.timings = RequestTimings(arrival=request.arrival_time)

    @property
    def started(self) -> bool:
        """Some token came back (a retry elsewhere would repeat what the caller may have seen)."""
        return self.num_output_tokens > 0

    def feed(self, chunk: dict[str, Any]) -> EngineOutput | None:
        """One parsed ``data:`` chunk; returns the new tokens as an unfinished output (None when
        the chunk has none). An error event raises ``UpstreamError``."""
        if "error" in chunk and not chunk.get("choices"):
            raise UpstreamError.from_body(500, chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        token_ids = choice.get("token_ids")
        if token_ids is None:
            if choice.get("text"):
                raise UpstreamError(502, "the upstream streamed text without token_ids: it needs return_token_ids "
                                         "(vLLM >= 0.10.2 or tokenline)")
            token_ids = []
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish_reason = FINISH_REASONS.get(reason, FinishReason.STOP)
            stop = choice.get("stop_reason")
            self.stop_reason = stop if isinstance(stop, int) else None
        if not token_ids:
            return None
        now = self._clock()
        if self.timings.first_token is None:
            self.timings.first_token = now
        self.timings.last_token = now
        self.num_output_tokens += len(token_ids)
        return EngineOutput(
            self.request.request_id, [int(t) for t in token_ids],
            new_logprobs=self._logprobs(choice.get("logprobs"), token_ids),
            num_prompt_tokens=len(self.request.prompt_token_ids),
        )

    def finish(self) -> EngineOutput:
        """The final output once the stream ended; ``UpstreamError`` if it ended without a finish reason."""
        if self.finish_reason is None:
            raise UpstreamError(502, "the upstream stream ended before the request finished")
        return self._final(self.finish_reason)

    def aborted(self) -> EngineOutput:
        """The final output of a request the router cancelled: the tokens it saw."""
        return self._final(FinishReason.ABORT)

    def _final(self, reason: FinishReason) -> EngineOutput:
        self.timings.finished = self._clock()
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        completion = usage.get("completion_tokens")
        return EngineOutput(
            self.request.request_id, [], finish_reason=reason,
            stop_reason=self.stop_reason if reason is FinishReason.STOP else None,
            num_prompt_tokens=int(usage.get("prompt_tokens") or len(self.request.prompt_token_ids)),
            num_cached_tokens=int(details.get("cached_tokens") or 0),
            # What the upstream generated (and bills); after a cancel, what reached us.
            num_output_tokens=int(completion) if isinstance(completion, int) else self.num_output_tokens,
            timings=self.timings,
        )

    def _logprobs(self, logprobs: Any, token_ids: list[int]) -> list[TokenLogprobs] | None:
        if self.request.sampling.logprobs is None or not isinstance(logprobs, dict):
            return None
        values = logprobs.get("token_logprobs") or []
        tops = logprobs.get("top_logprobs") or []
        out = []
        for i, _ in enumerate(token_ids):
            value = values[i] if i < len(values) and values[i] is not None else 0.0
            top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            alternatives = [(token_id, float(v)) for k, v in top.items()
                            if (token_id := _token_id(k)) is not None]
            alternatives.sort(key=lambda item: -item[1])
            out.append(TokenLogprobs(float(value), alternatives[: self.request.sampling.logprobs]))
        return out


def _token_id(text: str) -> int | None:
    if text.startswith(TOKEN_ID_PREFIX) and text[len(TOKEN_ID_PREFIX):].lstrip("-").isdigit():
        return int(text[len(TOKEN_ID_PREFIX):])
    return None


def sse_payload(line: str) -> str | None:
    """The data of one SSE line (``data: {...}``), or None for comments, blank and other fields."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()
