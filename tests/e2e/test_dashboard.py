"""The live pipeline page and its event stream on a real keyed server (admin, alice, bob).

GET /v1/events is read over plain HTTP (events parse, only documented types and fields, tenant
scoping); GET /dashboard is opened in Debian's headless Chromium while real streaming requests run,
and its DOM and a screenshot are checked.
"""

from __future__ import annotations

import json
import re
import signal
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, start_server
from tests.e2e.event_stream import EventReader
from tests.e2e.headless_chromium import CHROMIUM, Chromium
from tokenline.engine.messages import StepRecord
from tokenline.gateway.keys import add_key
from tokenline.gateway.live_events import EVENT_TYPES, REQUEST_STAGES

PIPELINE_DOC = Path(__file__).parents[2] / "docs/guide/pipeline.md"  # the live page and its events
TENANTS = ("admin", "alice", "bob")


@dataclass
class Keyed:
    server: Server
    keys: dict[str, str]

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.api_url, api_key=self.keys[tenant], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Keyed]:
    tmp = tmp_path_factory.mktemp("dashboard")
    keys_file = tmp / "keys.toml"
    keys = {name: add_key(keys_file, name, admin=name == "admin") for name in TENANTS}
    with start_server(tmp, "--keys", str(keys_file), "--max-num-seqs", "8") as server:
        yield Keyed(server, keys)


def stream_chat(client: openai.OpenAI, request_id: str, max_tokens: int, cancel_after: int | None = None) -> int:
    """One streaming chat request; closed after ``cancel_after`` chunks when given (a cancellation)."""
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": f"Count to twenty, please ({request_id})."}],
        max_tokens=max_tokens, temperature=0.0, stream=True, extra_headers={"X-Request-Id": request_id},
    )
    chunks = 0
    for _ in stream:
        chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            stream.close()
            break
    return chunks


