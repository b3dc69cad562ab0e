"""``RemoteEngineClient``: one upstream server (tokenline or vLLM) as an ``EngineClient``.

Each engine request is one streamed ``POST /v1/completions`` of token ids over a keep-alive pool
(``upstream_stream.py`` maps it both ways); each chunk is delivered as it arrives, so streaming
passes through unbuffered. Cancelling closes the stream (the upstream sees the disconnect and
aborts) and ends the request at once with the tokens seen.

Failures are per request: an upstream 4xx that is the request's own fault is a refusal
(``_reject``); a refused connection, a 5xx or a stream that breaks fails only that request
(``_fail_request``), which a ``FleetClient`` retries elsewhere when nothing was delivered yet.

Health is checked actively: ``GET /health`` every ``health_interval`` s; a member is in after a
success, out after ``unhealthy_after`` failures in a row or at once on a refused connection, and in
again once healthy (``alive``/``ready``/``state`` follow, so the fleet stops routing there). The
same loop scrapes ``/metrics`` into ``stats``. With ``kv_events``, a subscriber thread reads the
upstream's ZMQ KV events (vLLM's wire format) and delivers them as steps for the routing policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from tokenline.engine.client import EngineClient, OutputCollector
from tokenline.engine.kv_events import AllBlocksCleared
from tokenline.engine.messages import (
    EngineReady,
    EngineRequest,
    EngineStats,
    StepOutputs,
)
from tokenline.router.upstream_metrics import UpstreamLoad, parse_upstream_metrics
from tokenline.router.upstream_stream import (
    StreamDecoder,
    UnmappableRequest,
    UpstreamError,
    completion_body,
    sse_payload,
)

logger = logging.getLogger("tokenline.router")


@dataclass(frozen=True)
class UpstreamSpec:
    """One ``--upstream`` value: ``URL[,kv-events=tcp://HOST:PORT][,replay=tcp://HOST:PORT]`` or
    ``URL,kind=openai[,model=NAME]``. ``kv-events-bind=tcp://HOST:PORT`` instead of ``kv-events=``:
    the router listens there and the upstream's PUB socket connects (vLLM connects when its
    ``endpoint`` is a host address, and binds only a wildcard such as ``tcp://*:5557``)."""

    url: str
    kv_events: str | None = None
    replay: str | None = None
    kind: str = "tokenline"  # "openai": takes text only (router/passthrough.py); else token ids
    model: str | None = None  # kind=openai: the upstream's model name (default: its /v1/models' first)
    kv_events_bind: bool = False  # the router binds kv_events; the upstream connects to it

    @property
    def name(self) -> str:
        """The upstream's label on ``/metrics`` and in logs (host:port)."""
        return urlsplit(self.url).netloc


def parse_upstream(text: str) -> UpstreamSpec:
    """Parse an ``--upstream`` value; ``ValueError`` names what is wrong."""
    url, *options = [part.strip() for part in text.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--upstream needs an http(s) base URL such as http://10.0.0.5:8000, got {url!r}")
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key == "kind" and value in ("tokenline", "vllm", "openai") or key == "model" and value:
            values[key] = value
            continue
        if key not in ("kv-events", "kv-events-bind", "replay") or not sep or not value.startswith("tcp://"):
            raise ValueError(f"--upstream option {option!r}: expected kv-events=tcp://HOST:PORT, "
                             "kv-events-bind=tcp://HOST:PORT, replay=tcp://HOST:PORT, kind=tokenline|vllm|openai "
                             "or model=NAME")
        values[key] = value
    bind = "kv-events-bind" in values
    if bind and "kv-events" in values:
        raise ValueError(f"--upstream {url}: give kv-events= (the router connects) or kv-events-bind= (it listens), "
                         "not both")
    if bind:
        values["kv-events"] = values.pop("kv-events-bind")
    if "replay" in values and "kv-events" not in values:
        raise ValueError(f"--upstream {url}: replay= needs kv-events=")
    kind = "openai" if values.get("kind") == "openai" else "tokenline"  # vllm and tokenline speak the same
    if kind == "openai" and "kv-events" in values:
        raise ValueError(f"--upstream {url}: kind=openai takes text only and publishes no KV events")
    if "model" in values and kind != "openai":
        raise ValueError(f"--upstream {url}: model= is for kind=openai (token-id upstreams name their own)")
    return UpstreamSpec(url.rstrip("/").removesuffix("/v1"), values.get("kv-events"), values.get("replay"),
                        kind, values.get("model"), bind)


class RemoteEngineClient(EngineClient):
    """One upstream. ``api_key``: sent as a Bearer token on every call (requests, health, metrics)."""

    def __init__(
        self,
        spec: UpstreamSpec,
        *,
        api_key: str | None = None,
        health_interval: float = 2.0,
        unhealthy_after: int = 3,
        connect_timeout: float = 3.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(restart=None)  # the upstream supervises itself; health checks see it come back
        self.spec = spec
        self.api_key = api_key
        self.health_interval = health_interval
        self.unhealthy_after = max(1, unhealthy_after)
        self.connect_timeout = connect_timeout
        self.model: str | None = None  # the upstream's model name, from its /v1/models
        self.healthy = False
        self.was_healthy = False  # in at least once (a later failure means "out", not "loading")
        self._failures = 0
        self._http = http
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._decoders: dict[str, StreamDecoder] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._events_thread: threading.Thread | None = None
        self._reset_events = False  # the upstream came back: its event sequence starts over

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = httpx.AsyncClient(
                base_url=self.spec.url, headers=headers,
                # No read timeout: a long prefill streams nothing for a while; health checks judge.
                timeout=httpx.Timeout(None, connect=self.connect_timeout),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        loop = asyncio.get_running_loop()
        self._monitor = loop.create_task(self._watch(), name=f"upstream-health-{self.spec.name}")
        if self.spec.kv_events and (self._events_thread is None or not self._events_thread.is_alive()):
            self._events_thread = threading.Thread(target=self._read_events, args=(loop,), daemon=True,
                                                   name=f"upstream-kv-{self.spec.name}")
            self._events_thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        tasks = [self._monitor] if self._monitor is not None else []
        for task in [*tasks, *self._streams.values()]:
            task.cancel()
        await asyncio.gather(*tasks, *self._streams.values(), return_exceptions=True)
        if self._events_thread is not None:
            await asyncio.to_thread(self._events_thread.join, 2.0)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _transport_alive(self) -> bool:
        return self.healthy and not self._stopping

    @property
    def state(self) -> str:
        if self.healthy and self.info is not None:
            return "ok"
        return "restarting" if self.was_healthy else "loading"

    # --- health, load and model facts ----------------------------------------------------------

    async def _watch(self) -> None:
        while not self._stopping:
            await self.check_once()
            await asyncio.sleep(self.health_interval)

    async def check_once(self) -> None:
        """One health check (and, when healthy, a scrape of ``/metrics``)."""
        assert self._http is not None
        try:
            response = await self._http.get("/health", timeout=max(1.0, self.health_interval))
            ok = response.status_code == 200
            why = f"/health answered {response.status_code}"
        except httpx.ConnectError as exc:
            self._mark_out(f"connection refused ({exc})", at_once=True)
            return
        except httpx.HTTPError as exc:
            ok, why = False, f"/health failed: {exc!r}"
        if not ok:
            self._mark_out(why)
            return
        try:
            info = await self._fetch_info() if self.info is None else None
            await self._scrape()
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            self._mark_out(f"model facts or metrics unreadable: {exc!r}")
            return
        self._mark_in()
        if info is not None:
            self._set_ready(info)  # after _mark_in: whoever waits for readiness finds it alive

    async def _fetch_info(self) -> EngineReady:
        assert self._http is not None
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        card = response.json()["data"][0]
        self.model = str(card["id"])
        load = await self._load()
        return EngineReady(
            max_model_len=int(card.get("max_model_len") or 0), num_kv_blocks=load.num_kv_blocks or 0,
            block_size=load.block_size or 16, dtype="remote",
        )

    async def _load(self) -> UpstreamLoad:
        assert self._http is not None
        response = await self._http.get("/metrics")
        response.raise_for_status()
        return parse_upstream_metrics(response.text)

    async def _scrape(self) -> None:
        self.stats = (await self._load()).stats
        self._deliver(StepOutputs([], self.stats))  # observers (the fleet's sum) see the new load

    def _mark_in(self) -> None:
        self._failures = 0
        if self.healthy:
            return
        if self.was_healthy:
            logger.warning("upstream %s is healthy again: routing resumes", self.spec.name)
            # It may have restarted with an empty cache: forget what it was believed to hold.
            self._deliver(StepOutputs([], self.stats, [AllBlocksCleared()]))
            self._reset_events = True
        self.healthy = self.was_healthy = True

    def _mark_out(self, why: str, at_once: bool = False) -> None:
        self._failures += 1
        if self.healthy and (at_once or self._failures >= self.unhealthy_after):
            self.healthy = False
            self.stats = EngineStats()
            logger.error("upstream %s is out: %s", self.spec.name, why)

    # --- requests ------------------------------------------------------------------------------

    def _submit(self, request: EngineRequest) -> None:
        self._decoders[request.request_id] = StreamDecoder(request)
        task = asyncio.get_running_loop().create_task(self._stream(request), name=f"upstream-{request.request_id}")
        self._streams[request.request_id] = task

    def abort(self, request_ids: list[str]) -> None:
        # Unlike an engine process, a stream can be closed whatever the upstream's health.
        for request_id in request_ids:
            if request_id in self._collectors and request_id not in self._aborting:
                self._aborting.add(request_id)
                self._cancel(request_id)

    def _cancel(self, request_id: str) -> None:
        decoder = self._decoders.pop(request_id, None)
        task = self._streams.pop(request_id, None)
        if task is not None:
            task.cancel()  # closing the stream tells the upstream to abort
        if decoder is not None:
            self._deliver(StepOutputs([decoder.aborted()], self.stats))

    def forget(self, collector: OutputCollector) -> None:
        super().forget(collector)
        for request_id in collector.request_ids:  # a retry elsewhere, or a consumer gone: close its streams
            self._decoders.pop(request_id, None)
            task = self._streams.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def _stream(self, request: EngineRequest) -> None:
        request_id = request.request_id
        try:
            body = completion_body(request, self.model or "")
        except UnmappableRequest as exc:
            self._reject(request_id, exc.param, str(exc))
            return
        assert self._http is not None
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    raise UpstreamError.from_body(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    payload = sse_payload(line)
                    if payload is None or not payload:
                        continue
                    if payload == "[DONE]":
                        break
                    decoder = self._decoders.get(request_id)
                    if decoder is None:
                        return  # cancelled or forgotten meanwhile
                    output = decoder.feed(json.loads(payload))
                    if output is not None:
                        self._deliver(StepOutputs([output], self.stats))
            decoder = self._decoders.pop(request_id, None)
            if decoder is not None:
                self._deliver(StepOutputs([decoder.finish()], self.stats))
        except asyncio.CancelledError:
            raise
        except UpstreamError as exc:
            if exc.request_error:
                self._reject(request_id, exc.param or "prompt", exc.message)
            else:
                self._fail_request(request_id, f"upstream {self.spec.name}: {exc}")
        except httpx.ConnectError as exc:
            self._mark_out(f"connection refused ({exc})", at_once=True)
            self._fail_request(request_id, f"upstream {self.spec.name} refused the connection")
        except (httpx.HTTPError, ValueError) as exc:  # a broken stream, or a chunk that is not JSON
            self._fail_request(request_id, f"upstream {self.spec.name}: the stream broke ({exc!r})")
        finally:
            self._streams.pop(request_id, None)
            self._decoders.pop(request_id, None)

    # --- KV events -----------------------------------------------------------------------------

    def _read_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """The subscriber thread: ZMQ sockets block and are not thread-safe, so one thread owns it."""
        from tokenline.engine.kv_events_zmq import KVEventSubscriber

        assert self.spec.kv_events is not None
        subscriber = KVEventSubscriber(self.spec.kv_events, self.spec.replay, bind=self.spec.kv_events_bind)
        try:
            while not self._stopping:
                if self._reset_events:
                    subscriber.last_seq = -1
                    self._reset_events = False
                try:
                    batches = subscriber.receive(250)
                except TimeoutError as exc:  # the replay socket did not answer: carry on from the live stream
                    logger.warning("upstream %s: KV event replay failed: %s", self.spec.name, exc)
                    continue
                events = [event for _, batch in batches for event in batch.events]
                if events:
                    loop.call_soon_threadsafe(lambda e=events: self._deliver(StepOutputs([], self.stats, e)))
        except Exception:
            logger.exception("upstream %s: KV event subscriber failed", self.spec.name)
        finally:
            subscriber.close()
