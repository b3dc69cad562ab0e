"""A simulated replica (``tokenline serve --simulate PROFILE``) is the real server — OpenAI API,
gateway, /metrics, KV events — around the real scheduler and KV cache, whose steps sleep the
profile's predicted time and emit placeholder tokens; and ``tokenline simulate --replicas N``
puts N simulated engines behind the fleet's routing policies on one simulated clock.

The profile here is written by hand (``Profile.write``, the file ``bench calibrate`` writes) with
step times large enough that the server's own overhead is small beside them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import psutil
import pytest

from tests.e2e.conftest import (
    Server,
    free_port,
    start_server,
    stop,
    wait_healthy,
    wait_until,
)
from tokenline.cli import build_parser, serve_settings_from_args
from tokenline.cli import main as cli_main
from tokenline.engine.kv_events import BlockStored
from tokenline.engine.kv_events_zmq import KVEventSubscriber
from tokenline.sim.profile import Profile
from tokenline.sim.replicas import ChatConversations, FleetConfig, simulate_replicas
from tokenline.sim.simulate import SimConfig, simulate
from tokenline.sim.step_model import StepModel

MODEL = "SmolLM2-135M-Instruct"
STEP = StepModel(a=0.08, b=0.002, c=0.01, d=0.0)  # 80 ms a step, 2 ms a prefill token, 10 ms a decode seq
DECODE_STEP_S = STEP.a + STEP.c  # one sequence decoding


def predicted_prefill_s(prompt_tokens: int, cached_tokens: int) -> float:
    return STEP.a + STEP.b * (prompt_tokens - cached_tokens)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    Profile(step_model=STEP, model=MODEL, dtype="bfloat16", machine={"note": "written by the test"},
            vocab_size=49152, max_model_len=8192, kv_bytes_per_token=23040).write(path)
    return path


@pytest.fixture(scope="module")
def kv_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory, profile_path: Path, kv_endpoint: str) -> Iterator[Server]:
    kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_endpoint, "topic": "kv"}
    with start_server(tmp_path_factory.mktemp("replica"), "--simulate", str(profile_path), "--num-kv-blocks", "512",
                      "--kv-events-config", json.dumps(kv_config)) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
        # The first request pays one-time costs in the API process (template, tokenizer warm-up).
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        yield server


@contextmanager
def start_command(tmp_path: Path, command: str, *args: str) -> Iterator[Server]:
    """``tokenline <command>`` (the router) on a free port, stopped afterwards."""
    port = free_port()
    log_path = tmp_path / f"{command}-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "tokenline.cli", command, "--host", "127.0.0.1", "--port",
                                    str(port), "--usage-db", str(tmp_path / f"usage-{port}.sqlite3"), *args],
                                   stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop(process)


def engine_processes(server: Server) -> list[psutil.Process]:
    return [c for c in psutil.Process(server.process.pid).children()
            if "spawn_main" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE]


def test_bad_simulate_flags_are_one_line_errors(tmp_path: Path, profile_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{}")
    for args, message in ((["--simulate", str(tmp_path / "bad.json")], "not a tokenline profile"),
                          (["--simulate", str(profile_path), "--simulate-speed", "0"], "must be positive"),
                          (["--simulate-speed", "2"], "needs --simulate"),
                          (["--simulate", str(profile_path), "--num-kv-blocks", "0"], "at least 1")):
        with pytest.raises(ValueError, match=message):
            serve_settings_from_args(build_parser().parse_args(["serve", *args]))
    # What the command line shows of them: one line, exit 2.
    done = subprocess.run([sys.executable, "-m", "tokenline.cli", "serve", "--simulate", str(tmp_path / "missing.json")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stderr.startswith("tokenline serve: error: cannot read profile"), done.stderr
    assert "Traceback" not in done.stderr


def test_chat_and_streaming_through_the_openai_client(replica: Server) -> None:
    client = openai.OpenAI(base_url=replica.api_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, seed=5)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"  # placeholders are never EOS: max_tokens decides
    assert completion.usage.completion_tokens == 7 and completion.usage.prompt_tokens > 10
    text = choice.message.content
    assert text and text.isascii() and text.isprintable()  # ordinary tokens: words, no control bytes

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, logprobs=True)
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
                assert c.logprobs is not None and c.logprobs.content[0].logprob == 0.0
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens == completion.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix hit
    assert 1 <= len(pieces) <= 6 and "".join(pieces).isascii()


def test_the_engine_process_loads_no_torch_and_no_weights(replica: Server) -> None:
    # After the seeded request above: a seed must not pull torch in for its RNG either.
    [engine] = engine_processes(replica)
    mapped = {m.path for m in engine.memory_maps()}
    assert not [p for p in mapped if "libtorch" in p or p.endswith(".safetensors")]
    assert engine.memory_info().rss < 150 * 2**20  # a dozen fit on a small machine
    assert replica.metrics()["tokenline_kv_cache_blocks"] == 512  # --num-kv-blocks over the profile's sizing


def test_structured_output_is_refused_with_a_400(replica: Server) -> None:
    client = openai.OpenAI(base_url=replica.api_url, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=4,
                                       response_format={"type": "json_object"})
    assert "simulated replica" in str(error.value)


def test_time_to_first_token_and_decode_steps_follow_the_profile(replica: Server) -> None:
    client = openai.OpenAI(base_url=replica.api_url, api_key="none", max_retries=0)
    words = " ".join(f"w{i}" for i in range(80))  # a fresh prompt: a long uncached remainder
    start = time.perf_counter()
    stream = client.completions.create(model=MODEL, prompt=words, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    first = last = None
    usage = None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
    assert usage is not None and first is not None and last is not None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    prefill = predicted_prefill_s(usage.prompt_tokens, cached)
    ttft = first - start
    # The step sleeps the prediction, so never less; HTTP and a busy machine add, generously bounded.
    assert 0.95 * prefill <= ttft <= prefill + 1.5, (ttft, prefill)
    decode = last - first
    assert 0.9 * 5 * DECODE_STEP_S <= decode <= 5 * DECODE_STEP_S + 1.5, decode


def test_metrics_move_under_vllm_names(replica: Server) -> None:
    before = replica.metrics()
    client = openai.OpenAI(base_url=replica.api_url, api_key="none", max_retries=0)
    completion = client.completions.create(model=MODEL, prompt="count the waves", max_tokens=4)
    after = replica.metrics()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == completion.usage.prompt_tokens
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prefix_cache_queries_total"):
        assert after[name] > before[name], name
    assert after["vllm:num_requests_running"] == 0 and "vllm:kv_cache_usage_perc" in after


def test_kv_events_are_published(replica: Server, kv_endpoint: str) -> None:
    subscriber = KVEventSubscriber(kv_endpoint, topic="kv")
    try:
        time.sleep(0.5)  # let the subscription settle: PUB drops what comes before
        prompt = [3000 + i for i in range(40)]  # two full blocks, never sent before
        openai.OpenAI(base_url=replica.api_url, api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt=prompt, max_tokens=1)
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 10
        while not any(e.token_ids[:16] == prompt[:16] for e in stored) and time.monotonic() < deadline:
            for _, batch in subscriber.receive(timeout_ms=200):
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
    finally:
        subscriber.close()
    assert any(e.token_ids[:16] == prompt[:16] and e.block_size == 16 for e in stored)


PROMPTS = [f"Conversation {i}: " + " ".join(f"word{i}-{k}" for k in range(40)) for i in range(3)]


def test_three_simulated_engines_behind_one_fleet(tmp_path: Path, profile_path: Path) -> None:
    speed = 4.0
    with start_server(tmp_path, "--simulate", str(profile_path), "--simulate-speed", str(speed),
                      "--data-parallel-size", "3", "--routing-policy", "prefix") as server:
        engines = engine_processes(server)
        assert len(engines) == 3
        client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)
        client.completions.create(model=MODEL, prompt="warm up", max_tokens=1)
        e2e = []
        for prompt in PROMPTS:
            for attempt in range(2):
                start = time.perf_counter()
                completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
                e2e.append(time.perf_counter() - start)
            usage = completion.usage
            assert usage.completion_tokens == 12
            # The repeat went where its prefix is: all but the last partial block came from the cache.
            assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16
        metrics = server.metrics()
    routed = {k: v for k, v in metrics.items() if k.startswith("tokenline:router_requests_total")}
    assert len(routed) == 3 and sum(routed.values()) == 7
    # Four times faster than the profile: each request sleeps at least a quarter of its prediction.
    unscaled = predicted_prefill_s(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) \
        + 11 * DECODE_STEP_S
    # The fastest of the three (one spared by a busy machine) shows the speed-up.
    assert unscaled / speed * 0.95 <= min(e2e[1::2]) < unscaled / 2, (e2e, unscaled)


def test_a_router_in_front_of_three_simulated_replicas(tmp_path: Path, profile_path: Path, replica: Server) -> None:
    with ExitStack() as stack:
        # The module's replica and two more, four times faster (a router does not mind mixed speeds).
        extra = [stack.enter_context(start_server(tmp_path, "--simulate", str(profile_path), "--simulate-speed", "4",
                                                  wait_ready=False)) for _ in range(2)]
        for server in extra:
            wait_healthy(server)
        replicas = [replica, *extra]
        before = sum(r.metrics()["vllm:generation_tokens_total"] for r in replicas)
        router = stack.enter_context(start_command(
            tmp_path, "router", "--routing-policy", "prefix", "--health-interval", "0.5",
            *(a for r in replicas for a in ("--upstream", r.base_url))))
        assert wait_until(lambda: sum(v for k, v in router.metrics().items()
                                      if k.startswith("tokenline:router_upstream_healthy")) == 3)
        client = openai.OpenAI(base_url=router.api_url, api_key="none", max_retries=0)
        for prompt in PROMPTS:
            for attempt in range(2):
                completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
            usage = completion.usage
            assert usage.completion_tokens == 4
            assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 16  # the repeat found its prefix
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=5, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 5
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).isascii()
        routed = [v for k, v in router.metrics().items() if k.startswith("tokenline:router_requests_total")]
        generated = sum(r.metrics()["vllm:generation_tokens_total"] for r in replicas) - before
    assert sum(routed) == 7 and sum(1 for v in routed if v) >= 2  # spread, not piled on one
    assert generated == 6 * 4 + 5  # every token came from a simulated engine


def run_simulate(profile: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    command = [sys.executable, "-m", "tokenline.cli", "simulate", "--profile", str(profile), "--output-json",
               str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_simulate_replicas_prefix_routing_beats_round_robin(profile_path: Path, tmp_path: Path) -> None:
    workload = ["--replicas", "2", "--workload", "multiturn", "--num-groups", "2", "--num-conversations", "6",
                "--turns", "4", "--system-prompt-len", "32", "--input-len", "48", "--output-len", "24",
                "--concurrency", "3"]
    rates = {}
    for policy in ("prefix", "round_robin"):
        report = run_simulate(profile_path, tmp_path, *workload, "--routing-policy", policy)
        assert report["completed"] == report["num_prompts"] == 24 and report["failed"] == 0
        replicas = report["prefix_cache_replicas"]
        assert [r["url"] for r in replicas] == ["replica-0", "replica-1"]
        assert sum(r["requests"] for r in replicas) == 24
        assert sum(r["prompt_tokens"] for r in replicas) == report["total_input_tokens"]
        assert sum(r["decisions"].get(policy, 0) for r in replicas) > 12  # the policy's own reason
        rates[policy] = report["prefix_cache_hit_rate"]
    # Affinity keeps each conversation's history on the replica that holds it; round robin finds
    # only what an earlier turn left on the other replica (the run is deterministic: 0.66 vs 0.57).
    assert rates["prefix"] > rates["round_robin"] + 0.05, rates


def test_simulated_answers_are_cached_like_a_models(profile_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A model's answer, fed back in the next turn, renders as the ids it generated, so the next turn
    # hits the cache through it. Placeholder ids counting up re-tokenize into other ids and miss from
    # there; the filler token re-renders as itself.
    profile = Profile.read(profile_path)
    config = SimConfig(concurrency=2, input_len=16, output_len=64, num_kv_blocks=1024, seed=3)
    fleet = FleetConfig(replicas=1, workload="multiturn", num_groups=1, num_conversations=4, turns=3,
                        system_prompt_len=64)
    with_filler = simulate_replicas(profile, config, fleet)
    monkeypatch.setattr(ChatConversations, "filler_token_id", lambda self, answer_len: None)
    counting_up = simulate_replicas(profile, config, fleet)
    for turn in (1, 2):
        # (0.76 / 0.86 against 0.60 / 0.72: the run is deterministic)
        assert with_filler.cached_tokens_share_by_turn[turn] > counting_up.cached_tokens_share_by_turn[turn] + 0.1


def test_one_replica_is_the_plain_simulation(profile_path: Path) -> None:
    profile = Profile.read(profile_path)
    config = SimConfig(concurrency=3, num_prompts=9, input_len=40, output_len=6, num_kv_blocks=256,
                       request_overhead_s=0.03)
    plain = simulate(profile, config).to_dict()
    fleet = simulate_replicas(profile, config, FleetConfig(replicas=1)).to_dict()
    for key in ("duration_s", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p50_e2e_ms", "total_output_tokens"):
        assert fleet[key] == pytest.approx(plain[key]), key


def test_simulate_refuses_bad_fleet_flags(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--replicas", "0"], "--replicas must be >= 1"),
                          (["--replicas", "2", "--routing-policy", "nope"], "unknown routing policy"),
                          (["--workload", "multiturn", "--shared-prefix-len", "8"], "random workload's")):
        assert cli_main(["simulate", "--profile", str(profile_path), *args]) == 2
        assert message in capsys.readouterr().err
