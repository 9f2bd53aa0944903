"""With one torch thread the fused MX kernel runs its serial twin (no numba thread pool is
started, so no OpenMP thread spins beside prep-weights' writer): same bytes as the parallel
kernel and the pure-torch path."""

from __future__ import annotations

import pytest
import torch

from mxcli.mx import fake_quantize_mx, quantize_mx


@pytest.mark.parametrize("scheme", ["1x32", "wrapx"])
def test_serial_kernel_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 896, generator=g) * 3).to(torch.bfloat16)
    x[3, 7], x[5, 100], x[9, 640] = float("nan"), float("inf"), -float("inf")
    before = torch.get_num_threads()
    results = {}
    try:
        for label, threads, fused in (("serial", 1, "1"), ("parallel", 2, "1"), ("torch", 1, "0")):
            monkeypatch.setenv("MXCLI_FUSED", fused)
            torch.set_num_threads(threads)
            codes, scales = quantize_mx(x, axis=-1, scheme=scheme)
            deq = fake_quantize_mx(x, axis=-1, scheme=scheme)
            results[label] = (codes, scales, deq.view(torch.int32))
    finally:
        torch.set_num_threads(before)
    for label in ("parallel", "torch"):
        for a, b in zip(results["serial"], results[label], strict=True):
            assert torch.equal(a, b), label
