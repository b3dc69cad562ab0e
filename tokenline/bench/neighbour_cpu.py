"""How much CPU *other* processes took while a benchmark ran, from /proc.

A run on a shared machine measures its neighbours as much as the server when they are busy. Over a
run's wall time, the machine's busy time (``/proc/stat``) minus the CPU of the server's process tree,
the client's and the harness's own is what neighbours took; as a share of the machine's capacity
(wall time × CPUs) it says whether the run can be trusted. Steal time (the hypervisor running other
guests) counts as a neighbour's: it is CPU this machine did not get.

Process CPU is ``utime + stime + cutime + cstime`` of each process in the tree: a child that exits
during the run and is reaped by its parent moves its whole CPU into the parent's ``cutime``/``cstime``,
so start and end sums over the tree stay consistent. Standard library only (the API side may use it).
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MachineTimes:
    busy_ticks: int  # every state but idle and iowait, steal included
    steal_ticks: int


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    start_ticks: int  # since boot: with the pid, names the process (pids are reused)
    cpu_ticks: int  # utime + stime + cutime + cstime


def parse_proc_stat(text: str) -> MachineTimes:
    """The aggregate ``cpu`` line of ``/proc/stat``: user nice system idle iowait irq softirq steal …
    (guest time is already inside user)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(x) for x in parts[1:]] + [0] * 8
            user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
            return MachineTimes(user + nice + system + irq + softirq + steal, steal)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def parse_pid_stat(pid: int, text: str) -> ProcStat:
    """One ``/proc/<pid>/stat``; the command name may hold spaces and parentheses, so fields are
    counted from the last ')'."""
    fields = text[text.rfind(")") + 2:].split()
    # fields[0] is the state (field 3 of proc(5)): ppid is field 4, utime..cstime 14..17, starttime 22.
    cpu = sum(int(x) for x in fields[11:15])
    return ProcStat(pid, int(fields[1]), int(fields[19]), cpu)


def read_processes(proc: str = "/proc") -> dict[int, ProcStat]:
    """Every process now: pid -> its stat (those that vanish while being read are left out)."""
    table: dict[int, ProcStat] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            continue
        table[int(entry)] = parse_pid_stat(int(entry), text)
    return table


def tree_pids(root: int, table: dict[int, ProcStat]) -> list[int]:
    """``root`` and its descendants in ``table``."""
    children: dict[int, list[int]] = {}
    for stat in table.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            out.append(pid)
            stack.extend(children.get(pid, ()))
    return out


@dataclass(frozen=True)
class CpuSnapshot:
    """One reading of the machine and of the server's tree (taken by ``snapshot``, or built from
    texts in tests)."""

    wall_s: float  # time.monotonic()
    machine: MachineTimes
    server: dict[int, ProcStat]  # the server's process tree, by pid
    children_cpu_s: float  # CPU of this process's reaped children (the clients it ran and waited for)
    own_cpu_s: float  # this process, all threads (the harness: RSS sampler, health polls)


def snapshot(server_root: int | None, proc: str = "/proc") -> CpuSnapshot:
    with open(f"{proc}/stat") as f:
        machine = parse_proc_stat(f.read())
    table = read_processes(proc)
    server = {pid: table[pid] for pid in tree_pids(server_root, table)} if server_root is not None else {}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnapshot(time.monotonic(), machine, server, children.ru_utime + children.ru_stime,
                       time.process_time())


def _tree_ticks(start: dict[int, ProcStat], end: dict[int, ProcStat]) -> int:
    """CPU ticks the tree took between two readings: end sum − start sum. A process of the start
    reading that is gone by the end (or whose pid was reused) was reaped into its parent's cutime
    with its whole lifetime, so its start ticks must come off all the same; a new one counts from 0."""
    return max(0, sum(stat.cpu_ticks for stat in end.values()) - sum(stat.cpu_ticks for stat in start.values()))


@dataclass(frozen=True)
class NeighbourCpu:
    """Shares are of the machine's capacity over the run (wall × CPUs), 0..1."""

    wall_s: float
    cpus: int
    machine_busy_s: float
    server_s: float
    client_s: float
    harness_s: float
    neighbour_s: float
    neighbour_share: float
    steal_share: float  # part of neighbour_share: the hypervisor's other guests
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def neighbour_cpu(start: CpuSnapshot, end: CpuSnapshot, cpus: int | None = None,
                  clk_tck: int | None = None) -> NeighbourCpu:
    """What other processes took between two snapshots: machine busy − server tree − client −
    harness. Clock-tick rounding (10 ms a process at 100 Hz) can take it slightly below zero: clamped."""
    cpus = cpus or os.cpu_count() or 1
    hz = clk_tck or os.sysconf("SC_CLK_TCK")
    wall = max(end.wall_s - start.wall_s, 1e-9)
    busy = (end.machine.busy_ticks - start.machine.busy_ticks) / hz
    steal = (end.machine.steal_ticks - start.machine.steal_ticks) / hz
    server = _tree_ticks(start.server, end.server) / hz
    client = end.children_cpu_s - start.children_cpu_s
    harness = end.own_cpu_s - start.own_cpu_s
    others = max(0.0, busy - server - client - harness)
    notes = []
    if start.server and not end.server:
        notes.append("the server's tree was gone at the end: its CPU is unknown and counted as a neighbour's")
    capacity = wall * cpus
    return NeighbourCpu(wall, cpus, busy, server, client, harness, others, min(1.0, others / capacity),
                        min(1.0, max(0.0, steal) / capacity), notes)
