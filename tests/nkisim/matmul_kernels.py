"""A plain tiled bf16 NKI matmul for checking the cost model against measured Trn3 latencies.

``c = a @ b`` (torch.matmul's layout: a [M, K], b [K, N], c [M, N], all bf16; fp32 PSUM
accumulation, one rounding to bf16), the kind of kernel AWS's measured ``torch.matmul`` baseline
compiles to: under LNC 2 each core takes half of M. Per 512-row block of a core's M, the A
block is loaded whole and transposed on the PE into the stationary layout ``[128 k, K/128,
512 m]``; then per 512-column tile of N the B tiles ``[128 k, 512 n]`` stream through four fp32
PSUM accumulators (one per 128-row M tile); evictions alternate between VectorE and ScalarE,
loads and stores use the two hardware-DGE queues.

Imported only while the interpreter's modules are installed (see test_cost_calibration.py);
the same source runs on the real ``nki.simulate``.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

P = 128
BM = 512  # M rows per stationary block (4 PE tiles)
BN = 512  # N columns per PSUM accumulator (one fp32 bank)


def _load_a_block(a, r0, K):
    """Rows ``[r0, r0 + 512)`` of `a` transposed on the PE: ``aT [128 k, K/128, 512 m]``."""
    KT = K // P
    aT = nl.ndarray((P, KT, BM), nl.bfloat16, name="aT")
    for mt in range(BM // P):
        at = nl.ndarray((P, K), nl.bfloat16, name="a_rows")
        nisa.dma_copy(
            dst=at, src=a[r0 + mt * P : r0 + (mt + 1) * P, :],
            dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync,
        )  # fmt: skip
        for kt in range(KT):
            tp = nl.ndarray((P, P), nl.bfloat16, buffer=nl.psum, name="a_tp")
            nisa.nc_transpose(dst=tp, data=at[:, kt * P : (kt + 1) * P])
            nisa.tensor_copy(dst=aT[:, kt, mt * P : (mt + 1) * P], src=tp)
    return aT


def _load_b_tiles(b, n0, K):
    """``b[:, n0 : n0 + 512]`` as K/128 tiles ``[128 k, 512 n]``."""
    tiles = []
    for kt in range(K // P):
        bt = nl.ndarray((P, BN), nl.bfloat16, name="b_tile")
        nisa.dma_copy(
            dst=bt, src=b[kt * P : (kt + 1) * P, n0 : n0 + BN],
            dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync,
        )  # fmt: skip
        tiles.append(bt)
    return tiles


@nki.jit
def matmul_bf16(a, b):
    """c = a @ b: a [M, K], b [K, N] bf16, c [M, N] bf16 (M a multiple of 512 per core, K of
    128, N of 512). Software-pipelined: the next A block and the next B column tiles are
    loaded before the current tile's matmuls and stores are issued."""
    M, K = a.shape
    _, N = b.shape
    c = nl.ndarray((M, N), nl.bfloat16, buffer=nl.shared_hbm, name="c")
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    Mc = M // lnc
    m_lo = pid * Mc
    KT = K // P
    MT = BM // P
    nmb = Mc // BM
    nnb = N // BN
    steps = []
    for mb in range(nmb):
        for nb in range(nnb):
            steps.append((mb, nb))
    a_next = _load_a_block(a, m_lo, K)
    b_next = _load_b_tiles(b, 0, K)
    aT = a_next
    for i in range(len(steps)):
        mb, nb = steps[i]
        if nb == 0:
            aT = a_next
        bts = b_next
        if i + 1 < len(steps):
            mb2, nb2 = steps[i + 1]
            b_next = _load_b_tiles(b, nb2 * BN, K)
            if nb2 == 0:
                a_next = _load_a_block(a, m_lo + mb2 * BM, K)
        accs = []
        for _mt in range(MT):
            accs.append(nl.ndarray((P, BN), nl.float32, buffer=nl.psum, name="acc"))
        for kt in range(KT):
            for mt in range(MT):
                nisa.nc_matmul(
                    dst=accs[mt], stationary=aT[:, kt, mt * P : (mt + 1) * P], moving=bts[kt],
                    accumulate=kt > 0,
                )  # fmt: skip
        r0 = m_lo + mb * BM
        for mt in range(MT):
            ct = nl.ndarray((P, BN), nl.bfloat16, name="c_tile")
            if mt % 2 == 1:
                nisa.tensor_copy(dst=ct, src=accs[mt], engine=nisa.engine.scalar)
            else:
                nisa.tensor_copy(dst=ct, src=accs[mt])
            rows = r0 + mt * P
            nisa.dma_copy(
                dst=c[rows : rows + P, nb * BN : (nb + 1) * BN], src=ct,
                dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar,
            )  # fmt: skip
    return c
