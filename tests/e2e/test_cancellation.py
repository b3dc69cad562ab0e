"""Requests that end early, with raw httpx against real servers: client disconnects (streamed and
not), aborts from the queue, slow readers, server-side timeouts, SIGTERM and a dead engine. After
each, the engine must hold nothing for the request: no running or waiting sequence, every KV block
free (prefix-cached blocks count as free), no collector left in the API process.

Extra servers (each start costs ~10 s): one with ``--max-num-seqs 1`` (queue abort, then SIGTERM)
and one with ``--request-timeout 1`` (timeouts, then the engine is killed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, wait_until

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
SETTLE_S = 15.0


def settled(server: Server) -> bool:
    m = server.metrics()
    return (
        m["vllm:num_requests_running"] == 0
        and m["vllm:num_requests_waiting"] == 0
        and m["tokenline_inflight_requests"] == 0
        and m["tokenline_kv_cache_free_blocks"] == m["tokenline_kv_cache_blocks"]
    )


def assert_settles(server: Server, timeout: float = SETTLE_S) -> None:
    assert wait_until(lambda: settled(server), timeout=timeout), server.metrics()


def data_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """The payloads of an SSE body's `data:` lines, parsed (``"[DONE]"`` stays a string)."""
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def assert_openai_error(body: dict[str, Any], type_: str) -> dict[str, Any]:
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == type_, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


def engine_pid(server: Server) -> int:
    """The engine process: the API process's child that runs multiprocessing's spawn_main."""
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(child)
    raise AssertionError(f"no engine child among {children}")


# --- disconnects on the shared server -----------------------------------------------------


def test_disconnect_mid_stream_frees_everything(server: Server) -> None:
    assert_settles(server)
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{server.api_url}/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            events = data_events(response.iter_lines())
            for _ in range(3):
                event = next(events)
                assert isinstance(event, dict) and event["choices"][0]["finish_reason"] is None, event
            m = server.metrics()
            assert m["tokenline_inflight_requests"] == 1, m
            assert m["tokenline_kv_cache_free_blocks"] < m["tokenline_kv_cache_blocks"], m
        # Leaving the block closes the connection mid-stream.
    assert_settles(server, timeout=10)


def test_non_streaming_client_timeout_frees_everything(server: Server) -> None:
    assert_settles(server)
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["response"] = httpx.post(f"{server.api_url}/completions", json=LONG, timeout=1.5)
        except httpx.TimeoutException as exc:
            outcome["timeout"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    seen_inflight = wait_until(lambda: server.metrics()["tokenline_inflight_requests"] == 1, timeout=1.4,
                               interval=0.05)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "timeout" in outcome, outcome
    assert seen_inflight, "the request never reached the engine"
    assert_settles(server, timeout=10)


def test_slow_reader_backlog_is_bounded_by_its_tokens(server: Server) -> None:
    """A client that stops reading: the engine goes on to the end of the request, what waits for
    the client stays within the request's own tokens however long it stalls, and once it reads
    again every token arrives.

    Note: on loopback the kernel's send buffer grows to ~4 MiB (tcp_wmem), which holds the whole
    stream, so here the server-side backlog usually stays 0; the bound is what is checked."""
    assert_settles(server)
    max_tokens = 300
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    backlog = []
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", f"{server.api_url}/completions", json=body) as response:
            assert response.status_code == 200
            # Read nothing for at least 3 s, and until the engine has produced every token.
            started = time.monotonic()
            while time.monotonic() - started < 240:
                m = server.metrics()
                backlog.append(m["tokenline_stream_backlog_tokens"])
                assert m["tokenline_inflight_requests"] <= 1
                if time.monotonic() - started >= 3 and m["tokenline_inflight_requests"] == 0:
                    break
                time.sleep(0.1)
            assert server.metrics()["tokenline_inflight_requests"] == 0, "the engine stalled with its client"
            events = list(data_events(response.iter_lines()))
    assert max(backlog) <= max_tokens, backlog
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), chunks[-2:]
    *content, usage_chunk = chunks
    assert usage_chunk["usage"]["completion_tokens"] == max_tokens
    tokens = [t for c in content for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == max_tokens, "every token reaches the slow client"
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert "".join(c["choices"][0]["text"] for c in content)
    assert_settles(server)


# --- a server that runs one sequence at a time: abort from the queue, then SIGTERM -----------


@pytest.fixture(scope="module")
def one_seq_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("one-seq"), "--max-num-seqs", "1", "--shutdown-timeout", "90") as s:
        yield s