def test_event_stream_needs_a_key_and_the_page_does_not(keyed: Keyed) -> None:
    base = keyed.server.base_url
    for headers in ({}, {"Authorization": "Bearer tl-wrong"}):
        refused = httpx.get(f"{base}/v1/events", headers=headers, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    page = httpx.get(f"{base}/dashboard", timeout=10)  # the page holds no data; it asks for a key
    assert page.status_code == 200 and 'id="waterfall"' in page.text
    library = httpx.get(f"{base}/dashboard/static/uPlot.iife.min.js", timeout=10)
    assert library.status_code == 200 and "uPlot" in library.text[:200]
    missing = httpx.get(f"{base}/dashboard/static/..%2Fdashboard.py", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    # Everything else under /dashboard/ is keyed like the API.
    assert httpx.get(f"{base}/dashboard/other", timeout=10).status_code == 401


def test_events_parse_are_documented_and_scoped_to_the_tenant(keyed: Keyed) -> None:
    url = keyed.server.base_url
    admin, alice = EventReader(url, keyed.keys["admin"]), EventReader(url, keyed.keys["alice"])
    threads = [threading.Thread(target=r.run, daemon=True) for r in (admin, alice)]
    for thread in threads:
        thread.start()
    assert admin.connected.wait(30) and alice.connected.wait(30)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda args: stream_chat(keyed.client(args[0]), args[1], 12),
                      [("alice", "sse-alice-1"), ("bob", "sse-bob-1")]))
    finished = lambda r: {d["request_id"] for d in r.of("request") if d["stage"] == "finished"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not {"sse-alice-1", "sse-bob-1"} <= finished(admin):
        time.sleep(0.1)
    time.sleep(1.2)  # one more stats tick
    admin.stop.set()
    alice.stop.set()
    for thread in threads:
        thread.join(timeout=10)

    kinds = {k for k, _ in admin.events}
    assert kinds <= set(EVENT_TYPES) and {"hello", "step", "stats", "request"} <= kinds
    hello = admin.events[0]
    assert hello[0] == "hello" and hello[1]["scope"] == "all" and hello[1]["event_types"] == list(EVENT_TYPES)
    assert alice.events[0][1]["scope"] == "own" and alice.events[0][1]["tenant"] == "alice"

    # Every step event carries the engine's StepRecord fields; the requests' steps did work.
    steps = admin.of("step")
    record_fields = {f for f in StepRecord.__dataclass_fields__}
    assert all(record_fields <= set(s) for s in steps)
    assert sum(s["num_prefill_tokens"] for s in steps) > 0 and sum(s["num_decode_tokens"] for s in steps) > 0
    assert all(s["num_kv_blocks"] > 0 for s in steps)
    stats = admin.of("stats")
    assert stats and all(s["num_kv_blocks"] > 0 and 0 <= s["num_kv_blocks_used"] <= s["num_kv_blocks"] for s in stats)

    # Each request's lifecycle in order, with its tenant; the admin sees both, alice only hers.
    for rid, tenant in (("sse-alice-1", "alice"), ("sse-bob-1", "bob")):
        mine = [d for d in admin.of("request") if d["request_id"] == rid]
        assert [d["stage"] for d in mine] == list(REQUEST_STAGES)
        assert all(d["tenant"] == tenant for d in mine)
        assert [d["t"] for d in mine] == sorted(d["t"] for d in mine)
        done = mine[-1]
        assert done["status"] == "finished" and done["completion_tokens"] > 0 and done["prompt_tokens"] > 0
        assert {"queued", "first_scheduled", "first_token", "finished"} <= set(done["stages_s"])
    assert {d["tenant"] for d in alice.of("request")} == {"alice"}
    assert alice.of("step"), "step records are load, not tenant data: every key sees them"

    # The docs document every event type and every field seen here.
    doc = PIPELINE_DOC.read_text()
    for kind, data in admin.events:
        assert f"`{kind}`" in doc, f"event type {kind} not in {PIPELINE_DOC.name}"
        for name in data:
            assert f"`{name}`" in doc, f"field {name} of {kind} events not in {PIPELINE_DOC.name}"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (make chromium)")
def test_dashboard_in_headless_chromium_during_a_load(keyed: Keyed, tmp_path: Path) -> None:
    browser = Chromium(tmp_path / "profile")
    try:
        browser.navigate(f"{keyed.server.base_url}/dashboard")
        # Without a key the stream is refused and the page says so; with the admin's it goes live.
        assert browser.wait_for("document.getElementById('status').dataset.state === 'error'", 20)
        assert "key" in browser.evaluate("document.getElementById('status').textContent")
        browser.evaluate(f"document.getElementById('key').value = {json.dumps(keyed.keys['admin'])};"
                         "document.getElementById('connect').click()")
        assert browser.wait_for("document.getElementById('status').dataset.state === 'live'", 20)

        jobs = [("alice", f"page-alice-{i}", None) for i in range(3)] + [("bob", f"page-bob-{i}", None) for i in range(2)]
        jobs.append(("bob", "page-bob-cancelled", 3))
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda j: stream_chat(keyed.client(j[0]), j[1], 40, cancel_after=j[2]), jobs))
            # The page keeps up while the load runs.
            assert browser.wait_for("+document.getElementById('count-steps').dataset.value > 0", 60)
        ids = [rid for _, rid, _ in jobs]
        rows = "[...document.querySelectorAll('#waterfall .wf-row')]"
        assert browser.wait_for(
            f"{rows}.filter(r => {json.dumps(ids)}.includes(r.dataset.requestId) && r.dataset.status !== 'running')"
            f".length === {len(ids)}", 60)
        time.sleep(1.0)  # the next redraw also paints the last step's charts

        shot = browser.screenshot(tmp_path / "dashboard.png")
        width, height = png_size(shot)
        assert width >= 1000 and height >= 800 and len(shot) > 30_000, (width, height, len(shot))

        dom = browser.evaluate("""(() => {
          const v = (id) => +document.getElementById(id).dataset.value;
          const canvases = (id) => document.querySelectorAll('#' + id + ' canvas').length;
          return {
            steps: v('count-steps'), finished: v('count-finished'), cancelled: v('count-cancelled'),
            charts: ['chart-load', 'chart-steps', 'chart-kv', 'chart-throughput', 'chart-latency'].map(canvases),
            statuses: Object.fromEntries([...document.querySelectorAll('#waterfall .wf-row')]
              .map(r => [r.dataset.requestId, r.dataset.status])),
            decode_bars: document.querySelectorAll('#waterfall .seg.decode').length,
            cancel_marks: document.querySelectorAll('#waterfall .seg.cancelled').length,
            spend: [...document.querySelectorAll('#spend tbody tr')].map(r => r.dataset.tenant),
            kv: document.getElementById('now-kv').textContent,
          };
        })()""")
        assert dom["steps"] > 0 and dom["finished"] >= 5 and dom["cancelled"] >= 1, dom
        assert all(n > 0 for n in dom["charts"]), dom["charts"]
        assert all(dom["statuses"][rid] == "finished" for rid in ids[:-1]), dom["statuses"]
        assert dom["statuses"]["page-bob-cancelled"] == "cancelled"
        assert dom["decode_bars"] >= 5 and dom["cancel_marks"] >= 1
        assert {"alice", "bob"} <= set(dom["spend"])
        assert re.fullmatch(r"\d+ / [1-9]\d*", dom["kv"]), dom["kv"]
    finally:
        browser.close()


def test_an_open_stream_does_not_hold_up_shutdown(keyed: Keyed) -> None:
    """Last in this module: it stops the module's server (SIGTERM) while a stream is open."""
    reader = EventReader(keyed.server.base_url, keyed.keys["alice"])
    thread = threading.Thread(target=reader.run, daemon=True)
    thread.start()
    assert reader.connected.wait(30)
    started = time.monotonic()
    keyed.server.process.send_signal(signal.SIGTERM)
    keyed.server.process.wait(timeout=60)
    # The graceful shutdown waits up to 30 s for responses in flight; the stream ends at once.
    assert time.monotonic() - started < 15, keyed.server.log()[-2000:]
    assert keyed.server.process.returncode == 0
    thread.join(timeout=10)
    assert not thread.is_alive()
