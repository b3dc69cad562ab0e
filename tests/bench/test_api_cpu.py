"""bench/api_cpu.py for real: a simulated replica (the real API process and engine process, steps
sleeping a hand-written profile's time) loaded by ``bench serve``, the API's and engine's CPU per
output token read from /proc, and no server left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from tokenline.sim.profile import Profile
from tokenline.sim.step_model import StepModel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "api_cpu.py"


def test_cpu_per_token_of_a_simulated_replica(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    Profile(step_model=StepModel(a=0.01, b=0.0001, c=0.001, d=0.0), model="SmolLM2-135M-Instruct", dtype="float32",
            machine={"note": "written by the test"}, vocab_size=49152, max_model_len=8192,
            kv_bytes_per_token=23040).write(profile)
    out = tmp_path / "result.json"
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = subprocess.run(
        [sys.executable, str(BENCH), "--simulate", str(profile), "--concurrency", "2", "--num-prompts", "4",
         "--input-len", "16", "--output-len", "8", "--output-json", str(out), "--", "--num-kv-blocks", "64"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["variant"] == "current" and row["concurrency"] == 2
    assert row["failed"] == 0 and row["output_tokens"] == 4 * 8
    assert row["api_cpu_s"] > 0  # HTTP, detokenization and SSE for 32 tokens take some CPU
    (line,) = result["summary"]
    assert line["api_ms_per_token"] > 0 and 0 < line["api_share_of_server_cpu"] <= 1  # 10 ms ticks: a short run may show no engine CPU
    assert "api" in run.stdout and "ms/tok" in run.stdout
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # servers stopped
