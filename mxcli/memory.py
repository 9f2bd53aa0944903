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
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_available() -> int | None:
    """What the cgroup v2 memory limit still allows (None without a limit)."""
    with contextlib.suppress(OSError, ValueError):
        root = Path("/sys/fs/cgroup")
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    return None


def available_bytes() -> int | None:
    """Memory this process may still allocate: the least of MemAvailable and what the cgroup
    limit leaves; the physical memory where neither is known; None when nothing is known."""
    known = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
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
