"""``tokenline serve --ray``: two replicas of the default model on a local Ray cluster, routed by
tokenline's prefix policy inside Ray Serve's router.

One module, one cluster: a real server subprocess starts it (``ray.init`` on this machine), the
official ``openai`` client talks to it, and the last test sends SIGTERM and checks that every
process of the cluster is gone. Which replica served a request is seen from outside: each replica
runs its engine in a child process, and an engine that served a request spent CPU time; prefix
affinity shows as the prompt's cached tokens reported in ``usage``."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from ray.serve._private.common import DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from tests.e2e.conftest import Server, start_server, wait_healthy, wait_until
from tokenline.cli import build_parser, serve_settings_from_args
from tokenline.engine.kv_events import BlockStored
from tokenline.engine.messages import EngineRequest
from tokenline.router.policies import make_policy
from tokenline.router.policy import ReplicaState, RouteRequest
from tokenline.router.ray_serve import RayServeSettings, TokenlineRequestRouter, snapshot_events
from tokenline.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
SERVER_ERROR = re.compile(r"tokenline\.access: POST \S+ 5\d\d ")  # a request answered with a 5xx
PREAMBLE = "You are a careful assistant for a shipping company. Rules: " + " ".join(
    f"rule{k} applies to parcels of class {k % 7}." for k in range(40))


def _engine_processes(server: Server) -> list[psutil.Process]:
    """The engine process of each replica (a spawned child of a ``ray::ServeReplica`` actor)."""
    engines = []
    for process in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if process.name().startswith("ray::ServeReplica"):
                engines += [c for c in process.children() if "spawn_main" in " ".join(c.cmdline())]
        except psutil.NoSuchProcess:
            continue
    return engines


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _idle(server: Server, window: float = 1.0) -> bool:
    """No engine spent CPU over ``window`` seconds (a restarted one has finished loading its model)."""
    engines = _engine_processes(server)
    before = {p.pid: _cpu(p) for p in engines}
    time.sleep(window)
    return len(engines) == 2 and all(_cpu(p) - before[p.pid] < 0.1 * window for p in engines)


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("ray"), "--ray", "--num-replicas", "2", "--routing-policy", "prefix",
                      "--threads-per-engine", "1", wait_ready=False) as server:
        wait_healthy(server, timeout=300)  # a Ray cluster and two model loads on two busy cores
        yield server


@pytest.fixture(scope="module")
def client(ray_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=ray_server.api_url, api_key="none", max_retries=0, timeout=120)


def test_chat_streamed_and_not_uses_both_replicas(ray_server: Server, client: openai.OpenAI) -> None:
    engines = _engine_processes(ray_server)
    assert len(engines) == 2, [p.cmdline() for p in engines]
    before = {p.pid: _cpu(p) for p in engines}
    for i in range(4):  # prompts that differ from their first block: the prefix policy spreads them
        system = f"{['Alpha', 'Bravo', 'Charlie', 'Delta'][i]} persona, number {i}, answers briefly."
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system},
                                   {"role": "user", "content": "Name a colour"}], max_tokens=8)
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, stream=True, n=2,
        stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts[0] and texts[1]
    assert usage is not None and usage.completion_tokens > 0
    spent = {pid: _cpu(psutil.Process(pid)) - cpu for pid, cpu in before.items()}
    assert all(seconds > 0.05 for seconds in spent.values()), spent  # both engines ran forward passes


def test_a_shared_prefix_stays_on_one_replica(client: openai.OpenAI) -> None:
    cached = []
    for question in ("Where is parcel 1?", "Where is parcel 2?", "Where is parcel 3?", "Where is parcel 4?"):
        reply = client.completions.create(model=MODEL, prompt=f"{PREAMBLE}\n{question}", max_tokens=2,
                                          temperature=0)
        details = reply.usage.prompt_tokens_details
        cached.append((reply.usage.prompt_tokens, details.cached_tokens if details else 0))
    preamble_tokens = cached[0][0] - 8  # the question is a few tokens at the end
    # With two replicas and no affinity, some follow-up would land where the preamble is not cached.
    assert all(hit >= preamble_tokens - 16 for _, hit in cached[1:]), cached


def test_an_engine_death_before_the_first_token_is_retried_on_the_other_replica(
        ray_server: Server, client: openai.OpenAI) -> None:
    engines = _engine_processes(ray_server)
    before = {p.pid: _cpu(p) for p in engines}
    client.completions.create(model=MODEL, prompt=f"{PREAMBLE}\nWhere is parcel 5?", max_tokens=2)
    holder = max(engines, key=lambda p: _cpu(p) - before[p.pid])  # where the preamble is cached
    holder.kill()  # its replica stays; the replica's engine client restarts the engine
    reply = client.completions.create(model=MODEL, prompt=f"{PREAMBLE}\nWhere is parcel 6?", max_tokens=2)
    assert reply.choices[0].text is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # served by the other replica
    assert "before its first token" in ray_server.log()
    assert wait_until(lambda: _idle(ray_server), timeout=120)  # the engine is back and loaded


def test_bad_input_is_a_4xx_and_a_dropped_stream_is_aborted(ray_server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10**7)
    assert wait_until(lambda: _idle(ray_server), timeout=60)
    stream = client.completions.create(model=MODEL, prompt="Count slowly: 1, 2,", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    for n, _chunk in enumerate(stream):
        if n == 2:
            break
    stream.close()  # the server aborts the request on the replica that runs it
    engines = _engine_processes(ray_server)
    time.sleep(1.0)  # the abort's way: API process -> Ray Serve's router -> the replica -> its engine
    before = sum(_cpu(p) for p in engines)
    time.sleep(2.0)
    assert sum(_cpu(p) for p in engines) - before < 0.5  # nobody decodes the 1000 tokens any more
    reply = client.completions.create(model=MODEL, prompt="And now: 1, 2,", max_tokens=4)
    assert reply.choices[0].text
    assert httpx.get(f"{ray_server.base_url}/health", timeout=5).status_code == 200
    log = ray_server.log()
    # Ray forwards its actors' logs (the earlier engine death's traceback, prefixed "(ServeReplica…");
    # the API process itself logged none, and no request got a 5xx.
    assert not [line for line in log.splitlines() if "Traceback" in line and "(Serve" not in line], log[-3000:]
    assert not SERVER_ERROR.search(log), log[-3000:]


def test_a_killed_replica_costs_no_request_and_is_replaced(ray_server: Server, client: openai.OpenAI) -> None:
    replicas = [p for p in psutil.Process(ray_server.process.pid).children(recursive=True)
                if p.name().startswith("ray::ServeReplica")]
    assert len(replicas) == 2
    engines = {p.pid for p in _engine_processes(ray_server)}
    replicas[0].kill()  # SIGKILL: its engine process sees its pipe close and exits too
    for i in range(4):  # a request sent to the dead replica fails before any output and is retried
        reply = client.completions.create(model=MODEL, prompt=f"Story {i} begins:", max_tokens=4)
        assert reply.choices[0].text
    # Ray Serve starts a new replica (a new actor and engine) in its place.
    assert wait_until(lambda: len(_engine_processes(ray_server)) == 2
                      and len({p.pid for p in _engine_processes(ray_server)} - engines) == 1, timeout=180)
    assert not SERVER_ERROR.search(ray_server.log())  # Ray Serve's controller logs the crash; no caller saw it


def test_sigterm_shuts_the_cluster_down(ray_server: Server) -> None:
    tree = psutil.Process(ray_server.process.pid).children(recursive=True)
    assert any(p.name() == "raylet" for p in tree)
    ray_server.process.send_signal(signal.SIGTERM)
    assert ray_server.process.wait(timeout=90) == 0, ray_server.log()[-3000:]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree):
        time.sleep(0.5)
    left = [(p.pid, p.name()) for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


# --- without a cluster ---------------------------------------------------------------------------


def test_replica_snapshots_become_kv_events_for_the_precise_policy() -> None:
    policy = make_policy("kv_events")
    tokens = list(range(48))
    blocks = [(b"a", None, tokens[:16]), (b"b", b"a", tokens[16:32]), (b"c", b"b", tokens[32:48])]
    events, held = snapshot_events({}, blocks, 16)
    assert [type(e) for e in events] == [BlockStored] * 3
    policy.on_kv_events("r1", events)
    replicas = [ReplicaState("r0", block_size=16), ReplicaState("r1", block_size=16)]
    decision = policy.choose(RouteRequest("q1", token_ids=tokens + [7]), replicas)
    assert (decision.replica, decision.predicted_hit_tokens) == ("r1", 48)
    events, held = snapshot_events(held, blocks[:1], 16)  # two blocks evicted since the last report
    assert [e.block_hashes for e in events] == [[b"b", b"c"]]
    policy.on_kv_events("r1", events)
    assert policy.choose(RouteRequest("q2", token_ids=tokens + [7]), replicas).predicted_hit_tokens == 16
    assert snapshot_events(held, blocks[:1], 16)[0] == []  # the same snapshot twice: nothing new


def test_replica_snapshots_keep_a_salted_first_block_routable_for_its_salt_only() -> None:
    policy = make_policy("kv_events")
    tokens = list(range(32))
    blocks = [(b"a", None, tokens[:16], "tenant-a"), (b"b", b"a", tokens[16:32], None)]
    events, _ = snapshot_events({}, blocks, 16)
    assert events[0].extra_keys == [("tenant-a",)] and events[1].extra_keys is None
    policy.on_kv_events("r1", events)
    replicas = [ReplicaState("r0", block_size=16), ReplicaState("r1", block_size=16)]
    salted = policy.choose(RouteRequest("q1", token_ids=tokens + [7], cache_salt="tenant-a"), replicas)
    assert (salted.replica, salted.predicted_hit_tokens) == ("r1", 32)
    other = policy.choose(RouteRequest("q2", token_ids=tokens + [7], cache_salt="tenant-b"), replicas)
    assert other.predicted_hit_tokens == 0


def _settings(*argv: str) -> RayServeSettings | None:
    settings, _ = serve_settings_from_args(build_parser().parse_args(["serve", *argv]))
    return settings.ray


def test_ray_flags_are_checked_before_anything_starts(tmp_path: Path) -> None:
    ray = _settings("--ray", "--num-replicas", "2", "--max-replicas", "4", "--target-ongoing-requests", "8")
    assert ray is not None and ray.routing_policy == "prefix"
    assert ray.autoscaling_config() == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                        "target_ongoing_requests": 8.0}
    for argv, message in [
        (["--num-replicas", "2"], "need --ray"),
        (["--ray", "--data-parallel-size", "2"], "exclude each other"),
        (["--ray", "--num-replicas", "0"], "at least 1"),
        (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "min <= max"),
        (["--ray", "--target-ongoing-requests", "4"], "need --max-replicas"),
        (["--ray", "--routing-policy", "nearest"], "nearest"),
        (["--ray", "--kv-events-config", ('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                           '"endpoint": "tcp://127.0.0.1:5557"}')], "does not work with --ray"),
    ]:
        with pytest.raises(ValueError, match=message):
            _settings(*argv)


@dataclass
class _Replica:
    """The two fields of Ray Serve's ``RunningReplica`` that the router reads (the real one needs a
    live actor handle)."""

    replica_id: ReplicaID
    routing_stats: dict[str, Any]


def test_the_router_asks_the_policy_with_replica_stats_and_routes_aborts_and_retries() -> None:
    async def scenario() -> None:
        router = TokenlineRequestRouter.__new__(TokenlineRequestRouter)  # Ray Serve's part needs a cluster
        router.initialize_state(policy="kv_events")
        a, b = (ReplicaID(unique_id=u, deployment_id=DeploymentID(name="engine", app_name="tokenline"))
                for u in ("a", "b"))
        name_a, name_b = a.to_full_id_str(), b.to_full_id_str()
        tokens = list(range(40))
        held = [(b"h0", None, tokens[:16]), (b"h1", b"h0", tokens[16:32])]
        stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "block_size": 16, "num_kv_blocks": 64}
        replicas = [_Replica(a, {**stats, "blocks": []}), _Replica(b, {**stats, "blocks": held})]
        assert router.replica_state(replicas[0]).num_kv_blocks == 64
        requests = [EngineRequest("cmpl-1-0", tokens, SamplingParams())]

        def call(method: str, *args: object, internal: str = "i1") -> PendingRequest:
            return PendingRequest(list(args), {}, RequestMetadata("x", internal, call_method=method))

        async def first_tier(pending: PendingRequest) -> list[str]:
            tiers = await router.choose_replicas(replicas, pending)
            return [r.replica_id.to_full_id_str() for r in tiers[0]]

        generate = call("generate", requests)
        assert await first_tier(generate) == [name_b]  # b reported the prompt's two blocks
        router.on_request_routed(generate, b, None)
        assert router.in_flight[name_b] == 1 and router.decisions[(name_b, "prefix")] == 1
        router.on_request_completed(b, "i1")
        assert router.in_flight[name_b] == 0 and not router.routes and not router.chosen
        assert await first_tier(call("abort", name_b, ["cmpl-1-0"])) == [name_b]  # where the request runs
        assert await first_tier(call("generate", requests, name_b, internal="i2")) == [name_a]  # a retry
        replicas[1].routing_stats = {**stats, "num_running": 9, "blocks": held[:1]}  # one block evicted, busy
        assert await first_tier(call("generate", requests, internal="i3")) == [name_a]

    asyncio.run(scenario())
