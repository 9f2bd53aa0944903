"""Router of ``rmsnorm_mx_prefill``: logits, top-K (SIGMOID / SOFTMAX) and NOAUX_TC (spec §5).

Pure functions on token-major fp32 tensors; every selection emulates the hardware's ``max8`` +
``nc_find_index8`` pair (`hardware_topk`): the K largest values in descending order, and for
each the index of its occurrence in the row, where the k-th of equal values takes the k-th
occurrence (api spec §8.14: "duplicate values in ``vals`` take successive occurrences in
ascending position order (the k-th duplicate gets the k-th match)"). Exact ties therefore give
K distinct experts, the lower index first; this replaces the prefill spec's first-occurrence
reading (§5.2 step 3, marked [UNCONFIRMED]), under which a tie repeated one index.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from mxcli.kernels.rmsnorm_mx_prefill.contract import MAX_TOP_K, RouterActFnType
from mxcli.mx.quantize import uses_fused_kernels

# §5.2: pad columns of a short row never win against a real logit.
FP32_LOWEST = -3.4028234663852886e38
# §5.3: finite "minus infinity" of NOAUX_TC group masking.
NOAUX_SENTINEL = 30000.0
# §5.3: added to the selected-score sum before the reciprocal.
NOAUX_DEN_EPS = 1e-20


class LogitAccumulation(enum.Enum):
    """Order in which router logits ``raw[t, e] = sum_h a[t, h] * W[h, e]`` are accumulated (§5.1).

    Both accumulate cd x cd products (exact in fp32) in fp32; the PE array's internal order is
    not observable, so neither is bit-exact to hardware in general.

    - ``FLAT`` (default): one fp32 matmul over all H (BLAS order). Fastest.
    - ``PSUM_CHAIN``: one partial matmul per (H512 block, lane q) contracting the 128 partitions
      ``h = h512*512 + 4p + q``, partials added sequentially in kernel order (h512-major,
      q-minor) — the kernel's PSUM accumulation chain.
    """

    FLAT = "flat"
    PSUM_CHAIN = "psum_chain"


def prepare_router_matrix(
    w_natural: torch.Tensor, accumulation: LogitAccumulation = LogitAccumulation.FLAT
) -> torch.Tensor:
    """fp32 router matrix in the form `router_raw_logits` consumes.

    ``FLAT``: ``[H, E]``; ``PSUM_CHAIN``: ``[H/512, 4, 128, E]`` indexed (h512, q, p, e).
    """
    w = w_natural.to(torch.float32)
    if accumulation is LogitAccumulation.FLAT:
        return w.contiguous()
    H, E = w.shape
    # natural h = h512*512 + 4p + q  ->  [h512, p, q, E] -> [h512, q, p, E]
    return w.view(H // 512, 128, 4, E).permute(0, 2, 1, 3).contiguous()


def router_raw_logits(
    a: torch.Tensor,
    w_prepared: torch.Tensor,
    accumulation: LogitAccumulation,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``raw [T, E] = a [T, H] @ W`` in fp32 (§5.1); `a` holds the cd-rounded ``R_cd(x*gamma)``.

    With `out` (contiguous ``[T, E]`` fp32) the result is written there and returned."""
    if accumulation is LogitAccumulation.FLAT:
        # the same BLAS call either way; out= only saves the copy
        return torch.matmul(a, w_prepared) if out is None else torch.matmul(a, w_prepared, out=out)
    nb = w_prepared.shape[0]
    T = a.shape[0]
    # a: [T, h512, p, q] -> [h512, q, T, p]; partials [h512, q, T, E]
    a4 = a.view(T, nb, 128, 4).permute(1, 3, 0, 2)
    partial = torch.matmul(a4, w_prepared).view(nb * 4, T, -1)
    raw = partial[0].clone()
    for i in range(1, nb * 4):  # PSUM accumulation chain, kernel order (56 adds for H=7168)
        raw += partial[i]
    return raw if out is None else out.copy_(raw)


