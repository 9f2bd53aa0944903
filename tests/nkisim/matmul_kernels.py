"""A plain tiled bf16 NKI matmul for checking the cost model against measured Trn3 latencies.

``c = a @ b`` (torch.matmul's layout: a [M, K], b [K, N], c [M, N], all bf16; fp32 PSUM
accumulation, one rounding to bf16), the kind of kernel AWS's measured ``torch.matmul`` baseline
compiles to: under LNC 2 each core takes half of M. Per 512-row block of a core's M, the A
block is loaded and transposed on the PE into the stationary layout ``[128 k, K/128, 512 m]``;
then per 512-column tile of N the B tiles ``[128 k, 512 n]`` stream through four fp32 PSUM
accumulators (one per 128-row M tile); evictions alternate between VectorE and ScalarE, loads
and stores use the two hardware-DGE queues.

Any shape runs (every shape of AWS's table, `mxcli.nkisim.measured.MATMUL_BF16_TABLE`): the last
M block, M tile, K tile and N tile of a dimension that is not a multiple of 512 / 128 / 128 /
512 are partial (a K tile of fewer than 128 partitions, a stationary of fewer than 128 columns,
a moving of fewer than 512). Where the transposed A block and the next one's do not fit in SBUF
beside the B tiles (K > `RESIDENT_K`: two blocks of K/128 x 1 KiB plus two steps of B tiles pass
the 240 KiB budget near K 7000), each block's transpose goes to a private-HBM scratch
``[1024, 512]`` per 8-tile chunk of K instead (the first block's before the main loop, each later
block's spread over the previous block's first `STAGE_STEPS` N tiles, the same in every
extrapolation sample of tests/nkisim/matmul_estimate.py), and the main loop streams its
stationary tiles back one K tile at a time beside the B tiles (twice the DMA bytes of the
resident path).

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
RESIDENT_K = 6400  # the largest K whose transposed A blocks stay in SBUF (module docstring)
KCHUNK = 8  # K tiles per A-row load on the streamed path
STAGE_STEPS = 4  # the streamed path stages the next block over this many of the block's N tiles


def _span(n, step):
    """``[(start, size), ...]`` covering ``range(n)`` in steps of `step` (the last partial)."""
    out = []
    for s in range(0, n, step):
        out.append((s, min(step, n - s)))
    return out


def _load(dst, src, queue):
    nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=queue)


def _transpose_rows(at, k0, kp, mp, dst):
    """``dst[:kp, :mp] = at[:mp, k0 : k0 + kp].T`` on the PE, through PSUM."""
    tp = nl.ndarray((kp, mp), nl.bfloat16, buffer=nl.psum, name="a_tp")
    nisa.nc_transpose(dst=tp, data=at[:mp, k0 : k0 + kp])
    nisa.tensor_copy(dst=dst, src=tp)


def _load_a_block(a, r0, bm, K):
    """Rows ``[r0, r0 + bm)`` of `a` transposed on the PE: ``aT [128 k, K/128, bm]`` in SBUF."""
    ks = _span(K, P)
    aT = nl.ndarray((P, len(ks), bm), nl.bfloat16, name="aT")
    for m0, mp in _span(bm, P):
        at = nl.ndarray((mp, K), nl.bfloat16, name="a_rows")
        _load(at, a[r0 + m0 : r0 + m0 + mp, :], nisa.engine.sync)
        for kt in range(len(ks)):
            k0, kp = ks[kt]
            _transpose_rows(at, k0, kp, mp, aT[:kp, kt, m0 : m0 + mp])
    return aT


def _stage_chunk(a, r0, bm, c0, cw):
    """Rows ``[r0, r0 + bm)``, columns ``[c0, c0 + cw)`` of `a` transposed on the PE into a
    private-HBM ``[cw, bm]`` (one chunk of a staged block: the streamed path)."""
    aT = nl.ndarray((cw, bm), nl.bfloat16, buffer=nl.private_hbm, name="aT_hbm")
    for m0, mp in _span(bm, P):
        at = nl.ndarray((mp, cw), nl.bfloat16, name="a_rows")
        _load(at, a[r0 + m0 : r0 + m0 + mp, c0 : c0 + cw], nisa.engine.sync)
        for k0, kp in _span(cw, P):
            st = nl.ndarray((kp, mp), nl.bfloat16, name="aT_stage")
            _transpose_rows(at, k0, kp, mp, st)
            _load(aT[k0 : k0 + kp, m0 : m0 + mp], st, nisa.engine.scalar)
    return aT


def _load_b_tiles(b, n0, bn, K):
    """``b[:, n0 : n0 + bn]`` as tiles ``[kp k, bn n]``, one per K tile."""
    tiles = []
    for k0, kp in _span(K, P):
        bt = nl.ndarray((kp, bn), nl.bfloat16, name="b_tile")
        _load(bt, b[k0 : k0 + kp, n0 : n0 + bn], nisa.engine.sync)
        tiles.append(bt)
    return tiles


@nki.jit
def matmul_bf16(a, b):
    """c = a @ b: a [M, K], b [K, N] bf16, c [M, N] bf16 (M even under LNC 2). Software-
    pipelined: the next A block and the next B column tiles are loaded before the current
    tile's matmuls and stores are issued."""
    M, K = a.shape
    _, N = b.shape
    c = nl.ndarray((M, N), nl.bfloat16, buffer=nl.shared_hbm, name="c")
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    Mc = M // lnc
    m_lo = pid * Mc
    ks = _span(K, P)
    resident = K <= RESIDENT_K
    chunks = _span(K, KCHUNK * P)  # the streamed path's staged chunks of K
    mbs = _span(Mc, BM)
    nbs = _span(N, BN)
    steps = []
    for mb in range(len(mbs)):
        for nb in range(len(nbs)):
            steps.append((mb, nb))
    if resident:
        a_next = _load_a_block(a, m_lo + mbs[0][0], mbs[0][1], K)
        b_next = _load_b_tiles(b, 0, nbs[0][1], K)
    else:  # the first block staged whole; each later one spread over the previous one's steps
        a_next = []
        for c0, cw in chunks:
            a_next.append(_stage_chunk(a, m_lo + mbs[0][0], mbs[0][1], c0, cw))
        b_next = None
    per_step = (len(chunks) + STAGE_STEPS - 1) // STAGE_STEPS
    aT = a_next
    for i in range(len(steps)):
        mb, nb = steps[i]
        r0, bm = mbs[mb]
        n0, bn = nbs[nb]
        if nb == 0:
            aT = a_next
            if not resident and mb + 1 < len(mbs):
                a_next = []
        bts = b_next
        if resident and i + 1 < len(steps):
            mb2, nb2 = steps[i + 1]
            b_next = _load_b_tiles(b, nbs[nb2][0], nbs[nb2][1], K)
            if nb2 == 0:
                a_next = _load_a_block(a, m_lo + mbs[mb2][0], mbs[mb2][1], K)
        if not resident and mb + 1 < len(mbs):
            r2, bm2 = mbs[mb + 1]
            last = len(chunks) if nb + 1 == len(nbs) else min((nb + 1) * per_step, len(chunks))
            for j in range(nb * per_step, last):
                a_next.append(_stage_chunk(a, m_lo + r2, bm2, chunks[j][0], chunks[j][1]))
        mts = _span(bm, P)
        accs = []
        for _m0, mp in mts:
            accs.append(nl.ndarray((mp, bn), nl.float32, buffer=nl.psum, name="acc"))
        for kt in range(len(ks)):
            k0, kp = ks[kt]
            if resident:
                st, bt = aT[:kp, kt, :], bts[kt]
            else:  # one K tile of the staged block and of B, streamed
                ci = kt // KCHUNK
                kc = k0 - chunks[ci][0]
                st = nl.ndarray((kp, bm), nl.bfloat16, name="aT_tile")
                _load(st, aT[ci][kc : kc + kp, :], nisa.engine.scalar)
                bt = nl.ndarray((kp, bn), nl.bfloat16, name="b_tile")
                _load(bt, b[k0 : k0 + kp, n0 : n0 + bn], nisa.engine.sync)
            for mt in range(len(mts)):
                m0, mp = mts[mt]
                nisa.nc_matmul(
                    dst=accs[mt], stationary=st[:kp, m0 : m0 + mp], moving=bt, accumulate=kt > 0
                )  # fmt: skip
        for mt in range(len(mts)):
            m0, mp = mts[mt]
            ct = nl.ndarray((mp, bn), nl.bfloat16, name="c_tile")
            if mt % 2 == 1:
                nisa.tensor_copy(dst=ct, src=accs[mt], engine=nisa.engine.scalar)
            else:
                nisa.tensor_copy(dst=ct, src=accs[mt])
            rows = m_lo + r0 + m0
            _load(c[rows : rows + mp, n0 : n0 + bn], ct, nisa.engine.scalar)
    return c
