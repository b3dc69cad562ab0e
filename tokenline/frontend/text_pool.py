"""Template rendering, tokenizing and detokenizing off the event loop, a few at a time.

A 4 MB prompt takes seconds to tokenize; on the event loop that would stall every other request,
health probes included. The API process hands such work to one small thread pool (the Rust
tokenizer releases the GIL, so the loop keeps answering), and the pool's size bounds how many run
at once, so a burst of large bodies queues instead of taking every core.

A small chat's template and tokens take a fraction of a millisecond, less than the trip through the
pool: two thread hand-offs, each waiting for the GIL behind the loop and the other worker (the
interpreter switches every 5 ms). ``run_sized`` does such work on the loop itself, so requests
sent together are rendered and handed to the engine in the order they came, each as soon as it is
ready, instead of the pool finishing a burst's first requests together.
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
# Below this many characters (or token ids) rendering and tokenizing run on the loop. The default
# model's template and tokenizer here: 0.14 ms for a 300-character chat, 0.54 ms for 2,000, 4.1 ms
# for 16,384 (long enough to hold up other streams' chunks: the pool's tokenizing leaves the GIL).
INLINE_MAX_CHARS = 4096


def text_size(value: object) -> int:
    """Characters of text and count of token ids in a JSON-like value (messages, prompts): what
    rendering and tokenizing it reads."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 1 if isinstance(value, int) and not isinstance(value, bool) else 0


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

    async def run_sized(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn`` on the loop itself when ``size`` (characters of text, or token ids, that it reads)
        is under ``INLINE_MAX_CHARS``, else on a pool thread (``run``)."""
        if size < INLINE_MAX_CHARS:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
