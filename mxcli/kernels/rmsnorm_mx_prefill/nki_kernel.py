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
   block chained through the accumulator register in block order (§3.2), then
   ``inv_rms = rsqrt(ss * (1/N) + eps)``;
3. the "fp32-packed transpose" into the swizzled layout ``[128 p, NB, n, 4 q]`` (element
   ``h = h512*512 + 4p + q``): bf16 pairs are read as fp32 words, even and odd words transposed
   by the PE into the two halves of each x4 lane quad (bit-exact);
4. ``inv_rms`` broadcast to all 128 partitions by a matmul of a stride-0 stationary against the
   identity (exact), rounded to cd;
5. the three-rounding chain ``a = R_cd(x*gamma)``, ``y = R_cd(a * R_cd(inv_rms))`` (§3.3);
6. ``quantize_mx`` per H512 block: one scale per 8 partitions x 4 lanes = 32 contiguous natural
   elements; scales land in quadrant layout, shifted by ``(h512 % 4)*4`` rows when folded (§4.2);
7. codes transposed back as fp32 words (natural H order, §4.1) and scale bytes transposed as
   float8_e5m2 (1-byte bit-exact PE transpose); both DMA'd into the packed row;
8. router: ``raw = sum over (h512, q) of a[:, h512, :, q].T @ W[h512, q]`` accumulated in one
   PSUM tile (§5.1), ``logits = raw * inv_rms (+ bias)``, ``max8`` + ``nc_find_index8`` top-K,
   sigmoid / softmax over K with dense bf16 affinities (§5.2), or NOAUX_TC group selection in
   fp32 (§5.3); affinities either to their own tensor or into the packed row tail (§4.3).

LNC: with ``kernel[2]`` the two programs split the tokens (core 0 the first ``ceil(T/2)``,
prefill spec §7); tokens are independent, so results do not depend on it.

Bytes the hardware kernel leaves unwritten (scale-region holes, the affinity-row pad, spec §4.2,
§4.3) are written as 0x00 here, the reference's default (`HoleFill.ZERO`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import nki
import nki.isa as nisa
import nki.language as nl

from mxcli.kernels.rmsnorm_mx_prefill.contract import (
    HIDDEN_MULTIPLE,
    MAX_EXPERTS,
    MAX_GROUPS,
    MAX_TOP_K,
    PrefillValidationError,
    RouterActFnType,
)

P = 128  # partitions (nl.tile_size.pmax)
TOK_TILE = 128  # tokens per tile: the token-major tiles put tokens on partitions
BLOCK = 512  # one H512 block = 128 partitions x 4 lanes
FP32_LOWEST = -3.4028234663852886e38  # §5.2: pads of short logit rows never win
NOAUX_SENTINEL = 30000.0  # §5.3: finite "minus infinity" of group masking
NOAUX_DEN_EPS = 1e-20  # §5.3: added to the selected-score sum
T_BLOCKS_PER_PSUM = 4  # swizzle transposes: 4 blocks x n tokens x 2 fp32 words = 2 PSUM banks
SCALE_PACKS_PER_PSUM = 8  # scale transposes: 8 x 128 x 2 bytes = one PSUM bank


def _fail(name: str, expected: str, actual: object) -> PrefillValidationError:
    return PrefillValidationError(f"{name}: expected {expected}, got {actual}")


def _is_16bit(dt: Any) -> bool:
    return dt == nl.bfloat16 or dt == nl.float16


def _is_float(dt: Any) -> bool:
    return str(dt).startswith(("float", "bfloat", "tfloat"))


