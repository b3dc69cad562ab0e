"""Whether a calibration measured this machine or its neighbours: the CPU other processes took
before and during ``bench calibrate``'s runs (``bench/neighbour_cpu.py``, as the peers harness
reads it), a loaded stretch repeated a bounded number of times, and the load seen kept in the profile.

A step profile fitted while another process held a core carries that process's load into every
simulation made from it (one calibrated beside other work read TTFT +40 % and TPOT −20 % against a
real server, and nothing said so). So: a quiet check before the design starts (a few one-second
windows), the design's runs judged in stretches of at least ``min_window_s`` (a 50 ms run is 10
clock ticks on two cores: its share would be rounding), a loaded stretch discarded and run again,
and a calibration still loaded after its retries refused unless the caller allows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenline.bench.neighbour_cpu import CpuSnapshot, neighbour_cpu, snapshot

# Neighbours' share of the machine (wall × CPUs) above which a stretch is "under load". On the
# 2-core box here one busy neighbour thread is 0.5; tick rounding over a 1 s window is ~0.02.
DEFAULT_MAX_NEIGHBOUR_SHARE = 0.10


class CalibrationUnderLoad(RuntimeError):
    """Neighbours took more CPU than allowed, after the retries: the profile would be theirs."""


@dataclass(frozen=True)
class LoadPolicy:
    max_share: float = DEFAULT_MAX_NEIGHBOUR_SHARE
    retries: int = 2  # times a loaded stretch is run again before it counts as loaded
    allow_load: bool = False  # keep a loaded calibration (marked in the profile) instead of refusing
    quiet_checks: int = 3  # one-second windows before the design: the first quiet one starts it
    quiet_window_s: float = 1.0
    min_window_s: float = 1.0  # a stretch of runs is judged once it has run this long

    def __post_init__(self) -> None:
        if not 0 < self.max_share <= 1:
            raise ValueError("--max-neighbour-cpu must be in (0, 1]")
        if self.retries < 0 or self.quiet_checks < 1:
            raise ValueError("retries must be >= 0 and quiet_checks >= 1")


@dataclass
class CalibrationLoad:
    """What the profile keeps: the neighbours' shares seen (0..1 of the machine), how many stretches
    ran again, and whether any stretch was kept under load."""

    max_share: float  # the threshold used
    before_share: float = 0.0  # the quiet check's last window
    stretches: int = 0
    repeated: int = 0
    loaded_kept: int = 0  # stretches kept although loaded (only with allow_load)
    worst_share: float = 0.0  # of the stretches kept
    mean_share: float = 0.0  # of the kept stretches, weighed by their wall time
    server_share: float | None = None  # during the server run (None: no server run)
    kept_wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def under_load(self) -> bool:
        return (self.loaded_kept > 0 or self.before_share > self.max_share
                or (self.server_share or 0.0) > self.max_share)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "under_load": self.under_load}

    def summary(self) -> str:
        server = "" if self.server_share is None else f", {self.server_share:.0%} during the server run"
        return (f"neighbours took {self.before_share:.0%} of the CPU before, {self.mean_share:.0%} on average and "
                f"{self.worst_share:.0%} at worst during the kept runs{server}; {self.repeated} of "
                f"{self.stretches} stretches run again, {self.loaded_kept} kept under load "
                f"(threshold {self.max_share:.0%})")


def _own_snapshot() -> CpuSnapshot:
    """This process (every thread: the engine's torch threads too) and its reaped children are ours;
    every other process is a neighbour."""
    return snapshot(None)


def neighbour_share(start: CpuSnapshot, end: CpuSnapshot) -> float:
    return neighbour_cpu(start, end).neighbour_share


class LoadWatch:
    """Judges a calibration's stretches of runs by the CPU others took during them."""

    def __init__(self, policy: LoadPolicy, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy = policy
        self.load = CalibrationLoad(policy.max_share)
        self._sleep = sleep
        self._clock = clock
        self._weighted = 0.0

    def wait_for_quiet(self) -> None:
        """Up to ``quiet_checks`` windows of idle reading; refuse (unless allowed) if none is quiet."""
        share = 0.0
        for _ in range(self.policy.quiet_checks):
            start = _own_snapshot()
            self._sleep(self.policy.quiet_window_s)
            share = neighbour_share(start, _own_snapshot())
            if share <= self.policy.max_share:
                break
        self.load.before_share = share
        if share > self.policy.max_share:
            self._refuse_or_note(f"before the runs, neighbours took {share:.0%} of the CPU in each of "
                                 f"{self.policy.quiet_checks} {self.policy.quiet_window_s:g} s windows")

    def run_stretches(self, items: list[Callable[[], None]], begin: Callable[[], object],
                      discard: Callable[[object], None]) -> None:
        """Run ``items`` in order, judged in stretches of at least ``min_window_s``. ``begin()``
        marks what has been recorded so far; ``discard(mark)`` drops what was recorded after it
        (a loaded stretch's step records, before it runs again)."""
        i = 0
        while i < len(items):
            for attempt in range(self.policy.retries + 1):
                mark = begin()
                start = _own_snapshot()
                j = i
                while j < len(items) and (j == i or self._clock() - start.wall_s < self.policy.min_window_s):
                    items[j]()
                    j += 1
                end = _own_snapshot()
                share = neighbour_share(start, end)
                if share <= self.policy.max_share:
                    break
                if attempt < self.policy.retries:
                    discard(mark)
                    self.load.repeated += 1
            else:
                self.load.loaded_kept += 1
                self._refuse_or_note(f"neighbours took {share:.0%} of the CPU during a stretch of "
                                     f"{end.wall_s - start.wall_s:.1f} s, {self.policy.retries + 1} times running")
            self._keep(share, end.wall_s - start.wall_s)
            i = j

    def judge_server(self, start: CpuSnapshot, end: CpuSnapshot) -> None:
        """The server run, read with the server's process tree as ours (not repeated: it is long)."""
        share = neighbour_share(start, end)
        self.load.server_share = share
        if share > self.policy.max_share:
            self._refuse_or_note(f"neighbours took {share:.0%} of the CPU during the server run")

    def _keep(self, share: float, wall_s: float) -> None:
        self.load.stretches += 1
        self.load.worst_share = max(self.load.worst_share, share)
        self._weighted += share * wall_s
        self.load.kept_wall_s += wall_s
        self.load.mean_share = self._weighted / max(self.load.kept_wall_s, 1e-9)

    def _refuse_or_note(self, what: str) -> None:
        if not self.policy.allow_load:
            raise CalibrationUnderLoad(
                f"{what} (more than the {self.policy.max_share:.0%} allowed): a profile fitted now would carry "
                "their load into every simulation. Calibrate on a quiet machine, or pass --allow-load to keep it "
                "(marked in the profile)")
        self.load.notes.append(what)
