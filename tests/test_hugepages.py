"""Large fresh outputs are advised as huge pages (`mxcli.memory.empty`, issue #21 part 3).

The advice is a hint: these tests read what the kernel did (``/proc/self/smaps``) and skip where
the machine has transparent huge pages off or could not find a free huge page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxcli import memory
from mxcli.mx import dequantize_mx, quantize_mx

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def _anon_huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings overlapping `t`'s memory (advice splits a mapping)."""
    a0 = t.data_ptr()
    a1 = a0 + t.numel() * t.element_size()
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < a1 and a0 < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


needs_thp = pytest.mark.skipif(
    _thp_mode() in (None, "never"), reason="transparent huge pages are off here"
)


def _fresh(code: str) -> str:
    """Run `code` in a fresh interpreter: a long test session may hand a buffer back from an
    already-faulted heap, where no advice applies (and none is needed)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@needs_thp
def test_large_output_is_backed_by_huge_pages() -> None:
    before = _fallbacks()
    code = (
        "import torch\n"
        "from mxcli import memory\n"
        "from tests.test_hugepages import _anon_huge_bytes\n"
        "t = memory.empty((32 << 20,), torch.uint8); t.fill_(7)\n"
        "assert int(t[0]) == 7 and int(t[-1]) == 7\n"
        "print(_anon_huge_bytes(t))\n"
    )
    got = int(_fresh(code))
    if got == 0 and _fallbacks() > before:
        pytest.skip("the kernel had no free huge page")
    # the 2 MiB-aligned interior of 32 MiB: at least 30 MiB
    assert got >= 30 << 20


@needs_thp
def test_plain_allocation_is_not_advised_in_madvise_mode() -> None:
    """The oracle that makes the test above mean something: under ``madvise`` a plain buffer
    gets 4 KiB pages (unless it landed in an advised region a previous test freed)."""
    if _thp_mode() != "madvise":
        pytest.skip("THP mode is not madvise")
    code = (
        "import torch\n"
        "from tests.test_hugepages import _anon_huge_bytes\n"
        "t = torch.empty(32 << 20, dtype=torch.uint8); t.fill_(7)\n"
        "print(_anon_huge_bytes(t))\n"
    )
    assert int(_fresh(code)) == 0


def test_small_and_non_cpu_buffers_are_left_alone() -> None:
    assert not memory.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))
    assert not memory.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8, device="meta"))


def test_turned_off_by_environment() -> None:
    code = (
        "import torch\n"
        "from mxcli import memory\n"
        "print(memory.advise_huge_pages(torch.empty(64 << 20, dtype=torch.uint8)))\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {"MXCLI_HUGEPAGES": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@needs_thp
def test_quantize_outputs_are_advised_and_bytes_unchanged() -> None:
    torch.manual_seed(0)
    x = (torch.randn(4096, 4096) * 0.5).to(torch.bfloat16)  # codes: 16 MiB
    codes, scales = quantize_mx(x)
    if _thp_mode() == "madvise":
        code = (
            "import torch\n"
            "from mxcli.mx import quantize_mx\n"
            "from tests.test_hugepages import _anon_huge_bytes\n"
            "codes, _ = quantize_mx(torch.ones(4096, 4096, dtype=torch.bfloat16))\n"
            "print(_anon_huge_bytes(codes))\n"
        )
        before = _fallbacks()
        got = int(_fresh(code))
        assert got >= 14 << 20 or _fallbacks() > before
    # the same bytes as a small call (not advised), and the values round-trip
    ref_codes, ref_scales = quantize_mx(x[:8].clone())
    assert torch.equal(codes[:8], ref_codes) and torch.equal(scales[:8], ref_scales)
    back = dequantize_mx(codes[:8], scales[:8])
    assert torch.isfinite(back).all() and back.abs().max() > 0
