"""Small NKI kernels written against the real API (``import nki`` ...).

Imported only while the interpreter's modules are installed (see test_kernels.py); the same
source runs on the real ``nki.simulate``.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki.isa.constants import oob_mode

P = 128


@nki.jit
def tiled_matmul(a, b):
    """c = a @ b: a [M, K] bf16, b [K, N] bf16, c [M, N] fp32 (M, K multiples of 128, N of 512)."""
    M, K = a.shape
    _, N = b.shape
    c = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm, name="c")
    nl.shared_identity_matrix(P, dtype=nl.bfloat16)  # allocated and unused (capacity)
    for m0 in nl.affine_range(M // P):
        # stationary operands: a tile transposed on the PE -> [K-tile, M-tile]
        aT = nl.ndarray((P, K // P, P), nl.bfloat16, name="aT")
        for k0 in nl.affine_range(K // P):
            at = nl.ndarray((P, P), nl.bfloat16)
            nisa.dma_copy(dst=at, src=a[m0 * P : (m0 + 1) * P, k0 * P : (k0 + 1) * P])
            tp = nl.ndarray((P, P), nl.bfloat16, buffer=nl.psum)
            nisa.nc_transpose(dst=tp, data=at)
            nisa.tensor_copy(dst=aT[:, k0, :], src=tp)
        for n0 in nl.affine_range(N // 512):
            acc = nl.ndarray((P, 512), nl.float32, buffer=nl.psum)
            for k0 in nl.sequential_range(K // P):
                bt = nl.ndarray((P, 512), nl.bfloat16)
                nisa.dma_copy(dst=bt, src=b[k0 * P : (k0 + 1) * P, n0 * 512 : (n0 + 1) * 512])
                nisa.nc_matmul(dst=acc, stationary=aT[:, k0, :], moving=bt, accumulate=(k0 > 0))
            ct = nl.ndarray((P, 512), nl.float32)
            nisa.tensor_copy(dst=ct, src=acc, engine=nisa.scalar_engine)
            nisa.dma_copy(dst=c[m0 * P : (m0 + 1) * P, n0 * 512 : (n0 + 1) * 512], src=ct)
    return c


@nki.jit
def rmsnorm(x, gamma, eps):
    """y = x * rsqrt(mean(x^2) + eps) * gamma; x [T, H] bf16 (T multiple of 128), gamma [H]."""
    T, H = x.shape
    HB = 512 if H % 512 == 0 else H
    y = nl.ndarray((T, H), nl.bfloat16, buffer=nl.shared_hbm, name="y")
    g = nl.ndarray((P, H), nl.float32, name="gamma")
    nisa.dma_copy(dst=g, src=gamma.ap([[0, P], [1, H]], offset=0))  # stride-0 broadcast read
    eps_t = nl.ndarray((P, 1), nl.float32)
    nisa.memset(eps_t, eps)
    for t in nl.range(T // P):
        xt = nl.ndarray((P, H), nl.float32, name="x")
        nisa.dma_copy(dst=xt, src=x[t * P : (t + 1) * P, :])  # bf16 -> fp32 cast
        stats = nl.ndarray((P, 2), nl.float32)
        sq = nl.ndarray((P, HB), nl.float32)
        nb = H // HB
        for b in range(nb):
            nisa.activation(
                dst=sq,
                op=nl.square,
                data=xt[:, b * HB : (b + 1) * HB],
                reduce_op=nl.add,
                reduce_cmd=nisa.reduce_cmd.reset_reduce if b == 0 else nisa.reduce_cmd.reduce,
                reduce_res=stats[:, 0:1] if b == nb - 1 else None,
            )
        nisa.activation(
            dst=stats[:, 1:2], op=nl.rsqrt, data=stats[:, 0:1], bias=eps_t, scale=1.0 / H
        )
        yt = nl.ndarray((P, H), nl.bfloat16)
        nisa.scalar_tensor_tensor(
            dst=yt, data=xt, op0=nl.multiply, operand0=stats[:, 1:2], op1=nl.multiply, operand1=g
        )
        nisa.dma_copy(dst=y[t * P : (t + 1) * P, :], src=yt)
    return y


@nki.jit
def gather_scatter_add(table, x, idx):
    """table[idx[t]] += x[t] in place, tile by tile; idx == -1 rows are skipped (padding).

    Within one 128-row tile indices must be unique (a gather + add + scatter races otherwise).
    """
    T, H = x.shape
    for t in nl.sequential_range(T // P):
        it = nl.ndarray((P, 1), nl.int32)
        nisa.dma_copy(dst=it, src=idx[t * P : (t + 1) * P, :])
        rows = nl.ndarray((P, H), nl.float32)
        nisa.memset(rows, 0.0)
        view = table.ap([[H, P], [1, H]], offset=0, vector_offset=it, indirect_dim=0)
        nisa.dma_copy(dst=rows, src=view, oob_mode=oob_mode.skip)
        xt = nl.ndarray((P, H), nl.float32)
        nisa.dma_copy(dst=xt, src=x[t * P : (t + 1) * P, :])
        nisa.tensor_tensor(dst=rows, data1=rows, data2=xt, op=nl.add)
        nisa.dma_copy(dst=view, src=rows, oob_mode=oob_mode.skip)


@nki.jit
def scatter_add_dma_compute(table, x, idx):
    """The same update through dma_compute's read-modify-write scatter."""
    T, H = x.shape
    for t in nl.sequential_range(T // P):
        it = nl.ndarray((P, 1), nl.int32)
        nisa.dma_copy(dst=it, src=idx[t * P : (t + 1) * P, :])
        xt = nl.ndarray((P, H), nl.float32)
        nisa.dma_copy(dst=xt, src=x[t * P : (t + 1) * P, :])
        view = table.ap([[H, P], [1, H]], offset=0, vector_offset=it, indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, xt], reduce_op=nl.add, oob_mode=oob_mode.skip)
