"""Template rendering, tokenizing and detokenizing off the event loop, a few at a time.

A 4 MB prompt takes seconds to tokenize; on the event loop that would stall every other request,
health probes included. The API process hands such work to one small thread pool (the Rust
tokenizer releases the GIL, so the loop keeps answering), and the pool's size bounds how many run
at once, so a burst of large bodies queues instead of taking every core.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_TEXT_WORKERS = 2  # two: one large body does not hold up every small one behind it


class TextWorkPool:
    def __init__(self, workers: int = DEFAULT_TEXT_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"text workers must be at least 1, got {workers}")
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenline-text")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on a pool thread; its exception (a PromptError…) is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
