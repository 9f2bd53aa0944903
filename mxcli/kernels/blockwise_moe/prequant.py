"""Pre-quantized MXFP8 weights for `blockwise_mm_bwd_mxfp8` (bwd spec §5.5), and their inverse.

Layouts, per expert (the backward quantizes W_gu along 2I in phase 2 and W_d along H in phase 1):

| weight  | logical ``[K, F]``               | x4 data ``[K/4, F]`` | scales unpacked | scales packed              |
|---------|----------------------------------|----------------------|-----------------|----------------------------|
| gate/up | ``W_gu[e].reshape(H, 2I).T``     | ``[2I/4, H]``        | ``[2I/4, H]``   | ``[ceil(2I/2048)·128, H]`` |
| down    | ``W_d[e].T``                     | ``[H/4, I]``         | ``[H/4, I]``    | ``[ceil(H/2048)·128, I]``  |

x4 word ``[p, f]`` packs the fp8 codes of ``src[order[4p + j], f]`` for bytes ``j = 0..3`` (byte
0 least significant), ``order = mxcli.mx.group_order(K, scheme, tile_k, chunks)``: the wrapX
swizzle (or the identity for 1x32), so MX group ``m`` is swizzled rows ``8m … 8m+7``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.kernels.blockwise_moe.config import (
    BwdValidationError,
    MatmulMxfp8KernelConfig,
    MXFP8MOEBwdConfig,
)
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.mx import (
    GROUP_SIZE,
    ElemFormat,
    QuantScheme,
    ScaleRule,
    dequantize_mx,
    group_order,
    pack_x4,
    quantize_mx,
    to_group_order,
    unpack_x4,
)
from mxcli.mx.formats import as_tensor
from mxcli.mx.quantize import as_rule

__all__ = [
    "PrequantizedWeights",
    "ScaleLayout",
    "dequantize_weight_x4",
    "dequantize_weights",
    "prequantize_weights",
    "quantize_weight_x4",
    "scale_row_index",
    "scale_rows",
]


class ScaleLayout(str, enum.Enum):
    """Row layout of the E8M0 scale bytes of a pre-quantized weight (bwd spec §5.5).

    Compact scales are ``[K/32, F]`` (row m = MX group m in group order). Then:

    - ``UNPACKED`` (``enable_scale_packing=False``): ``[K/4, F]``; compact row m is stored at row
      ``(m // 4)·32 + m % 4`` (4 valid rows per 32-row SBUF quadrant), all other rows zero.
    - ``PACKED`` (``enable_scale_packing=True``, the config's default): ``[ceil(K/2048)·128, F]``;
      with 512-tile ``t = m // 16`` and ``ml = m % 16``, row
      ``(t // 4)·128 + 4·(t % 4) + (ml // 4)·32 + ml % 4``. A 256/128/384 remainder shares the
      next tile index, which places a 128-remainder after a 256-remainder at +64 as the spec says.
    """

    UNPACKED = "unpacked"
    PACKED = "packed"


def _as_layout(layout: ScaleLayout | str) -> ScaleLayout:
    if isinstance(layout, ScaleLayout):
        return layout
    try:
        return ScaleLayout(str(layout).lower())
    except ValueError:
        raise BwdValidationError(
            f"scale_layout: expected 'packed' or 'unpacked', got {layout!r}"
        ) from None


def scale_rows(K: int, layout: ScaleLayout | str) -> int:
    """Number of scale rows of a weight whose contraction length is K."""
    if _as_layout(layout) is ScaleLayout.UNPACKED:
        return K // 4
    return -(-K // 2048) * 128


def scale_row_index(K: int, layout: ScaleLayout | str) -> torch.Tensor:
    """Row of compact scale row m (= MX group m), ``LongTensor[K/32]`` (see `ScaleLayout`)."""
    m = torch.arange(K // GROUP_SIZE)
    quad = (m % 16 // 4) * 32 + m % 4
    if _as_layout(layout) is ScaleLayout.UNPACKED:
        return (m // 16) * 128 + quad  # == (m // 4)·32 + m % 4
    t = m // 16
    return (t // 4) * 128 + 4 * (t % 4) + quad


def _order(K: int, grouping: Grouping) -> torch.Tensor:
    chunks = None if grouping.chunks is None else list(grouping.chunks)
    return group_order(K, grouping.scheme, grouping.tile_k, chunks)


def _fused_x4(codes: torch.Tensor) -> Any:
    """`mxcli.mx._fused` when its x4 kernels apply to `codes` (numba, CPU, ``MXCLI_FUSED``)."""
    if codes.device.type != "cpu":
        return None
    try:
        from mxcli.mx import _fused
    except Exception:  # numba missing or broken: the torch path gives the same bytes
        return None
    return _fused if _fused.enabled() else None


def quantize_weight_x4(
    w_kf: torch.Tensor,
    grouping: Grouping,
    layout: ScaleLayout | str,
    rule: ScaleRule | str = ScaleRule.NEURON,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize ``w_kf [E, K, F]`` along K into ``(x4 [E, K/4, F] uint32, scales [E, rows, F] uint8)``."""
    E, K, F = w_kf.shape
    # Quantize with K as the last axis: the callers' weights are [E, F, K] in memory, so this
    # view is free, the codes come out K-contiguous, and the x4 words are a plain view.
    w_fk = w_kf.transpose(1, 2)  # [E, F, K]
    codes, compact = quantize_mx(
        w_fk,
        axis=-1,
        elem=ElemFormat.E4M3FN,
        rule=rule,
        scheme=grouping.scheme,
        tile_k=grouping.tile_k,
        chunks=None if grouping.chunks is None else list(grouping.chunks),
    )  # codes [E, F, K] natural order, compact [E, F, K/32]
    rows = scale_rows(K, layout)
    fused = _fused_x4(codes)
    if fused is not None:  # same bytes in one pass each (tests/kernels: both paths compared)
        return fused.x4_transposed(
            codes, _order(K, grouping), compact, scale_row_index(K, layout), rows
        )
    physical = to_group_order(
        codes,
        -1,
        grouping.scheme,
        grouping.tile_k,
        None if grouping.chunks is None else list(grouping.chunks),
    )  # swizzled rows x 4 lanes along K
    words = pack_x4(physical.contiguous(), axis=-1)  # [E, F, K/4], lane j = byte j
    x4 = words.transpose(1, 2).contiguous()  # [E, K/4, F]
    scales = torch.zeros(E, rows, F, dtype=torch.uint8, device=codes.device)
    scales[:, scale_row_index(K, layout).to(codes.device), :] = compact.transpose(1, 2)
    return x4, scales


def dequantize_weight_x4(
    x4: torch.Tensor,
    scales: torch.Tensor,
    grouping: Grouping,
    layout: ScaleLayout | str,
) -> torch.Tensor:
    """Inverse of `quantize_weight_x4`: float32 ``[E, K, F]`` (exactly the values the MX matmul uses)."""
    s = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    codes_sw = unpack_x4(x4, axis=1)  # [E, K, F] in swizzled order
    K = codes_sw.shape[1]
    order = _order(K, grouping).to(codes_sw.device)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(K, device=order.device)
    codes = codes_sw.index_select(1, inv)  # natural K order
    compact = s.index_select(1, scale_row_index(K, layout).to(s.device))  # [E, K/32, F]
    return dequantize_mx(
        codes,
        compact,
        axis=1,
        elem=ElemFormat.E4M3FN,
        scheme=grouping.scheme,
        tile_k=grouping.tile_k,
        chunks=None if grouping.chunks is None else list(grouping.chunks),
    )


@dataclass(frozen=True)
class PrequantizedWeights:
    """Pre-quantized weights as `blockwise_mm_bwd_mxfp8` takes them.

    Pass ``gate_up_proj_weight``/``gate_up_weight_scales`` and ``down_proj_weight``/
    ``down_weight_scales`` in place of the bf16 weights. The groupings and scale layouts record
    how they were made; the backward's config must agree (phase 2 for gate/up, phase 1 and
    ``fast_dma_transpose`` for down; ``enable_scale_packing`` of those phases for the layouts).
    """

    gate_up_proj_weight: torch.Tensor | None  # [E, 2I/4, H] uint32 (x4)
    gate_up_weight_scales: torch.Tensor | None  # [E, rows(2I), H] uint8 (E8M0)
    down_proj_weight: torch.Tensor | None  # [E, H/4, I] uint32 (x4)
    down_weight_scales: torch.Tensor | None  # [E, rows(H), I] uint8 (E8M0)
    gate_up_grouping: Grouping
    down_grouping: Grouping
    gate_up_scale_layout: ScaleLayout
    down_scale_layout: ScaleLayout
    rule: ScaleRule = ScaleRule.NEURON

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `blockwise_mm_bwd_mxfp8` (weights given are replaced)."""
        out: dict[str, Any] = {}
        if self.gate_up_proj_weight is not None:
            out["gate_up_proj_weight"] = self.gate_up_proj_weight
            out["gate_up_weight_scales"] = self.gate_up_weight_scales
        if self.down_proj_weight is not None:
            out["down_proj_weight"] = self.down_proj_weight
            out["down_weight_scales"] = self.down_weight_scales
        return out


def _weight_settings(
    config: MXFP8MOEBwdConfig | None,
    scale_layout: ScaleLayout | str | None,
    scheme: QuantScheme | str | None,
    tile_k: int | None,
    fast_dma_transpose: bool | None,
    H: int,
) -> tuple[Grouping, Grouping, ScaleLayout, ScaleLayout]:
    """(gate/up grouping, down grouping, gate/up layout, down layout): explicit args, else config."""
    cfg = config if config is not None else MXFP8MOEBwdConfig()
    p1, p2 = cfg.phase1_config, cfg.phase2_config
    assert p1 is not None and p2 is not None
    fast = cfg.fast_dma_transpose if fast_dma_transpose is None else bool(fast_dma_transpose)
    groupings = []
    for pc, K, f in ((p2, None, False), (p1, H, fast)):
        g = Grouping.for_phase(pc)
        sch = g.scheme if scheme is None else _scheme(scheme)
        tk = g.tile_k if tile_k is None else tile_k
        if tk not in (128, 256, 512):
            raise BwdValidationError(f"tile_k: expected 128, 256 or 512, got {tk}")
        groupings.append(Grouping.make(sch, tk, K, f))

    def layout(pc: MatmulMxfp8KernelConfig) -> ScaleLayout:
        if scale_layout is not None:
            return _as_layout(scale_layout)
        return ScaleLayout.PACKED if pc.enable_scale_packing else ScaleLayout.UNPACKED

    return groupings[0], groupings[1], layout(p2), layout(p1)


def _scheme(scheme: QuantScheme | str) -> QuantScheme:
    if isinstance(scheme, QuantScheme):
        return scheme
    key = str(scheme).lower().lstrip("_")
    for m in QuantScheme:
        if key in (m.value, m.name.lower()):
            return m
    raise BwdValidationError(f"scheme: expected 'wrapx' or '1x32', got {scheme!r}")


def prequantize_weights(
    gate_up_proj_weight: Any = None,
    down_proj_weight: Any = None,
    *,
    scale_layout: ScaleLayout | str | None = None,
    rule: ScaleRule | str = ScaleRule.NEURON,
    scheme: QuantScheme | str | None = None,
    tile_k: int | None = None,
    fast_dma_transpose: bool | None = None,
    config: MXFP8MOEBwdConfig | None = None,
) -> PrequantizedWeights:
    """Pre-quantize the backward's weights to MXFP8 x4 data + E8M0 scales (bwd spec §5.5).

    Args:
        gate_up_proj_weight: ``[E, H, 2, I]`` (bf16 as the kernel takes it; any float dtype is
            quantized from its given values), or None.
        down_proj_weight: ``[E, I, H]``, or None.
        scale_layout: ``"packed"`` or ``"unpacked"`` for both weights; None = from the config
            (``phase2_config.enable_scale_packing`` for gate/up, ``phase1_config`` for down;
            the default config packs).
        rule: scale rule; only ``NEURON`` (default) matches the backward's on-chip quantization.
        scheme, tile_k: MX grouping; None = the config's (phase 2 for gate/up along 2I, phase 1
            for down along H; default WRAPX with tile_k 512).
        fast_dma_transpose: errata 1 (down weight only: ``H ≡ 384 mod 512`` ends in one
            384-chunk); None = the config's.
        config: the `MXFP8MOEBwdConfig` the backward will run with (default config if None).

    Returns:
        `PrequantizedWeights`. With the same grouping and layout the backward gives results
        bit-identical to on-the-fly quantization of the original weights.
    """
    if gate_up_proj_weight is None and down_proj_weight is None:
        raise BwdValidationError("prequantize_weights: expected at least one weight, got none")
    gu = None if gate_up_proj_weight is None else as_tensor(gate_up_proj_weight)
    dw = None if down_proj_weight is None else as_tensor(down_proj_weight)
    for name, t, rank in (("gate_up_proj_weight", gu, 4), ("down_proj_weight", dw, 3)):
        if t is not None and (t.dim() != rank or not t.is_floating_point()):
            raise BwdValidationError(
                f"{name}: expected a float tensor of rank {rank}, got shape {tuple(t.shape)} {t.dtype}"
            )
    if gu is not None and gu.shape[2] != 2:
        raise BwdValidationError(
            f"gate_up_proj_weight: expected shape (E, H, 2, I), got {tuple(gu.shape)}"
        )
    H = gu.shape[1] if gu is not None else dw.shape[2]  # type: ignore[union-attr]
    if (
        gu is not None
        and dw is not None
        and (dw.shape[0] != gu.shape[0] or dw.shape[1:] != (gu.shape[3], H))
    ):
        raise BwdValidationError(
            f"down_proj_weight: expected shape {(gu.shape[0], gu.shape[3], H)}, got {tuple(dw.shape)}"
        )
    g_gu, g_d, lay_gu, lay_d = _weight_settings(
        config, scale_layout, scheme, tile_k, fast_dma_transpose, H
    )
    gu_x4 = gu_s = d_x4 = d_s = None
    if gu is not None:
        E, _, _, I = gu.shape  # noqa: E741 (spec notation I = I_TP)
        w_kf = gu.reshape(E, H, 2 * I).transpose(1, 2)  # [E, 2I, H]
        gu_x4, gu_s = quantize_weight_x4(w_kf, g_gu, lay_gu, rule)
    if dw is not None:
        d_x4, d_s = quantize_weight_x4(dw.transpose(1, 2), g_d, lay_d, rule)  # [E, H, I]
    return PrequantizedWeights(
        gu_x4, gu_s, d_x4, d_s, g_gu, g_d, lay_gu, lay_d,
        as_rule(rule),
    )  # fmt: skip


def dequantize_weights(
    pq: PrequantizedWeights,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Inverse of `prequantize_weights`: float32 ``(gate_up [E, H, 2, I], down [E, I, H])``.

    The values are the MXFP8-dequantized weights, i.e. exactly what the backward's phase 2 and
    phase 1 matmuls multiply with (not the original bf16 weights).
    """
    gu = d = None
    if pq.gate_up_proj_weight is not None:
        assert pq.gate_up_weight_scales is not None
        w = dequantize_weight_x4(
            pq.gate_up_proj_weight, pq.gate_up_weight_scales, pq.gate_up_grouping,
            pq.gate_up_scale_layout,
        )  # fmt: skip
        E, K2, H = w.shape
        gu = w.transpose(1, 2).reshape(E, H, 2, K2 // 2).contiguous()
    if pq.down_proj_weight is not None:
        assert pq.down_weight_scales is not None
        w = dequantize_weight_x4(
            pq.down_proj_weight, pq.down_weight_scales, pq.down_grouping, pq.down_scale_layout
        )
        d = w.transpose(1, 2).contiguous()
    return gu, d
