#!/usr/bin/env python3
"""``tokenline simulate`` held against real ``bench serve`` runs of the same workloads (the README's
"How close" table).

Starts one ``tokenline serve --dtype float32 --kv-cache-memory 1 --threads-per-engine 1`` on a free
local port (OMP_NUM_THREADS=1, as calibrated), then for each workload runs a pair back to back: the
real ``bench serve`` (a fresh --seed each run, so the prefix cache never helps; the server's step
records read from ``GET /v1/events`` meanwhile), then ``tokenline simulate`` with the same options.
Repeats the whole list ``--repeats`` times, stops the server by pid and prints one markdown row per
pair: p50 TTFT / TPOT / E2E real and simulated with the error, the 1-minute load average, and the
error once the simulation runs at the real run's own step speeds (``at_run_speed``: its decode and
prefill steps' wall times against the profile's prediction): on a shared machine, what is left
when the load of the moment is taken out. Then a summary: how many p50s are within 10 % as
calibrated, against the mean of the repeats (a workload's real runs averaged, against its
simulations averaged), and at the runs' own speed, with the median error of each.

    .venv/bin/python bench/sim_vs_real.py PROFILE.json OUT_DIR [--repeats 2] \\
        [--workloads 1,6,128,32 8,16,128,32 32,32,128,32 32,64,128,32 8,16,512,16 mt:4,8,4,2,256,32,32]
        # c,num-prompts,in,out; mt:c,conversations,turns,groups,system-prompt-len,in,out
    .venv/bin/python bench/sim_vs_real.py PROFILE.json OUT_DIR --resimulate   # no server: the saved
        # real runs of OUT_DIR against this profile (another fit of the same runs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenline.bench.ports import free_port  # noqa: E402
from tokenline.bench.serve import wait_healthy  # noqa: E402
from tokenline.sim.profile import Profile  # noqa: E402
from tokenline.sim.replicas import FleetConfig, simulate_replicas  # noqa: E402
from tokenline.sim.server_fit import busy_steps  # noqa: E402
from tokenline.sim.sim_target import scaled_step_model  # noqa: E402
from tokenline.sim.simulate import SimConfig, simulate  # noqa: E402

TOKENLINE = [sys.executable, "-m", "tokenline.cli"]
KEYS = ("p50_ttft_ms", "p50_tpot_ms", "p50_e2e_ms")


def read_events(url: str, steps: list[dict], requests: list[dict], stop: threading.Event) -> None:
    """The server's step records, and its requests' stages (when each reached the engine: the
    arrivals a simulation takes one at a time), from ``GET /v1/events``."""
    with httpx.stream("GET", f"{url}/v1/events", timeout=30) as response:
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind in ("step", "request"):
                (steps if kind == "step" else requests).append(json.loads(line[6:]))
            if stop.is_set():
                return


def pct(sim: float, real: float) -> str:
    return f"{(sim - real) / real * 100:+.0f} %"


@dataclass(frozen=True)
class Workload:
    """One line of ``--workloads``: ``c,num_prompts,in,out`` (random prompts) or
    ``mt:c,conversations,turns,groups,system_len,in,out`` (``bench serve --workload multiturn``:
    later turns and shared system prompts hit the prefix cache)."""

    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    fleet: FleetConfig | None = None  # multi-turn: one replica's conversations

    @classmethod
    def parse(cls, text: str) -> Workload:
        if text.startswith("mt:"):
            c, conversations, turns, groups, system_len, i, o = (int(x) for x in text[3:].split(","))
            fleet = FleetConfig(replicas=1, workload="multiturn", num_groups=groups, num_conversations=conversations,
                                turns=turns, system_prompt_len=system_len)
            return cls(c, conversations * turns, i, o, fleet)
        c, n, i, o = (int(x) for x in text.split(","))
        return cls(c, n, i, o)

    def label(self) -> str:
        if self.fleet is None:
            return f"c={self.concurrency}, {self.num_prompts} × {self.input_len}/{self.output_len}"
        f = self.fleet
        return (f"c={self.concurrency} multi-turn, {f.num_conversations}×{f.turns} turns, {f.num_groups}×"
                f"{f.system_prompt_len} system, {self.input_len}/{self.output_len}")

    def bench_args(self) -> list[str]:
        args = ["--concurrency", str(self.concurrency), "--input-len", str(self.input_len),
                "--output-len", str(self.output_len)]
        if self.fleet is None:
            return [*args, "--num-prompts", str(self.num_prompts)]
        f = self.fleet
        return [*args, "--workload", "multiturn", "--num-conversations", str(f.num_conversations), "--turns",
                str(f.turns), "--num-groups", str(f.num_groups), "--system-prompt-len", str(f.system_prompt_len)]

    def sim_config(self, seed: int) -> SimConfig:
        return SimConfig(concurrency=self.concurrency, num_prompts=self.num_prompts, input_len=self.input_len,
                         output_len=self.output_len, seed=seed, kv_cache_memory_gib=1.0)

    def simulate(self, profile: Profile, seed: int) -> dict:
        config = self.sim_config(seed)
        if self.fleet is None:
            return simulate(profile, config).to_dict()
        return simulate_replicas(profile, config, self.fleet).to_dict()


@dataclass
class Pair:
    """One real run and its simulations: as calibrated, and at the run's own step speeds."""

    workload: Workload
    repeat: int
    load: float
    real: dict
    sim: dict
    at_speed: dict
    decode_speed: float
    prefill_speed: float
    first_step_seqs: int  # requests in the real run's first step (the simulator takes the first alone)
    first_step_wait_ms: float | None  # from the first request's arrival at the server to the engine's first step

    def row(self) -> str:
        cells = [self.workload.label(), str(self.repeat), f"{self.load:.1f}"]
        cells += [f"{self.real[k]:.0f} / {self.sim[k]:.0f} ({pct(self.sim[k], self.real[k])})" for k in KEYS]
        cells.append(f"×{self.decode_speed:.2f} / ×{self.prefill_speed:.2f}: "
                     + " / ".join(pct(self.at_speed[k], self.real[k]) for k in KEYS))
        return "| " + " | ".join(cells) + " |"


