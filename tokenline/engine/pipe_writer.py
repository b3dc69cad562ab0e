"""Messages to the engine process, written from the event loop the moment they are sent.

A writer thread (the earlier transport) needs the GIL to pickle and write, and while the loop is
busy with a burst of requests it waits up to the interpreter's switch interval (5 ms) for it: the
first request of a burst reached an idle engine 0.3-4.7 ms after it was handed over, long enough
for the next ones to join the engine's first step in some runs and not in others. Here the loop
writes itself on a non-blocking pipe: at once while the pipe has room, and the rest from a writer
callback when the engine has read enough (a pipe fills only while the engine is mid-step and the
API process sends faster than it reads), so the loop never blocks on the engine.

The frames are ``multiprocessing.connection.Connection.send``'s (a 4-byte big-endian length, or
-1 and an 8-byte length past 2 GiB, then the pickle), so the engine reads them with
``Connection.recv``; ``tests/engine/test_pipe_writer.py`` holds the two ends together.
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

_LONG_FRAME = 0x7FFFFFFF  # past this, Connection's header is -1 and then an unsigned 64-bit length


def frame(message: object) -> bytes:
    """``message`` as ``Connection.send`` writes it."""
    payload = bytes(ForkingPickler.dumps(message))
    n = len(payload)
    header = struct.pack("!i", n) if n <= _LONG_FRAME else struct.pack("!i", -1) + struct.pack("!Q", n)
    return header + payload


class PipeWriter:
    """The write end of the engine's pipe, driven by ``loop``. ``send`` may be called from any
    thread (off the loop's thread it is handed to the loop); messages keep their order."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn  # kept open (and owned) here: its file descriptor is the pipe's write end
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)  # this end only; the engine's read end keeps blocking
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built on the loop's thread, as start() runs
        # What the pipe had no room for yet, in order; while it holds bytes a writer callback is registered.
        self._pending = bytearray()
        self._closing = False  # close once the pending bytes are out
        self.closed = False

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def send(self, message: object) -> None:
        """Write ``message`` now if the pipe takes it, else queue it behind the earlier ones. A
        message to a closed writer or a dead engine is dropped (the reader reports the death)."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.send, message)
            return
        if self.closed or self._closing:
            return
        data = frame(message)
        if self._pending:
            self._pending += data
            return
        written = self._write(data)
        if written is not None and written < len(data):
            self._pending += data[written:]
            self._loop.add_writer(self._fd, self._flush)

    def close(self) -> None:
        """Close the pipe once what is queued has been written (at once if nothing is)."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.close)
            return
        self._closing = True
        if not self._pending:
            self._close_now()

    def _write(self, data: bytes | bytearray) -> int | None:
        """Bytes written (0 when the pipe is full), or None once the engine's end is gone."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # BrokenPipeError and the like: the engine died; nothing more will be read
            self._close_now()
            return None

    def _flush(self) -> None:
        written = self._write(self._pending)
        if written is None:
            return
        del self._pending[:written]
        if self._pending:
            return
        self._loop.remove_writer(self._fd)
        if self._closing:
            self._close_now()

    def _close_now(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pending:
            self._loop.remove_writer(self._fd)
            self._pending.clear()
        self._conn.close()
