"""``PipeWriter``: the event loop's writes to the engine's pipe, read back by the engine's
``Connection.recv`` on real pipes — at once when the pipe has room, in order when it is full,
from any thread, and quietly dropped once the reader is gone."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import threading
from multiprocessing.connection import Connection

import pytest

from tokenline.engine.messages import AbortRequest, AddRequest, EngineRequest, Shutdown
from tokenline.engine.pipe_writer import PipeWriter, frame
from tokenline.sampling_params import SamplingParams


def _pipe() -> tuple[Connection, Connection]:
    return multiprocessing.get_context("spawn").Pipe(duplex=False)


def _request(i: int, prompt_len: int = 8) -> AddRequest:
    params = SamplingParams(max_tokens=4).with_defaults()
    return AddRequest(EngineRequest(f"r-{i}", list(range(prompt_len)), params))


@pytest.mark.parametrize("size", [1, 5_000, 100_000])  # one write; Connection's split past 16 KiB; past the pipe
def test_frames_read_back_by_connection_recv(size: int) -> None:
    reader, writer = _pipe()
    message = _request(0, size)

    def write_all(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(writer.fileno(), view):]

    try:
        thread = threading.Thread(target=write_all, args=(frame(message) + frame(Shutdown()),))
        thread.start()
        assert reader.recv() == message
        assert isinstance(reader.recv(), Shutdown)
        thread.join(10)
    finally:
        reader.close()
        writer.close()


def test_a_send_is_in_the_pipe_before_the_loop_yields() -> None:
    reader, writer_conn = _pipe()
    message = _request(1)

    async def run() -> bool:
        writer = PipeWriter(writer_conn, asyncio.get_running_loop())
        writer.send(message)
        # No await between the send and this check: a writer thread would still wait for the GIL.
        readable, _, _ = select.select([reader.fileno()], [], [], 0)
        writer.close()
        return bool(readable)

    try:
        assert asyncio.run(run())
        assert reader.recv() == message
    finally:
        reader.close()


def test_a_full_pipe_never_blocks_the_loop_and_keeps_the_order() -> None:
    reader, writer_conn = _pipe()
    messages = [_request(i, 20_000) for i in range(12)]  # ~1 MB of frames against a 64 KiB pipe
    received: list[object] = []

    async def run() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        writer = PipeWriter(writer_conn, loop)
        for m in messages[:6]:
            writer.send(m)
        queued = writer.pending_bytes  # nobody reads yet: most of it waits here, and send returned
        thread = threading.Thread(target=lambda: received.extend(reader.recv() for _ in messages))
        thread.start()
        from_thread = threading.Thread(target=lambda: [writer.send(m) for m in messages[6:]])
        from_thread.start()
        from_thread.join()
        for _ in range(2000):
            if writer.pending_bytes == 0 and len(received) == len(messages):
                break
            await asyncio.sleep(0.005)
        left = writer.pending_bytes
        writer.close()
        await asyncio.to_thread(thread.join, 10)
        return queued, left

    try:
        queued, left = asyncio.run(run())
        assert queued > 0 and left == 0
        assert received == messages
    finally:
        reader.close()


def test_close_waits_for_what_is_queued_then_the_reader_sees_the_end() -> None:
    reader, writer_conn = _pipe()
    messages = [_request(i, 20_000) for i in range(6)] + [Shutdown()]
    received: list[object] = []

    def read_all() -> None:
        try:
            while True:
                received.append(reader.recv())
        except EOFError:
            received.append("EOF")

    async def run() -> None:
        writer = PipeWriter(writer_conn, asyncio.get_running_loop())
        for m in messages:
            writer.send(m)
        writer.close()
        writer.send(AbortRequest("late"))  # after close: dropped
        assert not writer.closed  # bytes still queued: the pipe stays open for them
        thread = threading.Thread(target=read_all)
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        assert writer.closed

    try:
        asyncio.run(run())
        assert received == [*messages, "EOF"]
    finally:
        reader.close()


def test_a_gone_reader_drops_messages_without_raising() -> None:
    reader, writer_conn = _pipe()
    reader.close()  # the engine died

    async def run() -> bool:
        writer = PipeWriter(writer_conn, asyncio.get_running_loop())
        writer.send(_request(1))
        writer.send(_request(2))
        return writer.closed

    assert asyncio.run(run())