def compare(profile: Profile, workload: Workload, real: dict, steps: list[dict], load: float, repeat: int,
            requests: list[dict] | None = None) -> Pair:
    sim = workload.simulate(profile, real["seed"])
    adj, decode_speed, prefill_speed = at_run_speed(profile, workload, real["seed"], steps)
    first = min(steps, key=lambda r: r["start"]) if steps else None
    arrived = [r["t"] for r in requests or [] if r["stage"] == "arrived"]
    wait = (first["start"] - min(arrived)) * 1000 if first and arrived else None
    return Pair(workload, repeat, load, real, sim, adj, decode_speed, prefill_speed,
                first["num_seqs"] if first else 0, wait)


def within(errors: list[float], bound: float = 0.10) -> str:
    sizes = [abs(e) for e in errors]
    inside = sum(e <= bound for e in sizes)
    return (f"{inside} of {len(errors)} within {bound:.0%} (median {statistics.median(sizes) * 100:.1f} %, "
            f"largest {max(sizes) * 100:.0f} %)")


def summary(pairs: list[Pair]) -> list[str]:
    """The three counts the README quotes, and how the real runs began, over every p50 of every pair."""
    def err(sim: dict, real: dict, k: str) -> float:
        return (sim[k] - real[k]) / real[k]

    calibrated = [err(p.sim, p.real, k) for p in pairs for k in KEYS]
    own_speed = [err(p.at_speed, p.real, k) for p in pairs for k in KEYS]
    by_workload: dict[str, list[Pair]] = {}
    for p in pairs:
        by_workload.setdefault(p.workload.label(), []).append(p)
    mean = [(statistics.mean(p.sim[k] for p in ps) - statistics.mean(p.real[k] for p in ps))
            / statistics.mean(p.real[k] for p in ps) for ps in by_workload.values() for k in KEYS]
    # The noise floor: a later real run of a workload against its first real run, as if it were the prediction.
    real_vs_real = [err(p.real, ps[0].real, k) for ps in by_workload.values() for p in ps[1:] for k in KEYS]
    alone = sum(p.first_step_seqs == 1 for p in pairs)
    waits = sorted(p.first_step_wait_ms for p in pairs if p.first_step_wait_ms is not None)
    return [f"as calibrated: {within(calibrated)}", f"against the repeats' mean: {within(mean)}",
            f"at the runs' own speed: {within(own_speed)}",
            *([f"the real runs against their first repeat: {within(real_vs_real)}"] if real_vs_real else []),
            f"first steps: {alone} of {len(pairs)} real runs began with one request alone, as the simulator does "
            f"(the others: {', '.join(f'{p.workload.label()} #{p.repeat} {p.first_step_seqs}' for p in pairs if p.first_step_seqs != 1) or 'none'})"
            + (f"; the engine's first step started {statistics.median(waits):.1f} ms (median; {waits[0]:.1f} to "
               f"{waits[-1]:.1f}) after the first request arrived" if waits else "")]


