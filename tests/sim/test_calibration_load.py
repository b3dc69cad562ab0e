"""bench calibrate knows when its machine is busy: a real CPU hog beside a short calibration is
seen, the calibration refused (or kept, marked, with --allow-load), and simulate says so in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenline.cli import main
from tokenline.store.model_store import resolve_model
from tokenline.sim.calibrate import CalibrationDesign, calibrate
from tokenline.sim.calibration_load import CalibrationUnderLoad, LoadPolicy
from tokenline.sim.profile import Profile
from tokenline.sim.profile_check import SimulatedSetup, profile_warning
from tokenline.sim.step_model import StepModel

TINY = CalibrationDesign(prefill_lens=(16, 64), context_lens=(16,), decode_batches=(1, 4), decode_steps=3,
                         repeats=1, max_seconds=10.0, followups=((32, 8),))
# A hog of its own: not this process nor a child it waits for, so its CPU is a neighbour's. It
# spins for at most 90 s however the test ends, and is killed by its pid when the test is done.
HOG = "import time\nend = time.time() + 90\nwhile time.time() < end: pass\n"


@pytest.fixture
def hog() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_calibration_beside_a_cpu_hog_is_refused(hog: subprocess.Popen, one_thread: None) -> None:
    with pytest.raises(CalibrationUnderLoad, match="neighbours took .* --allow-load"):
        calibrate(resolve_model(None), "float32", design=TINY, threads=1,
                  load_policy=LoadPolicy(quiet_checks=1, retries=1))


def test_a_loaded_calibration_kept_is_marked_and_simulate_warns_once(
        hog: subprocess.Popen, one_thread: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = calibrate(resolve_model(None), "float32", design=TINY, threads=1,
                        load_policy=LoadPolicy(quiet_checks=1, retries=1, allow_load=True))
    load = profile.load
    assert load is not None and load["under_load"]
    # One spinning process on this machine's cores is far above the 10 % threshold.
    assert load["before_share"] > 0.10 and load["worst_share"] > 0.10
    # Every loaded stretch ran again once (its steps discarded), then was kept under load.
    assert load["repeated"] == load["stretches"] == load["loaded_kept"] >= 1
    assert len(load["notes"]) == 1 + load["loaded_kept"]
    assert profile.num_steps >= 5  # the kept runs' steps, the discarded ones' gone (checked in calibrate)

    path = tmp_path / "p.json"
    profile.write(path)
    assert Profile.read(path).load == json.loads(json.dumps(load))
    capsys.readouterr()
    assert main(["simulate", "--profile", str(path), "--num-prompts", "2", "--input-len", "16", "--output-len", "2",
                 "--dtype", "float32", "--threads", "1", "--max-num-batched-tokens", "512"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "under load" in err[0] and "dtype" not in err[0] and "threads" not in err[0]


def _profile(**kwargs: object) -> Profile:
    base = dict(step_model=StepModel(a=0.04, b=0.003, c=0.012, d=7e-6), model="small", dtype="float32",
                machine={"torch_threads": 2}, vocab_size=100, max_model_len=2048, kv_bytes_per_token=100,
                load={"under_load": False, "before_share": 0.01, "worst_share": 0.02}, max_num_batched_tokens=2048)
    return Profile(**{**base, **kwargs})  # type: ignore[arg-type]


def test_a_quiet_matching_profile_gives_no_warning_and_a_mismatch_one_line() -> None:
    setup = SimulatedSetup("float32", 2, 1024)
    assert profile_warning(_profile(), setup) is None
    line = profile_warning(_profile(dtype="bfloat16", machine={"torch_threads": 1}), setup, "p.json")
    assert line is not None and "\n" not in line
    assert "p.json" in line and "dtype bfloat16 (simulating float32)" in line and "1 torch threads" in line
    line = profile_warning(_profile(), SimulatedSetup("float32", 2, 4096))
    assert line is not None and "budget of 4096" in line
    loaded = _profile(load={"under_load": True, "before_share": 0.4, "worst_share": 0.5, "server_share": None})
    assert "under load (neighbours took up to 50% of the CPU)" in (profile_warning(loaded, setup) or "")
    # A profile from before load was measured warns only about what it does record.
    assert profile_warning(_profile(load=None, max_num_batched_tokens=None), setup) is None


def test_the_calibrate_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "calibrate", "--max-neighbour-cpu", "0", "--no-server-run"]) == 2
    assert "--max-neighbour-cpu must be in (0, 1]" in capsys.readouterr().err
