"""Per-tenant rate limits as OpenAI applies them: RPM, TPM, concurrency and a daily token quota.

- Requests and tokens per minute are token buckets that refill continuously: capacity is the
  per-minute limit, refilled at limit/60 per second, so a tenant may burst up to a minute's worth
  and then runs at the steady rate.
- Tokens are charged at admission as ``prompt_tokens + max_tokens`` (the completion is reserved,
  since we cannot know its length yet) and settled when the request ends to
  ``prompt_tokens + completion_tokens``: the unused part of the reservation is refunded.
- ``max_concurrent`` counts requests between ``acquire`` and ``settle``.
- ``daily_tokens`` is a quota per UTC day, reserved and settled like TPM.

Two backends share one interface: ``MemoryRateLimiter`` (one process) and ``RedisRateLimiter``
(any number of server processes behind one Redis; each operation is one Lua script, so checking
and charging is atomic and two servers cannot together admit more than a tenant's limit).

Typical use by the HTTP layer::

    reservation = await limiter.acquire(tenant, prompt_tokens, max_tokens)   # or APIError 429
    response.headers.update(reservation.headers.as_dict() if reservation.headers else {})
    try:
        ...generate...
    finally:
        await limiter.settle(reservation, completion_tokens)
"""

from __future__ import annotations

import abc
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenline.gateway.errors import APIError
from tokenline.gateway.keys import Tenant, TenantLimits

__all__ = [
    "MemoryRateLimiter",
    "RateLimitHeaders",
    "RateLimiter",
    "RedisRateLimiter",
    "Reservation",
    "format_duration",
    "make_rate_limiter",
]

logger = logging.getLogger(__name__)

DAY_S = 86400
# A reservation not settled within this long (its server crashed, say) stops counting against
# max_concurrent; generous, since a long generation may legitimately take many minutes.
DEFAULT_LEASE_S = 3600.0
# Buckets refill completely within 60 s, so a bucket untouched for longer is the same as no key.
_BUCKET_TTL_S = 120
_DAILY_TTL_S = 2 * DAY_S  # so a request that started yesterday can still be refunded today

# Which limits refused a request (bit mask, the same in Python and in the Lua scripts).
_CONCURRENT, _REQUESTS, _TOKENS, _DAILY = 1, 2, 4, 8


def format_duration(seconds: float) -> str:
    """OpenAI's reset durations: "17ms", "1s", "1.5s", "6m0s", "1h2m3s" (rounded up to a ms)."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    text = f"{secs}.{millis:03d}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text


@dataclass(frozen=True)
class RateLimitHeaders:
    """The x-ratelimit-* values for one response; a None pair means that limit is not set."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None

    def as_dict(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.limit_requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limit_requests)
            headers["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            headers["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s or 0.0)
        if self.limit_tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            headers["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            headers["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s or 0.0)
        return headers


@dataclass
class Reservation:
    """What ``acquire`` charged; hand it to ``settle`` exactly once (more is harmless)."""

    tenant: str
    limits: TenantLimits
    prompt_tokens: int
    max_tokens: int
    reservation_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    day: int = 0  # UTC day (days since the epoch) the daily quota was charged on
    headers: RateLimitHeaders | None = None
    tracked: bool = True  # False for unlimited tenants: nothing was charged, nothing to settle
    settled: bool = False

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class _Snapshot:
    """A backend's answer: whether it admitted, and the state after charging (or as found)."""

    admitted: bool
    refused: int  # bit mask of _CONCURRENT / _REQUESTS / _TOKENS / _DAILY
    requests_level: float | None
    tokens_level: float | None
    in_flight: int
    daily_used: int
    day: int
    now: float


def _limit(value: int | None) -> int:
    return value or 0  # the backends take 0 as "unlimited"


def _headers(limits: TenantLimits, snap: _Snapshot) -> RateLimitHeaders | None:
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    if rpm is None and tpm is None:
        return None
    values: dict[str, Any] = {}
    if rpm is not None and snap.requests_level is not None:
        level = max(0.0, snap.requests_level)
        values.update(limit_requests=rpm, remaining_requests=math.floor(level + 1e-9),
                      reset_requests_s=(rpm - level) * 60.0 / rpm)
    if tpm is not None and snap.tokens_level is not None:
        level = max(0.0, snap.tokens_level)
        values.update(limit_tokens=tpm, remaining_tokens=math.floor(level + 1e-9),
                      reset_tokens_s=(tpm - level) * 60.0 / tpm)
    return RateLimitHeaders(**values)


