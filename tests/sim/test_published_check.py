"""The published vLLM GPU rows (docs/benchmarks/data) beside tokenline's predictions: the command
recomputes every row's prediction and prints a well-formed table (its accuracy is the report's
business, docs/benchmarks/2026-12-07-planner.md, not this test's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenline.sim.published_check import load_rows, main

ROOT = Path(__file__).parents[2]
DATA = ROOT / "docs" / "benchmarks" / "data" / "2026-12-07-published-vllm-gpu.json"
REPORT = ROOT / "docs" / "benchmarks" / "2026-12-07-planner.md"


def test_every_published_row_gets_a_prediction_in_a_well_formed_table(capsys: pytest.CaptureFixture[str]) -> None:
    sources, rows = load_rows(DATA)
    assert main([str(DATA)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| source")]
    assert len(body) == len(rows) >= 10
    for line, row in zip(body, rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 8 and cells[0].startswith(row.source)
        for key in row.measured:  # each measured figure has its prediction and its error
            assert key in cells[5] and key in cells[6] and re.search(rf"{key} [+-]\d+%", cells[7])
    assert sum("(calibrated on)" in line for line in body) == 1  # calibrated on at most one row
    assert re.match(r"Within 25 % on output tok/s and TPOT \(rows not calibrated on\): \d+ of \d+ \(\d+%\)\.",
                    table[-1])
    # At least three published sources, each cited (with its address) in the dated report.
    assert len({row.source for row in rows}) >= 3
    report = REPORT.read_text()
    for source in sources.values():
        assert source["url"] in report


def test_a_bad_invocation_is_a_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err
