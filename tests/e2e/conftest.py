"""A real tokenline server on the default model, started as a subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tokenline.bench.ports import free_port
from tokenline.bench.serve import wait_until  # noqa: F401 - the tests import it from here

STARTUP_TIMEOUT_S = 120


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        """The samples of /metrics (see ``scrape_metrics``). ``api_key``: with keys configured,
        /metrics wants an admin key."""
        return scrape_metrics(f"{self.base_url}/metrics", api_key)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def scrape_metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """The samples of a Prometheus page by name; a sample labelled only with the model name is
    keyed by its bare name too (``vllm:num_requests_running``), others by ``name{labels}``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url, headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
            if name.endswith("}") and name.count("=") == 1 and "{model_name=" in name:
                values[name.split("{", 1)[0]] = float(value)
    return values


@contextmanager
def start_server(tmp_path: Path, *args: str, wait_ready: bool = True) -> Iterator[Server]:
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    command = [
        sys.executable, "-m", "tokenline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--kv-cache-memory", "0.25", "--usage-db", str(tmp_path / f"usage-{port}.sqlite3"), *args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        if wait_ready:
            wait_healthy(server)
        yield server
    finally:
        stop(process)


def wait_healthy(server: Server, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{server.log()}")


def stop(process: subprocess.Popen) -> None:
    """Stop the server we started (by its pid), politely first."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    # float32: many tests send one prompt twice and expect the same greedy text. In bfloat16 the
    # second request's prompt remainder (after its prefix-cache hit) goes through matmuls of another
    # shape, whose rounding can flip a near-tie; float32 makes such flips vanishingly rare.
    # The bfloat16 paths are covered by the model and engine tests and the other servers here.
    with start_server(tmp_path_factory.mktemp("server"), "--dtype", "float32") as running:
        yield running


