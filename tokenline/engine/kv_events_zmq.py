"""KV events on the wire for consumers in other processes, framed the way vLLM frames them.

PUB socket, one multipart message per batch: ``[topic, seq, payload]`` where ``seq`` is an 8-byte
big-endian sequence number starting at 0 and ``payload`` is ``kv_events.encode_event_batch``.

ROUTER socket for replay: a DEALER sends ``[b"", start_seq]`` (8 bytes big-endian) and gets back
``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
``[b"", b"", -1, b""]`` (``-1`` as a signed 8-byte integer) to mark the end: vLLM 0.32's frames.
Older vLLM replied without the topic frame (``[b"", seq, payload]``); the subscriber reads both.
A subscriber that sees a gap in the sequence numbers asks for the missing batches this way, so it
never silently loses an eviction.

Unlike vLLM, which binds or connects depending on the address, the publisher always binds: the
engine is the stable end and routers come and go. The subscriber connects, or binds
(``bind=True``) for a vLLM whose PUB endpoint is a host address: vLLM connects to those, so the
reader must be the one listening.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from tokenline.engine.kv_events import EventBatch, decode_event_batch, encode_event_batch

logger = logging.getLogger("tokenline.engine")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Publishes event batches from a background thread, which owns both sockets (ZMQ sockets
    are not thread-safe) and answers replay requests even while the engine blocks idle."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._topic = topic.encode()
        self._data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # (seq, payload) for replay
        self._next_seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._data_parallel_rank
        self._queue.put(batch)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        # Without a replay socket there is nothing to poll: sleep on the queue, so an idle engine
        # costs no CPU here. With one, wake every 20 ms to answer replay requests.
        wait = None if self._replay is None else 0.02
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay(self._replay)
                except zmq.ZMQError:
                    logger.exception("KV events: replay request failed")
            try:
                batch = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = self._next_seq, encode_event_batch(batch)
            self._next_seq += 1
            self._buffer.append((seq, payload))  # before sending, so a replay racing it finds it
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self, socket: zmq.Socket) -> None:
        frames = socket.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: malformed replay request with %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                socket.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        socket.send_multipart((client, b"", b"", END_SEQ, b""))


class KVEventSubscriber:
    """Reads a publisher's batches in order (ours or vLLM's), filling gaps from its replay socket.

    ``receive`` returns ``(seq, batch)`` pairs: normally one, more when missed batches were
    replayed first. Batches already seen are skipped, so every sequence number comes out once.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 bind: bool = False) -> None:
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self.last_seq = -1  # the last sequence number handed out

    def receive(self, timeout_ms: int = 1000) -> list[tuple[int, EventBatch]]:
        if not self._sub.poll(timeout_ms):
            return []
        _, seq_bytes, payload = self._sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        out: list[tuple[int, EventBatch]] = []
        if seq > self.last_seq + 1 and self._replay is not None:
            out = [(s, b) for s, b in self.replay(self.last_seq + 1, timeout_ms) if s < seq]
        elif seq > self.last_seq + 1:
            logger.warning("KV events: missed batches %d..%d and no replay socket", self.last_seq + 1, seq - 1)
        if seq > self.last_seq:
            out.append((seq, decode_event_batch(payload)))
        if out:
            self.last_seq = out[-1][0]
        return out

    def replay(self, start_seq: int, timeout_ms: int = 1000) -> list[tuple[int, EventBatch]]:
        """The publisher's buffered batches from ``start_seq`` on."""
        if self._replay is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while self._replay.poll(timeout_ms):
            # [b"", topic, seq, payload] from vLLM 0.32 and us; [b"", seq, payload] from older vLLM.
            *_, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq_bytes, "big"), decode_event_batch(payload)))
        raise TimeoutError(f"no end of replay from the publisher within {timeout_ms} ms")

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
