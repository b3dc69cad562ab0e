"""The Grafana dashboard's queries on a real Prometheus scraping a real tokenline server.

The server runs as the Deployment runs it: an API key set, /metrics on its own port. Prometheus
(Debian's package, `make prometheus`) runs the shipped scrape job with its discovery swapped for
that port, at a 1 s interval, on 127.0.0.1 with its own storage in tmp. After a few real requests,
every expression of every panel (template variables filled in as Grafana would) must be a valid
query that returns a finite value for every series.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.deploy.files import PROMETHEUS_CONFIG, container, dashboard, dashboard_queries, with_grafana_variables
from tests.deploy.test_dockerfile import healthcheck_command
from tests.e2e.conftest import Server, free_port, start_server, stop, wait_until

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary on PATH (`make prometheus` installs Debian's package)"
)

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "deploy-test-key"  # the Deployment's VLLM_API_KEY Secret
RATE_INTERVAL = "5m"  # Grafana's $__rate_interval; spans the whole test, so rates see its traffic
REQUESTS = 2  # few tokens: on 2 shared cores a token can take a second


@dataclass
class Prometheus:
    base_url: str
    process: subprocess.Popen

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series; fails the test with Prometheus' own error on a bad query."""
        reply = httpx.get(f"{self.base_url}/api/v1/query", params={"query": expr}, timeout=10)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", f"{expr}: {body.get('error', body)}"
        assert body["data"]["resultType"] == "vector", expr
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


def scrape_config(target: str) -> dict[str, Any]:
    """The shipped configuration, with the test server as the one target of its tokenline job."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (job,) = config["scrape_configs"]
    del job["dns_sd_configs"]  # Kubernetes DNS: there is no cluster here
    job["static_configs"] = [{"targets": [target]}]
    job["scrape_interval"] = "1s"
    return config


@dataclass
class Deployed:
    server: Server
    metrics_port: int


@pytest.fixture(scope="module")
def tokenline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    assert "--metrics-port" in container()["args"]  # as deployed: /metrics on a port of its own
    metrics_port = free_port()
    with start_server(tmp_path_factory.mktemp("tokenline"), "--api-key", API_KEY,
                      "--metrics-port", str(metrics_port)) as server:
        yield Deployed(server, metrics_port)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, tokenline: Deployed) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(f"127.0.0.1:{tokenline.metrics_port}")))
    port = free_port()
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", process)
    try:
        def scraped() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return prom.scalar('up{job="tokenline"}') == 1.0
            except (httpx.HTTPError, AssertionError, ValueError):
                return False

        assert wait_until(scraped, timeout=60, interval=0.25), "no successful scrape in 60 s"
        send_requests(tokenline.server)
        # Wait until a scrape has seen every request finish (the e2e histogram counts each once).
        finished = f'sum(vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}})'
        # rate() then has samples from before the traffic (scraped from the start) and after it.
        assert wait_until(lambda: prom.scalar(finished) == REQUESTS, timeout=30, interval=0.25), \
            "no scrape after the requests"
        yield prom
    finally:
        stop(process)


def send_requests(server: Server) -> None:
    """A streamed chat (inter-token latency needs updates streamed apart) and a completion cut
    by max_tokens; both decode several tokens, so time per output token is observed."""
    client = openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    reply = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=3)
    assert reply.choices[0].finish_reason == "length"


def test_every_panel_query_returns_finite_data(prometheus: Prometheus) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 12
    empty, not_finite = [], []
    for title, expr in queries:
        result = prometheus.query(with_grafana_variables(expr, MODEL, RATE_INTERVAL))
        if not result:
            empty.append(f"{title}: {expr}")
        not_finite += [f"{title}: {expr} = {s['value'][1]} {s['metric']}" for s in result
                       if not math.isfinite(float(s["value"][1]))]
    assert not empty, "queries with no data:\n" + "\n".join(empty)
    assert not not_finite, "queries with NaN/Inf:\n" + "\n".join(not_finite)


def test_a_misspelt_metric_or_a_broken_query_would_be_caught(prometheus: Prometheus) -> None:
    assert prometheus.query(f'vllm:num_requests_runing{{model_name="{MODEL}"}}') == []  # "no data"
    with pytest.raises(AssertionError, match="parse error"):
        prometheus.query("sum(rate(vllm:prompt_tokens_total[$__rate_interval]))")  # a variable left in


def test_panels_show_the_traffic_that_was_sent(prometheus: Prometheus) -> None:
    def value(expr: str) -> float:
        return prometheus.scalar(with_grafana_variables(expr, MODEL, RATE_INTERVAL))

    by_title = {title: expr for title, expr in reversed(dashboard_queries())}  # first target of each panel
    assert value(by_title["Token throughput"]) > 0
    assert value(by_title["Time to first token"]) > 0
    finished = prometheus.query(with_grafana_variables(by_title["Requests by finish reason"], MODEL, RATE_INTERVAL))
    rates = {s["metric"]["finished_reason"]: float(s["value"][1]) for s in finished}
    assert rates["length"] > 0


def test_model_variable_lists_the_served_model(prometheus: Prometheus) -> None:
    (variable,) = [v for v in dashboard()["templating"]["list"] if v["name"] == "model_name"]
    metric, label = variable["definition"].removeprefix("label_values(").removesuffix(")").split(", ")
    assert {s["metric"][label] for s in prometheus.query(metric)} == {MODEL}


def test_probe_paths_and_the_image_healthcheck_on_a_real_server(tokenline: Deployed) -> None:
    c = container()
    base_url = tokenline.server.base_url
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # a kubelet sends no key
        path = c[probe]["httpGet"]["path"]
        assert httpx.get(f"{base_url}{path}", timeout=5).status_code == 200, path
    assert httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 401  # the key is in force
    port = base_url.rsplit(":", 1)[1]
    command = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in healthcheck_command()]
    assert subprocess.run(command, capture_output=True, timeout=30, check=False).returncode == 0
    down = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{free_port()}") for arg in healthcheck_command()]
    assert subprocess.run(down, capture_output=True, timeout=30, check=False).returncode != 0


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool on PATH (Debian's prometheus package ships it)")
def test_shipped_scrape_config_passes_promtool() -> None:
    command = [PROMTOOL, "check", "config", str(PROMETHEUS_CONFIG)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
