"""``RemoteEngineClient`` over real HTTP and ZMQ against a fake vLLM server: a small HTTP app speaking
vLLM's streamed ``/v1/completions`` (return_token_ids, usage with cached tokens, its error shape),
``/health``, ``/v1/models`` and ``/metrics``, and a PUB socket sending vLLM 0.32's own KV-event
bytes (tests/router/fixtures). The model is not under test: tests/router/test_router_e2e.py runs
real upstreams."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from tokenline.bench.ports import free_port
from tokenline.engine.client import EngineDeadError, EngineRequestError
from tokenline.engine.messages import EngineRequest, FinishReason
from tokenline.router.fleet import FleetClient
from tokenline.router.policies import make_policy
from tokenline.router.remote_client import RemoteEngineClient, parse_upstream
from tokenline.sampling_params import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = json.loads((FIXTURES / "vllm_events.json").read_text())["prompt"]


class FakeVllm:
    """One fake vLLM server on a thread. ``mode``: "ok", "fail" (500 before any byte), "break"
    (the stream stops after two tokens without finishing), "down" (/health 503)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[
            Route("/health", self.health), Route("/v1/models", self.models), Route("/metrics", self.metrics),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.mode == "down" else 200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-vllm", "object": "model", "max_model_len": 2048}]})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="fake-vllm"} 2.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0",model_name="fake-vllm"} 1.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="fake-vllm"} 0.5\n'
            '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n')

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if body.get("max_tokens", 0) > 100:
            return JSONResponse({"error": {"message": "max_tokens is too large: 101", "type": "BadRequestError",
                                           "param": "max_tokens", "code": 400}}, status_code=400)
        if self.mode == "fail":
            return JSONResponse({"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}},
                                status_code=500)
        prompt = body["prompt"]

        async def events() -> AsyncIterator[str]:
            base = {"id": "cmpl-f", "object": "text_completion", "created": 1, "model": "fake-vllm"}
            for i, token in enumerate([11, 12, 13]):
                if self.mode == "break" and i == 2:
                    raise RuntimeError("the server died mid-stream")  # uvicorn drops the connection
                choice = {"index": 0, "text": f"t{token}", "logprobs": None, "finish_reason": None,
                          "stop_reason": None, "token_ids": [token]}
                if i == 0:
                    choice["prompt_token_ids"] = prompt
                if i == 2:
                    choice["finish_reason"] = "length"
                yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
                await asyncio.sleep(0.01)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3,
                     "prompt_tokens_details": {"cached_tokens": 96}}
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def __enter__(self) -> FakeVllm:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def fakes() -> Iterator[tuple[FakeVllm, FakeVllm]]:
    with FakeVllm() as a, FakeVllm() as b:
        yield a, b


def _request(rid: str, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                                           top_k=0, min_p=0.0, repetition_penalty=1.0))


async def _drain(collector) -> list:
    outputs = []
    while not collector.finished:
        outputs.extend(await collector.get())
    return outputs


async def _ready(client: RemoteEngineClient | FleetClient, timeout: float = 10.0) -> None:
    await client.wait_ready(timeout)


