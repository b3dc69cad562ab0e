"""Memory that follows use: the engine's and the API process's resident memory over rounds of fresh
random prompts (a bounded version of the hostile soak in issue 17).

One real server (the default model, 127.0.0.1, a free port, stopped by pid at the end) per
variant; `tokenline bench serve` drives ``--rounds`` rounds of ``--num-prompts`` requests with
fresh prompts each round (no prefix hits between rounds; ``ignore_eos``), and after each round the
script prints both processes' RSS and the engine's peak RSS (VmHWM). Then one round at
``--peak-concurrency`` (default 32) for the peak figure. Variants, side by side in one run:

  new          --no-prefix-cache-fills-pool: freed KV blocks, cached or not, reused before never-touched
               ones; one copy of each linear weight
  bounded      the default: cached prefixes grow into fresh memory up to --prefix-cache-resident-memory
               (0.5 GiB), then are evicted before more is touched
  fills-pool   --prefix-cache-fills-pool: cached prefixes kept until the whole pool is in use
  two-copies   like new, with TOKENLINE_KEEP_PLAIN_WEIGHTS=1: the plain weights kept beside the
               oneDNN-packed ones (the weight memory before this change)
  old          fills-pool and two copies

    .venv/bin/python bench/memory_soak.py                       # 6 rounds x 64, c=8, 256 in / 64 out
    .venv/bin/python bench/memory_soak.py --variants new old --rounds 3 --num-prompts 16 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.bench.ports import free_port  # noqa: E402
from tokenline.bench.serve import BenchServeConfig, run_bench_serve, wait_healthy  # noqa: E402

VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "new": (["--no-prefix-cache-fills-pool"], {}),
    "bounded": ([], {}),
    "fills-pool": (["--prefix-cache-fills-pool"], {}),
    "two-copies": (["--no-prefix-cache-fills-pool"], {"TOKENLINE_KEEP_PLAIN_WEIGHTS": "1"}),
    "old": (["--prefix-cache-fills-pool"], {"TOKENLINE_KEEP_PLAIN_WEIGHTS": "1"}),
}
MIB = 1 << 20


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(child) for child in text)
    return found


def engine_pid(api_pid: int) -> int:
    """The engine process: the API process's child that grew largest (multiprocessing's resource
    tracker is a child too)."""
    kids = children(api_pid)
    if not kids:
        raise RuntimeError("the server has no engine process")
    return max(kids, key=lambda pid: status_kib(pid, "VmRSS"))


def memory(api_pid: int) -> dict[str, float]:
    engine = engine_pid(api_pid)
    return {
        "engine_rss_mib": status_kib(engine, "VmRSS") / 1024,
        "engine_peak_mib": status_kib(engine, "VmHWM") / 1024,
        "api_rss_mib": status_kib(api_pid, "VmRSS") / 1024,
    }


def run_variant(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    flags, env_extra = VARIANTS[name]
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = open(work / f"server-{name}.log", "wb")  # noqa: SIM115 - closed at the end
    command = [sys.executable, "-m", "tokenline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(max(args.concurrency, args.peak_concurrency)),
               "--kv-cache-memory", str(args.kv_cache_memory),
               "--usage-db", str(work / f"usage-{name}.sqlite3"), "--disable-log-requests", *flags]
    if args.threads:  # memory does not depend on it; one thread spares a crowded machine's barriers
        env_extra = {**env_extra, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env_extra})
    rows: list[dict[str, Any]] = []
    try:
        wait_healthy(base_url, server)
        rows.append({"round": "start", **memory(server.pid)})
        print(f"[{name}] start: {rows[-1]}", flush=True)
        for round_no in range(args.rounds):
            config = BenchServeConfig(base_url, concurrency=args.concurrency, num_prompts=args.num_prompts,
                                      input_len=args.input_len, output_len=args.output_len,
                                      seed=1000 * round_no + 17)  # fresh prompts every round
            started = time.monotonic()
            report = asyncio.run(run_bench_serve(config))
            rows.append({"round": round_no + 1, "failed": report.failed,
                         "seconds": round(time.monotonic() - started, 1), **memory(server.pid)})
            print(f"[{name}] round {round_no + 1}: {rows[-1]}", flush=True)
        if args.peak_concurrency:
            config = BenchServeConfig(base_url, concurrency=args.peak_concurrency,
                                      num_prompts=args.peak_concurrency, input_len=args.input_len,
                                      output_len=args.output_len, seed=999_999)
            report = asyncio.run(run_bench_serve(config))
            rows.append({"round": f"c={args.peak_concurrency}", "failed": report.failed, **memory(server.pid)})
            print(f"[{name}] c={args.peak_concurrency}: {rows[-1]}", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    return {"variant": name, "flags": flags, "env": env_extra, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["new", "old"], choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--peak-concurrency", type=int, default=32, help="a last round at this concurrency; 0: none")
    parser.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB, as serve's flag")
    parser.add_argument("--threads", type=int, default=None, help="the engine's OMP_NUM_THREADS (default: torch's)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokenline-memory-soak-"))
    results = [run_variant(name, args, work) for name in args.variants]
    print(f"\n{'variant':12s} {'round':>6s} {'engine RSS':>11s} {'engine peak':>12s} {'API RSS':>9s}")
    for result in results:
        for row in result["rows"]:
            print(f"{result['variant']:12s} {row['round']!s:>6s} {row['engine_rss_mib']:9.0f} M "
                  f"{row['engine_peak_mib']:10.0f} M {row['api_rss_mib']:7.0f} M")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"server logs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
