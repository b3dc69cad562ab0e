"""What watching costs: the engine's throughput with the live page open vs closed, and whether the
page keeps up, under 64 concurrent streams (issue 13's target: < 2 % throughput, page responsive).

One server (127.0.0.1, free port, stopped by pid at the end) and `tokenline bench serve` at
concurrency 64, alternating rounds without a viewer and with one, so drift on a shared machine hits
both sides alike. Viewers:
  sse      a client reading /v1/events (what the page's EventSource does, without a browser's CPU)
  chromium the real page in Debian's headless Chromium; a probe in the page measures how late a
           10 ms timer fires (main-thread lag) while the load runs
The report: output tok/s per round, the median ratio with/without, events received and their
delay behind the engine step they describe, and the page's timer lag (p50 / p99 / max).

    .venv/bin/python bench/dashboard_cost.py --viewer sse --rounds 3
    .venv/bin/python bench/dashboard_cost.py --viewer chromium --rounds 2
    .venv/bin/python bench/dashboard_cost.py --viewer sse --rounds 4 --pin   # viewer off the server's core
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenline.bench.ports import free_port  # noqa: E402
from tokenline.bench.serve import BenchServeConfig, run_bench_serve, wait_healthy  # noqa: E402

PROBE = """(() => {
  window.__lags = [];
  let last = performance.now();
  window.__probe = setInterval(() => { const now = performance.now(); window.__lags.push(now - last - 10); last = now; }, 10);
  return true;
})()"""


class SseViewer:
    """Reads /v1/events in a thread; counts events and how far step events trail their step's end
    (both clocks are this machine's CLOCK_MONOTONIC)."""

    def __init__(self, base_url: str) -> None:
        self.url = f"{base_url}/v1/events"
        self.events = 0
        self.delays: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SseViewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with httpx.stream("GET", self.url, timeout=None) as response:
            event = None
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:"):
                    self.events += 1
                    if event == "step":
                        end = json.loads(line[5:]).get("t")  # when the step ended, engine clock
                        if end:
                            self.delays.append(time.monotonic() - end)

    def summary(self) -> dict[str, Any]:
        delays = sorted(self.delays) or [0.0]
        return {"events": self.events, "step_delay_ms_p50": 1000 * delays[len(delays) // 2],
                "step_delay_ms_max": 1000 * delays[-1]}


class ChromiumViewer:
    def __init__(self, base_url: str, profile: Path) -> None:
        from tests.e2e.headless_chromium import Chromium

        self.browser = Chromium(profile)
        self.browser.navigate(f"{base_url}/dashboard")
        if not self.browser.wait_for("document.getElementById('status').dataset.state === 'live'", 30):
            raise RuntimeError("the dashboard did not go live")

    def __enter__(self) -> ChromiumViewer:
        self.browser.evaluate(PROBE)
        return self

    def __exit__(self, *exc: object) -> None:
        lags = self.browser.evaluate("(() => { clearInterval(window.__probe); return window.__lags; })()") or [0.0]
        lags = sorted(max(0.0, lag) for lag in lags)
        self.lag = {"timer_lag_ms_p50": lags[len(lags) // 2], "timer_lag_ms_p99": lags[int(0.99 * (len(lags) - 1))],
                    "timer_lag_ms_max": lags[-1],
                    "steps_shown": self.browser.evaluate("+document.getElementById('count-steps').dataset.value")}

    def summary(self) -> dict[str, Any]:
        return self.lag

    def close(self) -> None:
        self.browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--viewer", choices=["sse", "chromium"], default="sse")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of rounds (without, with)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--pin", action="store_true",
                        help="server (API + engine, one engine thread) on CPU 0, this client and the viewer on "
                             "CPU 1: the viewer's own CPU stays off the server's core, as a viewer elsewhere would")
    args = parser.parse_args()
    server_cpus: set[int] | None = None
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            parser.error("--pin needs two CPUs")
        first, second, *_ = sorted(os.sched_getaffinity(0))
        server_cpus = {first}
        os.sched_setaffinity(0, {second})

    work = Path(tempfile.mkdtemp(prefix="tokenline-dashboard-cost-"))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed at the end
    argv = [sys.executable, "-m", "tokenline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(args.concurrency), "--usage-db", str(work / "usage.sqlite3"), "--disable-log-requests"]
    if server_cpus is not None:
        argv += ["--threads-per-engine", "1"]
    # The engine process inherits the API process's CPU affinity.
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
                              preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None)
    rows: list[dict[str, Any]] = []
    chromium = None
    try:
        wait_healthy(base_url, server)
        config = BenchServeConfig(base_url, concurrency=args.concurrency, num_prompts=args.num_prompts,
                                  input_len=args.input_len, output_len=args.output_len)
        asyncio.run(run_bench_serve(BenchServeConfig(base_url, concurrency=8, num_prompts=8, input_len=16,
                                                     output_len=8)))  # warm-up
        if args.viewer == "chromium":
            chromium = ChromiumViewer(base_url, work / "profile")
        for round_no in range(args.rounds):
            # ABBA: a drift across the run (a neighbour starting, the machine warming) hits both alike.
            for watched in ((False, True) if round_no % 2 == 0 else (True, False)):
                config.seed = round_no * 2 + int(watched)  # fresh prompts: no prefix hits between rounds
                if not watched:
                    report = asyncio.run(run_bench_serve(config))
                    rows.append({"round": round_no, "watched": False, "output_throughput": report.output_throughput})
                    continue
                viewer = chromium if chromium is not None else SseViewer(base_url)
                with viewer:
                    report = asyncio.run(run_bench_serve(config))
                rows.append({"round": round_no, "watched": True, "output_throughput": report.output_throughput,
                             **viewer.summary()})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if chromium is not None:
            chromium.close()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    off = statistics.median(r["output_throughput"] for r in rows if not r["watched"])
    on = statistics.median(r["output_throughput"] for r in rows if r["watched"])
    result = {"viewer": args.viewer, "concurrency": args.concurrency, "pinned": args.pin, "rounds": rows,
              "median_tok_s_unwatched": off, "median_tok_s_watched": on, "ratio": on / off}
    print(f"\n| viewer | c | output tok/s unwatched (median) | watched | ratio |\n|---|---:|---:|---:|---:|\n"
          f"| {args.viewer} | {args.concurrency} | {off:.1f} | {on:.1f} | {on / off:.3f} |")
    for row in rows:
        if row["watched"]:
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()})
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