def _never_fits(tenant: Tenant, prompt_tokens: int, max_tokens: int) -> APIError | None:
    """A request larger than the tenant's whole TPM (or daily) limit can never be admitted, so
    waiting cannot help: a 400 without Retry-After (a 429 would make clients retry it forever;
    OpenAI answers 429 here, the openai SDK then retries in vain)."""
    cost, who = prompt_tokens + max_tokens, f"tenant {tenant.name!r}"
    for name, limit in (("tokens per minute (TPM)", tenant.limits.tokens_per_minute),
                        ("daily token quota", tenant.limits.daily_tokens)):
        if limit is not None and cost > limit:
            return APIError.bad_request(
                f"Request too large for the {name} of {who}: limit {limit}, requested {cost} (prompt "
                f"{prompt_tokens} + max_tokens {max_tokens}); it can never fit, so reduce the prompt or max_tokens.",
                param="max_tokens", code="rate_limit_exceeds_capacity",
            )
    return None


def _refusal(tenant: Tenant, prompt_tokens: int, max_tokens: int, snap: _Snapshot) -> APIError:
    """The 429 for a refused request: every limit that refused it, and when to retry."""
    limits, cost, who = tenant.limits, prompt_tokens + max_tokens, f"tenant {tenant.name!r}"
    reasons: list[str] = []
    waits: list[float] = []
    code = "rate_limit_exceeded"
    if snap.refused & _TOKENS and limits.tokens_per_minute is not None and snap.tokens_level is not None:
        tpm, level = limits.tokens_per_minute, max(0.0, snap.tokens_level)
        wait = (cost - level) * 60.0 / tpm
        reasons.append(f"Rate limit reached for tokens per minute (TPM) of {who}: limit {tpm}, remaining "
                       f"{math.floor(level + 1e-9)}, requested {cost} (prompt {prompt_tokens} + max_tokens "
                       f"{max_tokens}); try again in {format_duration(wait)}")
        waits.append(wait)
    if snap.refused & _REQUESTS and limits.requests_per_minute is not None and snap.requests_level is not None:
        rpm, level = limits.requests_per_minute, max(0.0, snap.requests_level)
        wait = (1.0 - level) * 60.0 / rpm
        reasons.append(f"Rate limit reached for requests per minute (RPM) of {who}: limit {rpm}, remaining 0; "
                       f"try again in {format_duration(wait)}")
        waits.append(wait)
    if snap.refused & _DAILY and limits.daily_tokens is not None:
        daily = limits.daily_tokens
        wait = (snap.day + 1) * DAY_S - snap.now  # the quota renews at 00:00 UTC
        if code == "rate_limit_exceeded":
            code = "insufficient_quota"
        reasons.append(f"Daily token quota of {who} reached: limit {daily}, used {snap.daily_used}, requested "
                       f"{cost} (prompt {prompt_tokens} + max_tokens {max_tokens}); it renews at 00:00 UTC")
        waits.append(wait)
    if snap.refused & _CONCURRENT and limits.max_concurrent is not None:
        reasons.append(f"Too many concurrent requests for {who}: limit {limits.max_concurrent}; "
                       "try again when one finishes")
        waits.append(1.0)
    if not reasons:  # limits changed under us (a reload); still refuse clearly
        reasons.append(f"Rate limit reached for {who}")
        waits.append(1.0)
    # Every refusing limit must clear before a retry can succeed; round up so it is never early.
    error = APIError.rate_limited(". ".join(reasons) + ".", retry_after_s=max(1, math.ceil(max(waits))), code=code)
    headers = _headers(limits, snap)
    if headers is not None:
        error.headers.update(headers.as_dict())
    return error