def hardware_topk(
    x: torch.Tensor, k: int, pad_value: float = FP32_LOWEST
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max8`` + ``nc_find_index8`` on each row of ``x [T, N]`` (fp32), first `k` results.

    Rows shorter than 8 are padded with `pad_value` (pad column ``j`` has index ``j``).
    Returns ``(values [T, k] descending, index [T, k] int64)``: equal values take successive
    occurrences (api spec §8.14), so ``index`` is the first `k` of a stable descending sort
    (ties in ascending column order; -0 equals +0, as the fp32 compare has it) and its entries
    are distinct.
    """
    T, N = x.shape
    if N < MAX_TOP_K:
        pad = torch.full((T, MAX_TOP_K - N), pad_value, dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=1)
    values, index = torch.topk(x, k, dim=1, largest=True, sorted=True)  # [T, k]
    # torch.topk orders equal values arbitrarily: only rows where a selected value occurs twice
    # (a tie among the selected values, or another element equal to the k-th value) need the
    # stable sort, which is much slower on many rows
    tied = (x >= values[:, -1:]).sum(dim=1) > k
    if k > 1:
        tied |= (values[:, 1:] == values[:, :-1]).any(dim=1)
    rows = tied.nonzero().squeeze(1)
    if rows.numel():
        order = torch.sort(x[rows], dim=1, descending=True, stable=True)
        values[rows] = order.values[:, :k]
        index[rows] = order.indices[:, :k]
    return values, index


def _sequential_sum(v: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last (short) axis, left to right, as an accumulator register does."""
    acc = v[..., 0].clone()
    for j in range(1, v.shape[-1]):
        acc += v[..., j]
    return acc


def topk_affinities(
    logits: torch.Tensor, top_k: int, act: RouterActFnType
) -> tuple[torch.Tensor, torch.Tensor]:
    """SIGMOID / SOFTMAX top-K (§5.2) on fp32 ``logits [T, E]`` (bias already added).

    Returns ``(expert_index [T, K] int32, affinities [T, E] bf16)``. Affinities are dense: each
    slot adds ``R_bf16(s_k)`` at its own column (the K indices are distinct, `hardware_topk`),
    all other experts are exactly 0.

    Non-finite logits (an overflow, see `reference`) follow IEEE arithmetic and the decisions of
    the NKI interpreter (api spec §12 #25): ``max8`` sorts NaN as the largest value and
    ``nc_find_index8`` never matches NaN, so a NaN slot's index is 0xFFFFFFFF (-1 as int32). The
    dense row is built as ``sum_k (iota == idx_k) * s_k``, so one NaN ``s_k`` (a NaN logit, or
    ``exp(inf - inf)`` in the softmax) makes every column NaN (``0 * NaN``).
    """
    T, E = logits.shape
    vals, idx = hardware_topk(logits, top_k)  # [T, K]
    nan_slot = torch.isnan(vals)
    idx = idx.masked_fill(nan_slot, -1)
    if act is RouterActFnType.SIGMOID:
        s = torch.sigmoid(vals)  # no renormalisation
    else:
        # softmax over the K selected logits: m = l_0 (the max), reciprocal then multiply
        e = torch.exp(vals - vals[:, :1])
        s = e * (1.0 / _sequential_sum(e)).unsqueeze(1)
    s_bf = s.to(torch.bfloat16).to(torch.float32)
    aff = torch.zeros((T, max(E, MAX_TOP_K)), dtype=torch.float32, device=logits.device)
    for j in range(top_k):  # K <= 8 slots, in slot order (each add rounds to bf16)
        col = idx[:, j : j + 1].clamp_min(0)  # a -1 slot's row is all NaN below
        acc = (aff.gather(1, col) + s_bf[:, j : j + 1]).to(torch.bfloat16).to(torch.float32)
        aff.scatter_(1, col, acc)
    aff[torch.isnan(s_bf).any(dim=1)] = float("nan")
    return idx.to(torch.int32), aff[:, :E].to(torch.bfloat16)


def _fused_routing(score: torch.Tensor, bias: torch.Tensor) -> Any:
    """`_fused` when its NOAUX_TC routing applies: numba available and on (see
    `mxcli.mx.quantize.uses_fused_kernels`), CPU fp32 scores, a finite bias; else None."""
    if score.dtype != torch.float32 or not uses_fused_kernels(score):
        return None
    if not bool(torch.isfinite(bias).all()):
        return None
    try:
        from mxcli.kernels.rmsnorm_mx_prefill import _fused
    except Exception:  # numba broken: the torch path gives the same bytes
        return None
    return _fused


def noaux_tc_affinities(
    scaled_logits: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    routed_scaling_factor: float,
    *,
    emulate_upstream_ref_bias_bug: bool = False,
) -> torch.Tensor:
    """NOAUX_TC group-limited routing (§5.3, errata 4), fp32 ``[T, E]`` dense affinities.

    `scaled_logits` is ``raw * inv_rms`` [T, E] fp32, `bias` the fp32 e_score_correction_bias [E].
    With `emulate_upstream_ref_bias_bug` the bias is also added before the sigmoid, as the
    upstream golden does (its affinities then use the biased scores); off by default.
    """
    pre = scaled_logits + bias if emulate_upstream_ref_bias_bug else scaled_logits
    score = torch.sigmoid(pre)  # [T, E]; the kernel fuses the inv_rms scale, no bias here
    args = (bias, n_group, topk_group, top_k, routed_scaling_factor)
    fused = _fused_routing(score, bias)
    if fused is None:
        return _noaux_tc_from_scores(score, *args)
    # same arithmetic as `_noaux_tc_from_scores`, one pass per token; rows holding a non-finite
    # score take the torch path, which carries the NaN semantics (routing is per row)
    out, bad = fused.noaux_tc(score, *args, NOAUX_SENTINEL, FP32_LOWEST, NOAUX_DEN_EPS)
    if bad.numel():
        out[bad] = _noaux_tc_from_scores(score[bad], *args)
    return out


def _noaux_tc_from_scores(
    score: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    routed_scaling_factor: float,
) -> torch.Tensor:
    """`noaux_tc_affinities` after the sigmoid: ``score [T, E]`` fp32."""
    T, E = score.shape
    dev = score.device
    epg = E // n_group
    sfc = score + bias  # "scores for choice": selection only
    # group score = top1 + top2 of each group (max8 over the group padded with -SENT to 8)
    grouped = sfc.view(T, n_group, epg)
    if epg < MAX_TOP_K:
        pad = torch.full(
            (T, n_group, MAX_TOP_K - epg), -NOAUX_SENTINEL, dtype=torch.float32, device=dev
        )
        grouped = torch.cat([grouped, pad], dim=2)
    # top2 = the max after removing one occurrence of the max (equals top1 on a tie); two max
    # reductions are much cheaper than torch.topk on many short rows
    top1, at = grouped.max(dim=2, keepdim=True)  # [T, G, 1]
    top2 = grouped.scatter(2, at, float("-inf")).amax(dim=2)  # [T, G]
    gs = top1.squeeze(2) + top2  # [T, G]
    _, kept = hardware_topk(gs, topk_group, pad_value=-NOAUX_SENTINEL)  # [T, TG]
    # mask[e] = 1 for the experts of a kept group, else 0 (the kept groups are distinct)
    ones = torch.ones((T, max(topk_group, top_k)), dtype=torch.float32, device=dev)
    gmask = torch.zeros((T, max(n_group, MAX_TOP_K)), dtype=torch.float32, device=dev)
    gmask.scatter_add_(1, kept, ones[:, :topk_group])  # pad groups (index >= G) fall off below
    mask = gmask[:, :n_group].repeat_interleave(epg, dim=1)  # [T, E]
    # kept: sfc; dropped: sfc - 30000 (both adds in fp32, errata 4)
    masked = sfc + (mask - 1.0) * NOAUX_SENTINEL
    _, sel = hardware_topk(masked, top_k)  # [T, K]
    onehot = torch.zeros((T, E), dtype=torch.float32, device=dev)
    onehot.scatter_add_(1, sel, ones[:, :top_k])  # 0/1: the selected experts are distinct
    w = score * onehot  # pre-bias scores of the selected experts
    # den = sum over all E columns in ascending expert order (errata 4): only the selected
    # columns are nonzero, so add them in ascending order
    picked = w.gather(1, torch.sort(sel, dim=1).values)
    zero = torch.zeros((T, 1), dtype=torch.float32, device=dev)
    den = _sequential_sum(torch.cat([zero, picked], dim=1)) + NOAUX_DEN_EPS
    c = torch.tensor(routed_scaling_factor, dtype=torch.float32, device=dev) * (1.0 / den)
    return w * c.unsqueeze(1)
