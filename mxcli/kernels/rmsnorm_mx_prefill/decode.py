"""Decoder of packed ``rmsnorm_mx_prefill`` rows (prefill spec §6.2, §4).

Reads the bytes back: codes ``[0, H)`` in natural order, the scale byte of every 32-element group
from its folded/unfolded offset (`mxcli.mx.prefill_scale_offsets`, the same function the encoder
uses), the dequantized fp32 values, and the packed affinity tail when asked for. Holes and pads
are ignored.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mxcli.kernels.rmsnorm_mx_prefill.contract import (
    PrefillValidationError,
    QmxOutputDtype,
    RouterActFnType,
    row_geometry,
)
from mxcli.mx import dequantize_mx, prefill_scale_offsets
from mxcli.mx.formats import as_tensor


class DecodedRows(NamedTuple):
    """Content of packed rows; T = number of rows."""

    codes: torch.Tensor  # [T, H] uint8 fp8 codes, natural H order
    scales: torch.Tensor  # [T, H/32] uint8 E8M0 bytes, group g = elements [32g, 32g + 32)
    values: torch.Tensor  # [T, H] float32 = fp8(code) * 2^(scale - 127)
    affinities: torch.Tensor | None  # [T, E] bf16 / fp32 (NOAUX_TC) when num_experts was given


def packed_bytes(packed: Any) -> torch.Tensor:
    """The packed output as raw bytes ``[T, row_bytes]`` uint8, whatever dtype it is viewed as
    (fp8 as returned, uint8, or a bf16/fp32 view of the same memory)."""
    t = as_tensor(packed)
    if t.dim() != 2:
        raise PrefillValidationError(
            f"packed: expected a [T, row_region] tensor (rank 2), got shape {tuple(t.shape)}"
        )
    if t.dtype == torch.uint8:
        return t
    return t.contiguous().view(torch.uint8)


def defined_bytes(
    hidden_size: int,
    *,
    pack_scales: bool = True,
    num_experts: int | None = None,
    router_act_fn: RouterActFnType | str | int = RouterActFnType.SIGMOID,
    row_bytes: int | None = None,
) -> torch.Tensor:
    """``[row_bytes]`` bool: the bytes of a packed row the API defines (codes, scale bytes and,
    with `num_experts`, the affinity tail). The rest, scale-region holes and the row pad, a kernel
    may leave unwritten (prefill spec §4.2, §4.3; AWS's kernel does, mxcli's writes 0x00)."""
    H = int(hidden_size)
    geo = row_geometry(
        H,
        pack_scales=pack_scales,
        num_experts=num_experts,
        router_act_fn=router_act_fn,
        pack_affinities=num_experts is not None,
    )
    width = geo.row_region if row_bytes is None else int(row_bytes)
    mask = torch.zeros(width, dtype=torch.bool)
    mask[:H] = True
    mask[H + prefill_scale_offsets(H, pack_scales)] = True
    if num_experts is not None and geo.aff_bytes:
        mask[geo.affin_off : geo.affin_off + geo.num_experts * geo.aff_bytes] = True
    return mask


def decode_packed_rows(
    packed: Any,
    hidden_size: int,
    *,
    pack_scales: bool = True,
    num_experts: int | None = None,
    router_act_fn: RouterActFnType | str | int = RouterActFnType.SIGMOID,
    qmx_output_dtype: Any = "float8_e4m3fn_x4",
) -> DecodedRows:
    """Decode packed rows into codes, scale bytes, dequantized fp32 ``[T, H]`` and affinities.

    `packed` is the first output of `rmsnorm_mx_prefill` (any view of its bytes). Give
    `num_experts` (and the `router_act_fn`) to read the ``pack_affinities`` tail: E bf16 values
    (SIGMOID/SOFTMAX) or E fp32 values (NOAUX_TC), little-endian, at byte ``affin_off``.
    """
    raw = packed_bytes(packed)
    H = int(hidden_size)
    geo = row_geometry(
        H,
        pack_scales=pack_scales,
        num_experts=num_experts,
        router_act_fn=router_act_fn,
        pack_affinities=num_experts is not None,
    )
    width = int(raw.shape[1])
    if width < geo.row_region:
        raise PrefillValidationError(
            f"packed: expected rows of at least {geo.row_region} bytes for H={H}, "
            f"pack_scales={pack_scales}, num_experts={num_experts}, got {width}"
        )
    elem = QmxOutputDtype.coerce(qmx_output_dtype).elem
    codes = raw[:, :H].contiguous()  # [T, H]
    offsets = H + prefill_scale_offsets(H, pack_scales).to(raw.device)
    scales = raw[:, offsets].contiguous()  # [T, H/32]
    values = dequantize_mx(codes, scales, -1, elem=elem, scheme="1x32")
    affinities = None
    if num_experts is not None and geo.affinity_dtype is not None:
        nbytes = geo.num_experts * geo.aff_bytes
        tail = raw[:, geo.affin_off : geo.affin_off + nbytes].contiguous()
        affinities = tail.view(geo.affinity_dtype)  # [T, E]
    return DecodedRows(codes=codes, scales=scales, values=values, affinities=affinities)
