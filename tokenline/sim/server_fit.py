"""What a server adds to the offline engine's step times: the second half of ``bench calibrate``.

Short closed-loop loads (``bench serve``'s client) against a real ``tokenline serve`` started with
the same dtype and threads, its step records read from ``GET /v1/events``: one request at a time,
six, and sixteen longer ones (decode batches of up to 16 over a few thousand context tokens, the
shape the offline design reaches only briefly). Their busy steps join the offline ones in the step
model's fit (``calibrate``), and on them:

    server step wall time (its duration and the gap to the next step) = k · model(f) + g

k is how much slower the engine's steps run beside the API process and the load client on the same
cores than a step model fitted elsewhere prices them, g the per-step time outside the step (sending
outputs, reading new requests). ``calibrate`` fits its model over these steps too, and keeps k = 1,
fitting g + g_seq · decoding sequences instead: each sequence's token costs the API process
detokenizing and streaming beside the engine's next step, on the cores they share. The request
overhead is what the client waits beyond the engine at c=1: TTFT less the prefill step.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import httpx
import numpy as np

from tokenline.bench.neighbour_cpu import CpuSnapshot, snapshot
from tokenline.bench.ports import free_port
from tokenline.bench.results import BenchServeReport
from tokenline.bench.serve import BenchServeConfig, ServerNotReady, run_bench_serve, wait_healthy
from tokenline.sim.step_model import StepFeatures, StepModel, relative_weight, robust_lstsq

BUSY_GAP_S = 0.05  # a longer gap before the next step: the engine was idle, waiting for a request
# The least per-request overhead a fit gives. The API process hands requests to the engine one at a
# time, and a simulation holds to that only while the overhead is above zero: at zero a closed-loop
# wave lands at once and its first step takes 16 prompts where the server's takes one (c=32 x 64
# simulated TTFT -38 %, TPOT +30 %). The fit is a difference of two noisy figures (the c=1 TTFT less
# its prefill step and g) and came out at or below zero on the Ice Lake Xeon; any value above zero
# gives the server's order (1 and 2.5 ms simulated the same).
MIN_REQUEST_OVERHEAD_S = 0.001


@dataclass(frozen=True)
class ServerFit:
    step_scale: float  # k
    step_overhead_s: float  # g
    request_overhead_s: float
    num_steps: int
    step_overhead_per_seq_s: float = 0.0  # g_seq (fitted with k = 1 only)


@dataclass(frozen=True)
class ServerRun:
    """What the server loads measured: every busy step (features, wall seconds), and the c=1 run's
    prefill step durations and TTFT p50 (for the per-request overhead)."""

    steps: tuple[tuple[StepFeatures, float], ...]
    lone_prefills_s: tuple[float, ...]
    lone_ttft_p50_s: float

    def fit(self, model: StepModel, scale: bool = True) -> ServerFit:
        """k, g and the request overhead against ``model``; ``scale=False`` (for a model whose own
        fit took these steps in) keeps k = 1."""
        if scale:
            k, g = fit_scale_and_overhead(model, self.steps)
            g_seq = 0.0
        else:
            k, (g, g_seq) = 1.0, fit_overheads(model, self.steps)
        request_overhead = max(MIN_REQUEST_OVERHEAD_S, self.lone_ttft_p50_s - median(self.lone_prefills_s) - g - g_seq)
        return ServerFit(k, g, request_overhead, len(self.steps), g_seq)


def record_features(record: dict[str, Any]) -> StepFeatures:
    """A step record's features in ``batch_features``' terms (drafts count as prefill there)."""
    drafts = record.get("num_draft_tokens", 0)
    return StepFeatures(record["num_prefill_tokens"] + drafts, record["num_decode_tokens"] - drafts,
                        record.get("num_context_tokens", 0), record.get("num_prefill_attention_pairs", 0))


def busy_steps(records: Sequence[dict[str, Any]]) -> list[tuple[StepFeatures, float]]:
    """(features, wall seconds to the next step's start) of every step the next one followed at once."""
    out = []
    for rec, nxt in zip(records, records[1:]):
        wall = nxt["start"] - rec["start"]
        if nxt["step"] == rec["step"] + 1 and wall - rec["duration"] <= BUSY_GAP_S:
            out.append((record_features(rec), wall))
    return out


def fit_scale_and_overhead(model: StepModel, steps: Sequence[tuple[StepFeatures, float]],
                           scale: bool = True) -> tuple[float, float]:
    """wall = k · model(f) + g by ``robust_lstsq`` over relative errors, as the step model is fitted
    (k, g >= 0; steps another process slowed left out). ``scale=False``: k = 1, g alone."""
    if len(steps) < 2:
        raise ValueError(f"need at least 2 busy server steps to fit, got {len(steps)}")
    pred = np.array([model.predict(f) for f, _ in steps])
    wall = np.array([w for _, w in steps])
    # In absolute terms the few long prefill steps would set k and their spread the outlier band.
    weight = relative_weight(wall)
    if not scale:
        (g,), _ = robust_lstsq(weight[:, None], (wall - pred) * weight)
        return 1.0, float(g)
    (k, g), _ = robust_lstsq(np.stack([pred, np.ones_like(pred)], axis=1) * weight[:, None], wall * weight)
    return float(k), float(g)


def fit_overheads(model: StepModel, steps: Sequence[tuple[StepFeatures, float]]) -> tuple[float, float]:
    """wall = model(f) + g + g_seq · decoding sequences, by ``robust_lstsq`` over relative errors (both
    >= 0). g_seq: what each sequence's token costs beside the step, on cores the engine shares with
    the API process (detokenizing, streaming): a real server's batch-16 decode steps ran 5.6-7.3 ms
    over the offline model, its batch-1 steps 1-2.7 ms."""
    # Pure decode steps where the server ran enough of them: the model prices those best. Over all
    # the steps, mixed prefill ones included, three quiet calibrations fitted g = 0.2, 0.7 and 2.6 ms,
    # while the real servers after them paid ~2.5 ms more than the model on a batch-1 decode step.
    decode = [(f, w) for f, w in steps if f.decode_seqs and not f.prefill_tokens]
    steps = decode if len(decode) >= 10 else steps
    if len(steps) < 2:
        raise ValueError(f"need at least 2 busy server steps to fit, got {len(steps)}")
    pred = np.array([model.predict(f) for f, _ in steps])
    wall = np.array([w for _, w in steps])
    weight = relative_weight(wall)
    x = np.stack([np.ones_like(pred), np.array([float(f.decode_seqs) for f, _ in steps])], axis=1)
    (g, g_seq), _ = robust_lstsq(x * weight[:, None], (wall - pred) * weight)
    return float(g), float(g_seq)


@dataclass
class _StepReader:
    url: str
    records: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    connected: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            with httpx.stream("GET", f"{self.url}/v1/events", timeout=30) as response:
                kind = None
                for line in response.iter_lines():
                    self.connected.set()
                    if line.startswith("event: "):
                        kind = line[len("event: "):]
                    elif line.startswith("data: ") and kind == "step":
                        self.records.append(json.loads(line[len("data: "):]))
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            self.connected.set()  # the fit reports the missing records


def _run_load(url: str, config: BenchServeConfig) -> tuple[BenchServeReport, list[dict[str, Any]]]:
    reader = _StepReader(url)
    thread = threading.Thread(target=reader.run, daemon=True)
    thread.start()
    reader.connected.wait(10)
    report = asyncio.run(run_bench_serve(config))
    time.sleep(1.2)  # the last steps' events, and a stats tick that ends the reader's wait for a line
    reader.stop.set()
    thread.join(5)
    return report, reader.records


def run_server_loads(model_dir: Path, dtype: str, threads: int | None, startup_timeout_s: float = 180.0,
                     wide: bool = True,
                     judge_load: Callable[[CpuSnapshot, CpuSnapshot], None] | None = None) -> ServerRun:
    """Start ``tokenline serve`` on a free local port, load it at c=1 and c=6 (prompts of 96 tokens,
    12 output tokens) and, with ``wide``, c=16 (32 prompts of 256 tokens, 24 output tokens): workloads
    of their own, not the ones a simulation is checked on. Stops it. ``judge_load`` gets CPU readings
    (the server's tree as the server) from before and after the loads."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as log:
        # Its own usage ledger: calibration traffic stays out of the operator's.
        argv = [sys.executable, "-m", "tokenline.cli", "serve", "--model", str(model_dir), "--dtype", dtype,
                "--port", str(port), "--kv-cache-memory", "0.5", "--usage-db", str(Path(tmp) / "usage.sqlite3")]
        if threads is not None:
            argv += ["--threads-per-engine", str(threads)]
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        try:
            try:
                wait_healthy(url, server, timeout=startup_timeout_s, interval=0.3)
            except ServerNotReady as exc:
                log.seek(0)
                raise RuntimeError(f"the calibration server: {exc}: {log.read().decode(errors='replace')[-2000:]}") \
                    from exc
            base = BenchServeConfig(base_url=url, input_len=96, output_len=12, tokenizer_dir=str(model_dir))
            asyncio.run(run_bench_serve(BenchServeConfig(**{**base.__dict__, "num_prompts": 2, "output_len": 2,
                                                            "seed": 7})))  # warm-up
            before = snapshot(server.pid)
            lone, lone_records = _run_load(url, BenchServeConfig(**{**base.__dict__, "num_prompts": 4, "seed": 8}))
            records = list(lone_records)
            _, busy_records = _run_load(url, BenchServeConfig(**{**base.__dict__, "concurrency": 6,
                                                                 "num_prompts": 12, "seed": 9}))
            steps = busy_steps(lone_records) + busy_steps(busy_records)
            if wide:
                _, wide_records = _run_load(url, BenchServeConfig(**{
                    **base.__dict__, "concurrency": 16, "num_prompts": 32, "input_len": 256, "output_len": 24,
                    "seed": 10}))
                steps += busy_steps(wide_records)
            if judge_load is not None:
                judge_load(before, snapshot(server.pid))
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    prefills = tuple(r["duration"] for r in records if r["num_prefill_tokens"] > 0)
    ttft = lone.ttft_ms["p50"]
    if not prefills or ttft is None:
        raise RuntimeError("the calibration server's c=1 run left no prefill steps or TTFTs to fit on")
    return ServerRun(tuple(steps), prefills, ttft / 1000)


def measure_server(model_dir: Path, dtype: str, threads: int | None, model: StepModel,
                   startup_timeout_s: float = 180.0) -> ServerFit:
    """The server loads (c=1 and c=6 only) and k, g and the request overhead fitted against ``model``."""
    return run_server_loads(model_dir, dtype, threads, startup_timeout_s, wide=False).fit(model)