def _validate(
    hidden_states: Any,
    gamma: Any,
    router_weights: Any,
    router_bias: Any,
    top_k: int,
    act: RouterActFnType,
    n_group: int,
    topk_group: int,
    unpadded_hidden_size: int | None,
    residual: Any,
) -> None:
    """Every check of prefill spec §2.3 (in the kernel's order, errata 2), then the checks the
    upstream kernel leaves to trace-time failures or undefined results. Runs before any work."""
    if len(hidden_states.shape) != 3:
        raise _fail("hidden_states", "a [B, S, H] tensor (rank 3)", f"shape {hidden_states.shape}")
    H = hidden_states.shape[2]
    if H % HIDDEN_MULTIPLE:
        raise _fail("hidden_states", "H (last dim) a positive multiple of 512", f"H={H}")
    N = H if unpadded_hidden_size is None else unpadded_hidden_size
    if not 0 < N <= H:
        raise _fail("unpadded_hidden_size", f"a value in (0, H={H}]", N)
    if residual is not None and tuple(residual.shape) != tuple(hidden_states.shape):
        raise _fail(
            "residual",
            f"shape {tuple(hidden_states.shape)} (same as hidden_states)",
            residual.shape,
        )
    if router_weights is not None:
        E = router_weights.shape[-1]
        if not 0 < E <= MAX_EXPERTS:
            raise _fail("router_weights", f"E (dim 1) in [1, {MAX_EXPERTS}]", f"E={E}")
        if top_k > MAX_TOP_K:
            raise _fail("top_k", f"<= {MAX_TOP_K}", top_k)
        if act is RouterActFnType.NOAUX_TC:
            if router_bias is None:
                raise _fail(
                    "router_bias",
                    "a [1, E] or [E] tensor (NOAUX_TC requires the e_score_correction_bias)",
                    "None",
                )
            if topk_group > MAX_GROUPS:
                raise _fail("topk_group", f"<= {MAX_GROUPS}", topk_group)
            if n_group > MAX_GROUPS:
                raise _fail("n_group", f"<= {MAX_GROUPS} (max8-based group selection)", n_group)
            if n_group >= 1 and E % n_group:
                raise _fail("n_group", f"a divisor of E={E}", n_group)
    # --- checks the upstream kernel leaves out (§2.3 "NOT validated", errata 2) ---
    if not _is_16bit(hidden_states.dtype):
        raise _fail("hidden_states", "dtype bfloat16 or float16", hidden_states.dtype)
    if tuple(gamma.shape) not in ((H,), (1, H)):
        raise _fail("gamma", f"shape ({H},) or (1, {H})", tuple(gamma.shape))
    if not _is_float(gamma.dtype):
        raise _fail("gamma", "a floating-point dtype", gamma.dtype)
    if residual is not None and not _is_float(residual.dtype):
        raise _fail("residual", "a floating-point dtype", residual.dtype)
    if router_weights is None:
        return
    E = router_weights.shape[-1]
    if len(router_weights.shape) != 2 or router_weights.shape[0] != H:
        raise _fail("router_weights", f"an [H={H}, E] tensor", tuple(router_weights.shape))
    if not _is_16bit(router_weights.dtype):
        # §1: cd must be 2 bytes (the router matmul runs on cd activations)
        raise _fail(
            "router_weights",
            "dtype bfloat16 or float16 (16-bit compute dtype)",
            router_weights.dtype,
        )
    if not 1 <= top_k <= E:
        raise _fail("top_k", f"in [1, E={E}]", top_k)
    if router_bias is not None:
        if tuple(router_bias.shape) not in ((E,), (1, E)):
            raise _fail("router_bias", f"shape ({E},) or (1, {E})", tuple(router_bias.shape))
        if not _is_float(router_bias.dtype):
            raise _fail("router_bias", "a floating-point dtype", router_bias.dtype)
    if act is RouterActFnType.NOAUX_TC:
        if n_group < 1:
            raise _fail("n_group", ">= 1", n_group)
        if not 1 <= topk_group <= n_group:
            raise _fail("topk_group", f"in [1, n_group={n_group}]", topk_group)
        if E < MAX_TOP_K:
            raise _fail("router_weights", "E >= 8 for NOAUX_TC (max8 expert selection)", f"E={E}")