def test_a_streamed_request_and_the_upstreams_facts(fakes: tuple[FakeVllm, FakeVllm]) -> None:
    async def run() -> None:
        client = RemoteEngineClient(parse_upstream(fakes[0].url), health_interval=0.2, api_key="k")
        client.start()
        try:
            info = await asyncio.wait_for(client.wait_ready(), 10)
            assert (info.max_model_len, info.block_size, info.num_kv_blocks) == (2048, 16, 1000)
            assert (client.model, client.state) == ("fake-vllm", "ok")
            assert (client.stats.num_running, client.stats.num_waiting, client.stats.kv_cache_usage) == (2, 1, 0.5)
            outputs = await _drain(client.add([_request("r-0")]))
            assert [t for o in outputs for t in o.new_token_ids] == [11, 12, 13]
            final = outputs[-1]
            assert final.finish_reason is FinishReason.LENGTH
            assert (final.num_prompt_tokens, final.num_cached_tokens, final.num_output_tokens) == (len(PROMPT), 96, 3)
            body = fakes[0].bodies[-1]
            assert body["model"] == "fake-vllm" and body["prompt"] == PROMPT and body["return_token_ids"] is True
            # The request's own fault is a refusal naming the field, not a dead engine.
            with pytest.raises(EngineRequestError) as refused:
                await _drain(client.add([_request("r-1", max_tokens=101)]))
            assert refused.value.param == "max_tokens" and "too large" in str(refused.value)
            # A stream that breaks fails only that request; the client carries on.
            fakes[0].mode = "break"
            with pytest.raises(EngineDeadError, match="stream broke|ended before"):
                await _drain(client.add([_request("r-2")]))
            fakes[0].mode = "ok"
            assert client.alive and len(await _drain(client.add([_request("r-3")]))) == 4
            # /health failing twice in a row takes it out; healthy again, it is back.
            fakes[0].mode = "down"
            client.unhealthy_after = 2
            deadline = time.monotonic() + 5
            while client.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not client.alive and client.state == "restarting"
            fakes[0].mode = "ok"
            deadline = time.monotonic() + 5
            while not client.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert client.alive and client.state == "ok"
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_cancel_ends_the_request_at_once_with_what_was_seen(fakes: tuple[FakeVllm, FakeVllm]) -> None:
    async def run() -> None:
        client = RemoteEngineClient(parse_upstream(fakes[0].url), health_interval=0.2)
        client.start()
        try:
            await asyncio.wait_for(client.wait_ready(), 10)
            collector = client.add([_request("c-0")])
            first = await collector.get()
            client.abort(["c-0"])
            outputs = first + await _drain(collector)
            assert outputs[-1].finish_reason is FinishReason.ABORT
            assert outputs[-1].num_output_tokens == sum(len(o.new_token_ids) for o in outputs) >= 1
            assert not client._streams  # the stream is closed: the upstream saw the disconnect
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_fleet_of_fake_vllm_servers_retries_routes_by_their_kv_events(fakes: tuple[FakeVllm, FakeVllm]) -> None:
    """Upstream b publishes vLLM 0.32's own BlockStored bytes for PROMPT on ZMQ: the kv_events policy
    sends PROMPT there; a 500 before the first byte on one upstream is retried on the other."""
    a, b = fakes
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    stored = (FIXTURES / "vllm_stored.msgpack").read_bytes()

    async def run() -> None:
        members = {
            "a": RemoteEngineClient(parse_upstream(a.url), health_interval=0.2),
            "b": RemoteEngineClient(parse_upstream(f"{b.url},kv-events={endpoint}"), health_interval=0.2),
        }
        fleet = FleetClient(members, make_policy("kv_events"), ready_grace_s=5)
        seen: list = []
        members["b"].add_step_listener(lambda step: seen.extend(step.kv_events))
        fleet.start()
        try:
            await asyncio.wait_for(fleet.wait_ready(), 10)
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:  # PUB drops until the subscription lands
                pub.send_multipart((b"kv@fake", (0).to_bytes(8, "big"), stored))
                await asyncio.sleep(0.05)
            assert seen, "no KV event reached the router"
            await _drain(fleet.add([_request("k-0")]))
            assert fleet.decisions[("b", "prefix")] == 1 and fleet.counters["b"].predicted_hit_tokens == 96
            assert fleet.counters["b"].reported_hit_tokens == 96
            b.mode = "fail"
            outputs = await _drain(fleet.add([_request("k-1")]))  # goes to b (prefix), fails, retried on a
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            assert fleet.counters["b"].retries == 1 and fleet.decisions[("a", "retry")] == 1
            assert not fleet.member_healthy("b")  # ejected for a while
        finally:
            await fleet.shutdown()

    try:
        asyncio.run(run())
    finally:
        pub.close(linger=0)


def test_a_vllm_publisher_that_connects_and_replays_with_its_topic_frame(fakes: tuple[FakeVllm, FakeVllm]) -> None:
    """What a real vLLM 0.32 server does (bench/router_vllm_check.py): given a host address as its
    KV-event endpoint its PUB socket *connects* (so the router listens: ``kv-events-bind=``), and
    its replay socket answers ``[b"", topic, seq, payload]`` then ``[b"", b"", -1, b""]``. The router
    joins late (sees seq 1 first), fills seq 0 from the replay and routes by what both say."""
    a, b = fakes
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    router_socket = ctx.socket(zmq.ROUTER)
    router_socket.bind(replay)
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)  # vLLM's side for tcp://127.0.0.1:PORT: the router must have bound it
    batches = [(FIXTURES / f"vllm_{n}.msgpack").read_bytes() for n in ("stored", "removed")]
    stop = threading.Event()
    replays: list[int] = []

    def serve_replay() -> None:  # vLLM's ZmqEventPublisher._service_replay, frame for frame
        while not stop.is_set():
            if not router_socket.poll(50):
                continue
            client, _, start = router_socket.recv_multipart()
            replays.append(int.from_bytes(start, "big"))
            for seq, payload in enumerate(batches):
                if seq >= int.from_bytes(start, "big"):
                    router_socket.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            router_socket.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    thread = threading.Thread(target=serve_replay, daemon=True)
    thread.start()

    async def run() -> None:
        members = {
            "a": RemoteEngineClient(parse_upstream(a.url), health_interval=0.2),
            "b": RemoteEngineClient(parse_upstream(f"{b.url},kv-events-bind={endpoint},replay={replay}"),
                                    health_interval=0.2),
        }
        fleet = FleetClient(members, make_policy("kv_events"), ready_grace_s=5)
        seen: list = []
        members["b"].add_step_listener(lambda step: seen.extend(step.kv_events))
        fleet.start()
        try:
            await asyncio.wait_for(fleet.wait_ready(), 10)
            deadline = time.monotonic() + 10
            while len(seen) < 2 and time.monotonic() < deadline:  # seq 1 until it lands: seq 0 is replayed
                pub.send_multipart((b"", (1).to_bytes(8, "big"), batches[1]))
                await asyncio.sleep(0.05)
            assert replays == [0], "the router did not ask the replay socket for the missed batch"
            assert [type(e).__name__ for e in seen] == ["BlockStored", "BlockStored", "BlockRemoved"]
            await _drain(fleet.add([_request("v-0")]))
            # Six blocks stored, the last two removed: four 16-token blocks predicted cached on b.
            assert fleet.decisions[("b", "prefix")] == 1 and fleet.counters["b"].predicted_hit_tokens == 64
        finally:
            await fleet.shutdown()

    try:
        asyncio.run(run())
    finally:
        stop.set()
        thread.join(5)
        pub.close(linger=0)
        router_socket.close(linger=0)
