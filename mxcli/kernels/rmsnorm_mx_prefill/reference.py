"""Kernel-faithful torch reference of ``rmsnorm_mx_prefill`` (prefill spec §3-§5).

Reproduces the Trn3 kernel's numerics (every rounding point of §3.3, the NEURON MX scale rule,
the hardware's top-K tie order, NOAUX_TC in fp32) and its byte layout (§4). Arithmetic runs in
fp32 with explicit rounds to the compute dtype ``cd`` where the kernel rounds. Tokens are
independent, so the work runs in chunks of tokens: memory is linear in T and intermediates stay
cache-sized.

Not bit-exact by nature (spec §1, §9): the hardware's rsqrt / sigmoid / exp approximations and
its fp32 accumulation orders (sum of squares, router matmul).

Overflow (decision; spec §1 "engine arithmetic converts to fp32", §3.2, §3.3): every step is
IEEE fp32 with RNE casts, nothing is guarded. A finite row with ``|x| >= 2^64`` overflows the
fp32 sum of squares to +inf, so ``inv_rms = rsqrt(inf) = 0``: with a bf16 compute dtype
``y = R_cd(a * 0) = 0`` (zero codes, scale byte 0, ``norm_bf16`` 0, logits ``raw * 0``); with
fp16 (an fp16 router) ``a = R_fp16(x * gamma)`` is inf once ``|x * gamma| > 65504`` and
``y = inf * 0 = NaN`` (NaN codes under scale byte 248, §3.4). The NKI kernel on the interpreter
gives the same codes and scales. ``run-prefill`` warns about such outputs
(`mxcli.verification.finite`).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from mxcli import memory
from mxcli.io.kwargs import coerce_enum
from mxcli.kernels.rmsnorm_mx_prefill.contract import PrefillCall, RouterActFnType, as_call
from mxcli.kernels.rmsnorm_mx_prefill.router import (
    LogitAccumulation,
    noaux_tc_affinities,
    prepare_router_matrix,
    router_raw_logits,
    topk_affinities,
)
from mxcli.kernels.rmsnorm_mx_prefill.router_weights import unarrange_router_weights
from mxcli.mx import ScaleRule, prefill_scale_offsets, quantize_mx
from mxcli.mx.quantize import as_rule, uses_fused_kernels

# Tokens per work chunk on CPU: at least 128 (the router matmul loses efficiency below that),
# more for small H so per-op overhead stays small. Results do not depend on it.
_MIN_CHUNK_TOKENS = 128
_CHUNK_ELEMS = 1 << 21
# Tokens per router matmul on CPU: the gamma-only activations of several work chunks are kept
# (fp32, about 32 MB) and multiplied at once. Measured on a 2-core EPYC (T 4096, H 7168, E 256):
# 292-token matmuls took 98 ms in all, 1024-token ones 81 ms, and each switch between numba's
# and torch's thread pools costs more on 2 cores.
_MATMUL_SPAN_ELEMS = 1 << 23
# Tokens per routing chunk (top-K / NOAUX_TC on [chunk, E] logits).
_ROUTE_CHUNK_TOKENS = 2048


class HoleFill(enum.Enum):
    """Bytes the reference writes where the API defines none (spec §4.2, §4.3): the scale-region
    holes and the affinity-row pad. The API promises nothing about them, and a kernel may leave
    them unwritten (AWS's does: its rows carry stale SBUF there, `decode.defined_bytes` marks
    them); comparisons exclude and count them (`mxcli.verification.policy`).

    - ``ZERO`` (default): 0x00 (what the consumer-side layout helper upstream writes, and what
      mxcli's NKI kernel writes).
    - ``UNFOLDED_FF``: with ``pack_scales=False`` the scale-region holes are 0xFF; folded holes
      and pads stay 0x00. This is *not* AWS's unfolded output: its 0xFF staging memset is
      overwritten by a full-width copy of each transposed scale tile, whose hole columns are
      whatever ``quantize_mx`` left in the partitions it does not write (measured on the NKI
      Library kernel, issue 20). Kept for consumers that want a fixed non-zero hole pattern.
    """

    ZERO = "zero"
    UNFOLDED_FF = "unfolded_ff"


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Spec §3.1: ``x_nat[4p + q] = x_stored[q*(H/4) + p]`` over the whole row."""
    T, H = x.shape
    return x.view(T, 4, H // 4).transpose(1, 2).reshape(T, H)


def _fused_chain(cfg: PrefillCall, hidden_states: torch.Tensor) -> Any:
    """The `_fused` kernels module when they apply (numba installed and not turned off with
    ``MXCLI_FUSED=0``, CPU, bf16 input and compute dtype, a fixed bf16 NaN pattern), else None."""
    if cfg.compute_dtype != torch.bfloat16 or hidden_states.dtype != torch.bfloat16:
        return None
    if not uses_fused_kernels(hidden_states):
        return None
    try:
        from mxcli.kernels.rmsnorm_mx_prefill import _fused
    except Exception:  # numba broken: the torch chain gives the same bytes
        return None
    return _fused if _fused.bf16_nan_bits() is not None else None


def _sequential_sum(v: torch.Tensor) -> torch.Tensor:
    acc = v[..., 0].clone()
    for j in range(1, v.shape[-1]):
        acc += v[..., j]
    return acc


def rmsnorm_mx_prefill_reference(
    *args: Any,
    emulate_upstream_ref_bias_bug: bool = False,
    hole_fill: HoleFill = HoleFill.ZERO,
    scale_rule: ScaleRule = ScaleRule.NEURON,
    logit_accumulation: LogitAccumulation = LogitAccumulation.FLAT,
    token_chunk: int | None = None,
    **kwargs: Any,
) -> list[torch.Tensor]:
    """The ``reference`` backend of `rmsnorm_mx_prefill`: takes its `PrefillCall`, or the
    arguments of `rmsnorm_mx_prefill` (validated here into one).

    Keyword-only extras, all defaulting to the kernel's behaviour:

    - `emulate_upstream_ref_bias_bug`: NOAUX_TC adds the bias before the sigmoid too, like the
      upstream golden (spec §5.3); for golden-for-golden comparisons only.
    - `hole_fill`: content of the bytes the kernel never writes (`HoleFill`).
    - `scale_rule`: ``ScaleRule.OCP`` gives the legacy emax-8 scale bytes (spec §3.4).
    - `logit_accumulation`: fp32 accumulation order of the router matmul (`LogitAccumulation`).
    - `token_chunk`: tokens per work chunk (performance only). The packed rows, residual and
      norm outputs do not depend on it; router logits come from a BLAS fp32 matmul whose
      summation order may change with the chunk (last-bit differences, spec §5.1).
    """
    cfg = as_call(*args, **kwargs)
    hole = coerce_enum(HoleFill, hole_fill, "hole_fill")
    rule = as_rule(scale_rule)
    acc = coerce_enum(LogitAccumulation, logit_accumulation, "logit_accumulation")
    return _run(
        cfg,
        cfg.hidden_states,
        cfg.gamma,
        cfg.router_weights,
        cfg.router_bias,
        cfg.residual,
        emulate_upstream_ref_bias_bug=bool(emulate_upstream_ref_bias_bug),
        hole=hole,
        rule=rule,
        acc=acc,
        token_chunk=token_chunk,
    )


def _run(
    cfg: PrefillCall,
    hidden_states: torch.Tensor,
    gamma: torch.Tensor,
    router_weights: torch.Tensor | None,
    router_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    *,
    emulate_upstream_ref_bias_bug: bool,
    hole: HoleFill,
    rule: ScaleRule,
    acc: LogitAccumulation,
    token_chunk: int | None,
) -> list[torch.Tensor]:
    T, H, E, K = cfg.T, cfg.H, cfg.num_experts, cfg.top_k
    geo = cfg.geometry
    dev = hidden_states.device
    cd = cfg.compute_dtype
    in_dtype = hidden_states.dtype
    f32 = torch.float32

    hs = hidden_states.reshape(T, H)  # [T, H] stored order
    res = residual.reshape(T, H) if residual is not None else None
    g = gamma.reshape(H).to(f32).contiguous()  # [H] natural order
    # §3.2: the mean is a multiply by the fp32 immediate 1/N; eps is the rsqrt bias (fp32)
    inv_n = torch.tensor(1.0 / cfg.unpadded_hidden_size, dtype=f32, device=dev)
    eps32 = torch.tensor(cfg.eps, dtype=f32, device=dev)

    # --- outputs (§2.2) ---
    packed = memory.empty((T, geo.row_region), torch.uint8, dev)  # written in full: huge pages
    offsets = H + prefill_scale_offsets(H, cfg.pack_scales).to(dev)  # [H/32] absolute bytes
    out_index = torch.empty((T, K), dtype=torch.int32, device=dev) if cfg.returns_index else None
    aff_dtype = f32 if cfg.act is RouterActFnType.NOAUX_TC else torch.bfloat16
    out_aff = torch.empty((T, E), dtype=aff_dtype, device=dev) if cfg.returns_affinities else None
    out_res = (
        torch.empty((T, H), dtype=residual.dtype, device=dev) if residual is not None else None
    )
    out_norm = torch.empty((T, H), dtype=torch.bfloat16, device=dev) if cfg.emit_norm_bf16 else None
    # the region after the codes: scale bytes + holes (+ affinity tail + pad); holes per HoleFill
    tail_fill = torch.zeros(geo.row_region - H, dtype=torch.uint8, device=dev)
    if hole is HoleFill.UNFOLDED_FF and not cfg.pack_scales:
        tail_fill[: geo.scale_region] = 0xFF

    w_mat = bias32 = logits = None
    if router_weights is not None:
        w_nat = unarrange_router_weights(router_weights, cfg.act)  # [H, E] natural rows (§6.1)
        w_mat = prepare_router_matrix(w_nat, acc)
        if router_bias is not None:
            bias32 = router_bias.reshape(E).to(f32)
        logits = torch.empty((T, E), dtype=f32, device=dev)  # raw * inv_rms, fp32

    chunk = token_chunk or max(_MIN_CHUNK_TOKENS, _CHUNK_ELEMS // H)
    if dev.type == "cuda" and token_chunk is None:
        chunk = max(chunk, 8192)  # a GPU wants big launches; memory stays linear in T
    chunk = max(1, min(chunk, T))
    # Work buffers reused by every chunk ([chunk, H]): fp32 x, fp32 scratch, fp32 a, and one cd
    # buffer holding a, then y (a lives on in fp32 for the router).
    # router matmul span: whole work chunks (the GPU keeps one chunk per matmul)
    span = chunk if dev.type == "cuda" else chunk * max(1, _MATMUL_SPAN_ELEMS // (chunk * H))
    span = min(span, -(-T // chunk) * chunk)
    xf_buf = torch.empty((chunk, H), dtype=f32, device=dev)
    tmp_buf = torch.empty((chunk, H), dtype=f32, device=dev)
    af_span = torch.empty((span if w_mat is not None else chunk, H), dtype=f32, device=dev)
    inv_span = torch.empty((span, 1), dtype=f32, device=dev)
    a_buf = torch.empty((chunk, H), dtype=cd, device=dev)
    xs_buf = torch.empty((chunk, H), dtype=in_dtype, device=dev) if res is not None else None
    fused = _fused_chain(cfg, hidden_states)
    fmt = cfg.qmx.elem
    offset = rule.exponent_offset(fmt)
    xn_buf = (
        torch.empty((chunk, H), dtype=in_dtype, device=dev)
        if fused is not None and cfg.hidden_interleaved
        else None
    )

    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        n = t1 - t0
        s0 = (t0 % span) if w_mat is not None else 0  # row of this chunk in the span
        xf, tmp, a = xf_buf[:n], tmp_buf[:n], a_buf[:n]
        af = af_span[s0 : s0 + n]
        x = hs[t0:t1]  # [n, H] in_dtype, stored order
        if res is not None:
            # §3.1: the DMA adds in fp32 and writes the sum in the input dtype (one RNE)
            assert xs_buf is not None and out_res is not None
            xf.copy_(x)
            tmp.copy_(res[t0:t1])
            xs = xs_buf[:n]
            xs.copy_(xf.add_(tmp))
            out_res[t0:t1] = xs  # stored (interleaved) order, converted to residual.dtype
            x = xs
        if fused is not None:
            # same arithmetic as the torch branch below, fused (`_fused`): bit-identical
            if cfg.hidden_interleaved:
                assert xn_buf is not None
                xn = xn_buf[:n]  # §3.1 de-interleave in bf16 (exact)
                xn.view(n, H // 4, 4).copy_(x.view(n, 4, H // 4).transpose(1, 2))
                x = xn
            x = x.contiguous()
            fused.squares(x, tmp)
            ss = _sequential_sum(tmp.view(n, geo.num_h512, 512).sum(dim=2))
            inv_rms = torch.rsqrt(ss * inv_n + eps32)  # [n] fp32
            inv_col = inv_rms.unsqueeze(1)
            if out_norm is not None:
                xf.copy_(x)
                torch.mul(xf, inv_col, out=tmp)
                out_norm[t0:t1] = tmp.mul_(g)
            rows = packed[t0:t1]
            r = inv_rms.to(cd).to(f32).contiguous()
            fused.rms_chain(
                x,
                g,
                r,
                offset,
                fmt.torch_dtype,
                fmt.max_finite,
                offsets,
                tail_fill,
                rows,
                af if w_mat is not None else None,
            )
        else:
            if cfg.hidden_interleaved:
                # §3.1: x_nat[4p + q] = x_stored[q*(H/4) + p], de-interleaved while widening
                xf.view(n, H // 4, 4).copy_(x.view(n, 4, H // 4).transpose(1, 2))
            else:
                xf.copy_(x)  # [n, H] fp32, natural order (exact widening)

            # §3.2: fp32 sum of squares over the full padded H, 512-blocks chained in order
            torch.mul(xf, xf, out=tmp)
            ss = _sequential_sum(tmp.view(n, geo.num_h512, 512).sum(dim=2))
            inv_rms = torch.rsqrt(ss * inv_n + eps32)  # [n] fp32
            inv_col = inv_rms.unsqueeze(1)

            if out_norm is not None:
                # §3.5: fp32 x*inv_rms*gamma (fp32 inv_rms, not the cd one), one bf16 rounding
                torch.mul(xf, inv_col, out=tmp)
                out_norm[t0:t1] = tmp.mul_(g)

            # §3.3: three roundings to cd: a = R(x*g); r = R(inv); y = R(a*r)
            torch.mul(xf, g, out=af)
            a.copy_(af)
            af.copy_(a)  # af: the cd values of a in fp32 (router input too, §5.1)
            r = inv_rms.to(cd).to(f32).unsqueeze(1)
            torch.mul(af, r, out=tmp)
            y = a
            y.copy_(tmp)  # [n, H] cd, what quantize_mx sees

            # §3.4 / §4: codes in natural order, one scale byte per 32 contiguous elements
            codes, scales = quantize_mx(y, -1, elem=cfg.qmx.elem, rule=rule, scheme="1x32")
            rows = packed[t0:t1]
            rows[:, :H] = codes
            rows[:, H:] = tail_fill
            rows[:, offsets] = scales

        if w_mat is not None:
            assert logits is not None
            inv_span[s0 : s0 + n] = inv_col
            if t1 == T or s0 + n == span:  # the span is complete
                # §5.1: logits from the gamma-only activations; inv_rms applied after the matmul
                lg = logits[t1 - (s0 + n) : t1]
                router_raw_logits(af_span[: s0 + n], w_mat, acc, out=lg)
                lg.mul_(inv_span[: s0 + n])

    if logits is not None:
        # Routing runs on big token chunks: its many small ops are overhead-bound.
        for t0 in range(0, T, _ROUTE_CHUNK_TOKENS):
            t1 = min(T, t0 + _ROUTE_CHUNK_TOKENS)
            lg = logits[t0:t1]  # [n, E] fp32
            if cfg.act is RouterActFnType.NOAUX_TC:
                assert bias32 is not None
                aff = noaux_tc_affinities(
                    lg,
                    bias32,
                    cfg.n_group,
                    cfg.topk_group,
                    K,
                    cfg.routed_scaling_factor,
                    emulate_upstream_ref_bias_bug=emulate_upstream_ref_bias_bug,
                )
            else:
                if bias32 is not None:
                    lg = lg + bias32  # §5.1: bias after the inv_rms scale
                idx, aff = topk_affinities(lg, K, cfg.act)
                assert out_index is not None
                out_index[t0:t1] = idx
            if out_aff is not None:
                out_aff[t0:t1] = aff
            else:
                # §4.3: little-endian affinity bytes in the row tail (bf16 or fp32)
                nbytes = E * geo.aff_bytes
                tail = packed[t0:t1, geo.affin_off : geo.affin_off + nbytes]
                tail.copy_(aff.contiguous().view(torch.uint8))

    outputs: list[torch.Tensor] = [packed.view(torch.float8_e4m3fn)]
    if out_index is not None:
        outputs.append(out_index)
    if out_aff is not None:
        outputs.append(out_aff)
    if out_res is not None:
        outputs.append(out_res)
    if out_norm is not None:
        outputs.append(out_norm)
    return outputs