def _qmx_dtype(qmx_output_dtype: Any) -> Any:
    """The x4 dtype of ``quantize_mx``'s output: e5m2 when asked for, else e4m3fn."""
    return nl.float8_e5m2_x4 if "e5m2" in str(qmx_output_dtype).lower() else nl.float8_e4m3fn_x4


@dataclass(frozen=True)
class _Geometry:
    """Static facts of one launch (trace-time Python values)."""

    H: int
    NB: int  # H512 blocks
    N: int  # unpadded hidden size (RMS divisor)
    E: int  # experts (0 without a router)
    K: int
    eps: float
    in_dt: Any  # hidden_states dtype
    cd: Any  # compute dtype (§1)
    qdt: Any  # x4 output dtype of quantize_mx
    pack_scales: bool
    n_packs: int  # 128-byte scale blocks per row
    act: RouterActFnType
    n_group: int
    topk_group: int
    rsf: float
    hidden_interleaved: bool
    affin_off: int
    row: int
    pack_aff: bool


@dataclass(frozen=True)
class _Tensors:
    """HBM views and per-program SBUF constants shared by all tiles (None when unused)."""

    hs2: Any  # [T, H] hidden_states
    res2: Any  # [T, H] residual
    ident: Any  # [128, 128] fp32 identity
    gamma_sw: Any  # [128, NB, 4] fp32 swizzled gamma
    gamma_tm: Any  # [128, H] fp32 gamma on every partition (emit_norm_bf16)
    w_sb: Any  # [128, NB*4, E] router weights
    bias_tm: Any  # [128, E] fp32 router bias on every partition
    iota_e: Any  # [128, max(E, 8)] fp32 expert ids
    gid_e: Any  # [128, E] fp32 group id of each expert (NOAUX_TC)
    packed_f32: Any  # [T, row/4] fp32 view of the packed rows (code words)
    packed_u8: Any  # [T, row] the packed rows (bytes)
    out_packed: Any
    out_index: Any
    out_aff: Any
    out_res: Any
    out_norm: Any


def _flat_1d(t: Any, n: int) -> Any:
    """An HBM [n] or [1, n] tensor as a 1-D view."""
    return t.reshape((n,))


