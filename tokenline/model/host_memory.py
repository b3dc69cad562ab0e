"""How the model's process holds host memory: glibc's malloc, tuned once for a forward pass's
pattern of large short-lived activations, and trimmed once after loading.

By default glibc serves a large allocation by ``mmap`` and unmaps it when freed, and hands the top
of its heap back to the OS whenever enough of it is free; either way the next step's activations
fault the same pages in again. On the default model at float32 a 1024-token prefill step took
50,000-160,000 minor faults this way (~1.5 us each here, 5-15 % of the step), a count that moved
with the process's allocation history: the same step ran at different speeds in a server and in
the calibration that priced it.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("tokenline.model")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (4 MiB x sizeof(long)): a step's activations
# up to this size come from the heap and are reused, larger ones are still mapped per use.
MMAP_THRESHOLD = 32 << 20
# Free memory the heap keeps on top rather than return: more than a step's activations.
TRIM_THRESHOLD = 1 << 30
# Set by the user (GLIBC_TUNABLES, the MALLOC_*_ variables) or another allocator preloaded: theirs.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - glibc, not another libc
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Make glibc keep freed activations for reuse (fixed mmap and trim thresholds, which also stop
    its dynamic ones from moving). The loader calls it before a CPU model's first allocation; again
    changes nothing. False where it did nothing:
    no glibc, or malloc tuned by the user or replaced through ``LD_PRELOAD``."""
    if "malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(k in os.environ for k in _USER_SETTINGS):
        return False
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # tcmalloc, jemalloc: their own policies
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("mallopt refused the mmap/trim thresholds: activations will page-fault each step")
    return ok


def return_freed_memory() -> None:
    """Give the heap pages freed while loading (checkpoint buffers, plain weights replaced by packed
    ones) back to the OS, whatever the trim threshold. A no-op without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocated_bytes() -> int | None:
    """Bytes malloc has handed out and not taken back, over every thread's arena and the chunks it
    mapped (glibc's ``mallinfo2``): what a piece of work allocated is the change across it. None
    without glibc 2.33 or later."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)
