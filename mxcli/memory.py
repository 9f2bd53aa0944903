"""Host memory: how much a process may still allocate, and a refusal before work that cannot fit.

A request that cannot fit (``make-inputs --tokens 100000000000``) must fail at once with one line
giving the figure, not after minutes in the allocator with a traceback. The estimates passed here
are lower bounds of what the work holds at its peak, so a refusal is never wrong; work that passes
may still need more (working copies) and is then limited by the allocator as before.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mxcli.errors import InputError


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
