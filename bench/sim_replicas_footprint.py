"""What a dozen simulated replicas (``tokenline serve --simulate PROFILE``) cost on this machine:
seconds until all answer /health, memory (RSS of each API process and its engine process), CPU
while idle, and one chat request through each to show they serve.

Started all at once, as a router test would. The processes are this script's children, stopped
(SIGTERM, then kill) at the end. Without ``--profile`` a profile is written with the step model
of the README's calibration table.

    .venv/bin/python bench/sim_replicas_footprint.py
    .venv/bin/python bench/sim_replicas_footprint.py --replicas 12 --idle-s 10 --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.bench.ports import free_port
from tokenline.sim.profile import Profile
from tokenline.sim.step_model import StepModel

README_STEP = StepModel(a=0.057, b=0.0028, c=0.0119, d=7.4e-6)  # SmolLM2-135M float32, one thread, here


def tree(process: psutil.Process) -> list[psutil.Process]:
    return [process, *process.children(recursive=True)]


def measure(replicas: int, profile: Path, idle_s: float, work: Path) -> dict[str, Any]:
    ports = [free_port() for _ in range(replicas)]
    started = time.monotonic()
    procs = []
    for port in ports:
        log = open(work / f"replica-{port}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tokenline.cli", "serve", "--simulate", str(profile), "--port", str(port),
             "--usage-db", str(work / f"usage-{port}.sqlite3")], stdout=log, stderr=subprocess.STDOUT))
    try:
        pending = set(ports)
        ready_s: dict[int, float] = {}
        deadline = started + 300
        while pending and time.monotonic() < deadline:
            for port in list(pending):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        ready_s[port] = time.monotonic() - started
                        pending.discard(port)
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        if pending:
            raise RuntimeError(f"{len(pending)} replica(s) not healthy after 300 s; logs in {work}")
        time.sleep(1.0)  # let start-up work (first scrapes, GC) settle
        processes = [p for proc in procs for p in tree(psutil.Process(proc.pid))]
        cpu_before = sum(p.cpu_times().user + p.cpu_times().system for p in processes)
        time.sleep(idle_s)
        cpu_after = sum(p.cpu_times().user + p.cpu_times().system for p in processes)
        api_rss = [psutil.Process(proc.pid).memory_info().rss for proc in procs]
        engine_rss = [c.memory_info().rss for proc in procs for c in psutil.Process(proc.pid).children()
                      if "spawn_main" in " ".join(c.cmdline())]
        tokens = 0
        for port in ports:
            body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello"}],
                    "max_tokens": 8}
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    mib = 2**20
    return {
        "replicas": replicas,
        "all_healthy_s": max(ready_s.values()),
        "first_healthy_s": min(ready_s.values()),
        "api_rss_mib_mean": sum(api_rss) / len(api_rss) / mib,
        "engine_rss_mib_mean": sum(engine_rss) / max(1, len(engine_rss)) / mib,
        "engine_processes": len(engine_rss),
        "total_rss_mib": (sum(api_rss) + sum(engine_rss)) / mib,
        "idle_s": idle_s,
        "idle_cpu_percent_of_one_core": 100 * (cpu_after - cpu_before) / idle_s,
        "completion_tokens": tokens,
        "cpu_count": psutil.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=12)
    parser.add_argument("--profile", default=None, help="a bench calibrate profile (default: the README's step model)")
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sim-replicas-") as tmp:
        work = Path(tmp)
        profile = Path(args.profile) if args.profile else work / "profile.json"
        if args.profile is None:
            Profile(step_model=README_STEP, model="SmolLM2-135M-Instruct", dtype="float32",
                    machine={"note": "the README's calibration"}, vocab_size=49152, max_model_len=8192,
                    kv_bytes_per_token=46080).write(profile)
        result = measure(args.replicas, profile, args.idle_s, work)
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
