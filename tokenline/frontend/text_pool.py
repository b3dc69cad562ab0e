"""Template rendering, tokenizing and detokenizing off the event loop, a few at a time, fairly.

A 4 MB prompt takes seconds to tokenize; on the event loop that would stall every other request,
health probes included. The API process hands such work to a few threads of its own (the Rust
tokenizer releases the GIL, so the loop keeps answering), and their number bounds how many run at
once, so a burst of large bodies queues instead of taking every core.

The queue is fair between owners (tenants): each owner's work waits in its own line, and a free
thread takes the next piece from the owners in turn, so one tenant's dozen large bodies delay
another tenant's work by at most the pieces already running. With two threads or more, one of
them takes only small work (under ``EXPRESS_MAX_CHARS``), so a small chat never waits behind a
large body at all. Work whose caller went away before it started is dropped.

A small chat's template and tokens take a fraction of a millisecond, less than the trip through the
pool: two thread hand-offs, each waiting for the GIL behind the loop and the other worker (the
interpreter switches every 5 ms). ``run_sized`` does such work on the loop itself, so requests
sent together are rendered and handed to the engine in the order they came, each as soon as it is
ready, instead of the pool finishing a burst's first requests together.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TEXT_WORKERS = 2  # two: one large body does not hold up every small one behind it
# Below this many characters (or token ids) rendering and tokenizing run on the loop. The default
# model's template and tokenizer here: 0.14 ms for a 300-character chat, 0.54 ms for 2,000, 4.1 ms
# for 16,384 (long enough to hold up other streams' chunks: the pool's tokenizing leaves the GIL).
INLINE_MAX_CHARS = 4096
# Up to this size work may take the express thread: ~15k tokens, ~30 ms of tokenizing here, so
# work in that lane waits at most a few such pieces; a 4 MB body takes ~3 s.
EXPRESS_MAX_CHARS = 65_536


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


@dataclass(eq=False)
class _Work:
    fn: Callable[[], Any]
    size: int
    owner: Hashable
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class TextWorkPool:
    def __init__(self, workers: int = DEFAULT_TEXT_WORKERS) -> None:
        if workers < 1:
            raise ValueError(f"text workers must be at least 1, got {workers}")
        self.workers = workers
        self._ready = threading.Condition()
        self._lines: OrderedDict[Hashable, deque[_Work]] = OrderedDict()  # per owner, in the order served
        self._closed = False
        for i in range(workers):
            express = workers > 1 and i == 0
            threading.Thread(target=self._serve, args=(express,), name=f"tokenline-text-{i}", daemon=True).start()

    async def run(self, fn: Callable[[], T], size: int | None = None, owner: Hashable = None) -> T:
        """``fn()`` on a pool thread, in ``owner``'s line; its exception (a PromptError…) is raised
        here. ``size``: characters of text or token ids it reads (None: counted as large)."""
        loop = asyncio.get_running_loop()
        work = _Work(fn, EXPRESS_MAX_CHARS + 1 if size is None else size, owner, loop.create_future(), loop)
        with self._ready:
            if self._closed:
                raise RuntimeError("the text pool is closed")
            self._lines.setdefault(owner, deque()).append(work)
            self._ready.notify_all()
        try:
            return await work.future
        except asyncio.CancelledError:
            self._withdraw(work)  # the caller is gone: nobody wants it done
            raise

    async def run_sized(self, size: int, fn: Callable[[], T], owner: Hashable = None) -> T:
        """``fn()`` on the loop itself when ``size`` (characters of text, or token ids, that it reads)
        is under ``INLINE_MAX_CHARS``, else on a pool thread (``run``)."""
        if size < INLINE_MAX_CHARS:
            return fn()
        return await self.run(fn, size, owner)

    def close(self) -> None:
        with self._ready:
            self._closed = True
            waiting = [work for line in self._lines.values() for work in line]
            self._lines.clear()
            self._ready.notify_all()
        for work in waiting:
            work.loop.call_soon_threadsafe(work.future.cancel)

    # --- the threads -------------------------------------------------------------------------

    def _serve(self, express: bool) -> None:
        while True:
            with self._ready:
                work = self._next(express)
                while work is None:
                    if self._closed:
                        return
                    self._ready.wait()
                    work = self._next(express)
            result, error = None, None
            try:
                result = work.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
                error = exc
            try:
                work.loop.call_soon_threadsafe(_settle, work.future, result, error)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody waits

    def _next(self, express: bool) -> _Work | None:
        """The next piece of work for a thread (under the lock): the owners in turn, each's oldest
        piece; the express thread takes only small pieces."""
        for owner, line in self._lines.items():
            work = next((w for w in line if w.size <= EXPRESS_MAX_CHARS), None) if express else line[0]
            if work is None:
                continue
            line.remove(work)
            if line:
                self._lines.move_to_end(owner)  # served: the other owners go first next time
            else:
                del self._lines[owner]
            return work
        return None

    def _withdraw(self, work: _Work) -> None:
        with self._ready:
            line = self._lines.get(work.owner)
            if line is not None and work in line:
                line.remove(work)
                if not line:
                    del self._lines[work.owner]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
