"""``tokenline top --once --json`` against a live tokenline server: its numbers follow real traffic."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import openai

from tests.e2e.conftest import Server


def _top(server: Server, interval: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tokenline.cli", "top", "--url", server.base_url, "--interval", str(interval),
         "--once", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _snapshot(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    snap = json.loads(out)
    assert len(snap["models"]) == 1, snap
    return snap["models"][0]


def _ask(client: openai.OpenAI, model: str) -> None:
    client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                   messages=[{"role": "user", "content": "Name three colours."}])


def test_top_follows_the_traffic_of_a_live_server(server: Server) -> None:
    idle = _snapshot(_top(server, 0.5))
    with openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        _ask(client, model)  # between the two snapshots
        # Keep requests going for the whole window of the second snapshot, so its rates and
        # latency quantiles have observations (bounded in count and time). Counters move when a
        # request finishes, so the window is long enough for one to start and finish inside it on
        # a busy 2-core machine (where a 4-token request has taken up to 11 s).
        top = _top(server, 15.0)
        sent = []

        def load() -> None:
            deadline = time.monotonic() + 90
            while top.poll() is None and len(sent) < 30 and time.monotonic() < deadline:
                _ask(client, model)
                sent.append(1)

        loader = threading.Thread(target=load)
        loader.start()
        busy = _snapshot(top)
        loader.join(timeout=120)

    assert busy["model"] == idle["model"], (busy, idle, len(sent))
    assert busy["prompt_tokens_total"] > idle["prompt_tokens_total"]
    assert busy["generation_tokens_total"] > idle["generation_tokens_total"]
    assert busy["prompt_tokens_per_s"] > 0 and busy["generation_tokens_per_s"] > 0, (busy, idle, len(sent))
    assert isinstance(busy["ttft_s"]["p50"], float) and busy["ttft_s"]["p50"] > 0
    assert busy["ttft_s"]["p99"] >= busy["ttft_s"]["p50"]
    assert isinstance(busy["e2e_s"]["p50"], float)
    assert sum(busy["finished_total"].values()) > sum(idle["finished_total"].values())
    assert sum(busy["finished_in_interval"].values()) >= 1
    assert busy["running"] is not None and busy["waiting"] is not None
    assert 0 <= busy["kv_cache_usage"] <= 1
    # An idle window: the rates are zero and no latency was observed in it.
    assert idle["generation_tokens_per_s"] == 0 and idle["ttft_s"]["p50"] is None
