"""The gateway's verbs for one request: admit it, reserve its tokens, observe it, write its receipt.

Everything here is policy and bookkeeping — keys, limits, the ledger, metrics, traces — and none
of it needs an engine: a server with its own engine and a router in front of many use the same
``Gateway``. The HTTP layer calls, in order: ``open`` (trace + model access), ``check_limits``,
``reserve`` (rate limits charge prompt + reserved completion), then ``first_token`` /
``inter_token`` as outputs arrive, and ``settle`` once with the ``Receipt``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenline.engine.messages import RequestTimings
from tokenline.gateway.cache_scope import prefix_cache_salt
from tokenline.gateway.errors import APIError, shorten
from tokenline.gateway.filters import VERDICTS, ContentFilter, Decision, OutputGuard
from tokenline.gateway.keys import KeyStore, Tenant
from tokenline.gateway.ledger import UsageLedger, UsageRecord
from tokenline.gateway.live_events import LiveEvents
from tokenline.gateway.metrics import ServerMetrics
from tokenline.gateway.rate_limit import RateLimiter, Reservation
from tokenline.gateway.trace import RequestTrace, TraceStore

logger = logging.getLogger("tokenline.gateway")


@dataclass
class GatewayLimits:
    """Limits checked before any expensive work (the byte limit is the door's)."""

    max_request_bytes: int = 4 * 1024 * 1024
    max_messages: int = 1024
    max_tokens_cap: int | None = None  # largest max_tokens a request may ask for


@dataclass
class RequestContext:
    """What the gateway knows about one HTTP request; the ids here join trace, ledger and logs."""

    request_id: str  # the caller's X-Request-Id (sanitized) or one we assigned
    trace: RequestTrace
    tenant: Tenant | None = None
    response_headers: dict[str, str] = field(default_factory=dict)  # e.g. x-ratelimit-*, sent by the door
    reservation: Reservation | None = None
    scope_state: dict[str, Any] = field(default_factory=dict)  # the door's per-request state
    journal: UsageRecord | None = None  # the ledger's in-flight row, once the engine has the request
    journaled_at: float = 0.0  # monotonic time of the last journal write (admission or progress)

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant is not None else "anonymous"

    @property
    def arrival(self) -> float:
        return self.trace.stamps["arrived"]

    def name_response(self, response_id: str, engine_request_ids: list[str]) -> None:
        """Record the ids the request got downstream, so every record of it can be joined."""
        self.trace.response_id = response_id
        self.trace.engine_request_ids = list(engine_request_ids)
        self.scope_state["response_id"] = response_id  # the door's access-log line names it


@dataclass
class SequenceReceipt:
    """One engine request (one of ``n`` choices) as it ended."""

    engine_request_id: str
    prompt_tokens: int
    completion_tokens: int  # tokens the engine actually produced: what is billed
    finish_reason: str
    timings: RequestTimings | None = None


@dataclass
class Receipt:
    """What one HTTP request used, written once when it ends for any reason."""

    model: str
    status: str  # one of gateway.ledger.STATUSES
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    sequences: list[SequenceReceipt]
    prompts: list[str] | None = None  # the texts, only when the operator asked to log prompts
    completions: list[str] | None = None
    content_filter: str | None = None  # the safety filter that ended the request, if one did


class Gateway:
    def __init__(
        self,
        metrics: ServerMetrics,
        keys: KeyStore | None = None,
        limiter: RateLimiter | None = None,
        ledger: UsageLedger | None = None,
        traces: TraceStore | None = None,
        limits: GatewayLimits | None = None,
        log_prompts: bool = False,
        content_filters: tuple[ContentFilter, ...] = (),
        progress_interval_s: float = 1.0,
        filter_holdback: int | None = None,
        prefix_cache_scope: str = "tenant",
    ) -> None:
        self.metrics = metrics
        self.keys = keys
        self.limiter = limiter
        self.ledger = ledger
        self.traces = traces or TraceStore()
        # (tenant, request id) of requests whose response is not finished: an id names one request.
        self._in_flight: set[tuple[str | None, str]] = set()
        self.limits = limits or GatewayLimits()
        self.log_prompts = log_prompts  # user text is untrusted and private: logged only when asked
        # At most one ledger update per running request this often: bounded write cost, and a
        # crash loses at most this much of what a request produced.
        self.progress_interval_s = progress_interval_s
        self.content_filters = content_filters  # the default of tenants without their own
        self.filter_holdback = filter_holdback  # characters of output held back; None: each filter's own
        prefix_cache_salt(prefix_cache_scope, None, None)  # a wrong scope fails here, at start-up
        self.prefix_cache_scope = prefix_cache_scope  # who may reuse whose cached prefixes (cache_scope.py)
        self.events: LiveEvents | None = None  # the live stream (GET /v1/events), when the app has one
        for f in (*content_filters, *(f for t in (keys.tenants if keys else ()) for f in t.content_filters or ())):
            metrics.declare_filter(f.name, sorted(f.stages), VERDICTS)

    # --- admission -----------------------------------------------------------------------------

    def open(self, state: dict[str, Any], model: str | None) -> RequestContext:
        """Start the trace of a request the door let in, and check that its tenant may use ``model``."""
        trace = RequestTrace(state["request_id"], model=model)
        trace.mark("arrived", state["arrived"])
        trace.mark("authenticated", state["authenticated"])
        tenant: Tenant | None = state.get("tenant")
        if tenant is not None:
            trace.tenant = tenant.name
            if model is not None:
                self.check_model_access(tenant, model)
        key = (trace.tenant, trace.request_id)
        if key in self._in_flight:
            # Answered, not renamed: the caller chose the id to find this request again (trace,
            # ledger, logs), and a silently different id would break exactly that.
            self.metrics.rejected.labels("duplicate_request_id").inc()
            raise APIError.conflict(
                f"a request with X-Request-Id {shorten(trace.request_id)!r} is still in progress; use a new id",
                param="X-Request-Id", code="duplicate_request_id",
            )
        self._in_flight.add(key)
        # The door runs these when the response is over (streamed or not, error or not).
        state.setdefault("on_finish", []).append(lambda: self._in_flight.discard(key))
        self.traces.add(trace)
        self._announce(trace, "arrived", trace.stamps["arrived"])
        return RequestContext(state["request_id"], trace, tenant, state["extra_headers"], scope_state=state)

    def queued(self, ctx: RequestContext, at: float | None = None) -> None:
        """The engine has the request's sequences (since monotonic time ``at``, default now)."""
        ctx.trace.mark("queued", at)
        self._announce(ctx.trace, "queued", ctx.trace.stamps["queued"])

    def _announce(self, trace: RequestTrace, stage: str, at: float, **extra: Any) -> None:
        if self.events is not None:
            self.events.request(trace, stage, at, **extra)

    def cache_salt(self, ctx: RequestContext, cache_salt: str | None) -> str | None:
        """The engine's prefix-cache salt for this request (gateway/cache_scope.py)."""
        tenant = ctx.tenant.name if ctx.tenant is not None else None
        return prefix_cache_salt(self.prefix_cache_scope, tenant, cache_salt)

    def allows_model(self, tenant: Tenant | None, model: str) -> bool:
        return tenant is None or self.keys is None or self.keys.allows_model(tenant, model)

    def check_model_access(self, tenant: Tenant | None, model: str) -> None:
        """A 404 for a model the tenant may not use: the same answer as for one that does not exist."""
        if not self.allows_model(tenant, model):
            self.metrics.rejected.labels("model_not_allowed").inc()
            raise APIError.not_found(
                f"The model `{shorten(model)}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )

    async def admit_text_work(self, state: dict[str, Any], model: str) -> RequestContext:
        """Admit a request that runs no generation (``/tokenize``, ``/detokenize``): it is a request
        all the same, so the tenant's model restrictions apply as to a chat, and it counts against
        its RPM and holds one of its concurrent slots while it runs (``release`` it after). No
        tokens are charged, no trace or ledger row is kept."""
        tenant: Tenant | None = state.get("tenant")
        self.check_model_access(tenant, model)
        trace = RequestTrace(state["request_id"], tenant=tenant.name if tenant is not None else None, model=model)
        ctx = RequestContext(state["request_id"], trace, tenant, state["extra_headers"], scope_state=state)
        await self.reserve(ctx, 0, 0)
        return ctx

    def check_limits(self, messages: int, max_tokens: int | None, param: str) -> None:
        """Refuse too many messages or an explicit ``max_tokens`` above the cap. An omitted one
        is not refused: the processor's ``fit`` caps it (``InputProcessor.fit(max_tokens_cap=)``)."""
        limits = self.limits
        if messages > limits.max_messages:
            self.metrics.rejected.labels("too_many_messages").inc()
            raise APIError.bad_request(
                f"{messages} messages exceed this server's limit of {limits.max_messages}", param="messages"
            )
        if limits.max_tokens_cap is not None and max_tokens is not None and max_tokens > limits.max_tokens_cap:
            self.metrics.rejected.labels("max_tokens_cap").inc()
            raise APIError.bad_request(
                f"{param} is {max_tokens}; this server allows at most {limits.max_tokens_cap}", param=param
            )

    async def reserve(self, ctx: RequestContext, prompt_tokens: int, completion_tokens: int) -> None:
        """Charge the tenant's token limits before any expensive work: the prompt plus the
        completion reserved (settled to the tokens really produced in ``settle``)."""
        ctx.trace.prompt_tokens = prompt_tokens
        if self.limiter is not None and ctx.tenant is not None:
            try:
                ctx.reservation = await self.limiter.acquire(ctx.tenant, prompt_tokens, completion_tokens)
            except APIError as exc:
                self.metrics.rejected.labels("rate_limited").inc()
                self.metrics.count_rate_limited(ctx.tenant.name, exc.code or "rate_limit")
                raise
            if ctx.reservation.headers is not None:
                ctx.response_headers.update(ctx.reservation.headers.as_dict())
        self.traces.admit(ctx.trace)  # admitted: its trace joins the tenant's, out of the refusals' ring

    async def release(self, ctx: RequestContext) -> None:
        """The request never reached an engine: give its reservation back whole."""
        if ctx.reservation is not None and self.limiter is not None:
            await self.limiter.settle(ctx.reservation, 0)
            ctx.reservation = None

    # --- safety filters ----------------------------------------------------------------------

    def filters_for(self, tenant: Tenant | None) -> tuple[ContentFilter, ...]:
        if tenant is not None and tenant.content_filters is not None:
            return tenant.content_filters
        return self.content_filters

    async def screen_input(self, ctx: RequestContext, texts: list[str], param: str) -> None:
        """Run the tenant's input filters before any engine work: a block is a 400 with code
        ``content_filter``; a filter that cannot decide and fails closed is a 503."""
        for f in self.filters_for(ctx.tenant):
            if "input" not in f.stages:
                continue
            decision = await f.check_input(texts)
            self.filter_decided(ctx, "input", decision)
            if not decision.blocked:
                continue
            self.metrics.rejected.labels("content_filter").inc()
            await self._record_refusal(ctx, decision)
            if decision.verdict == "error":
                raise APIError(
                    503, f"The content filter `{f.name}` is unavailable; the request was not run. Retry later.",
                    "service_unavailable", param, "content_filter_unavailable", {"Retry-After": "5"},
                )
            raise APIError.bad_request(
                f"The request was refused by the content filter `{f.name}`.", param=param, code="content_filter"
            )

    def output_guard(self, ctx: RequestContext) -> OutputGuard | None:
        """The tenant's output filters for one request; None when it has none."""
        filters = [f for f in self.filters_for(ctx.tenant) if "output" in f.stages]
        if not filters:
            return None
        return OutputGuard(filters, lambda d: self.filter_decided(ctx, "output", d), self.filter_holdback)

    def filter_decided(self, ctx: RequestContext, stage: str, decision: Decision) -> None:
        self.metrics.content_filter.labels(decision.filter, stage, decision.verdict).inc()
        ctx.trace.filter_decision(stage, decision.filter, decision.verdict, decision.reason)

    async def _record_refusal(self, ctx: RequestContext, decision: Decision) -> None:
        """A refused input never reaches an engine, yet the refusal is on record: a ledger row
        with no tokens, status ``refused``."""
        now = time.monotonic()
        ctx.trace.mark("finished", now)
        ctx.trace.status = "refused"
        if self.ledger is not None:
            await self.ledger.record(UsageRecord(
                request_id=ctx.request_id, response_id=None, tenant=ctx.tenant_name, model=ctx.trace.model or self.metrics.model_name,
                status="refused", finish_reason="content_filter", created_at=ctx.trace.wall_arrival,
                e2e_s=now - ctx.arrival, content_filter=decision.filter,
            ))
        self._announce(ctx.trace, "finished", now, status="refused", finish_reason="content_filter")

    # --- the journal -------------------------------------------------------------------------

    def journal(self, ctx: RequestContext, model: str, prompt_tokens: int) -> None:
        """The engine has the request: write its in-flight ledger row (not awaited), so a crash
        from here on leaves a row to recover."""
        if self.ledger is None or ctx.trace.response_id is None:
            return
        record = UsageRecord(
            request_id=ctx.request_id, response_id=ctx.trace.response_id, tenant=ctx.tenant_name, model=model,
            status="in_flight", prompt_tokens=prompt_tokens, created_at=ctx.trace.wall_arrival,
        )
        try:
            self.ledger.journal(record)
        except RuntimeError as exc:  # a closed or broken ledger: settle still tries, and logs
            logger.error("usage journal for request %s not written: %s", ctx.request_id, exc)
            return
        ctx.journal = record
        ctx.journaled_at = time.monotonic()

    def progress_due(self, ctx: RequestContext, now: float) -> bool:
        return ctx.journal is not None and now - ctx.journaled_at >= self.progress_interval_s

    def progress(self, ctx: RequestContext, now: float, cached_tokens: int, completion_tokens: int) -> None:
        """Journal the tokens produced so far (call when ``progress_due``)."""
        record = ctx.journal
        if record is None or self.ledger is None:
            return
        record.cached_tokens = min(cached_tokens, record.prompt_tokens)
        record.completion_tokens = completion_tokens
        ctx.journaled_at = now
        try:
            self.ledger.progress(record)
        except RuntimeError as exc:
            logger.error("usage journal for request %s not updated: %s", ctx.request_id, exc)

    # --- observation ---------------------------------------------------------------------------

    def first_token(self, ctx: RequestContext, at: float) -> None:
        """One sequence's first token: TTFT is observed per engine request (each of ``n``), the
        trace keeps the request's earliest."""
        if "first_token" not in ctx.trace.stamps:
            self._announce(ctx.trace, "first_token", at)
        ctx.trace.mark("first_token", at)
        self.metrics.first_token(at - ctx.arrival)

    def inter_token(self, ctx: RequestContext, at: float, seconds: float) -> None:
        self.metrics.inter_token(seconds)
        ctx.trace.stamps["last_token"] = at

    # --- the receipt ---------------------------------------------------------------------------

    async def settle(self, ctx: RequestContext, receipt: Receipt) -> None:
        """Count the request once everywhere: metrics, trace, rate-limit settlement, the durable
        ledger row (awaited: a response ends only after its row is committed), the log line."""
        now = time.monotonic()
        trace = ctx.trace
        trace.mark("finished", now)
        for seq in receipt.sequences:
            timings = seq.timings
            if timings is not None:
                if timings.first_scheduled is not None:
                    trace.mark("first_scheduled", timings.first_scheduled)
                trace.num_steps = max(trace.num_steps, timings.num_steps)
                trace.num_shared_steps = max(trace.num_shared_steps, timings.num_shared_steps)
            self.metrics.finished(seq.prompt_tokens, seq.completion_tokens, seq.finish_reason, timings, ctx.arrival, now)
        trace.status = receipt.status
        trace.completion_tokens = receipt.completion_tokens
        if ctx.reservation is not None and self.limiter is not None:
            await self.limiter.settle(ctx.reservation, receipt.completion_tokens)
            ctx.reservation = None
        cost_usd: float | None = None
        if self.ledger is not None:
            record = UsageRecord(
                request_id=ctx.request_id,
                response_id=trace.response_id,
                tenant=ctx.tenant_name,
                model=receipt.model,
                status=receipt.status,
                finish_reason=receipt.finish_reason,
                prompt_tokens=receipt.prompt_tokens,
                cached_tokens=receipt.cached_tokens,
                completion_tokens=receipt.completion_tokens,
                created_at=trace.wall_arrival,
                queue_s=trace.since_arrival("first_scheduled"),
                ttft_s=trace.since_arrival("first_token"),
                e2e_s=now - ctx.arrival,
                content_filter=receipt.content_filter,
            )
            await self.ledger.record(record)
            self.metrics.add_spend(ctx.tenant_name, receipt.model, record.cost_usd or 0.0)
            cost_usd = record.cost_usd
        self._announce(
            trace, "finished", now, status=receipt.status, finish_reason=receipt.finish_reason,
            prompt_tokens=receipt.prompt_tokens, cached_tokens=receipt.cached_tokens,
            completion_tokens=receipt.completion_tokens, cost_usd=cost_usd,
        )
        line: dict[str, Any] = {"event": "request_finished", **trace.to_dict()}
        if self.log_prompts and receipt.prompts is not None:
            line["prompts"] = receipt.prompts
            line["completions"] = receipt.completions
        logger.info("request %s", json.dumps(line, ensure_ascii=False))