def rmsnorm_mx_prefill_nki(
    hidden_states: Any,
    gamma: Any,
    router_weights: Any = None,
    router_bias: Any = None,
    eps: float = 1e-6,
    top_k: int = 1,
    router_act_fn: Any = RouterActFnType.SIGMOID,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    qmx_output_dtype: Any = nl.float8_e4m3fn_x4,
    pack_scales: bool = True,
    pack_affinities: bool = False,
    unpadded_hidden_size: int | None = None,
    residual: Any = None,
    emit_norm_bf16: bool = False,
    hidden_interleaved: bool = False,
) -> list[Any]:
    """Fused RMSNorm + MXFP8 quantization (+ router top-K) for prefill, Trn3 only.

    Parameters are those of the API reference (``hidden_interleaved`` is the documented V-B
    extra, prefill spec errata 1). ``hidden_states`` [B, S, H] bf16/fp16 HBM, ``gamma`` [H] or
    [1, H], ``router_weights`` [H, E] bf16/fp16 arranged for the act fn (§6.1), ``router_bias``
    [E] or [1, E]. Returns the HBM outputs of prefill spec §2.2, in order: the packed rows
    ``[T, row_region]`` uint8 (bytes: codes, scales, optional affinity tail; fp8 codes),
    ``expert_index`` [T, K] int32 (SIGMOID/SOFTMAX), ``expert_affinities`` [T, E] bf16 / fp32
    (router without ``pack_affinities``), ``output_residual`` [T, H], ``norm_bf16`` [T, H].
    Raises `PrefillValidationError` (before any instruction) when an argument breaks §2.3.
    """
    act = RouterActFnType.coerce(router_act_fn)
    has_router = router_weights is not None
    _validate(
        hidden_states,
        gamma,
        router_weights,
        router_bias,
        top_k,
        act,
        n_group,
        topk_group,
        unpadded_hidden_size,
        residual,
    )
    B, S, H = (int(d) for d in hidden_states.shape)
    T = B * S
    NB = H // BLOCK
    N = H if unpadded_hidden_size is None else int(unpadded_hidden_size)
    in_dt = hidden_states.dtype
    cd = router_weights.dtype if has_router else in_dt  # §1 compute dtype
    qdt = _qmx_dtype(qmx_output_dtype)
    noaux = has_router and act is RouterActFnType.NOAUX_TC
    pack_aff = bool(pack_affinities) and has_router  # §2.1: silently off without a router
    E = int(router_weights.shape[1]) if has_router else 0
    K = int(top_k)

    # --- row geometry (§2.4) ---
    n_packs = (NB + 3) // 4 if pack_scales else NB
    SR = P * n_packs  # scale region bytes
    affin_off = H + SR
    aff_bytes = 4 if noaux else 2
    row = 4 * math.ceil((affin_off + E * aff_bytes) / 4) if pack_aff else affin_off

    # --- outputs (§2.2), in shared HBM (visible to both LNC programs) ---
    # raw bytes (uint8): MX data crosses to torch as uint8; the backend views it as fp8
    out_packed = nl.ndarray((T, row), dtype=nl.uint8, buffer=nl.shared_hbm, name="packed")
    out_index = None
    out_aff = None
    if has_router and not noaux:
        out_index = nl.ndarray((T, K), dtype=nl.int32, buffer=nl.shared_hbm, name="expert_index")
    if has_router and not pack_aff:
        aff_dt = nl.float32 if noaux else nl.bfloat16
        out_aff = nl.ndarray((T, E), dtype=aff_dt, buffer=nl.shared_hbm, name="expert_affinities")
    out_res = None
    if residual is not None:
        out_res = nl.ndarray(
            (T, H), dtype=residual.dtype, buffer=nl.shared_hbm, name="output_residual"
        )
    out_norm = None
    if emit_norm_bf16:
        out_norm = nl.ndarray((T, H), dtype=nl.bfloat16, buffer=nl.shared_hbm, name="norm_bf16")

    # --- this program's tokens (LNC split, prefill spec §7) ---
    n_prog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    per_core = -(-T // n_prog)
    tok_begin = min(T, pid * per_core)
    tok_end = min(T, tok_begin + per_core)

    hs2 = hidden_states.reshape((T, H))  # [T, H]
    res2 = residual.reshape((T, H)) if residual is not None else None
    gamma1 = _flat_1d(gamma, H)
    packed_f32 = out_packed.view(nl.float32)  # [T, row/4]: code words
    packed_u8 = out_packed  # [T, row]: scale bytes, pad

    # --- per-program constants ---
    ident = nl.shared_identity_matrix(P, dtype=nl.float32)
    # gamma in the swizzled layout [128 p, NB, 4 q] = gamma[h512*512 + 4p + q], fp32 (exact)
    gamma_sw = nl.ndarray((P, NB, 4), dtype=nl.float32, buffer=nl.sbuf, name="gamma_sw")
    nisa.dma_copy(dst=gamma_sw, src=gamma1.ap([[4, P], [BLOCK, NB], [1, 4]], offset=0))
    gamma_tm = None
    if emit_norm_bf16:
        # token-major gamma broadcast to every partition [128, H] fp32 (stride-0 HBM rows)
        gamma_tm = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.sbuf, name="gamma_tm")
        nisa.dma_copy(dst=gamma_tm, src=gamma1.ap([[0, P], [1, H]], offset=0))
    w_sb = None
    bias_tm = None
    iota_e = None
    gid_e = None
    if has_router:
        # router weights [128 p, NB*4 (h512, q), E]: arranged row h512*512 + q*128 + p (§6.1);
        # NOAUX_TC rows are already partition-major ([128, H/128, E] contiguous)
        w_sb = nl.ndarray((P, NB * 4, E), dtype=cd, buffer=nl.sbuf, name="router_w")
        if noaux:
            w_src = router_weights.reshape((P, NB * 4, E))
        else:
            w_src = router_weights.reshape((NB * 4, P, E)).permute((1, 0, 2))
        nisa.dma_copy(dst=w_sb, src=w_src, dge_mode=nisa.dge_mode.hwdge)
        if router_bias is not None:
            bias_tm = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf, name="router_bias")
            nisa.dma_copy(dst=bias_tm, src=_flat_1d(router_bias, E).ap([[0, P], [1, E]], offset=0))
        Ew = max(E, MAX_TOP_K)
        iota_e = nl.ndarray((P, Ew), dtype=nl.float32, buffer=nl.sbuf, name="iota_e")
        nisa.iota(dst=iota_e, pattern=[[1, Ew]], offset=0, channel_multiplier=0)
        if noaux:
            epg = E // n_group
            gid_e = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf, name="group_id")
            nisa.iota(dst=gid_e, pattern=[[1, n_group], [0, epg]], offset=0, channel_multiplier=0)

    geo = _Geometry(
        H=H,
        NB=NB,
        N=N,
        E=E,
        K=K,
        eps=float(eps),
        in_dt=in_dt,
        cd=cd,
        qdt=qdt,
        pack_scales=bool(pack_scales),
        n_packs=n_packs,
        act=act,
        n_group=int(n_group),
        topk_group=int(topk_group),
        rsf=float(routed_scaling_factor),
        hidden_interleaved=bool(hidden_interleaved),
        affin_off=affin_off,
        row=row,
        pack_aff=pack_aff,
    )
    ts = _Tensors(
        hs2=hs2,
        res2=res2,
        ident=ident,
        gamma_sw=gamma_sw,
        gamma_tm=gamma_tm,
        w_sb=w_sb,
        bias_tm=bias_tm,
        iota_e=iota_e,
        gid_e=gid_e,
        packed_f32=packed_f32,
        packed_u8=packed_u8,
        out_packed=out_packed,
        out_index=out_index,
        out_aff=out_aff,
        out_res=out_res,
        out_norm=out_norm,
    )
    for t0 in range(tok_begin, tok_end, TOK_TILE):
        _tile(geo, ts, t0, min(TOK_TILE, tok_end - t0))

    outputs = [out_packed]
    for t in (out_index, out_aff, out_res, out_norm):
        if t is not None:
            outputs.append(t)
    return outputs


