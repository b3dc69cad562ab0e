"""``TextWorkPool``: small text work runs on the event loop itself, in the order it was asked for;
large work on a pool thread, so the loop keeps answering while it runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenline.frontend.text_pool import INLINE_MAX_CHARS, TextWorkPool, text_size


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
        results = await asyncio.gather(*(pool.run_sized(10, work, i) for i in range(5)))
        with pytest.raises(ValueError, match="bad prompt"):
            await pool.run_sized(10, fail)
        return list(results)

    try:
        assert asyncio.run(run()) == [0, 1, 2, 3, 4]
    finally:
        pool.close()
    assert done == [0, 1, 2, 3, 4]
