"""Host memory: how much a process may still allocate, a refusal before work that cannot fit, and
large output buffers backed by huge pages.

A request that cannot fit (``make-inputs --tokens 100000000000``) must fail at once with one line
giving the figure, not after minutes in the allocator with a traceback. The estimates passed here
are lower bounds of what the work holds at its peak, so a refusal is never wrong; work that passes
may still need more (working copies) and is then limited by the allocator as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mxcli.errors import InputError

if TYPE_CHECKING:
    import torch


def _meminfo_available() -> int | None:
    """MemAvailable (free memory plus what the kernel can reclaim, page cache included) plus
    the free swap."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
        if "MemAvailable" in info:
            return info["MemAvailable"] + info.get("SwapFree", 0)
    return None


def _cgroup_limit() -> int | None:
    """The cgroup v2 memory limit (None without one). Not less what the cgroup holds now: that
    counts reclaimable page cache, and a refusal must never be wrong."""
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            return int(limit)
    return None


def available_bytes() -> int | None:
    """Memory this process may allocate at most: the lesser of MemAvailable + free swap and the
    cgroup limit; the physical memory where neither is known; None when nothing is known."""
    known = [v for v in (_meminfo_available(), _cgroup_limit()) if v is not None]
    if known:
        return min(known)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    return None


def human_bytes(n: float) -> str:
    """``1.23 GB`` style (decimal units, as `df -H` and the plan's byte counts)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_fits(what: str, need: int) -> None:
    """Refuse (`InputError`) work whose lower-bound memory estimate `need` exceeds what is
    available; `what` names the request (the flag and its value)."""
    have = available_bytes()
    if have is not None and need > have:
        raise InputError(
            f"{what} need at least {human_bytes(need)} of memory, {human_bytes(have)} available"
        )


# Huge pages for large fresh outputs. A fresh CPU buffer over glibc's mmap threshold (at most
# 32 MiB) comes from a new mapping on every call, and its first write faults it in 4 KiB at a time:
# measured on a 2-core EPYC (Zen 4), quantizing a [16, 2048, 1536] bf16 expert stack ran at
# 2.5 GB/s into fresh outputs and 5.5 GB/s into faulted ones, the difference being ~12k page
# faults. Advising the buffer's 2 MiB-aligned interior as MADV_HUGEPAGE (what torch does for
# every allocation under THP_MEM_ALLOC_ENABLE=1, which must be set before torch starts) faults it
# in 2 MiB at a time: 4.4 GB/s. Linux only; a no-op where THP is off ("never"), and a hint the
# kernel may ignore, so the contents and results never depend on it.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_MIN_BYTES = 8 << 20  # smaller buffers usually come back from the heap already faulted
_madvise: Any = None


def check_input_memory(what: str, need: int) -> None:
    """Refuse sizes that cannot fit in memory before anything is drawn (`check_fits`)."""
    check_fits(f"tokens: {what}", need)


def _libc_madvise() -> Any:
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux") and os.environ.get("MXCLI_HUGEPAGES", "1") != "0":
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
    return _madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask the kernel to back the 2 MiB-aligned interior of CPU tensor `t`'s memory with huge
    pages (``MADV_HUGEPAGE``); True when the advice was given. Call it before the first write.
    ``MXCLI_HUGEPAGES=0`` turns it off."""
    if t.device.type != "cpu":
        return False
    n = t.numel() * t.element_size()
    fn = _libc_madvise()
    if not fn or n < HUGE_MIN_BYTES:
        return False
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + n) // HUGE_PAGE * HUGE_PAGE
    return end > start and fn(start, end - start, _MADV_HUGEPAGE) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """``torch.empty`` for an output that is about to be written in full: large CPU buffers are
    advised as huge pages (`advise_huge_pages`)."""
    import torch

    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t
