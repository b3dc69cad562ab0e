"""``tokenline top`` on vLLM's own exposition format: the parser, the quantile and rate arithmetic,
the table, and the command against an HTTP endpoint serving vLLM-format text (v1 names with two
engines and two models; v0's older names). The fixtures in tests/top_fixtures/ are vLLM's text
format; every expected number below is worked out by hand from them."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from tokenline.top import (
    Histogram,
    Quantiles,
    bucket_delta,
    counter_delta,
    histogram_quantile,
    metrics_url,
    parse_metrics,
    render_table,
    snapshot,
)

FIXTURES = Path(__file__).parent / "top_fixtures"
LLAMA, QWEN, OPT = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-0.6B", "facebook/opt-125m"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- histogram_quantile ---------------------------------------------------------------------------

def test_quantile_interpolates_inside_the_bucket_it_falls_in() -> None:
    buckets = {0.1: 10.0, 0.2: 30.0, 0.4: 40.0, math.inf: 40.0}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: half way through (0.1, 0.2]
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.32)  # rank 36: 6 of 10 into (0.2, 0.4]
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.02)  # the first bucket starts at 0


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.99, {1.0: 1.0, 2.5: 1.0, math.inf: 5.0}) == 2.5
    assert histogram_quantile(0.5, {math.inf: 3.0}) is None  # no finite bound at all


def test_quantile_without_observations_or_inf_bucket_is_none() -> None:
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {0.1: 4.0, 0.2: 8.0}) is None  # not a complete histogram
    assert histogram_quantile(0.5, {}) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, {math.inf: 1.0})


def test_quantile_tolerates_a_bucket_count_that_falls() -> None:
    # A scrape racing an observation: Prometheus treats counts as monotonic, and so do we.
    assert histogram_quantile(0.5, {0.1: 4.0, 0.2: 3.0, 0.4: 8.0, math.inf: 8.0}) == pytest.approx(0.1)


def test_deltas_count_a_reset_counter_from_zero() -> None:
    assert counter_delta(100.0, 160.0) == 60.0
    assert counter_delta(100.0, 30.0) == 30.0  # the server restarted
    assert counter_delta(None, 30.0) is None
    before = Histogram({0.1: 5.0, math.inf: 6.0})
    assert bucket_delta(before, Histogram({0.1: 7.0, math.inf: 9.0})) == {0.1: 2.0, math.inf: 3.0}
    assert bucket_delta(before, Histogram({0.1: 1.0, math.inf: 1.0})) == {0.1: 1.0, math.inf: 1.0}
    assert bucket_delta(None, Histogram({math.inf: 1.0})) == {}


# --- vLLM v1 exposition: two engines of one model, and a second model -------------------------------

def test_parse_sums_a_models_engines_and_skips_info_series() -> None:
    scrapes = parse_metrics(fixture("vllm_v1_after.txt"))
    assert set(scrapes) == {LLAMA, QWEN}  # cache_config_info (no model_name) is not a model
    llama = scrapes[LLAMA]
    assert llama.values["vllm:num_requests_running"] == 5
    assert llama.values["vllm:prompt_tokens_total"] == 4500
    assert llama.finished == {"stop": 22, "length": 3, "abort": 1}
    ttft = llama.histograms["vllm:time_to_first_token_seconds"].buckets
    assert ttft[0.06] == 10 and ttft[0.08] == 20 and ttft[math.inf] == 30


def test_snapshot_of_two_vllm_v1_scrapes() -> None:
    before, after = parse_metrics(fixture("vllm_v1_before.txt")), parse_metrics(fixture("vllm_v1_after.txt"))
    snap = snapshot("http://vllm:8000/metrics", before, after, 10.0, at=0.0)
    assert [v.model for v in snap.models] == [LLAMA, QWEN]
    llama, qwen = snap.models
    assert (llama.running, llama.waiting) == (5, 1)
    assert llama.kv_cache_usage == pytest.approx(0.4)  # the mean of its engines' 0.5 and 0.3, not the sum
    assert llama.prompt_tokens_per_s == pytest.approx(300.0)  # (3000 + 1500 - 1000 - 500) / 10 s
    assert llama.generation_tokens_per_s == pytest.approx(150.0)
    assert llama.prefix_cache_hit_rate == pytest.approx(0.75)  # 2250 hits of 3000 queried tokens
    # TTFT in the window: 10 in (0.04, 0.06] from engine 0, 10 in (0.06, 0.08] from engine 1 (the
    # earlier observations in (0.1, 0.25] are outside it).
    assert llama.ttft_s.p50 == pytest.approx(0.06)
    assert llama.ttft_s.p99 == pytest.approx(0.0796)
    assert llama.itl_s.p50 == pytest.approx(0.03)  # 100 in (0.02, 0.04]
    assert llama.itl_s.p99 == pytest.approx(0.0398)
    assert llama.e2e_s.p50 == pytest.approx(4.0625)  # 4 in (2.5, 5], 1 beyond 2560 s
    assert llama.e2e_s.p99 == 2560.0
    assert llama.finished_total == {"stop": 22, "length": 3, "abort": 1}
    assert llama.finished_in_interval == {"stop": 12, "length": 2, "abort": 1}
    # An idle model: zero rates, no latency in the window, no hit rate without queries.
    assert qwen.prompt_tokens_per_s == 0.0 and qwen.generation_tokens_per_s == 0.0
    assert qwen.ttft_s == Quantiles(None, None) and qwen.prefix_cache_hit_rate is None
    assert qwen.prompt_tokens_total == 40


def test_first_scrape_has_gauges_and_totals_but_no_rates() -> None:
    snap = snapshot("u", None, parse_metrics(fixture("vllm_v1_after.txt")), None, at=0.0)
    llama = snap.models[0]
    assert snap.interval_s is None and llama.running == 5 and llama.generation_tokens_total == 1800
    assert llama.prompt_tokens_per_s is None and llama.ttft_s == Quantiles(None, None)


# --- vLLM v0's older names; missing series ---------------------------------------------------------

def test_older_vllm_names_are_read() -> None:
    before, after = parse_metrics(fixture("vllm_v0_before.txt")), parse_metrics(fixture("vllm_v0_after.txt"))
    (opt,) = snapshot("u", before, after, 4.0, at=0.0).models
    assert opt.model == OPT
    assert opt.kv_cache_usage == 0.25  # vllm:gpu_cache_usage_perc
    assert opt.itl_s.p50 == pytest.approx(0.0175)  # vllm:time_per_output_token_seconds: 8 in (0.01, 0.025]
    assert opt.prefix_cache_hit_rate == 0.5  # vllm:gpu_prefix_cache_hit_rate
    assert opt.prompt_tokens_per_s == pytest.approx(50.0) and opt.generation_tokens_per_s == pytest.approx(30.0)
    assert opt.e2e_s == Quantiles(None, None)  # not exported by this server
    assert opt.finished_in_interval == {"stop": 2}


def test_table_shows_a_dash_for_what_is_missing() -> None:
    before, after = parse_metrics(fixture("vllm_v0_before.txt")), parse_metrics(fixture("vllm_v0_after.txt"))
    console = Console(width=250, record=True)
    console.print(render_table(snapshot("http://old-vllm/metrics", before, after, 4.0, at=0.0)))
    text = console.export_text()
    row = next(line for line in text.splitlines() if OPT in line)
    assert "– / –" in row  # E2E
    assert "25.0%" in row and "50.0%" in row and "17.5ms" in row and "stop 3 (+2)" in row


def test_text_that_is_not_prometheus_format_is_a_clear_error() -> None:
    from tokenline.top import TopError

    with pytest.raises(TopError, match="not Prometheus text format"):
        parse_metrics("vllm:num_requests_running{model_name=\"x\" 1\n")
    assert parse_metrics("# nothing here\nprocess_cpu_seconds_total 3.0\n") == {}


def test_metrics_url_accepts_a_base_url() -> None:
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert metrics_url("http://h:8001/metrics") == "http://h:8001/metrics"


# --- the command against an endpoint serving vLLM's text -------------------------------------------

vllm_scrapes: list[str] = []  # the paths vllm_endpoint served, in order


@pytest.fixture
def vllm_endpoint() -> Iterator[str]:
    """Serves the v1 "before" exposition on the first scrape and "after" on the next; needs key k1."""
    pages = [fixture("vllm_v1_before.txt"), fixture("vllm_v1_after.txt")]
    served = vllm_scrapes
    served.clear()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != "Bearer k1":
                self.send_response(401)
                self.end_headers()
                return
            body = pages[min(len(served), 1)].encode()
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenline.cli", "top", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_top_once_json_against_a_vllm_endpoint(vllm_endpoint: str) -> None:
    result = _top("--url", vllm_endpoint, "--api-key", "k1", "--interval", "0.2", "--once", "--json")
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["url"] == f"{vllm_endpoint}/metrics"
    llama = snap["models"][0]
    assert llama["model"] == LLAMA and llama["running"] == 5
    assert llama["ttft_s"]["p50"] == pytest.approx(0.06)
    assert llama["prompt_tokens_per_s"] > 0 and llama["finished_in_interval"]["stop"] == 12


def test_top_without_the_key_says_what_to_pass(vllm_endpoint: str) -> None:
    result = _top("--url", vllm_endpoint, "--once", "--interval", "0.1")
    assert result.returncode == 1
    assert "answered 401" in result.stderr and "--api-key" in result.stderr
    assert "Traceback" not in result.stderr


def test_live_view_refreshes_until_ctrl_c(vllm_endpoint: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenline.cli", "top", "--url", vllm_endpoint, "--api-key", "k1", "--interval", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
        # As from a terminal: a test run started in the background (`cmd &` in a script) ignores
        # SIGINT, children inherit that, and Python then keeps Ctrl-C ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    # The fourth scrape comes after the third frame (after vs after: no "(+n)") was drawn.
    while len(vllm_scrapes) < 4 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert len(vllm_scrapes) >= 4 and set(vllm_scrapes) == {"/metrics"}
    assert "Ctrl-C to quit" in out and "Traceback" not in err
    assert "abort 1, length 3, stop 22" in out and "5 │       1 │    40.0%" in out, out