class RateLimiter(abc.ABC):
    """Check-and-charge per tenant. ``acquire`` raises ``APIError`` 429 when over a limit."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.lease_s = lease_s

    async def acquire(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation:
        """Admit one request and charge 1 request and ``prompt_tokens + max_tokens`` tokens."""
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("prompt_tokens and max_tokens must be >= 0")
        reservation = Reservation(tenant.name, tenant.limits, prompt_tokens, max_tokens)
        if tenant.limits.unlimited:
            reservation.tracked = False  # no state to touch: no lock, no round trip
            return reservation
        too_large = _never_fits(tenant, prompt_tokens, max_tokens)
        if too_large is not None:  # refused before charging anything, not even the request
            current = await self.headers(tenant)
            if current is not None:
                too_large.headers.update(current.as_dict())
            raise too_large
        snap = await self._acquire(reservation, peek=False)
        if not snap.admitted:
            raise _refusal(tenant, prompt_tokens, max_tokens, snap)
        reservation.day = snap.day
        reservation.headers = _headers(tenant.limits, snap)
        return reservation

    async def settle(self, reservation: Reservation, completion_tokens: int) -> None:
        """End the request: refund the unused reservation, release its concurrency slot. Idempotent."""
        if reservation.settled:
            return
        reservation.settled = True
        if not reservation.tracked:
            return
        # The refund is what was reserved minus what was used; a negative one (more tokens than
        # max_tokens, which should not happen) charges the difference.
        used = reservation.prompt_tokens + max(0, completion_tokens)
        await self._settle(reservation, reservation.reserved_tokens - used)

    async def headers(self, tenant: Tenant) -> RateLimitHeaders | None:
        """The current x-ratelimit-* values for a tenant, charging nothing."""
        if tenant.limits.requests_per_minute is None and tenant.limits.tokens_per_minute is None:
            return None
        snap = await self._acquire(Reservation(tenant.name, tenant.limits, 0, 0), peek=True)
        return _headers(tenant.limits, snap)

    async def close(self) -> None:  # noqa: B027 - optional for backends without connections
        """Release connections."""

    @abc.abstractmethod
    async def _acquire(self, reservation: Reservation, peek: bool) -> _Snapshot: ...

    @abc.abstractmethod
    async def _settle(self, reservation: Reservation, refund: int) -> None: ...


# --- in-process backend --------------------------------------------------------------------


@dataclass
class _Bucket:
    level: float
    ts: float


@dataclass
class _TenantState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    in_flight: dict[str, float] = field(default_factory=dict)  # reservation id -> lease expiry
    day: int = -1
    daily_used: int = 0


def _refill(bucket: _Bucket | None, capacity: int, now: float) -> float:
    if bucket is None:
        return float(capacity)
    # max(0, ...): a clock that steps back must not drain the bucket.
    return min(float(capacity), bucket.level + max(0.0, now - bucket.ts) * capacity / 60.0)


class MemoryRateLimiter(RateLimiter):
    """Limits for one server process. The same rules as the Lua scripts of ``RedisRateLimiter``."""

    def __init__(self, clock: Callable[[], float] = time.time, lease_s: float = DEFAULT_LEASE_S) -> None:
        super().__init__(lease_s)
        self._clock = clock
        self._state: dict[str, _TenantState] = {}
        # Each operation runs to completion under this lock with no await inside, so concurrent
        # coroutines (and threads) cannot both see the last token and both take it.
        self._lock = threading.Lock()

    async def _acquire(self, reservation: Reservation, peek: bool) -> _Snapshot:
        limits = reservation.limits
        rpm, tpm = _limit(limits.requests_per_minute), _limit(limits.tokens_per_minute)
        conc, daily = _limit(limits.max_concurrent), _limit(limits.daily_tokens)
        cost = reservation.reserved_tokens
        with self._lock:
            now = self._clock()
            st = self._state.setdefault(reservation.tenant, _TenantState())
            refused = 0
            r_level = _refill(st.requests, rpm, now) if rpm else None
            t_level = _refill(st.tokens, tpm, now) if tpm else None
            if r_level is not None and r_level < 1:
                refused |= _REQUESTS
            if t_level is not None and t_level < cost:
                refused |= _TOKENS
            if not peek:
                st.in_flight = {rid: exp for rid, exp in st.in_flight.items() if exp > now}
            in_flight = sum(1 for exp in st.in_flight.values() if exp > now)
            if conc and in_flight >= conc:
                refused |= _CONCURRENT
            day = math.floor(now / DAY_S)
            used = st.daily_used if st.day == day else 0
            if daily and used + cost > daily:
                refused |= _DAILY
            admitted = refused == 0 and not peek
            if admitted:
                if r_level is not None:
                    r_level -= 1
                    st.requests = _Bucket(r_level, now)
                if t_level is not None:
                    t_level -= cost
                    st.tokens = _Bucket(t_level, now)
                if daily:
                    used += cost
                    st.day, st.daily_used = day, used
                st.in_flight[reservation.reservation_id] = now + self.lease_s
                in_flight += 1
            return _Snapshot(admitted, refused, r_level, t_level, in_flight, used, day, now)

    async def _settle(self, reservation: Reservation, refund: int) -> None:
        limits = reservation.limits
        tpm, daily = _limit(limits.tokens_per_minute), _limit(limits.daily_tokens)
        with self._lock:
            now = self._clock()
            st = self._state.get(reservation.tenant)
            # Gone from in_flight: settled already, or its lease ran out; either way nothing to do.
            if st is None or st.in_flight.pop(reservation.reservation_id, None) is None:
                return
            if refund and tpm:
                st.tokens = _Bucket(max(0.0, min(float(tpm), _refill(st.tokens, tpm, now) + refund)), now)
            if refund and daily and st.day == reservation.day:
                st.daily_used = max(0, st.daily_used - refund)


# --- Redis backend ---------------------------------------------------------------------------

# Shared by both scripts: the clock, and a bucket's level refilled up to now.
_LUA_COMMON = """
local now
if ARGV[1] == '' then
  -- The Redis server's clock: one clock for every tokenline process sharing this Redis.
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end  -- absent (or expired) = full
  return math.min(cap, tonumber(v[1]) + math.max(0, now - tonumber(v[2])) * cap / 60)
