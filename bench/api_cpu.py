"""The API process's share of the CPU: API, engine and load-client CPU per output token, and the
server's output tok/s against the offline engine's on the same workload (issue 17).

On a 2-core machine the API process (HTTP, detokenization, stop strings, SSE) and the load client
share the cores with the engine, so every ms of their CPU per token is taken from it. CPU time
(``utime + stime`` of each process, every thread counted) is robust to a busy machine where wall
time is not. Per variant, one real server (127.0.0.1, a free port, stopped by pid at the end);
``tokenline bench serve`` (random token-id prompts, ``ignore_eos``) at each ``--concurrency``;
variants alternate round by round and the table gives medians.

Variants: ``current`` is this checkout; ``--old-checkout DIR`` adds ``old``, the same server run
from another checkout (``git worktree add /tmp/api-old <commit>``) with this interpreter, for a
before/after in one run. ``--simulate PROFILE.json`` serves a simulated replica (the real API
process, scheduler and IPC; steps sleep instead of running the model), which isolates the API's
CPU from a loaded engine's. ``--offline`` runs ``tokenline bench throughput`` with the same lengths
and ``--max-num-seqs`` (the issue's target: server ≥ 0.95 × offline at c=32).

    .venv/bin/python bench/api_cpu.py                                        # c=8 and 32, 64 x 256/128
    .venv/bin/python bench/api_cpu.py --offline --concurrency 32
    .venv/bin/python bench/api_cpu.py --simulate profile.json --old-checkout /tmp/api-old --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.bench.ports import free_port  # noqa: E402
from tokenline.bench.serve import BenchServeConfig, run_bench_serve, wait_healthy  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    variant: str
    round: int
    concurrency: int
    output_tokens: int
    failed: int
    api_cpu_s: float
    engine_cpu_s: float
    client_cpu_s: float
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float | None

    def per_token_ms(self, cpu_s: float) -> float:
        return 1000 * cpu_s / max(self.output_tokens, 1)


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process, all its threads (not its children: the engine is counted apart)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Server:
    """``tokenline serve`` run from ``checkout`` (its package first on the path)."""

    def __init__(self, name: str, checkout: Path, serve_args: list[str], work: Path) -> None:
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"server-{name}.log"
        command = [sys.executable, "-m", "tokenline.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--usage-db", str(work / f"usage-{name}.sqlite3"), "--disable-log-requests", *serve_args]
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=checkout, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.base_url, self.process, timeout=600)
            self.engine_pid = int(httpx.get(f"{self.base_url}/health", timeout=10).json()["engine_pid"])
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def measure(server: Server, concurrency: int, round_no: int, args: argparse.Namespace) -> Row:
    config = BenchServeConfig(server.base_url, concurrency=concurrency, num_prompts=args.num_prompts,
                              input_len=args.input_len, output_len=args.output_len, seed=1000 * round_no + concurrency,
                              timeout=args.timeout)  # fresh prompts per round: no prefix hits between runs
    api0, engine0, client0, wall0 = (process_cpu_s(server.process.pid), process_cpu_s(server.engine_pid),
                                     own_cpu_s(), time.monotonic())
    report = asyncio.run(run_bench_serve(config))
    wall = time.monotonic() - wall0
    return Row(server.name, round_no, concurrency, report.total_output_tokens, report.failed,
               process_cpu_s(server.process.pid) - api0, process_cpu_s(server.engine_pid) - engine0,
               own_cpu_s() - client0, wall, report.output_throughput, report.ttft_ms.get("p50"))


def offline_tok_s(args: argparse.Namespace, work: Path) -> float:
    out = work / "offline.json"
    command = [sys.executable, "-m", "tokenline.cli", "bench", "throughput", "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--max-num-seqs", str(max(args.concurrency)), "--output-json", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())[0]  # the tokenline row (no --hf)
    return result["output_tokens"] / result["elapsed_s"]


def summary(rows: list[Row]) -> list[dict[str, Any]]:
    table = []
    for variant in dict.fromkeys(r.variant for r in rows):
        for concurrency in dict.fromkeys(r.concurrency for r in rows):
            mine = [r for r in rows if r.variant == variant and r.concurrency == concurrency]
            if not mine:
                continue

            def median(values: list[float | None]) -> float | None:
                present = [v for v in values if v is not None]
                return round(statistics.median(present), 3) if present else None

            table.append({
                "variant": variant, "concurrency": concurrency, "runs": len(mine),
                "api_ms_per_token": median([r.per_token_ms(r.api_cpu_s) for r in mine]),
                "engine_ms_per_token": median([r.per_token_ms(r.engine_cpu_s) for r in mine]),
                "client_ms_per_token": median([r.per_token_ms(r.client_cpu_s) for r in mine]),
                "api_share_of_server_cpu": median([r.api_cpu_s / max(r.api_cpu_s + r.engine_cpu_s, 1e-9) for r in mine]),
                "output_tok_s": median([r.output_tok_s for r in mine]),
                "ttft_p50_ms": median([r.ttft_p50_ms for r in mine]),
            })
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant and concurrency, alternated")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request (a loaded box is slow)")
    parser.add_argument("--old-checkout", type=Path, help="also run the server from this checkout (variant old)")
    parser.add_argument("--simulate", type=Path, help="serve a simulated replica with this profile (no model)")
    parser.add_argument("--offline", action="store_true", help="also run tokenline bench throughput (same lengths)")
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more tokenline serve flags")
    args = parser.parse_args()
    extra = [a for a in args.serve_args if a != "--"]
    serve_args = ["--max-num-seqs", str(max(args.concurrency)), *extra]
    if args.simulate is not None:
        serve_args = [*serve_args, "--simulate", str(args.simulate.resolve())]
    variants = [("current", ROOT)] + ([("old", args.old_checkout.resolve())] if args.old_checkout else [])
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="api-cpu-") as tmp:
        work = Path(tmp)
        servers = []
        try:
            for name, checkout in variants:
                servers.append(Server(name, checkout, serve_args, work))
                # Warm-up: the first requests pay one-time costs (templates, allocator, caches).
                asyncio.run(run_bench_serve(BenchServeConfig(servers[-1].base_url, concurrency=4, num_prompts=4,
                                                             input_len=16, output_len=8, seed=99)))
            for round_no in range(args.rounds):
                order = servers if round_no % 2 == 0 else servers[::-1]  # ABBA
                for concurrency in args.concurrency:
                    for server in order:
                        rows.append(measure(server, concurrency, round_no, args))
                        row = rows[-1]
                        print(f"[{row.variant}] round {round_no} c={concurrency}: "
                              f"api {row.per_token_ms(row.api_cpu_s):.3f} ms/tok, "
                              f"engine {row.per_token_ms(row.engine_cpu_s):.3f} ms/tok, "
                              f"client {row.per_token_ms(row.client_cpu_s):.3f} ms/tok, "
                              f"{row.output_tok_s:.1f} tok/s, TTFT p50 {row.ttft_p50_ms} ms, "
                              f"{row.failed} failed", flush=True)
        finally:
            for server in servers:
                server.stop()
        result: dict[str, Any] = {"load_at_start": load, "load_at_end": os.getloadavg(),
                                  "summary": summary(rows), "rows": [asdict(r) for r in rows]}
        if args.offline:
            offline = offline_tok_s(args, work)
            result["offline_output_tok_s"] = offline
            for line in result["summary"]:
                line["server_over_offline"] = round(line["output_tok_s"] / offline, 3)
    print(json.dumps(result["summary"], indent=1))
    if "offline_output_tok_s" in result:
        print(f"offline (bench throughput, --max-num-seqs {max(args.concurrency)}): "
              f"{result['offline_output_tok_s']:.1f} output tok/s")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in result['load_at_end'])}")
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
