"""``TextWorkPool``: small text work runs on the event loop itself, in the order it was asked for;
large work on a pool thread, so the loop keeps answering while it runs; owners (tenants) are
served in turn, small work has a thread of its own, and work whose caller left is dropped."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenline.frontend.text_pool import EXPRESS_MAX_CHARS, INLINE_MAX_CHARS, TextWorkPool, text_size

LARGE = EXPRESS_MAX_CHARS + 1


def test_text_size_counts_characters_and_token_ids() -> None:
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert text_size(messages) == len("system") + 3 + len("user") + len("text") + 5
    assert text_size([[1, 2, 3], "four"]) == 3 + 4
    assert text_size({"flag": True, "n": None}) == 0


def test_small_work_runs_on_the_loop_and_large_work_on_a_pool_thread() -> None:
    pool = TextWorkPool()

    async def run() -> tuple[int, int, int]:
        loop_thread = threading.get_ident()
        small = await pool.run_sized(INLINE_MAX_CHARS - 1, threading.get_ident)
        large = await pool.run_sized(INLINE_MAX_CHARS, threading.get_ident)
        return loop_thread, small, large

    try:
        loop_thread, small, large = asyncio.run(run())
    finally:
        pool.close()
    assert small == loop_thread
    assert large != loop_thread


def test_small_work_keeps_the_order_it_was_asked_in_and_errors_reach_the_caller() -> None:
    pool = TextWorkPool()
    done: list[int] = []

    def work(i: int) -> int:
        time.sleep(0.002 * (5 - i))  # the earlier asks take longer: a pool would finish them last
        done.append(i)
        return i

    def fail() -> None:
        raise ValueError("bad prompt")

    async def run() -> list[int]:
        results = await asyncio.gather(*(pool.run_sized(10, lambda i=i: work(i)) for i in range(5)))
        with pytest.raises(ValueError, match="bad prompt"):
            await pool.run_sized(10, fail)
        return list(results)

    try:
        assert asyncio.run(run()) == [0, 1, 2, 3, 4]
    finally:
        pool.close()
    assert done == [0, 1, 2, 3, 4]


async def _blocked(pool: TextWorkPool, owner: str) -> tuple[asyncio.Task[None], threading.Event]:
    """A large piece of work that holds a pool thread until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(30)

    task = asyncio.create_task(pool.run(hold, LARGE, owner))
    assert await asyncio.to_thread(started.wait, 30)
    return task, release


def test_owners_are_served_in_turn() -> None:
    pool = TextWorkPool(workers=1)
    order: list[str] = []

    async def run() -> None:
        blocker, release = await _blocked(pool, "x")
        work = [pool.run(lambda name=name: order.append(name), LARGE, name[0]) for name in ("a1", "a2", "a3")]
        tasks = [asyncio.create_task(w) for w in work]
        await asyncio.sleep(0)  # queued before b's
        tasks.append(asyncio.create_task(pool.run(lambda: order.append("b1"), LARGE, "b")))
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(blocker, *tasks)

    try:
        asyncio.run(run())
    finally:
        pool.close()
    # One tenant's queue of large bodies: another's work goes next, not after all of them.
    assert order == ["a1", "b1", "a2", "a3"]


def test_small_work_never_waits_behind_large_work() -> None:
    pool = TextWorkPool(workers=2)

    async def run() -> None:
        blocker, release = await _blocked(pool, "bulk")
        queued = asyncio.create_task(pool.run(lambda: "large", LARGE, "bulk"))
        try:
            # Both large pieces wait for the general thread; the small one takes the express thread.
            assert await asyncio.wait_for(pool.run(lambda: "small", EXPRESS_MAX_CHARS, "chat"), 30) == "small"
            assert not blocker.done() and not queued.done()
        finally:
            release.set()
        assert await queued == "large"
        await blocker

    try:
        asyncio.run(run())
    finally:
        pool.close()


def test_work_whose_caller_left_is_dropped() -> None:
    pool = TextWorkPool(workers=1)
    ran: list[str] = []

    async def run() -> None:
        blocker, release = await _blocked(pool, "x")
        gone = asyncio.create_task(pool.run(lambda: ran.append("gone"), LARGE, "a"))
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone  # the caller has left before a thread was free
        release.set()
        await blocker
        assert await pool.run(lambda: "after", LARGE, "a") == "after"

    try:
        asyncio.run(run())
    finally:
        pool.close()
    assert ran == []
