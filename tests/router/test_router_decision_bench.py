"""bench/router_decision.py runs end to end at a small size (its real figures are in docs/operate/fleet.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "router_decision.py"


def test_router_decision_bench_small(tmp_path: Path) -> None:
    out = tmp_path / "decision.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--replicas", "4", "--cached-blocks", "300", "--prompt-tokens", "256",
         "--requests", "30", "--output-json", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"round_robin", "least_load", "prefix", "kv_events"}
    for name, row in report["policies"].items():
        assert 0 < row["median_us"] <= row["p99_us"], name
        assert name in result.stdout
    # The prefix policies were measured over a warm index of at least the asked-for size.
    assert report["policies"]["prefix"]["cached_blocks"] >= 300
    assert report["policies"]["kv_events"]["cached_blocks"] >= 300
    assert report["policies"]["kv_events"]["event_us_per_block"] > 0


def test_router_decision_bench_refuses_bad_sizes() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--replicas", "0"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 2
    assert "sizes must be positive" in result.stderr
