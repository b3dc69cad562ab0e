"""bench/linears_bf16.py: a small real run, old kernel, new kernel and oneDNN on the same packed bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenline.model import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cpu_kernels.load() is None or not cpu_kernels.cpu_has_native_bf16(),
                    reason="needs the CPU kernels and native bf16 (oneDNN's packed bf16 weights)")
def test_a_small_run_reports_every_path_and_the_same_bits(tmp_path: Path) -> None:
    out = tmp_path / "linears.json"
    # 12 rows: the new kernel's many-row path, which gives the old one's bits where rows come in fours
    # and oneDNN packs 64-column blocks (AMD Zen 4 here); with 32 (Sapphire Rapids) they differ by rounding.
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "linears_bf16.py"), "--rows", "1", "12", "--layers", "2",
                          "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["rows"]] == [1, 12]
    for row in report["rows"]:
        assert set(row["layer_s"]) >= {"new", "onednn"} and all(t > 0 for t in row["layer_s"].values())
        if "old" in row["layer_s"]:  # a clone with the baseline revision in its history
            if row["bits_expected_same"]:
                assert row["same_bits"] is True
            assert row["max_rel_diff"] <= 2.0 ** -7  # at most about one bf16 rounding apart
            if row["rows"] == 1:
                assert row["bits_expected_same"] is True
    assert "| 12 |" in run.stdout
