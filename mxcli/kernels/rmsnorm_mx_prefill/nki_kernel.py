"""NKI kernel of ``rmsnorm_mx_prefill`` for Trn3 (NeuronCore-v4), NKI 0.6 API.

Fused RMSNorm [T, H] + MXFP8 quantization (+ router top-K / NOAUX_TC) for prefill. The numerics
are those of the torch reference beside this file (`reference.py`, prefill spec §3-§5); this
module is the same computation written as NKI instructions, and runs unchanged on the real
``nki.simulate``, on mxcli's interpreter (`mxcli.nkisim`) and on Trainium.

Import this module only with an ``nki`` package importable: the real one, or mxcli's interpreter
activated by `mxcli.kernels.nki_runtime` (never import it at package import time).

Dataflow of one tile of ``n <= 128`` tokens (prefill spec §3, §4, §5):

1. token-major load ``x [n, H]`` (partition = token); with ``residual`` the DMA adds the two
   inputs and writes the sum in the input dtype (``dma_compute``, §3.1);
2. sum of squares per token on the Scalar engine, one ``activation(square)`` per 512-column
   block chained through the accumulator register in block order (§3.2; the squares go to a
   bf16 junk tile, the accumulator sums them in fp32), then ``inv_rms = rsqrt(ss * (1/N) + eps)``;
3. the "fp32-packed transpose" into the swizzled layout ``[128 p, NB, n, 4 q]`` (element
   ``h = h512*512 + 4p + q``): bf16 pairs are read as fp32 words, even and odd words transposed
   by the PE into the two halves of each x4 lane quad (bit-exact), copied to SBUF as fp32 words
   by the Scalar engine;
4. ``inv_rms`` broadcast to all 128 partitions by a PE transpose of its stride-0 free broadcast
   (a bit-exact data move, so a NaN stays in its token; see `_scale_inv`), rounded to cd;
5. the three-rounding chain ``a = R_cd(x*gamma)``, ``y = R_cd(a * R_cd(inv_rms))`` (§3.3);
6. ``quantize_mx`` per H512 block: one scale per 8 partitions x 4 lanes = 32 contiguous natural
   elements; scales land in quadrant layout, shifted by ``(h512 % 4)*4`` rows when folded (§4.2);
7. codes transposed back as fp32 words (natural H order, §4.1) and scale bytes transposed as
   float8_e5m2 (1-byte bit-exact PE transpose); both DMA'd into the packed row;
8. router: ``raw = sum over (h512, q) of a[:, h512, :, q].T @ W[h512, q]`` accumulated in one
   PSUM tile (§5.1), ``logits = raw * inv_rms (+ bias)``, ``max8`` + ``nc_find_index8`` top-K,
   sigmoid / softmax over K with dense bf16 affinities (§5.2), or NOAUX_TC group selection in
   fp32 (§5.3; its one-hot compare on GpSimd); affinities either to their own tensor or into
   the packed row tail (§4.3).

Tiles are software-pipelined (the main loop's comment): the engines run their queues in order,
so the issue order interleaves neighbouring tiles' work. `mxcli profile prefill` (the per-engine
cost model) chose it: at DeepSeek-V3 shapes (T 2048, LNC 2) the schedule went from 323 us (2.06x
the Vector bound, 157 us) to 128 us (1.28x the bound, 101 us).

LNC: with ``kernel[2]`` the two programs split the tokens (core 0 the first ``ceil(T/2)``,
prefill spec §7); tokens are independent, so results do not depend on it. The programs write
disjoint rows of the shared outputs and never read what the other wrote: no tensor is handed
over between the cores, so no ``core_barrier`` is needed.

Front end (NKI 0.6 meta-programming subset, nki_python_subset.md): the launcher
(`nki_backend`) validates the arguments (`contract.validate`, prefill spec §2.3) and plans the
launch (`PrefillKernelConfig`) before tracing, once; the kernel receives tensors and that
NKIObject config (ints, floats, bools, a basic enum, ``nki`` dtypes) and only re-asserts what
its own addressing relies on. Helpers are plain functions over tensors (inlined at each call).

Bytes the hardware kernel leaves unwritten (scale-region holes, the affinity-row pad, spec §4.2,
§4.3) are written as 0x00 here, the reference's default (`HoleFill.ZERO`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nki
import nki.isa as nisa
import nki.language as nl

from mxcli.kernels.rmsnorm_mx_prefill.kernel_types import RouterMode

P = 128  # partitions (nl.tile_size.pmax)
TOK_TILE = 128  # tokens per tile: the token-major tiles put tokens on partitions
BLOCK = 512  # one H512 block = 128 partitions x 4 lanes
MAX8 = 8  # candidates of max8 / nc_find_index8
FP32_LOWEST = -3.4028234663852886e38  # §5.2: pads of short logit rows never win
NOAUX_SENTINEL = 30000.0  # §5.3: finite "minus infinity" of group masking
NOAUX_DEN_EPS = 1e-20  # §5.3: added to the selected-score sum
T_BLOCKS_PER_PSUM = 4  # swizzle transposes: 4 blocks x n tokens x 2 fp32 words = 2 PSUM banks
SCALE_PACKS_PER_PSUM = 8  # scale transposes: 8 x 128 x 2 bytes = one PSUM bank


@dataclass(frozen=True)
class PrefillKernelConfig(nl.NKIObject):
    """The launch plan, computed by the launcher before tracing (`nki_backend.kernel_config`).

    Shapes and row geometry (prefill spec §2.4) are those of validated arguments; ``E == 0``
    means no router. Dtypes are ``nki`` dtypes.
    """

    T: int  # tokens (B * S)
    H: int  # hidden size (multiple of 512)
    NB: int  # H512 blocks
    N: int  # unpadded hidden size: the RMS divisor (§3.2)
    eps: float
    E: int  # experts, 0 without a router
    K: int  # top-K
    router_mode: RouterMode
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    compute_dtype: Any  # cd (§1): the router dtype with a router, else the hidden dtype
    qmx_dtype: Any  # x4 output dtype of quantize_mx
    pack_scales: bool
    n_packs: int  # 128-byte scale blocks per row
    pack_affinities: bool  # effective (False without a router)
    aff_width: int  # bytes per packed affinity: 2 (bf16) or 4 (fp32, NOAUX_TC)
    affin_off: int  # byte offset of the affinity tail
    row: int  # bytes per packed row (row_region)
    emit_norm_bf16: bool
    hidden_interleaved: bool


def _flat_1d(t: Any, n: int) -> Any:
    """An HBM [n] or [1, n] tensor as a 1-D view."""
    return t.reshape((n,))


def rmsnorm_mx_prefill_nki(
    hidden_states: Any,
    gamma: Any,
    cfg: PrefillKernelConfig,
    router_weights: Any = None,
    router_bias: Any = None,
    residual: Any = None,
) -> list[Any]:
    """Fused RMSNorm + MXFP8 quantization (+ router top-K) for prefill, Trn3 only.

    ``hidden_states`` [B, S, H] bf16/fp16 HBM, ``gamma`` [H] or [1, H], ``router_weights``
    [H, E] bf16/fp16 arranged for the router mode (§6.1), ``router_bias`` [E] or [1, E],
    ``residual`` [B, S, H]; ``cfg`` the launch plan of validated arguments (the launcher,
    `nki_backend`, runs `contract.validate`). Returns the HBM outputs of prefill spec §2.2, in
    order: the packed rows ``[T, row_region]`` uint8 (codes, scales, optional affinity tail),
    ``expert_index`` [T, K] int32 (SIGMOID/SOFTMAX), ``expert_affinities`` [T, E] bf16 / fp32
    (router without ``pack_affinities``), ``output_residual`` [T, H], ``norm_bf16`` [T, H].
    """
    T, H, NB, E, K = cfg.T, cfg.H, cfg.NB, cfg.E, cfg.K
    # what the addressing below relies on: the plan belongs to these tensors
    assert hidden_states.shape[0] * hidden_states.shape[1] == T, "cfg.T != B * S"
    assert hidden_states.shape[2] == H and NB * BLOCK == H, "cfg.H != hidden_states H"
    assert (router_weights is not None) == (E > 0), "cfg.E and router_weights disagree"
    noaux = cfg.router_mode == RouterMode.NOAUX_TC
    if noaux:
        assert router_bias is not None, "NOAUX_TC needs router_bias"

    # --- outputs (§2.2), in shared HBM (visible to both LNC programs) ---
    # raw bytes (uint8): MX data crosses to torch as uint8; the backend views it as fp8
    out_packed = nl.ndarray((T, cfg.row), dtype=nl.uint8, buffer=nl.shared_hbm, name="packed")
    out_index = None
    out_aff = None
    if E > 0 and not noaux:
        out_index = nl.ndarray((T, K), dtype=nl.int32, buffer=nl.shared_hbm, name="expert_index")
    if E > 0 and not cfg.pack_affinities:
        aff_dt = nl.float32 if noaux else nl.bfloat16
        out_aff = nl.ndarray((T, E), dtype=aff_dt, buffer=nl.shared_hbm, name="expert_affinities")
    out_res = None
    if residual is not None:
        out_res = nl.ndarray(
            (T, H), dtype=residual.dtype, buffer=nl.shared_hbm, name="output_residual"
        )
    out_norm = None
    if cfg.emit_norm_bf16:
        out_norm = nl.ndarray((T, H), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="norm_bf16")

    # --- this program's tokens (LNC split, prefill spec §7) ---
    n_prog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    per_core = (T + n_prog - 1) // n_prog
    tok_begin = min(T, pid * per_core)
    tok_end = min(T, tok_begin + per_core)

    hs2 = hidden_states.reshape((T, H))
    res2 = None
    if residual is not None:
        res2 = residual.reshape((T, H))
    gamma1 = _flat_1d(gamma, H)

    # --- per-program constants ---
    # gamma in the swizzled layout [128 p, NB, 4 q] = gamma[h512*512 + 4p + q], in its own dtype
    # when that is 2-byte (a bit copy; the x * gamma pass then streams at VectorE's 2-byte rate),
    # else fp32 (exact)
    g_dt = nl.float32
    if gamma1.dtype == nl.bfloat16 or gamma1.dtype == nl.float16:
        g_dt = gamma1.dtype
    gamma_sw = nl.ndarray((P, NB, 4), dtype=g_dt, buffer=nl.sbuf, name="gamma_sw")
    nisa.dma_copy(dst=gamma_sw, src=gamma1.ap([[4, P], [BLOCK, NB], [1, 4]], offset=0))
    gamma_tm = None
    if cfg.emit_norm_bf16:
        # token-major gamma broadcast to every partition [128, H] fp32 (stride-0 HBM rows)
        gamma_tm = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.sbuf, name="gamma_tm")
        nisa.dma_copy(dst=gamma_tm, src=gamma1.ap([[0, P], [1, H]], offset=0))

    # Software pipeline over this program's token tiles. Every tile has its own buffers, so no
    # tile waits on another's; what is pipelined is the issue order, because each engine runs its
    # queue in order. Iteration i issues: tile i+1's load (Activation DMA queue, ahead of tile
    # i's stores on the SP queue), tile i's swizzle, gamma and inv_rms passes, tile i-1's router
    # logits (PE) and NOAUX_TC scores (ScalarE), tile i+1's sum of squares, tile i-3's
    # affinities, tile i's quantization and stores, then tile i-1's top-K selection. Each
    # engine thus finds independent work from neighbouring tiles queued where it would
    # otherwise wait on another engine. The first load goes out before the router weights,
    # whose DMA would otherwise delay it.
    tiles: list[tuple[int, int]] = []  # (first token, tokens) of this program's tiles
    for t0 in range(tok_begin, tok_end, TOK_TILE):
        tiles.append((t0, min(TOK_TILE, tok_end - t0)))
    x_next = None
    inv_next = None
    if tiles:
        x_next = _load(cfg, tiles[0][0], tiles[0][1], hs2, res2, out_res)
        inv_next = _rms(cfg, tiles[0][1], x_next)
    # router stages in flight: [t0, n, a_sw, inv, logits/scores or None, tile] awaiting the
    # top-K selection, and [t0, n, selection, tile] awaiting the affinities
    routing: list[list[Any]] = []
    finishing: list[list[Any]] = []

    w_sb = None
    bias_tm = None
    iota_e = None
    if E > 0:
        # router weights [128 p, NB*4 (h512, q), E]: arranged row h512*512 + q*128 + p (§6.1);
        # NOAUX_TC rows are already partition-major ([128, H/128, E] contiguous)
        w_sb = nl.ndarray((P, NB * 4, E), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="router_w")
        if noaux:
            w_src = router_weights.reshape((P, NB * 4, E))
        else:
            w_src = router_weights.reshape((NB * 4, P, E)).permute((1, 0, 2))
        nisa.dma_copy(dst=w_sb, src=w_src, dge_mode=nisa.dge_mode.hwdge)
        if router_bias is not None:
            bias_tm = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf, name="router_bias")
            nisa.dma_copy(dst=bias_tm, src=_flat_1d(router_bias, E).ap([[0, P], [1, E]], offset=0))
        Ew = max(E, MAX8)
        iota_e = nl.ndarray((P, Ew), dtype=nl.float32, buffer=nl.sbuf, name="iota_e")
        nisa.iota(dst=iota_e, pattern=[[1, Ew]], offset=0, channel_multiplier=0)

    for i in range(len(tiles)):
        t0, n = tiles[i]
        x, inv = x_next, inv_next
        if i + 1 < len(tiles):
            x_next = _load(cfg, tiles[i + 1][0], tiles[i + 1][1], hs2, res2, out_res)
        a_sw = _swizzle_gamma(cfg, n, x, gamma_sw)
        y_sw = _scale_inv(cfg, n, a_sw, inv)
        if E > 0 and routing:
            prev = routing[0]
            prev[4] = _router_logits(cfg, prev[1], prev[2], prev[3], w_sb)
        if i + 1 < len(tiles):
            inv_next = _rms(cfg, tiles[i + 1][1], x_next)
        if E > 0 and finishing and finishing[0][3] <= i - 3:
            f0, fn, fsel, _ = finishing.pop(0)
            _route_finish(cfg, f0, fn, fsel, out_packed, out_aff)
        _quantize_and_store(cfg, t0, n, y_sw, out_packed)
        if out_norm is not None:
            _store_norm_bf16(cfg, t0, n, x, inv, gamma_tm, out_norm)
        if E > 0:
            if routing:
                r0, rn, _, rinv, rlg, ri = routing.pop(0)
                rsel = _route_select(cfg, r0, rn, rlg, rinv, bias_tm, iota_e, out_index)
                finishing.append([r0, rn, rsel, ri])
            routing.append([t0, n, a_sw, inv, None, i])
    # drain: the last tile's router, then the affinities still due
    for r0, rn, ra, rinv, _, ri in routing:
        rlg = _router_logits(cfg, rn, ra, rinv, w_sb)
        rsel = _route_select(cfg, r0, rn, rlg, rinv, bias_tm, iota_e, out_index)
        finishing.append([r0, rn, rsel, ri])
    for f0, fn, fsel, _ in finishing:
        _route_finish(cfg, f0, fn, fsel, out_packed, out_aff)

    outputs = [out_packed]
    for t in (out_index, out_aff, out_res, out_norm):
        if t is not None:
            outputs.append(t)
    return outputs


def _load(cfg: PrefillKernelConfig, t0: int, n: int, hs2: Any, res2: Any, out_res: Any) -> Any:
    """Step 1 for tokens ``[t0, t0 + n)``: the token-major tile ``x [n, H]`` in natural H
    order, input dtype (prefill spec §3.1)."""
    H = cfg.H
    in_dt = hs2.dtype
    # 1. token-major load [n, H] (partition = token), §3.1
    x_st = nl.ndarray((TOK_TILE, H), dtype=in_dt, buffer=nl.sbuf, name="x_tok")
    if res2 is not None:
        # the DMA adds in fp32 and writes the sum once rounded to the input dtype
        nisa.dma_compute(
            dst=x_st[0:n, :], srcs=[hs2[t0 : t0 + n, :], res2[t0 : t0 + n, :]], reduce_op=nl.add
        )
        # output_residual: the sum in stored order, converted to residual.dtype
        nisa.dma_copy(dst=out_res[t0 : t0 + n, :], src=x_st[0:n, :])
    else:
        # triggered from the Activation queue: the stores go through the SP (sync) queue, so
        # the next tile's load never waits behind this tile's stores (nki_api_subset §6.1)
        nisa.dma_copy(
            dst=x_st[0:n, :],
            src=hs2[t0 : t0 + n, :],
            dge_mode=nisa.dge_mode.hwdge,
            engine=nisa.engine.scalar,
        )
    x = x_st
    if cfg.hidden_interleaved:
        # §3.1 (V-B): x_nat[4p + q] = x_stored[q*(H/4) + p], a bit-exact strided copy
        x = nl.ndarray((TOK_TILE, H), dtype=in_dt, buffer=nl.sbuf, name="x_nat")
        Hq = H // 4
        nisa.tensor_copy(
            dst=x.ap([[H, n], [4, Hq], [1, 4]], offset=0),
            src=x_st.ap([[H, n], [1, Hq], [Hq, 4]], offset=0),
        )
    return x


def _rms(cfg: PrefillKernelConfig, n: int, x: Any) -> Any:
    """Step 2: ``inv_rms`` fp32 ``[n, 1]`` of the token-major tile ``x`` (prefill spec §3.2)."""
    NB = cfg.NB
    # 2. sum of squares, 512-blocks chained in order in the ScalarE accumulator (§3.2)
    stat = nl.ndarray((TOK_TILE, 2), dtype=nl.float32, buffer=nl.sbuf, name="ss_inv")
    # the squares themselves are junk: a bf16 tile streams at ScalarE's 2-byte rate, while the
    # accumulator sums the fp32 squares before the output rounding (the sum stays fp32)
    sq = nl.ndarray((TOK_TILE, BLOCK), dtype=nl.bfloat16, buffer=nl.sbuf, name="sq_junk")
    for blk in range(NB):
        nisa.activation(
            dst=sq[0:n, :],
            op=nl.square,
            data=x[0:n, blk * BLOCK : (blk + 1) * BLOCK],
            reduce_op=nl.add,
            reduce_cmd=nisa.reduce_cmd.reset_reduce if blk == 0 else nisa.reduce_cmd.reduce,
            reduce_res=stat[0:n, 0:1] if blk == NB - 1 else None,
        )
    # inv_rms = rsqrt(ss * fp32(1/N) + fp32(eps)): the mean is a multiply, eps the bias (§3.2)
    inv = stat[0:n, 1:2]
    nisa.activation(dst=inv, op=nl.rsqrt, data=stat[0:n, 0:1], bias=cfg.eps, scale=1.0 / cfg.N)
    return inv


def _swizzle_gamma(cfg: PrefillKernelConfig, n: int, x: Any, gamma_sw: Any) -> Any:
    """Steps 3 + 5a: ``a = R_cd(x * gamma)`` in the swizzled layout ``[128 p, NB, n, 4 q]``
    (element ``h512*512 + 4p + q``), prefill spec §3.3."""
    NB, cd = cfg.NB, cfg.compute_dtype
    in_dt = x.dtype
    # 3 + 5a. fp32-packed transposes into [128 p, NB, n, 4 q]; a = R_cd(x * gamma) from PSUM
    a_sw = nl.ndarray((P, NB, n, 4), dtype=cd, buffer=nl.sbuf, name="a_sw")
    x32 = x[0:n, :].view(nl.float32)  # [n, H/2]: word w holds elements 2w, 2w+1
    for b0 in range(0, NB, T_BLOCKS_PER_PSUM):
        cb = min(T_BLOCKS_PER_PSUM, NB - b0)
        xt_ps = nl.ndarray((P, cb, n, 2), dtype=nl.float32, buffer=nl.psum, name="x_swz")
        for c in range(cb):
            w0 = (b0 + c) * (BLOCK // 2)
            for j in range(2):
                # word 2p + j of the block = elements 4p + 2j, 4p + 2j + 1 -> lanes 2j, 2j + 1
                nisa.nc_transpose(dst=xt_ps[:, c, :, j], data=x32[:, w0 + j : w0 + BLOCK // 2 : 2])
        # PSUM -> SBUF on the Scalar engine as fp32 words (bit-exact): the Vector multiply below
        # then reads two 2-byte SBUF tiles, at twice the rate of a PSUM read
        xt_sb = nl.ndarray((P, cb, n, 2), dtype=nl.float32, buffer=nl.sbuf, name="x_swz_sb")
        nisa.tensor_copy(dst=xt_sb, src=xt_ps, engine=nisa.engine.scalar)
        nisa.tensor_tensor(
            dst=a_sw[:, b0 : b0 + cb, :, :],
            data1=xt_sb.view(in_dt),  # [128, cb, n, 4] values of x (bit-exact)
            data2=gamma_sw[:, b0 : b0 + cb, :].expand_dim(2).broadcast(2, n),
            op=nl.multiply,
        )

    return a_sw


def _scale_inv(cfg: PrefillKernelConfig, n: int, a_sw: Any, inv: Any) -> Any:
    """Steps 4 + 5b: ``y = R_cd(a * R_cd(inv_rms))`` in the swizzled layout, prefill spec §3.3
    (apart from `_swizzle_gamma`, which does not need inv_rms)."""
    NB, cd = cfg.NB, cfg.compute_dtype
    # 4. inv_rms broadcast to the swizzled layout [128, n]: the PE transposes the stride-0 free
    # broadcast [n, 128] of the column. A transpose is a data move: "Bit-exact copy of elements
    # (dst.dtype == data.dtype required); on v2 the PE path is not NaN/Inf-safe (irrelevant for
    # v3/v4)" (api spec §7.4; §2.4: a same-dtype "PE transpose on v3+ ... is bit-exact: copy
    # raw bytes, never go through float math"). The broadcast was once a matmul of that view
    # against the identity (upstream's form), which is fp32 arithmetic (§7.1: "Products and
    # accumulation in fp32"; is_moving_onezero is a hint with "No semantic effect"): there one
    # token's NaN inv_rms gave NaN * 0 = NaN in every column, i.e. NaN codes for all n tokens
    # of the tile, while tokens are independent everywhere else (the reference, verify's
    # non-finite rules in mxcli.verification.finite).
    inv_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="inv_bcast")
    nisa.nc_transpose(dst=inv_ps, data=inv.broadcast(1, P))
    r_sw = nl.ndarray((P, n), dtype=cd, buffer=nl.sbuf, name="inv_cd")
    nisa.tensor_copy(dst=r_sw, src=inv_ps, engine=nisa.engine.scalar)  # R_cd(inv_rms), §3.3

    # 5b. y = R_cd(a * R_cd(inv_rms)), inv broadcast over blocks and lanes (stride 0)
    y_sw = nl.ndarray((P, NB, n, 4), dtype=cd, buffer=nl.sbuf, name="y_sw")
    nisa.tensor_tensor(
        dst=y_sw,
        data1=a_sw,
        data2=r_sw.ap([[n, P], [0, NB], [1, n], [0, 4]], offset=0),
        op=nl.multiply,
    )
    return y_sw


def _quantize_and_store(
    cfg: PrefillKernelConfig, t0: int, n: int, y_sw: Any, out_packed: Any
) -> None:
    """Steps 6-7: MX quantization per H512 block, then codes and scale bytes back to
    token-major rows of ``out_packed`` (prefill spec §3.4, §4.1, §4.2)."""
    H, NB, n_packs = cfg.H, cfg.NB, cfg.n_packs
    SR = P * n_packs  # scale region bytes
    # 6. group = 8 partitions x 4 lanes = 32 natural elements. Scale tile rows
    # 32*(b//4) + b%4 (+ (h512%4)*4 when folded), one column per token (§4.2): every scale sits
    # in its data's 32-partition quadrant, at offset 0/4/8/12 within it.
    q_sw = nl.ndarray((P, NB, n), dtype=cfg.qmx_dtype, buffer=nl.sbuf, name="q_sw")
    sc = nl.ndarray((P, n_packs, n), dtype=nl.uint8, buffer=nl.sbuf, name="scales")
    # holes of the scale region are 0x00 (reference HoleFill.ZERO); GpSimd has time to spare
    nisa.memset(dst=sc, value=0, engine=nisa.engine.gpsimd)
    for blk in range(NB):
        pack = blk
        shift = 0
        if cfg.pack_scales:
            pack = blk // 4
            shift = (blk % 4) * 4
        nisa.quantize_mx(dst=q_sw[:, blk, :], src=y_sw[:, blk, :, :], dst_scale=sc[shift:, pack, :])

    # 7a. codes back to token-major natural order: x4 words as fp32, PE transposes (§4.1)
    codes_tm = nl.ndarray((TOK_TILE, H // 4), dtype=nl.float32, buffer=nl.sbuf, name="codes_tm")
    q32 = q_sw.view(nl.float32)  # [128, NB, n]
    for b0 in range(0, NB, 4):
        cb = min(4, NB - b0)
        ct_ps = nl.ndarray((TOK_TILE, cb, P), dtype=nl.float32, buffer=nl.psum, name="codes_t")
        for c in range(cb):
            nisa.nc_transpose(dst=ct_ps[0:n, c, :], data=q32[:, b0 + c, :])
        # on VectorE: the Scalar engine's queue is busier in the pipeline (cost-model schedule)
        nisa.tensor_copy(
            dst=codes_tm[0:n, b0 * P : (b0 + cb) * P],
            src=ct_ps[0:n, :, :],
            engine=nisa.engine.vector,
        )
    packed_f32 = out_packed.view(nl.float32)  # [T, row/4]: code words
    nisa.dma_copy(
        dst=packed_f32[t0 : t0 + n, 0 : H // 4],
        src=codes_tm[0:n, :],
        dge_mode=nisa.dge_mode.hwdge,
    )

    # 7b. scale bytes: 1-byte PE transposes through a float8_e5m2 view (bit-exact) into a
    # step-2 PSUM view, then one bit-exact copy and one DMA into [H, H + SR)
    sc_tm = nl.ndarray((TOK_TILE, SR), dtype=nl.uint8, buffer=nl.sbuf, name="scales_tm")
    sc_e5 = sc.view(nl.float8_e5m2)
    sc_tm_e5 = sc_tm.view(nl.float8_e5m2)
    for k0 in range(0, n_packs, SCALE_PACKS_PER_PSUM):
        ck = min(SCALE_PACKS_PER_PSUM, n_packs - k0)
        st_ps = nl.ndarray(
            (TOK_TILE, ck, P, 2), dtype=nl.float8_e5m2, buffer=nl.psum, name="scales_t"
        )
        for c in range(ck):
            nisa.nc_transpose(dst=st_ps[0:n, c, :, 0], data=sc_e5[:, k0 + c, :])
        nisa.tensor_copy(dst=sc_tm_e5[0:n, k0 * P : (k0 + ck) * P], src=st_ps[0:n, :, :, 0])
    nisa.dma_copy(
        dst=out_packed[t0 : t0 + n, H : H + SR], src=sc_tm[0:n, :], dge_mode=nisa.dge_mode.hwdge
    )


def _store_norm_bf16(
    cfg: PrefillKernelConfig, t0: int, n: int, x: Any, inv: Any, gamma_tm: Any, out_norm: Any
) -> None:
    """emit_norm_bf16 (§3.5): ``R_bf16((x * inv_rms) * gamma)``, fp32 inv_rms, natural order."""
    nrm = nl.ndarray((TOK_TILE, cfg.H), dtype=nl.bfloat16, buffer=nl.sbuf, name="norm_bf16")
    nisa.scalar_tensor_tensor(
        dst=nrm[0:n, :],
        data=x[0:n, :],
        op0=nl.multiply,
        operand0=inv,
        op1=nl.multiply,
        operand1=gamma_tm[0:n, :],
    )
    nisa.dma_copy(dst=out_norm[t0 : t0 + n, :], src=nrm[0:n, :], dge_mode=nisa.dge_mode.hwdge)


def _router_logits(cfg: PrefillKernelConfig, n: int, a_sw: Any, inv: Any, w_sb: Any) -> Any:
    """Step 8a: raw router logits ``[n, E]`` fp32 in PSUM: one matmul per (h512, q) contracting
    partitions p, one PSUM accumulation chain in (h512, q) order (prefill spec §5.1). NOAUX_TC:
    then its scores ``sigmoid(raw * inv_rms)`` [n, E] fp32 in SBUF (§5.3), issued here so the
    Scalar engine computes them as soon as the logits are ready."""
    NB, E = cfg.NB, cfg.E
    lg_ps = nl.ndarray((TOK_TILE, E), dtype=nl.float32, buffer=nl.psum, name="logits")
    for blk in range(NB):
        for q in range(4):
            i = blk * 4 + q
            nisa.nc_matmul(
                dst=lg_ps[0:n, :],
                stationary=a_sw[:, blk, :, q],
                moving=w_sb[:, i, :],
                accumulate=i > 0,
            )
    if cfg.router_mode == RouterMode.NOAUX_TC:
        # score = sigmoid(raw * inv_rms): the inv_rms scale fused, no bias inside the sigmoid
        score = nl.ndarray((TOK_TILE, E), dtype=nl.float32, buffer=nl.sbuf, name="noaux_score")
        nisa.activation(dst=score[0:n, :], op=nl.sigmoid, data=lg_ps[0:n, :], scale=inv)
        return score
    return lg_ps


def _route_select(
    cfg: PrefillKernelConfig,
    t0: int,
    n: int,
    lg_ps: Any,
    inv: Any,
    bias_tm: Any,
    iota_e: Any,
    out_index: Any,
) -> list[Any]:
    """Step 8b: from `_router_logits`' raw logits (NOAUX_TC: scores) ``lg_ps``, the top-K /
    NOAUX_TC selection
    of tokens ``[t0, t0 + n)`` (prefill spec §5). Returns ``[aff, score, eq]``: the dense
    affinity tile (SIGMOID / SOFTMAX), or NOAUX_TC's scores and selection planes for
    `_route_finish` (a later pipeline stage: the planes come from GpSimd)."""
    E, K = cfg.E, cfg.K
    if cfg.router_mode == RouterMode.NOAUX_TC:
        score, eq = _noaux_select(n, E, K, cfg.n_group, cfg.topk_group, lg_ps, bias_tm, iota_e)
        return [None, score, eq]
    aff = _topk_router(n, E, K, cfg.router_mode, lg_ps, inv, bias_tm, iota_e, out_index, t0)
    return [aff, None, None]


def _route_finish(
    cfg: PrefillKernelConfig, t0: int, n: int, selected: list[Any], out_packed: Any, out_aff: Any
) -> None:
    """Step 8c: the affinities of `_route_select`'s selection into their own tensor or the
    packed row tail (prefill spec §4.3, §5.3)."""
    E = cfg.E
    aff = selected[0]
    if aff is None:
        aff = _noaux_affinities(n, E, cfg.K, cfg.routed_scaling_factor, selected[1], selected[2])
    if not cfg.pack_affinities:
        nisa.dma_copy(dst=out_aff[t0 : t0 + n, :], src=aff[0:n, :], dge_mode=nisa.dge_mode.hwdge)
        return
    # §4.3: affinity tail at byte affin_off (bf16 or fp32 little-endian), zero pad to the row end
    col = cfg.affin_off // cfg.aff_width
    tail = out_packed.view(aff.dtype)
    nisa.dma_copy(
        dst=tail[t0 : t0 + n, col : col + E], src=aff[0:n, :], dge_mode=nisa.dge_mode.hwdge
    )
    pad = cfg.row - (cfg.affin_off + E * cfg.aff_width)
    if pad > 0:
        zpad = nl.ndarray((TOK_TILE, pad), dtype=nl.uint8, buffer=nl.sbuf, name="row_pad")
        nisa.memset(dst=zpad, value=0)
        nisa.dma_copy(dst=out_packed[t0 : t0 + n, cfg.row - pad : cfg.row], src=zpad[0:n, :])


def _topk_router(
    n: int,
    E: int,
    K: int,
    mode: RouterMode,
    lg_ps: Any,
    inv: Any,
    bias_tm: Any,
    iota_e: Any,
    out_index: Any,
    t0: int,
) -> Any:
    """SIGMOID / SOFTMAX top-K (§5.2): returns the dense bf16 affinity tile [n, E]."""
    Ew = max(E, MAX8)
    lg = nl.ndarray((TOK_TILE, Ew), dtype=nl.float32, buffer=nl.sbuf, name="logits_sb")
    if Ew > E:
        nisa.memset(dst=lg[0:n, E:Ew], value=FP32_LOWEST)  # pads never beat a real logit
    if bias_tm is not None:
        # logit = raw * inv_rms (fp32) + bias: the bias after the inv_rms scale (§5.1)
        nisa.scalar_tensor_tensor(
            dst=lg[0:n, 0:E],
            data=lg_ps[0:n, :],
            op0=nl.multiply,
            operand0=inv,
            op1=nl.add,
            operand1=bias_tm[0:n, :],
        )
    else:
        nisa.tensor_scalar(dst=lg[0:n, 0:E], data=lg_ps[0:n, :], op0=nl.multiply, operand0=inv)
    top8 = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name="top8")
    nisa.max8(dst=top8[0:n, :], src=lg[0:n, :])
    idx = nl.ndarray((TOK_TILE, 8), dtype=nl.int32, buffer=nl.sbuf, name="top8_idx")
    nisa.nc_find_index8(dst=idx[0:n, :].view(nl.uint32), data=lg[0:n, :], vals=top8[0:n, :])
    nisa.dma_copy(dst=out_index[t0 : t0 + n, :], src=idx[0:n, 0:K], dge_mode=nisa.dge_mode.hwdge)

    s = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name="topk_act")
    if mode == RouterMode.SIGMOID:
        nisa.activation(dst=s[0:n, 0:K], op=nl.sigmoid, data=top8[0:n, 0:K])
    else:
        # softmax over the K selected: exp(l_k - l_0) * (1 / sum), reciprocal then multiply
        negm = nl.ndarray((TOK_TILE, 2), dtype=nl.float32, buffer=nl.sbuf, name="softmax_stat")
        nisa.tensor_scalar(dst=negm[0:n, 0:1], data=top8[0:n, 0:1], op0=nl.multiply, operand0=-1.0)
        nisa.activation(
            dst=s[0:n, 0:K],
            op=nl.exp,
            data=top8[0:n, 0:K],
            bias=negm[0:n, 0:1],
            scale=1.0,
            reduce_op=nl.add,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
            reduce_res=negm[0:n, 1:2],
        )
        nisa.reciprocal(dst=negm[0:n, 1:2], data=negm[0:n, 1:2])
        nisa.tensor_scalar(
            dst=s[0:n, 0:K], data=s[0:n, 0:K], op0=nl.multiply, operand0=negm[0:n, 1:2]
        )

    # dense bf16 row: per slot, (iota == idx_k) * s_k rounded to bf16, accumulated in bf16
    idx_f = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name="top8_idx_f")
    nisa.tensor_copy(dst=idx_f[0:n, :], src=idx[0:n, :].view(nl.uint32))
    aff = nl.ndarray((TOK_TILE, E), dtype=nl.bfloat16, buffer=nl.sbuf, name="affinities")
    nisa.memset(dst=aff[0:n, :], value=0.0)
    contrib = nl.ndarray((TOK_TILE, E), dtype=nl.bfloat16, buffer=nl.sbuf, name="aff_slot")
    for k in range(K):
        nisa.tensor_scalar(
            dst=contrib[0:n, :],
            data=iota_e[0:n, 0:E],
            op0=nl.equal,
            operand0=idx_f[0:n, k : k + 1],
            op1=nl.multiply,
            operand1=s[0:n, k : k + 1],
        )
        nisa.tensor_tensor(dst=aff[0:n, :], data1=aff[0:n, :], data2=contrib[0:n, :], op=nl.add)
    return aff


def _select8(n: int, src: Any, name: str) -> Any:
    """``max8`` + ``nc_find_index8`` of `src` [n, >= 8]: the 8 indices as fp32 [n, 8] (fp32:
    they are ``tensor_scalar`` operands downstream)."""
    top = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name=name + "_top8")
    nisa.max8(dst=top[0:n, :], src=src)
    idx = nl.ndarray((TOK_TILE, 8), dtype=nl.uint32, buffer=nl.sbuf, name=name + "_idx")
    nisa.nc_find_index8(dst=idx[0:n, :], data=src, vals=top[0:n, :])
    idx_f = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name=name + "_idx_f")
    nisa.tensor_copy(dst=idx_f[0:n, :], src=idx[0:n, :])
    return idx_f


def _noaux_select(
    n: int,
    E: int,
    K: int,
    G: int,
    TG: int,
    score: Any,
    bias_tm: Any,
    iota_e: Any,
) -> tuple[Any, Any]:
    """NOAUX_TC group-limited selection in fp32 (§5.3, errata 4) from the pre-bias scores
    [n, E] (`_router_logits`): returns them with the onehot counts of the K selected experts in
    plane 0 of ``eq [n, 8, E]``."""
    epg = E // G
    f32 = nl.float32
    sfc = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_sfc")
    nisa.tensor_tensor(dst=sfc[0:n, :], data1=score[0:n, :], data2=bias_tm[0:n, :], op=nl.add)

    # group score = top1 + top2 of each group (groups padded with -SENT to 8 entries)
    if epg < MAX8:
        grp = nl.ndarray((TOK_TILE, G, MAX8), dtype=f32, buffer=nl.sbuf, name="noaux_groups")
        nisa.memset(dst=grp[0:n, :, :], value=-NOAUX_SENTINEL)
        nisa.tensor_copy(dst=grp[0:n, :, 0:epg], src=sfc[0:n, :].reshape((n, G, epg)))
    else:
        grp = sfc[0:n, :].reshape((n, G, epg))
    g8 = nl.ndarray((TOK_TILE, G, 8), dtype=f32, buffer=nl.sbuf, name="noaux_group_top8")
    for g in range(G):
        nisa.max8(dst=g8[0:n, g, :], src=grp[0:n, g, :])
    gs = nl.ndarray((TOK_TILE, MAX8), dtype=f32, buffer=nl.sbuf, name="noaux_group_score")
    if G < MAX8:
        nisa.memset(dst=gs[0:n, G:MAX8], value=-NOAUX_SENTINEL)
    nisa.tensor_tensor(dst=gs[0:n, 0:G], data1=g8[0:n, :, 0], data2=g8[0:n, :, 1], op=nl.add)
    kept = _select8(n, gs[0:n, :], "noaux_kept")

    # mask[g] = number of kept slots naming group g, per group (G columns, not E: the group ids
    # are iota_e's first G columns); masked = sfc + (mask[group(e)] - 1) * SENT, the group's
    # shift broadcast over its experts by a stride-0 view (same fp32 operations per element)
    gmask = nl.ndarray((TOK_TILE, G), dtype=f32, buffer=nl.sbuf, name="noaux_group_mask")
    nisa.memset(dst=gmask[0:n, :], value=0.0)
    for j in range(TG):
        nisa.scalar_tensor_tensor(
            dst=gmask[0:n, :],
            data=iota_e[0:n, 0:G],
            op0=nl.equal,
            operand0=kept[0:n, j : j + 1],
            op1=nl.add,
            operand1=gmask[0:n, :],
        )
    nisa.tensor_scalar(
        dst=gmask[0:n, :],
        data=gmask[0:n, :],
        op0=nl.subtract,
        operand0=1.0,
        op1=nl.multiply,
        operand1=NOAUX_SENTINEL,
    )
    masked = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_masked")
    nisa.tensor_tensor(
        dst=masked[0:n, :].reshape((n, G, epg)),
        data1=sfc[0:n, :].reshape((n, G, epg)),
        data2=gmask[0:n, :].expand_dim(2).broadcast(2, epg),
        op=nl.add,
    )
    sel = _select8(n, masked[0:n, :], "noaux_sel")

    # the K selection planes on the otherwise idle GpSimd engine: one compare of [n, K, E]
    # (iota and the K indices broadcast by stride-0 views)
    eq = nl.ndarray((TOK_TILE, MAX8, E), dtype=f32, buffer=nl.sbuf, name="noaux_onehot")
    nisa.tensor_tensor(
        dst=eq[0:n, 0:K, :],
        data1=iota_e[0:n, 0:E].expand_dim(1).broadcast(1, K),
        data2=sel[0:n, 0:K].expand_dim(2).broadcast(2, E),
        op=nl.equal,
        engine=nisa.engine.gpsimd,
    )
    # onehot (counts) = the K planes summed pairwise into plane 0, on GpSimd too (counts of 0/1:
    # exact in any order)
    width = K
    for _ in range(3):  # K <= 8 = 2**3 planes
        if width > 1:
            half = width // 2
            nisa.tensor_tensor(
                dst=eq[0:n, 0:half, :],
                data1=eq[0:n, 0:half, :],
                data2=eq[0:n, width - half : width, :],
                op=nl.add,
                engine=nisa.engine.gpsimd,
            )
            width = width - half
    return score, eq


def _noaux_affinities(n: int, E: int, K: int, rsf: float, score: Any, eq: Any) -> Any:
    """NOAUX_TC affinities (§5.3) from `_noaux_select`: w = pre-bias score of the selected
    (``score * eq[:, 0]``), aff = w * rsf / (sum(w) + 1e-20), fp32 [n, E]."""
    f32 = nl.float32
    w = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_w")
    nisa.tensor_tensor(dst=w[0:n, :], data1=score[0:n, :], data2=eq[0:n, 0, :], op=nl.multiply)
    # den = sum over all E columns + 1e-20; c = rsf * (1 / den); aff = w * c
    den = nl.ndarray((TOK_TILE, 1), dtype=f32, buffer=nl.sbuf, name="noaux_den")
    nisa.tensor_reduce(dst=den[0:n, :], op=nl.add, data=w[0:n, :], axis=1, keepdims=True)
    nisa.tensor_scalar(dst=den[0:n, :], data=den[0:n, :], op0=nl.add, operand0=NOAUX_DEN_EPS)
    nisa.reciprocal(dst=den[0:n, :], data=den[0:n, :])
    nisa.tensor_scalar(dst=den[0:n, :], data=den[0:n, :], op0=nl.multiply, operand0=rsf)
    aff = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_affinities")
    nisa.tensor_scalar(dst=aff[0:n, :], data=w[0:n, :], op0=nl.multiply, operand0=den[0:n, :])
    return aff


# The launchable kernel object: ``nki.jit`` wraps it for the real toolchain and for mxcli's
# interpreter alike (``nki.simulate(rmsnorm_mx_prefill_kernel[lnc])(...)``).
rmsnorm_mx_prefill_kernel = nki.jit(rmsnorm_mx_prefill_nki)
