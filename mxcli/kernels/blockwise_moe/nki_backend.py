"""The host side of ``blockwise_mm_bwd_mxfp8``'s NKI launch: the hooks of its spec's `NkiLaunch`,
which the one launcher (`mxcli.kernels.launcher`) calls on the ``sim`` and ``neuron`` backends
with the validated `BwdCall` (or the arguments of `blockwise_mm_bwd_mxfp8`, validated into one);
the outputs are the reference's tuple of torch tensors on the device of ``hidden_states``.

Everything that is not device work happens on the host, once, before the kernel is traced (as
upstream NKI Library launchers do; nki_python_subset.md): the contract has validated the inputs
with the reference's rules and messages (bwd spec §10), including the data-dependent ones the
device can only report as a DMA fault (padding ids without ``skip_token``, expert ids out of
range); here the
`MXFP8MOEBwdConfig` (torch dtypes, host enums) is checked against what the kernel implements and
turned into the kernel's `BwdKernelConfig` (`kernel_config`: ints, bools, tuples, ``nki``
dtypes), with the launch planned: the wrapX chunk lists of the four contractions (tile_k,
errata 1), the DMA runs over them and the placement of packed pre-quantized scales.

Tensors cross as NKI-compatible dtypes: token ids and expert ids as int32, ``num_valid_tokens``
as a ``[1]`` int32 tensor, pre-quantized weights as uint32 x4 words and uint8 scale bytes
(nki_execution.md §7.2).
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels.blockwise_moe.config import (
    AffinityOption,
    BwdValidationError,
    MXFP8MOEBwdConfig,
)
from mxcli.kernels.blockwise_moe.contract import BwdCall, as_call
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.blockwise_moe.spec import MXCLI_KERNEL
from mxcli.kernels.nki_runtime import DTypeName, KernelObject
from mxcli.mx import QuantScheme, wrapx_chunks

__all__ = [
    "KERNEL",
    "NkiKernelUnsupportedError",
    "api_arguments",
    "finish",
    "kernel_arguments",
    "kernel_config",
    "prepare",
]

KERNEL = str(MXCLI_KERNEL.kernel)  # the jit entry, "module:function"
KERNEL_CONFIG = f"{KERNEL.partition(':')[0]}:BwdKernelConfig"
P = 128  # partitions
QUAD = 32  # partitions per SBUF quadrant
# the kernel's tensor parameters (`nki_kernel.blockwise_mm_bwd_mxfp8_nki`)
_KERNEL_TENSORS = (
    "hidden_states",
    "expert_affinities_masked",
    "gate_up_proj_weight",
    "down_proj_weight",
    "token_position_to_id",
    "block_to_expert",
    "output_hidden_states_grad",
    "gate_up_proj_act_checkpoint_T",
    "gate_act_checkpoint_T",
    "intermediate_checkpoint_T",
    "scaled_intermediate_checkpoint_T",
    "gate_up_weight_scales",
    "down_weight_scales",
    "num_valid_tokens",
)


class NkiKernelUnsupportedError(BwdValidationError):
    """A valid configuration that this NKI kernel does not implement (the reference does)."""


# -- planning ------------------------------------------------------------------------------------

Chunks = tuple[tuple[int, int], ...]


def phase_chunks(K: int, grouping: Grouping) -> Chunks:
    """wrapX chunks ``((k0, c), ...)`` of a contraction of length K (config tile_k, errata-1
    override)."""
    chunks = grouping.chunks if grouping.chunks is not None else wrapx_chunks(K, grouping.tile_k)
    return tuple((int(k0), int(c)) for k0, c in chunks)


def dma_runs(chunks: Chunks) -> tuple[tuple[int, int], ...]:
    """``(first chunk, count)`` runs of full 128-lane chunks whose HBM rows (``k0/4 ...``)
    are contiguous, so that one DMA loads a run; remainder chunks form runs of one."""
    runs: list[tuple[int, int]] = []
    for i, (k0, c) in enumerate(chunks):
        if runs:
            i0, m = runs[-1]
            lk0, lc = chunks[i0 + m - 1]
            if c // 4 == P and lc // 4 == P and lk0 // 4 + P == k0 // 4:
                runs[-1] = (i0, m + 1)
                continue
        runs.append((i, 1))
    return tuple(runs)


def packed_scale_placement(
    chunks: Chunks,
) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
    """Where the kernel finds each chunk's scales in a packed scale tensor (bwd spec §5.5).

    Packed row of MX group ``m`` (512-tile ``t = m // 16``, ``ml = m % 16``):
    ``(t // 4)·128 + 4·(t % 4) + (ml // 4)·32 + ml % 4``. A chunk from ``k0`` has lane ``p`` in
    quadrant ``p // 32`` and its scale in row ``g·128 + o + qoff + 32·(p // 32) + (p % 32) // 8``
    with ``g = t // 4``, ``o = 4·(t % 4)`` and ``qoff = 32·((k0/32 % 16) // 4)``, which is not 0
    when the chunk does not start on a 512 boundary: the scales would sit ``qoff/32`` quadrants
    below their data, and the MX matmul needs them in the data's quadrant.

    Returns ``(groups, place)``: the 128-row groups loaded whole (one slot each, used by the
    chunks with ``qoff = 0``), and per chunk ``(slot, start partition o, first HBM row)``, the
    row being -1 for a chunk served by its group and ``g·128 + o + qoff`` for a chunk whose
    4 rows per quadrant the kernel copies into a slot of its own at partitions
    ``o + 32·q ... o + 32·q + 3`` of quadrant ``q``.
    """
    groups: list[int] = []
    info: list[tuple[int, int, int]] = []
    for k0, _c in chunks:
        m0 = k0 // 32
        t, ml0 = m0 // 16, m0 % 16
        g, o, qoff = t // 4, 4 * (t % 4), QUAD * (ml0 // 4)
        info.append((g, o, qoff))
        if qoff == 0 and g not in groups:
            groups.append(g)
    place: list[tuple[int, int, int]] = []
    extra = len(groups)
    for g, o, qoff in info:
        if qoff == 0:
            place.append((groups.index(g), o, -1))
        else:
            place.append((extra, o, g * P + o + qoff))
            extra += 1
    return tuple(groups), tuple(place)


def kernel_config(
    inp: BwdCall, cfg: MXFP8MOEBwdConfig, nv: bool, pq_gu: bool, pq_d: bool
) -> KernelObject:
    """The kernel's `BwdKernelConfig` for a validated call `inp` and config `cfg`, after
    checking that this kernel implements the configuration (`NkiKernelUnsupportedError`)."""
    if cfg.quant_scheme is not QuantScheme.WRAPX:
        raise NkiKernelUnsupportedError(
            f"config.quant_scheme: the NKI kernel implements WRAPX only, got {cfg.quant_scheme.name}"
        )
    if cfg.affinity_option is not AffinityOption.AFFINITY_ON_I:
        raise NkiKernelUnsupportedError(
            "config.affinity_option: the NKI kernel implements AFFINITY_ON_I only, got "
            f"{cfg.affinity_option.name}"
        )
    T, H, I, E, B, N = inp.T, inp.H, inp.I, inp.E, inp.B, inp.N  # noqa: E741
    p1, p2, p3, p4 = cfg.phase_configs()
    cl = cfg.clamp_limits
    assert cl is not None  # validated
    k1 = phase_chunks(H, Grouping.for_phase(p1, H, cfg.fast_dma_transpose))
    k2 = phase_chunks(2 * I, Grouping.for_phase(p2, 2 * I))
    k3 = phase_chunks(B, Grouping.for_phase(p3, B))
    k4 = phase_chunks(B, Grouping.for_phase(p4, B))
    d_groups, d_place = packed_scale_placement(k1) if pq_d and p1.enable_scale_packing else ((), ())
    gu_groups, gu_place = (
        packed_scale_placement(k2) if pq_gu and p2.enable_scale_packing else ((), ())
    )
    fields: dict[str, Any] = dict(
        T=T, H=H, I=I, E=E, B=B, N=N, W=min(B, 512),
        dense=cfg.single_expert_dense, nv=nv, accumulate=cfg.accumulate_hidden_states_grad,
        bias=cfg.bias, skip_token=cfg.effective_skip_dma.skip_token, pq_gu=pq_gu, pq_d=pq_d,
        clamp=tuple(
            None if x is None else float(x)
            for x in (
                cl.non_linear_clamp_lower_limit, cl.non_linear_clamp_upper_limit,
                cl.linear_clamp_lower_limit, cl.linear_clamp_upper_limit,
            )
        ),
        k1=k1, k2=k2, k3=k3, k4=k4,
        runs1=dma_runs(k1), runs2=dma_runs(k2), runs3=dma_runs(k3), runs4=dma_runs(k4),
        d_groups=d_groups, d_place=d_place, gu_groups=gu_groups, gu_place=gu_place,
        x4_dtype=DTypeName("float8_e4m3fn_x4"), compute_dtype=DTypeName("bfloat16"),
    )  # fmt: skip
    return KernelObject(KERNEL_CONFIG, tuple(fields.items()))


# -- validation and argument conversion ------------------------------------------------------------


def api_arguments(call: BwdCall) -> dict[str, Any]:
    """A validated call's arguments by the API reference's names, for a third-party kernel
    (`mxcli.kernels.spec.ThirdParty.arguments`; `nkilib.convert` rebuilds the config as the
    module's own class): ``num_valid_tokens`` given as an int as the ``[1]`` int32 tensor the
    API takes."""
    out = {k: getattr(call, k) for k in _KERNEL_TENSORS}
    out.update(
        block_size=call.B, down_proj_act_checkpoint=call.down_proj_act_checkpoint,
        config=call.config,
    )  # fmt: skip
    nv = out["num_valid_tokens"]
    if isinstance(nv, int) and not isinstance(nv, bool):  # a tensor argument of the API
        out["num_valid_tokens"] = torch.tensor([nv], dtype=torch.int32)
    return out


def prepare(*args: Any, **kwargs: Any) -> tuple[dict[str, Any], torch.device]:
    """Plan the launch of a validated call (a `BwdCall`, or the arguments of
    `blockwise_mm_bwd_mxfp8`) and convert its arguments for the kernel.

    Returns ``(kernel kwargs, device of hidden_states)``: the kernel's tensors (int32 indices,
    uint8 scale bytes, a ``[1]`` int32 token count) and ``config``, the kernel's
    `BwdKernelConfig` as a `KernelObject`. Raises `NkiKernelUnsupportedError` for what this
    kernel does not implement.
    """
    call = as_call(*args, **kwargs)
    if call.gate_up_proj_act_checkpoint_T is None:
        raise NkiKernelUnsupportedError(
            "gate_up_proj_act_checkpoint_T: the NKI kernel needs the gate/up checkpoint (no "
            "recompute from hidden_states), got None"
        )
    out: dict[str, Any] = {}
    for k in _KERNEL_TENSORS:
        v = getattr(call, k)
        if v is None:
            out[k] = None
            continue
        if k == "num_valid_tokens" and isinstance(v, int) and not isinstance(v, bool):
            out[k] = torch.tensor([min(max(v, -(2**31)), 2**31 - 1)], dtype=torch.int32)
            continue
        t = torch.as_tensor(v)
        if k in ("token_position_to_id", "block_to_expert"):
            t = t.to(torch.int32)
        elif k == "num_valid_tokens":
            # [1] int32, clamped to [0, T] on the device (API reference)
            t = t.reshape(-1)[:1].to(torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32)
        elif k.endswith("_scales") and t.dtype == torch.float8_e8m0fnu:
            t = t.view(torch.uint8)
        out[k] = t.contiguous()
    out["config"] = kernel_config(
        call,
        call.config,
        call.nv is not None,
        call.gate_up_weight_scales is not None,
        call.down_weight_scales is not None,
    )
    return out, call.hidden_states.device


def kernel_arguments(call: BwdCall) -> tuple[tuple[()], dict[str, Any]]:
    """The launch of mxcli's kernel (`mxcli.kernels.spec.NkiLaunch.prepare`): all by keyword
    (`prepare`)."""
    kw, _ = prepare(call)
    return (), kw


def finish(call: BwdCall, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs on the device of ``hidden_states``."""
    return [t.to(call.hidden_states.device) for t in outputs]
