"""Per-tenant RPM/TPM/concurrency/daily limits, for both backends (in-memory and a real Redis)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenline.bench.ports import free_port
from tokenline.gateway.errors import APIError
from tokenline.gateway.keys import Tenant, TenantLimits
from tokenline.gateway.rate_limit import (
    DAY_S,
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    format_duration,
    make_rate_limiter,
)

REPO = Path(__file__).resolve().parents[2]
# Mid-day (UTC), so that only the daily tests come near a day boundary.
T0 = 20000 * DAY_S + 12 * 3600.0


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def tenant(name: str = "acme", **limits: int) -> Tenant:
    return Tenant(name, "0" * 64, ("*",), TenantLimits(**limits), False)


# --- a real redis-server for the Redis backend ---------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); Redis backend not tested")
    import redis

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(100):  # up to ~5 s for the server to accept connections
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server exited with {proc.returncode}")
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start within 5 s")
        yield url
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(params=["memory", "redis"])
def make_limiter(request: pytest.FixtureRequest) -> Callable[..., RateLimiter]:
    """A factory: make_limiter(clock, **kwargs) -> a fresh limiter on empty state."""
    if request.param == "memory":
        return lambda clock=None, **kw: MemoryRateLimiter(clock=clock or time.time, **kw)
    url = request.getfixturevalue("redis_url")
    import redis

    with redis.Redis.from_url(url) as client:
        client.flushdb()
    return lambda clock=None, **kw: RedisRateLimiter(url, clock=clock, **kw)


def run(limiter: RateLimiter, body: Callable[[RateLimiter], Awaitable[Any]]) -> Any:
    """Run one test body on a fresh event loop (Redis connections belong to the loop)."""

    async def main() -> Any:
        try:
            return await body(limiter)
        finally:
            await limiter.close()

    return asyncio.run(main())


async def refused(limiter: RateLimiter, t: Tenant, prompt: int = 0, max_tokens: int = 0) -> APIError:
    with pytest.raises(APIError) as info:
        await limiter.acquire(t, prompt, max_tokens)
    assert info.value.status_code == 429
    return info.value


# --- tests for both backends -----------------------------------------------------------------


def test_rpm_exhaustion_gives_429_with_retry_after_and_headers(make_limiter: Callable[..., RateLimiter]) -> None:
    clock = FakeClock()
    t = tenant(requests_per_minute=3)

    async def body(limiter: RateLimiter) -> None:
        remaining = []
        for _ in range(3):
            r = await limiter.acquire(t, 10, 10)
            remaining.append(r.headers.as_dict()["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]
        err = await refused(limiter, t)
        assert err.type == "rate_limit_error" and err.code == "rate_limit_exceeded"
        assert "requests per minute (RPM)" in err.message and "'acme'" in err.message
        # One request refills in 60/3 = 20 s; the bucket is full again in 60 s.
        assert err.headers["Retry-After"] == "20"
        assert err.headers["x-ratelimit-limit-requests"] == "3"
        assert err.headers["x-ratelimit-remaining-requests"] == "0"
        assert err.headers["x-ratelimit-reset-requests"] == "1m0s"
        assert "x-ratelimit-limit-tokens" not in err.headers  # no TPM limit set
        clock.advance(19.9)
        await refused(limiter, t)
        clock.advance(0.1)
        r = await limiter.acquire(t, 10, 10)
        assert r.headers.as_dict()["x-ratelimit-remaining-requests"] == "0"

    run(make_limiter(clock), body)


def test_tpm_charges_prompt_plus_max_tokens_and_settle_refunds(make_limiter: Callable[..., RateLimiter]) -> None:
    clock = FakeClock()
    t = tenant(tokens_per_minute=1000)

    async def body(limiter: RateLimiter) -> None:
        r = await limiter.acquire(t, 100, 300)
        assert r.reserved_tokens == 400
        assert r.headers.as_dict()["x-ratelimit-remaining-tokens"] == "600"
        # 600 left: a request reserving 601 must wait even if it would produce fewer tokens.
        err = await refused(limiter, t, 101, 500)
        assert "tokens per minute (TPM)" in err.message and "requested 601" in err.message
        assert err.headers["Retry-After"] == "1"  # 1 token at 1000/60 per s: 60 ms, rounded up
        assert err.headers["x-ratelimit-remaining-tokens"] == "600"
        await limiter.settle(r, 50)  # used 150 of 400: 250 come back
        assert (await limiter.headers(t)).remaining_tokens == 850
        await limiter.settle(r, 50)  # idempotent
        assert (await limiter.headers(t)).remaining_tokens == 850
        r2 = await limiter.acquire(t, 101, 500)
        await limiter.settle(r2, 10_000)  # more than reserved (should not happen): charged, floored at 0
        assert (await limiter.headers(t)).remaining_tokens == 0

    run(make_limiter(clock), body)


def test_a_burst_admits_exactly_what_tpm_allows(make_limiter: Callable[..., RateLimiter]) -> None:
    clock = FakeClock()
    t = tenant(tokens_per_minute=1000, requests_per_minute=1000)

    async def body(limiter: RateLimiter) -> None:
        results = await asyncio.gather(*(limiter.acquire(t, 50, 100) for _ in range(20)), return_exceptions=True)
        admitted = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(admitted) == 6  # 6 * 150 = 900 <= 1000 < 7 * 150
        assert all(isinstance(e, APIError) and e.status_code == 429 for e in errors)
        assert sorted(int(r.headers.remaining_tokens) for r in admitted) == [100, 250, 400, 550, 700, 850]

    run(make_limiter(clock), body)


async def never_fits(limiter: RateLimiter, t: Tenant, prompt: int, max_tokens: int) -> APIError:
    """A request that can never fit a limit: a 400 without a retry hint (a 429 invites retries)."""
    with pytest.raises(APIError) as info:
        await limiter.acquire(t, prompt, max_tokens)
    err = info.value
    assert err.status_code == 400 and err.code == "rate_limit_exceeds_capacity", err
    assert "Retry-After" not in err.headers and err.param == "max_tokens"
    return err


def test_request_larger_than_tpm_is_a_400_without_retry_hint(make_limiter: Callable[..., RateLimiter]) -> None:
    t = tenant(tokens_per_minute=1000, requests_per_minute=10)

    async def body(limiter: RateLimiter) -> None:
        err = await never_fits(limiter, t, 500, 501)
        assert "Request too large" in err.message and "can never fit" in err.message
        headers = await limiter.headers(t)
        assert headers.remaining_tokens == 1000 and headers.remaining_requests == 10  # nothing charged
        await limiter.acquire(t, 500, 500)  # exactly the limit still fits

    run(make_limiter(FakeClock()), body)


def test_concurrency_limit_and_release(make_limiter: Callable[..., RateLimiter]) -> None:
    t = tenant(max_concurrent=2)

    async def body(limiter: RateLimiter) -> None:
        a = await limiter.acquire(t, 1, 1)
        b = await limiter.acquire(t, 1, 1)
        assert a.headers is None  # no RPM/TPM limit: no x-ratelimit headers
        err = await refused(limiter, t)
        assert "concurrent" in err.message and err.headers["Retry-After"] == "1"
        await limiter.settle(a, 1)
        await limiter.settle(a, 1)  # settling twice frees one slot, not two
        c = await limiter.acquire(t, 1, 1)
        await refused(limiter, t)
        await limiter.settle(b, 0)
        await limiter.settle(c, 0)
        await asyncio.gather(limiter.acquire(t, 1, 1), limiter.acquire(t, 1, 1))

    run(make_limiter(FakeClock()), body)


def test_unsettled_reservation_frees_its_slot_when_the_lease_expires(
    make_limiter: Callable[..., RateLimiter],
) -> None:
    clock = FakeClock()
    t = tenant(max_concurrent=1)

    async def body(limiter: RateLimiter) -> None:
        await limiter.acquire(t, 1, 1)  # its server "crashed": never settled
        await refused(limiter, t)
        clock.advance(31)
        await limiter.acquire(t, 1, 1)

    run(make_limiter(clock, lease_s=30), body)


def test_daily_quota(make_limiter: Callable[..., RateLimiter]) -> None:
    day = 20000
    clock = FakeClock(day * DAY_S + DAY_S - 3600.5)  # 22:59:59.5 UTC
    t = tenant(daily_tokens=1000)

    async def body(limiter: RateLimiter) -> None:
        a = await limiter.acquire(t, 100, 500)
        err = await refused(limiter, t, 100, 500)
        assert err.code == "insufficient_quota" and "Daily token quota" in err.message
        assert "used 600" in err.message
        assert err.headers["Retry-After"] == "3601"  # until 00:00 UTC, rounded up
        await limiter.settle(a, 100)  # settled to 200: 400 come back to today's quota
        b = await limiter.acquire(t, 100, 700)  # 200 + 800 = 1000, exactly the quota
        await refused(limiter, t, 1, 0)
        clock.advance(3601)  # the next UTC day: a fresh quota
        c = await limiter.acquire(t, 0, 1000)
        # Yesterday's reservation settles against yesterday, not the new day's count.
        await limiter.settle(b, 0)
        await refused(limiter, t, 1, 0)
        await limiter.settle(c, 0)
        await limiter.acquire(t, 0, 1000)
        err = await never_fits(limiter, t, 1000, 1)
        assert "daily token quota" in err.message

    run(make_limiter(clock), body)


def test_buckets_refill_continuously(make_limiter: Callable[..., RateLimiter]) -> None:
    clock = FakeClock()
    t = tenant(tokens_per_minute=600, requests_per_minute=60)  # 10 tokens/s, 1 request/s

    async def body(limiter: RateLimiter) -> None:
        await limiter.acquire(t, 600, 0)
        err = await refused(limiter, t, 1, 0)
        assert err.headers["x-ratelimit-reset-tokens"] == "1m0s"
        clock.advance(1.5)
        h = await limiter.headers(t)
        assert h.remaining_tokens == 15 and h.remaining_requests == 60
        assert h.reset_tokens_s == pytest.approx(58.5)
        await limiter.acquire(t, 15, 0)
        err = await refused(limiter, t, 2, 0)
        assert err.headers["Retry-After"] == "1"  # 2 tokens at 10/s: 0.2 s, rounded up to 1
        assert err.headers["x-ratelimit-reset-requests"] == "1s"  # 59 of 60 requests left
        clock.advance(120)  # long idle: full, not more than full
        h = await limiter.headers(t)
        assert (h.remaining_tokens, h.remaining_requests) == (600, 60)

    run(make_limiter(clock), body)


def test_header_values(make_limiter: Callable[..., RateLimiter]) -> None:
    t = tenant(requests_per_minute=100, tokens_per_minute=40000)

    async def body(limiter: RateLimiter) -> None:
        r = await limiter.acquire(t, 1000, 3000)
        assert r.headers.as_dict() == {
            "x-ratelimit-limit-requests": "100",
            "x-ratelimit-remaining-requests": "99",
            "x-ratelimit-reset-requests": "600ms",  # 1 request at 100/min
            "x-ratelimit-limit-tokens": "40000",
            "x-ratelimit-remaining-tokens": "36000",
            "x-ratelimit-reset-tokens": "6s",  # 4000 tokens at 40000/min
        }

    run(make_limiter(FakeClock()), body)


def test_unlimited_tenant_is_never_limited(make_limiter: Callable[..., RateLimiter]) -> None:
    t = tenant("free")

    async def body(limiter: RateLimiter) -> None:
        rs = await asyncio.gather(*(limiter.acquire(t, 10**6, 10**6) for _ in range(50)))
        assert all(r.headers is None for r in rs)
        assert await limiter.headers(t) is None
        for r in rs:
            await limiter.settle(r, 5)

    run(make_limiter(FakeClock()), body)


def test_format_duration() -> None:
    assert format_duration(0) == "0s"
    assert format_duration(0.017) == "17ms"
    assert format_duration(0.0171) == "18ms"  # rounded up: never tell a client to retry early
    assert format_duration(1) == "1s"
    assert format_duration(1.5) == "1.5s"
    assert format_duration(360) == "6m0s"
    assert format_duration(90.25) == "1m30.25s"
    assert format_duration(3723) == "1h2m3s"
    assert format_duration(3600) == "1h0m0s"


def test_make_rate_limiter(redis_url: str) -> None:
    assert isinstance(make_rate_limiter(None), MemoryRateLimiter)
    limiter = make_rate_limiter(redis_url)
    assert isinstance(limiter, RedisRateLimiter)
    asyncio.run(limiter.close())


# --- Redis only: shared across server processes ---------------------------------------------


def test_redis_keys_are_namespaced_and_expire(redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    t = tenant("ttl", requests_per_minute=5, tokens_per_minute=100, max_concurrent=2, daily_tokens=1000)

    def keys_and_ttls() -> dict[str, int]:
        with redis.Redis.from_url(redis_url) as client:
            return {k.decode(): client.ttl(k) for k in client.keys("*")}

    async def body(limiter: RateLimiter) -> None:
        r = await limiter.acquire(t, 1, 1)
        held = keys_and_ttls()
        assert sorted(held) == [f"tokenline:rl:{{ttl}}:{k}" for k in ("daily", "inflight", "rpm", "tpm")]
        assert all(0 < ttl <= 2 * DAY_S for ttl in held.values())  # nothing lives forever
        await limiter.settle(r, 1)
        # The last in-flight reservation gone, its set goes too; the rest expire on their own.
        assert sorted(keys_and_ttls()) == [f"tokenline:rl:{{ttl}}:{k}" for k in ("daily", "rpm", "tpm")]

    run(RedisRateLimiter(redis_url), body)


def test_redis_two_limiters_cannot_together_exceed_the_limit(redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    # Redis's own clock (TIME): a request refills every 6 s, far longer than this test takes.
    t = tenant("shared", requests_per_minute=10, tokens_per_minute=100_000)

    async def body() -> int:
        a, b = RedisRateLimiter(redis_url), RedisRateLimiter(redis_url)  # as two servers would have
        try:
            results = await asyncio.gather(
                *(limiter.acquire(t, 1, 1) for _ in range(25) for limiter in (a, b)), return_exceptions=True
            )
        finally:
            await a.close()
            await b.close()
        assert all(isinstance(r, APIError) for r in results if isinstance(r, BaseException))
        return sum(not isinstance(r, BaseException) for r in results)

    assert asyncio.run(body()) == 10


_WORKER = textwrap.dedent("""
    import asyncio, json, sys, time
    from tokenline.gateway.errors import APIError
    from tokenline.gateway.keys import Tenant, TenantLimits
    from tokenline.gateway.rate_limit import RedisRateLimiter

    url, start_at = sys.argv[1], float(sys.argv[2])
    tenant = Tenant("procs", "0" * 64, ("*",), TenantLimits(daily_tokens=1000, max_concurrent=50), False)

    async def main():
        limiter = RedisRateLimiter(url)
        await limiter.ping()  # connect before the start line, so both start at once
        await asyncio.sleep(max(0.0, start_at - time.time()))
        results = await asyncio.gather(*(limiter.acquire(tenant, 40, 60) for _ in range(40)),
                                       return_exceptions=True)
        await limiter.close()
        print(json.dumps(sum(not isinstance(r, BaseException) for r in results)))

    asyncio.run(main())
""")


def test_redis_two_processes_cannot_together_exceed_the_limit(redis_url: str) -> None:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    start_at = time.time() + 2.0  # both processes start acquiring at the same moment
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, redis_url, str(start_at)], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    counts = []
    for proc in procs:
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        counts.append(json.loads(out))
    # 1000 daily tokens at 100 per request: exactly 10 between the two, whatever the split.
    assert sum(counts) == 10, counts