end
"""

# KEYS: 1 requests bucket, 2 tokens bucket, 3 in-flight zset (id -> lease expiry), 4 daily hash
# ARGV: 1 now ('' = TIME), 2 rpm, 3 tpm, 4 max_concurrent, 5 daily (0 = unlimited), 6 cost,
#       7 reservation id, 8 lease seconds, 9 peek ('1' = report only, write nothing)
# Returns {admitted, refused mask, requests level, tokens level, in flight, daily used, day, now};
# levels and now as strings, since Redis truncates Lua numbers to integers.
_ACQUIRE_LUA = _LUA_COMMON + """
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local conc, daily = tonumber(ARGV[4]), tonumber(ARGV[5])
local cost, peek = tonumber(ARGV[6]), ARGV[9] == '1'
local refused = 0
local rl, tl = -1, -1
if rpm > 0 then
  rl = level(KEYS[1], rpm)
  if rl < 1 then refused = refused + 2 end
end
if tpm > 0 then
  tl = level(KEYS[2], tpm)
  if tl < cost then refused = refused + 4 end
end
if not peek then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
local in_flight = redis.call('ZCOUNT', KEYS[3], '(' .. string.format('%.6f', now), '+inf')
if conc > 0 and in_flight >= conc then refused = refused + 1 end
local day = math.floor(now / 86400)
local used = 0
local d = redis.call('HMGET', KEYS[4], 'day', 'used')
if d[1] and tonumber(d[1]) == day then used = tonumber(d[2]) end
if daily > 0 and used + cost > daily then refused = refused + 8 end
local admitted = 0
if refused == 0 and not peek then
  admitted = 1
  if rpm > 0 then
    rl = rl - 1
    redis.call('HSET', KEYS[1], 'level', rl, 'ts', now)
    redis.call('EXPIRE', KEYS[1], BUCKET_TTL)
  end
  if tpm > 0 then
    tl = tl - cost
    redis.call('HSET', KEYS[2], 'level', tl, 'ts', now)
    redis.call('EXPIRE', KEYS[2], BUCKET_TTL)
  end
  if daily > 0 then
    used = used + cost
    redis.call('HSET', KEYS[4], 'day', day, 'used', used)
    redis.call('EXPIRE', KEYS[4], DAILY_TTL)
  end
  local lease = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[3], now + lease, ARGV[7])
  redis.call('EXPIRE', KEYS[3], math.ceil(lease) + 60)
  in_flight = in_flight + 1