def test_disconnect_while_queued_leaves_the_running_request_alone(one_seq_server: Server) -> None:
    server = one_seq_server
    assert_settles(server)
    first_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=300) as first_client, httpx.Client(timeout=300) as second_client:
        with first_client.stream("POST", f"{server.api_url}/completions", json=first_body) as first:
            assert first.status_code == 200
            first_events = data_events(first.iter_lines())
            next(first_events)  # the first is running
            with second_client.stream("POST", f"{server.api_url}/completions", json={**LONG, "stream": True}) as second:
                assert second.status_code == 200
                assert wait_until(lambda: server.metrics()["vllm:num_requests_waiting"] == 1, timeout=20), server.metrics()
                m = server.metrics()
                assert m["vllm:num_requests_running"] == 1 and m["tokenline_inflight_requests"] == 2, m
            # The second hung up while queued.
            assert wait_until(
                lambda: (m := server.metrics())["vllm:num_requests_waiting"] == 0
                and m["tokenline_inflight_requests"] <= 1,
                timeout=10,
            ), server.metrics()
            rest = list(first_events)
    assert rest[-1] == "[DONE]"
    *content, usage_chunk = rest[:-1]
    assert all("error" not in c for c in content), content[-1:]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 128
    assert_settles(server)


@pytest.fixture(scope="module")
def sigterm_run(one_seq_server: Server) -> dict[str, Any]:
    """SIGTERM the server while a stream of 60 tokens is in flight; what happened, for the tests below."""
    server = one_seq_server
    assert_settles(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "stream": True}
    run: dict[str, Any] = {}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{server.api_url}/completions", json=body) as response:
            assert response.status_code == 200
            events = data_events(response.iter_lines())
            first = next(events)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # New connections are refused soon after (the listening socket closes first).
            run["refused_after_s"] = None
            while time.monotonic() - signalled < 10:
                try:
                    httpx.get(f"{server.base_url}/health", timeout=1)
                except httpx.ConnectError:
                    run["refused_after_s"] = time.monotonic() - signalled
                    break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            run["events"] = [first, *events]
    try:
        run["returncode"] = server.process.wait(timeout=60)
    except Exception:  # noqa: BLE001 - reported by the test
        run["returncode"] = "still running"
    run["exit_after_s"] = time.monotonic() - signalled
    return run


def test_sigterm_finishes_the_inflight_stream_and_refuses_new_connections(sigterm_run: dict[str, Any]) -> None:
    events = sigterm_run["events"]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks)
    assert sigterm_run["refused_after_s"] is not None and sigterm_run["refused_after_s"] < 5, sigterm_run
    assert sigterm_run["returncode"] != "still running" and sigterm_run["exit_after_s"] < 60, sigterm_run


def test_sigterm_exits_with_code_0(sigterm_run: dict[str, Any]) -> None:
    assert sigterm_run["returncode"] == 0, sigterm_run


# --- a server with a 1 s request timeout: timeouts, then its engine is killed -----------------


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    with start_server(tmp_path_factory.mktemp("timeout"), "--request-timeout", "1") as s:
        yield s


def test_request_timeout_non_streamed_is_504(timeout_server: Server) -> None:
    server = timeout_server
    assert_settles(server)
    started = time.monotonic()
    response = httpx.post(f"{server.api_url}/completions", json=LONG, timeout=30)
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert_openai_error(response.json(), "timeout_error")
    assert elapsed < 10
    assert_settles(server)


def test_request_timeout_streamed_ends_with_error_event(timeout_server: Server) -> None:
    server = timeout_server
    assert_settles(server)
    with httpx.stream("POST", f"{server.api_url}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 2000, "ignore_eos": True, "stream": True,
    }) as response:
        assert response.status_code == 200
        events = list(data_events(response.iter_lines()))
    assert events[-1] == "[DONE]", events[-3:]
    assert_openai_error(events[-2], "timeout_error")
    assert all("error" not in e for e in events[:-2])
    assert_settles(server)


def test_engine_death_fails_streams_and_new_requests_fast(timeout_server: Server) -> None:
    server = timeout_server
    assert_settles(server)
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    pid = engine_pid(server)
    with httpx.stream("POST", f"{server.api_url}/completions", timeout=30,
                      json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        os.kill(pid, signal.SIGKILL)
        events = list(data_events(response.iter_lines()))
    assert events[-1] == "[DONE]", events[-3:]
    error = assert_openai_error(events[-2], "server_error")
    assert "engine" in error["message"]
    # A new request fails at once with a 5xx in OpenAI's shape (the client timeout bounds a hang).
    for path, body in [("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "stream": True})]:
        started = time.monotonic()
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=10)
        assert time.monotonic() - started < 5
        # 500 while the death is being noticed, 503 (with Retry-After) once the supervisor restarts it.
        assert response.status_code in (500, 503), response.text
        assert_openai_error(response.json(), "server_error" if response.status_code == 500 else "service_unavailable")
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 503, health.text
    assert server.process.poll() is None, "the API process stays up to report the failure"
