"""The machine's own figures, measured: memory read bandwidth and matmul throughput. ``bench roofline``
bounds decode steps with them; ``bench calibrate`` records them in its profile."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

GB = 1e9  # bandwidth and sizes in the report are decimal (GB/s, MB), as hardware specs quote them
_TILE = 1 << 20  # elements of the random tile the bandwidth buffer is built from


@dataclass
class BandwidthResult:
    gb_per_s: float  # the best method's median
    method: str
    by_method: dict[str, float]  # median GB/s of each method
    buffer_bytes: int
    repeats: int




def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                    clock: Callable[[], float] = time.perf_counter) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def _filled_buffer(numel: int, seed: int) -> torch.Tensor:
    """float32 buffer of real data on every page: a random tile plus the row index, so no page is the
    kernel's shared zero page (torch.empty's untouched pages read from cache) and no two pages are
    identical (a host that merges equal pages could otherwise shrink the buffer into its cache)."""
    generator = torch.Generator().manual_seed(seed)
    tile = torch.rand(_TILE, generator=generator)
    buf = torch.empty(numel)
    rows = numel // _TILE
    if rows:
        offsets = torch.arange(rows, dtype=torch.float32).unsqueeze(1)
        torch.add(tile, offsets, out=buf[: rows * _TILE].view(rows, _TILE))
    buf[rows * _TILE :] = tile[: numel - rows * _TILE]
    return buf


def measure_bandwidth(num_bytes: int, repeats: int = 5, seed: int = 0) -> BandwidthResult:
    """Memory read bandwidth over a float32 buffer of ``num_bytes``, with torch's own threads. Take
    it much larger than the last-level cache, or the figure is the cache's, not memory's."""
    numel = num_bytes // 8 * 2  # even, so it splits into two halves for dot
    if numel < 2:
        raise ValueError("bandwidth buffer must hold at least 8 bytes")
    buf = _filled_buffer(numel, seed)
    half = numel // 2
    nbytes = numel * 4
    by_method: dict[str, float] = {}
    # sum: one read of every byte. dot of the two halves: likewise, through BLAS.
    by_method["sum"] = nbytes / _median_seconds(lambda: buf.sum(), repeats) / GB
    by_method["dot"] = nbytes / _median_seconds(lambda: torch.dot(buf[:half], buf[half:]), repeats) / GB
    dst = torch.zeros_like(buf)  # zeros_like writes every page, so the first timed copy faults nothing in
    # copy: counts the read and the write (a write-allocate cache reads the target too, uncounted).
    by_method["copy"] = 2 * nbytes / _median_seconds(lambda: dst.copy_(buf), repeats) / GB
    del buf, dst
    gc.collect()
    method = max(by_method, key=by_method.__getitem__)
    return BandwidthResult(by_method[method], method, by_method, nbytes, repeats)


def measure_matmul_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, seed: int = 0,
                          clock: Callable[[], float] = time.perf_counter) -> float:
    """Median GFLOP/s of an n x n x n ``torch.mm`` (warm, into a preallocated output). ``clock``:
    ``time.thread_time`` with one torch thread counts only this thread's CPU time (a shared machine)."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(a, b, out=out), repeats, warmup=2, clock=clock)
    return 2 * n**3 / seconds / GB
