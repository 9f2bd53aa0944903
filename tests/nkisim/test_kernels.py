"""Small NKI kernels (written with ``import nki``) run on the interpreter and match torch."""

from __future__ import annotations

import importlib
import time

import numpy as np
import pytest
import torch

import mxcli.nkisim as nkisim


@pytest.fixture(scope="module")
def kernels():
    if nkisim.real_nki_available():
        pytest.skip("a real nki is installed: these kernels would bind to it")
    with nkisim.installed():
        import nki

        mod = importlib.import_module("tests.nkisim.nki_kernels")
        yield nki, mod


def test_example_kernels_pass_the_front_end_check(kernels) -> None:
    _, k = kernels
    for kern in (k.tiled_matmul, k.rmsnorm, k.gather_scatter_add, k.scatter_add_dma_compute):
        assert nkisim.check_frontend(kern) == (), kern


def test_tiled_matmul_with_psum_accumulation(kernels) -> None:
    nki, k = kernels
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 384, generator=g).to(torch.bfloat16)
    b = torch.randn(384, 1024, generator=g).to(torch.bfloat16)
    c = nki.simulate(k.tiled_matmul)(a, b)  # torch in -> torch out
    assert isinstance(c, torch.Tensor) and c.dtype == torch.float32
    ref = a.float() @ b.float()
    torch.testing.assert_close(c, ref, rtol=1e-5, atol=1e-4)  # fp32 accumulation order only


def test_rmsnorm_kernel_matches_torch(kernels) -> None:
    nki, k = kernels
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(256, 1024, generator=g) * 3).to(torch.bfloat16)
    gamma = torch.randn(1024, generator=g)
    t0 = time.perf_counter()
    sk = nkisim.simulate(k.rmsnorm)
    y = sk(x, gamma, 1e-6)
    elapsed = time.perf_counter() - t0
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma).to(torch.bfloat16)
    # fp32 sum order and the exact rsqrt may flip a bf16 rounding: at most 1 ulp
    diff = (y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)
    assert diff.max() <= 2**-7 and (y == ref).float().mean() > 0.99
    assert elapsed < 5.0, f"T=256, H=1024 RMSNorm took {elapsed:.2f}s"
    assert sk.report.counters.instructions["scalar"] == 2 * (2 + 1)


def test_gather_scatter_add_kernels_match_torch(kernels) -> None:
    nki, k = kernels
    rng = np.random.default_rng(2)
    V, H, T = 300, 64, 256
    table = rng.standard_normal((V, H)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.concatenate([rng.permutation(V)[:128], rng.permutation(V)[:128]]).astype(np.int32)
    idx[::9] = -1
    idx = idx.reshape(T, 1)
    ref = torch.from_numpy(table.copy())
    keep = idx[:, 0] >= 0
    ref.index_add_(0, torch.from_numpy(idx[keep, 0]).long(), torch.from_numpy(x[keep]))
    t1 = table.copy()
    nki.simulate(k.gather_scatter_add)(t1, x, idx)
    torch.testing.assert_close(torch.from_numpy(t1), ref, rtol=1e-6, atol=1e-6)
    t2 = table.copy()
    nki.simulate(k.scatter_add_dma_compute)(t2, x, idx)
    torch.testing.assert_close(torch.from_numpy(t2), ref, rtol=1e-6, atol=1e-6)