end
return {admitted, refused, tostring(rl), tostring(tl), in_flight, used, day, string.format('%.6f', now)}
""".replace("BUCKET_TTL", str(_BUCKET_TTL_S)).replace("DAILY_TTL", str(_DAILY_TTL_S))

# KEYS: as above. ARGV: 1 now, 2 tpm, 3 daily, 4 refund (may be negative), 5 reservation id,
#       6 the reservation's day. Returns 1 if it settled, 0 if already settled (or lease expired).
_SETTLE_LUA = _LUA_COMMON + """
-- ZREM succeeds once per reservation: that makes settling idempotent across processes too.
if redis.call('ZREM', KEYS[3], ARGV[5]) == 0 then return 0 end
local tpm, daily, refund = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if refund ~= 0 and tpm > 0 then
  local l = math.max(0, math.min(tpm, level(KEYS[2], tpm) + refund))
  redis.call('HSET', KEYS[2], 'level', l, 'ts', now)
  redis.call('EXPIRE', KEYS[2], BUCKET_TTL)
end
if refund ~= 0 and daily > 0 then
  local d = redis.call('HMGET', KEYS[4], 'day', 'used')
  -- Only the day the tokens were charged on; a new day started with a fresh quota.
  if d[1] and tonumber(d[1]) == tonumber(ARGV[6]) then
    redis.call('HSET', KEYS[4], 'used', math.max(0, tonumber(d[2]) - refund))
  end
end
return 1
""".replace("BUCKET_TTL", str(_BUCKET_TTL_S))


class RedisRateLimiter(RateLimiter):
    """Limits shared by every server process that uses the same Redis.

    Keys are ``tokenline:rl:{<tenant>}:<rpm|tpm|inflight|daily>`` (the braces keep one tenant's
    keys in one Redis Cluster slot, which a multi-key script needs), all with TTLs. The clock is
    Redis's ``TIME`` unless ``clock`` is given (tests), never a mix of the two.
    If Redis is unreachable, requests are refused with 503 rather than admitted unlimited.
    """

    def __init__(
        self,
        url: str,
        *,
        clock: Callable[[], float] | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        prefix: str = "tokenline:rl",
    ) -> None:
        super().__init__(lease_s)
        import redis.asyncio as aioredis  # optional dependency: only this backend needs it

        self._redis = aioredis.Redis.from_url(url)
        self._clock = clock
        self._prefix = prefix
        # register_script runs EVALSHA and falls back to EVAL (loading it) when Redis lacks it.
        self._acquire_script = self._redis.register_script(_ACQUIRE_LUA)
        self._settle_script = self._redis.register_script(_SETTLE_LUA)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}:{{{tenant}}}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:inflight", f"{base}:daily"]

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    async def _acquire(self, reservation: Reservation, peek: bool) -> _Snapshot:
        import redis

        limits = reservation.limits
        args = [
            self._now_arg(),
            _limit(limits.requests_per_minute),
            _limit(limits.tokens_per_minute),
            _limit(limits.max_concurrent),
            _limit(limits.daily_tokens),
            reservation.reserved_tokens,
            reservation.reservation_id,
            repr(float(self.lease_s)),
            "1" if peek else "0",
        ]
        try:
            out = await self._acquire_script(keys=self._keys(reservation.tenant), args=args)
        except redis.RedisError as exc:
            logger.error("rate limiter: Redis failed: %s", exc)
            raise APIError.unavailable("The rate limiter is unavailable; try again shortly.", 1.0) from exc
        admitted, refused, r_level, t_level, in_flight, used, day, now = out
        return _Snapshot(
            admitted=int(admitted) == 1,
            refused=int(refused),
            requests_level=float(r_level) if limits.requests_per_minute else None,
            tokens_level=float(t_level) if limits.tokens_per_minute else None,
            in_flight=int(in_flight),
            daily_used=int(used),
            day=int(day),
            now=float(now),
        )

    async def _settle(self, reservation: Reservation, refund: int) -> None:
        import redis

        limits = reservation.limits
        args = [
            self._now_arg(),
            _limit(limits.tokens_per_minute),
            _limit(limits.daily_tokens),
            refund,
            reservation.reservation_id,
            reservation.day,
        ]
        try:
            await self._settle_script(keys=self._keys(reservation.tenant), args=args)
        except redis.RedisError as exc:
            # Nothing the client can do about it; the slot frees itself when its lease expires.
            logger.warning("rate limiter: could not settle %s for %r: %s", reservation.reservation_id,
                           reservation.tenant, exc)

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()


def make_rate_limiter(redis_url: str | None, **kwargs: Any) -> RateLimiter:
    """Redis-backed when ``redis_url`` is given (limits shared by all processes), else in-memory."""
    if redis_url:
        return RedisRateLimiter(redis_url, **kwargs)
    return MemoryRateLimiter(**kwargs)