def at_run_speed(profile: Profile, workload: Workload, seed: int, steps: list[dict]) -> tuple[dict, float, float]:
    """The simulation with the step model moved to the real run's own speed: the decode-step
    factor (median wall / predicted over its busy pure-decode steps) on a, c, d and g, the prefill
    one (median of what the prefill tokens took over their predicted cost) on b and its hinge. A shared machine's load changes
    both, and not alike."""
    served = scaled_step_model(profile.step_model, profile.step_scale)
    m, g = served, profile.step_overhead_s
    busy = busy_steps(steps)
    decode = statistics.median(w / (m.predict(f) + g) for f, w in busy if f.prefill_tokens == 0)
    # What is not the prefill tokens' own b·P in a mixed step (its decode rows, context, the unfused
    # step's price) runs at the decode factor.
    prefill_rows = [(w - decode * (m.predict(f) - m.prefill_s(f) + g)) / m.prefill_s(f)
                    for f, w in busy if f.prefill_tokens > 0] if m.b > 0 else []
    prefill = statistics.median(prefill_rows) if prefill_rows else decode
    model = m.scaled(decode, prefill)
    at_speed = Profile(**{**profile.__dict__, "step_model": model, "step_scale": 1.0, "step_overhead_s": g * decode})
    return workload.simulate(at_speed, seed), decode, prefill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("out_dir")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--resimulate", action="store_true",
                        help="start no server: compare OUT_DIR's saved real runs with this profile")
    parser.add_argument("--workloads", nargs="+", default=["1,6,128,32", "8,16,128,32", "32,32,128,32", "32,64,128,32", "8,16,512,16",
                                                         "mt:4,8,4,2,256,32,32"])
    args = parser.parse_args()
    profile = Profile.read(args.profile)
    out = Path(args.out_dir)
    if args.resimulate:
        return resimulate(profile, out, args.repeats, args.workloads)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out / "server.log", "w") as log:
        server = subprocess.Popen([*TOKENLINE, "serve", "--dtype", "float32", "--kv-cache-memory", "1", "--port",
                                   str(port), "--threads-per-engine", "1"], env=env, stdout=log, stderr=log, cwd=ROOT)
    print_header()
    pairs: list[Pair] = []
    try:
        wait_healthy(url, server, timeout=300)
        subprocess.run([*TOKENLINE, "bench", "serve", "--base-url", url, "--num-prompts", "2", "--input-len", "16",
                        "--output-len", "4", "--seed", "999"], capture_output=True, cwd=ROOT)  # warm-up
        seed = 100
        for repeat in range(args.repeats):
            for spec in args.workloads:
                workload = Workload.parse(spec)
                seed += 1
                tag = run_tag(spec, repeat)
                steps: list[dict] = []
                requests: list[dict] = []
                stop = threading.Event()
                reader = threading.Thread(target=read_events, args=(url, steps, requests, stop), daemon=True)
                reader.start()
                time.sleep(0.5)
                opts = [*workload.bench_args(), "--seed", str(seed)]
                subprocess.run([*TOKENLINE, "bench", "serve", "--base-url", url, *opts, "--output-json",
                                str(out / f"{tag}_real.json")], capture_output=True, check=True, cwd=ROOT)
                load = os.getloadavg()[0]
                stop.set()
                time.sleep(1.2)  # the last steps' events, and a stats tick that wakes the reader
                (out / f"{tag}_steps.json").write_text(json.dumps(steps))
                (out / f"{tag}_requests.json").write_text(json.dumps(requests))
                (out / f"{tag}_load.json").write_text(json.dumps(load))
                real = json.loads((out / f"{tag}_real.json").read_text())
                pairs.append(compare(profile, workload, real, steps, load, repeat, requests))
                print(pairs[-1].row(), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    print("\n" + "\n".join(summary(pairs)))
    return 0


def run_tag(spec: str, repeat: int) -> str:
    return f"{spec.replace(':', '').replace(',', '_')}_r{repeat}"


def print_header() -> None:
    print("| workload (c, in/out) | repeat | load | TTFT p50 ms real / sim | TPOT p50 ms real / sim "
          "| E2E p50 ms real / sim | at the run's decode / prefill speed: TTFT / TPOT / E2E |")
    print("|---|---|---|---|---|---|---|")


def resimulate(profile: Profile, out: Path, repeats: int, specs: list[str]) -> int:
    """The saved runs of an earlier comparison (real results and step records) against ``profile``."""
    print_header()
    pairs = []
    for repeat in range(repeats):
        for spec in specs:
            tag = run_tag(spec, repeat)
            if not (out / f"{tag}_real.json").exists():
                continue
            real = json.loads((out / f"{tag}_real.json").read_text())
            steps = json.loads((out / f"{tag}_steps.json").read_text())
            load_file = out / f"{tag}_load.json"
            load = json.loads(load_file.read_text()) if load_file.exists() else float("nan")
            requests_file = out / f"{tag}_requests.json"
            requests = json.loads(requests_file.read_text()) if requests_file.exists() else None
            pairs.append(compare(profile, Workload.parse(spec), real, steps, load, repeat, requests))
            print(pairs[-1].row(), flush=True)
    if not pairs:
        print(f"no saved runs in {out}", file=sys.stderr)
        return 1
    print("\n" + "\n".join(summary(pairs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