def _tile(g: _Geometry, ts: _Tensors, t0: int, n: int) -> None:
    """One tile of `n` tokens starting at token `t0` (module docstring, steps 1-8)."""
    H, NB, N, E, K, eps = g.H, g.NB, g.N, g.E, g.K, g.eps
    in_dt, cd, qdt, n_packs, act = g.in_dt, g.cd, g.qdt, g.n_packs, g.act
    res2, gamma_sw, gamma_tm, w_sb, bias_tm = ts.res2, ts.gamma_sw, ts.gamma_tm, ts.w_sb, ts.bias_tm
    out_res, out_norm, out_aff = ts.out_res, ts.out_norm, ts.out_aff
    SR = P * n_packs

    # 1. token-major load [n, H] (partition = token), §3.1
    x_st = nl.ndarray((TOK_TILE, H), dtype=in_dt, buffer=nl.sbuf, name="x_tok")
    if res2 is not None:
        # the DMA adds in fp32 and writes the sum once rounded to the input dtype
        nisa.dma_compute(
            dst=x_st[0:n, :], srcs=[ts.hs2[t0 : t0 + n, :], res2[t0 : t0 + n, :]], reduce_op=nl.add
        )
        # output_residual: the sum in stored order, converted to residual.dtype
        nisa.dma_copy(dst=out_res[t0 : t0 + n, :], src=x_st[0:n, :])
    else:
        nisa.dma_copy(dst=x_st[0:n, :], src=ts.hs2[t0 : t0 + n, :], dge_mode=nisa.dge_mode.hwdge)
    x = x_st
    if g.hidden_interleaved:
        # §3.1 (V-B): x_nat[4p + q] = x_stored[q*(H/4) + p], a bit-exact strided copy
        x = nl.ndarray((TOK_TILE, H), dtype=in_dt, buffer=nl.sbuf, name="x_nat")
        Hq = H // 4
        nisa.tensor_copy(
            dst=x.ap([[H, n], [4, Hq], [1, 4]], offset=0),
            src=x_st.ap([[H, n], [1, Hq], [Hq, 4]], offset=0),
        )

    # 2. sum of squares, 512-blocks chained in order in the ScalarE accumulator (§3.2)
    stat = nl.ndarray((TOK_TILE, 2), dtype=nl.float32, buffer=nl.sbuf, name="ss_inv")
    sq = nl.ndarray((TOK_TILE, BLOCK), dtype=nl.float32, buffer=nl.sbuf, name="sq_junk")
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
    nisa.activation(dst=inv, op=nl.rsqrt, data=stat[0:n, 0:1], bias=eps, scale=1.0 / N)

    # 4. inv_rms broadcast to the swizzled layout [128, n]: stride-0 stationary x identity
    inv_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="inv_bcast")
    nisa.nc_matmul(
        dst=inv_ps,
        stationary=inv.broadcast(1, P),
        moving=ts.ident[0:n, 0:n],
        is_moving_onezero=True,
        accumulate=False,
    )
    r_sw = nl.ndarray((P, n), dtype=cd, buffer=nl.sbuf, name="inv_cd")
    nisa.tensor_copy(dst=r_sw, src=inv_ps)  # R_cd(inv_rms), §3.3

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
        nisa.tensor_tensor(
            dst=a_sw[:, b0 : b0 + cb, :, :],
            data1=xt_ps.view(in_dt),  # [128, cb, n, 4] values of x (bit-exact)
            data2=gamma_sw[:, b0 : b0 + cb, :].expand_dim(2).broadcast(2, n),
            op=nl.multiply,
        )

    # 5b. y = R_cd(a * R_cd(inv_rms)), inv broadcast over blocks and lanes (stride 0)
    y_sw = nl.ndarray((P, NB, n, 4), dtype=cd, buffer=nl.sbuf, name="y_sw")
    nisa.tensor_tensor(
        dst=y_sw,
        data1=a_sw,
        data2=r_sw.ap([[n, P], [0, NB], [1, n], [0, 4]], offset=0),
        op=nl.multiply,
    )

    # 6. MX quantization per H512 block: group = 8 partitions x 4 lanes = 32 natural elements.
    # Scale tile rows 32*(b//4) + b%4 (+ (h512%4)*4 when folded), one column per token (§4.2).
    q_sw = nl.ndarray((P, NB, n), dtype=qdt, buffer=nl.sbuf, name="q_sw")
    sc = nl.ndarray((P, n_packs, n), dtype=nl.uint8, buffer=nl.sbuf, name="scales")
    nisa.memset(dst=sc, value=0)  # holes of the scale region are 0x00 (reference HoleFill.ZERO)
    for blk in range(NB):
        pack, shift = (blk // 4, (blk % 4) * 4) if g.pack_scales else (blk, 0)
        nisa.quantize_mx(dst=q_sw[:, blk, :], src=y_sw[:, blk, :, :], dst_scale=sc[shift:, pack, :])

    # 7a. codes back to token-major natural order: x4 words as fp32, PE transposes (§4.1)
    codes_tm = nl.ndarray((TOK_TILE, H // 4), dtype=nl.float32, buffer=nl.sbuf, name="codes_tm")
    q32 = q_sw.view(nl.float32)  # [128, NB, n]
    for b0 in range(0, NB, 4):
        cb = min(4, NB - b0)
        ct_ps = nl.ndarray((TOK_TILE, cb, P), dtype=nl.float32, buffer=nl.psum, name="codes_t")
        for c in range(cb):
            nisa.nc_transpose(dst=ct_ps[0:n, c, :], data=q32[:, b0 + c, :])
        nisa.tensor_copy(dst=codes_tm[0:n, b0 * P : (b0 + cb) * P], src=ct_ps[0:n, :, :])
    nisa.dma_copy(
        dst=ts.packed_f32[t0 : t0 + n, 0 : H // 4],
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
        dst=ts.packed_u8[t0 : t0 + n, H : H + SR], src=sc_tm[0:n, :], dge_mode=nisa.dge_mode.hwdge
    )

    # emit_norm_bf16 (§3.5): R_bf16((x * inv_rms) * gamma), fp32 inv_rms, natural order
    if out_norm is not None:
        nrm = nl.ndarray((TOK_TILE, H), dtype=nl.bfloat16, buffer=nl.sbuf, name="norm_bf16")
        nisa.scalar_tensor_tensor(
            dst=nrm[0:n, :],
            data=x[0:n, :],
            op0=nl.multiply,
            operand0=inv,
            op1=nl.multiply,
            operand1=gamma_tm[0:n, :],
        )
        nisa.dma_copy(dst=out_norm[t0 : t0 + n, :], src=nrm[0:n, :], dge_mode=nisa.dge_mode.hwdge)

    if w_sb is None:
        return

    # 8. router logits: one matmul per (h512, q) contracting partitions p, PSUM chain (§5.1)
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
    if act is RouterActFnType.NOAUX_TC:
        aff = _noaux_tc(
            n, E, K, g.n_group, g.topk_group, g.rsf, lg_ps, inv, bias_tm, ts.iota_e, ts.gid_e
        )
    else:
        aff = _topk_router(n, E, K, act, lg_ps, inv, bias_tm, ts.iota_e, ts.out_index, t0)

    if not g.pack_aff:
        nisa.dma_copy(dst=out_aff[t0 : t0 + n, :], src=aff[0:n, :], dge_mode=nisa.dge_mode.hwdge)
        return
    # §4.3: affinity tail at byte affin_off (bf16 or fp32 little-endian), zero pad to the row end
    aff_dt = aff.dtype
    width = 4 if act is RouterActFnType.NOAUX_TC else 2
    col = g.affin_off // width
    tail = ts.out_packed.view(aff_dt)
    nisa.dma_copy(
        dst=tail[t0 : t0 + n, col : col + E], src=aff[0:n, :], dge_mode=nisa.dge_mode.hwdge
    )
    pad = g.row - (g.affin_off + E * width)
    if pad:
        zpad = nl.ndarray((TOK_TILE, pad), dtype=nl.uint8, buffer=nl.sbuf, name="row_pad")
        nisa.memset(dst=zpad, value=0)
        nisa.dma_copy(dst=ts.packed_u8[t0 : t0 + n, g.row - pad : g.row], src=zpad[0:n, :])


def _topk_router(
    n: int,
    E: int,
    K: int,
    act: RouterActFnType,
    lg_ps: Any,
    inv: Any,
    bias_tm: Any,
    iota_e: Any,
    out_index: Any,
    t0: int,
) -> Any:
    """SIGMOID / SOFTMAX top-K (§5.2): returns the dense bf16 affinity tile [n, E]."""
    Ew = max(E, MAX_TOP_K)
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
    if act is RouterActFnType.SIGMOID:
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
    """``max8`` + ``nc_find_index8`` of `src` [n, >= 8]: the 8 indices as fp32 [n, 8]."""
    top = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_top8")
    nisa.max8(dst=top[0:n, :], src=src)
    idx = nl.ndarray((TOK_TILE, 8), dtype=nl.uint32, buffer=nl.sbuf, name=f"{name}_idx")
    nisa.nc_find_index8(dst=idx[0:n, :], data=src, vals=top[0:n, :])
    idx_f = nl.ndarray((TOK_TILE, 8), dtype=nl.float32, buffer=nl.sbuf, name=f"{name}_idx_f")
    nisa.tensor_copy(dst=idx_f[0:n, :], src=idx[0:n, :])
    return idx_f


def _noaux_tc(
    n: int,
    E: int,
    K: int,
    G: int,
    TG: int,
    rsf: float,
    lg_ps: Any,
    inv: Any,
    bias_tm: Any,
    iota_e: Any,
    gid_e: Any,
) -> Any:
    """NOAUX_TC group-limited routing in fp32 (§5.3, errata 4): dense fp32 affinities [n, E]."""
    epg = E // G
    f32 = nl.float32
    # score = sigmoid(raw * inv_rms): the inv_rms scale fused, no bias inside the sigmoid
    score = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_score")
    nisa.activation(dst=score[0:n, :], op=nl.sigmoid, data=lg_ps[0:n, :], scale=inv)
    sfc = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_sfc")
    nisa.tensor_tensor(dst=sfc[0:n, :], data1=score[0:n, :], data2=bias_tm[0:n, :], op=nl.add)

    # group score = top1 + top2 of each group (groups padded with -SENT to 8 entries)
    if epg < MAX_TOP_K:
        grp = nl.ndarray((TOK_TILE, G, MAX_TOP_K), dtype=f32, buffer=nl.sbuf, name="noaux_groups")
        nisa.memset(dst=grp[0:n, :, :], value=-NOAUX_SENTINEL)
        nisa.tensor_copy(dst=grp[0:n, :, 0:epg], src=sfc[0:n, :].reshape((n, G, epg)))
    else:
        grp = sfc[0:n, :].reshape((n, G, epg))
    g8 = nl.ndarray((TOK_TILE, G, 8), dtype=f32, buffer=nl.sbuf, name="noaux_group_top8")
    for g in range(G):
        nisa.max8(dst=g8[0:n, g, :], src=grp[0:n, g, :])
    gs = nl.ndarray((TOK_TILE, MAX_TOP_K), dtype=f32, buffer=nl.sbuf, name="noaux_group_score")
    if G < MAX_TOP_K:
        nisa.memset(dst=gs[0:n, G:MAX_TOP_K], value=-NOAUX_SENTINEL)
    nisa.tensor_tensor(dst=gs[0:n, 0:G], data1=g8[0:n, :, 0], data2=g8[0:n, :, 1], op=nl.add)
    kept = _select8(n, gs[0:n, :], "noaux_kept")

    # mask[e] = number of kept slots naming group(e); masked = sfc + (mask - 1) * SENT
    mask = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_mask")
    nisa.memset(dst=mask[0:n, :], value=0.0)
    for j in range(TG):
        nisa.scalar_tensor_tensor(
            dst=mask[0:n, :],
            data=gid_e[0:n, :],
            op0=nl.equal,
            operand0=kept[0:n, j : j + 1],
            op1=nl.add,
            operand1=mask[0:n, :],
        )
    shift = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_shift")
    nisa.tensor_scalar(
        dst=shift[0:n, :],
        data=mask[0:n, :],
        op0=nl.subtract,
        operand0=1.0,
        op1=nl.multiply,
        operand1=NOAUX_SENTINEL,
    )
    masked = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_masked")
    nisa.tensor_tensor(dst=masked[0:n, :], data1=sfc[0:n, :], data2=shift[0:n, :], op=nl.add)
    sel = _select8(n, masked[0:n, :], "noaux_sel")

    # onehot (counts) of the K selected experts; w = pre-bias score of the selected
    onehot = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_onehot")
    nisa.memset(dst=onehot[0:n, :], value=0.0)
    for k in range(K):
        nisa.scalar_tensor_tensor(
            dst=onehot[0:n, :],
            data=iota_e[0:n, 0:E],
            op0=nl.equal,
            operand0=sel[0:n, k : k + 1],
            op1=nl.add,
            operand1=onehot[0:n, :],
        )
    w = nl.ndarray((TOK_TILE, E), dtype=f32, buffer=nl.sbuf, name="noaux_w")
    nisa.tensor_tensor(dst=w[0:n, :], data1=score[0:n, :], data2=onehot[0:n, :], op=nl.multiply)
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
