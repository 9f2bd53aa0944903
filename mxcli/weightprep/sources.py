"""Decoders for quantized *source* checkpoints: DeepSeek FP8 block weights and gpt-oss MXFP4.

Both return bf16, the dtype every later step (re-stacking, TP slicing, MXFP8 pre-quantization)
starts from.
"""

from __future__ import annotations

import torch

from mxcli.errors import InputError

# gpt-oss / OCP FP4 (E2M1) code -> value; low nibble first (ecosystem §1.6, transformers mxfp4).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequant_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> torch.Tensor:
    """DeepSeek-V3 FP8 block dequantization (ecosystem §1.7).

    ``weight [M, N]`` (float8) times ``scale_inv [ceil(M/bm), ceil(N/bn)]`` (fp32) broadcast over
    its ``bm x bn`` block; the product is taken in fp32 and rounded once to `out_dtype`. A
    partial edge block uses its block's scale (the checkpoint zero-padded it before scaling).
    """
    if weight.dim() != 2:
        raise InputError(f"{name}: expected a 2-D FP8 weight, got shape {tuple(weight.shape)}")
    M, N = (int(d) for d in weight.shape)
    bm, bn = block
    expected = (-(-M // bm), -(-N // bn))
    if tuple(scale_inv.shape) != expected:
        raise InputError(
            f"{name}_scale_inv: expected shape {list(expected)} for a {M}x{N} weight in "
            f"{bm}x{bn} blocks, got {list(scale_inv.shape)}"
        )
    s = scale_inv.to(torch.float32)
    w = weight.to(torch.float32)
    if M % bm == 0 and N % bn == 0:
        # [M/bm, bm, N/bn, bn] * [M/bm, 1, N/bn, 1]: no expanded scale tensor
        out = w.view(M // bm, bm, N // bn, bn) * s.view(M // bm, 1, N // bn, 1)
        return out.view(M, N).to(out_dtype)
    full = s.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:M, :N]
    return (w * full).to(out_dtype)


def decode_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """gpt-oss MXFP4 -> values: ``blocks [..., G, 16]`` uint8 (two E2M1 codes per byte, low
    nibble first), ``scales [..., G]`` uint8 E8M0 (bias 127) -> ``[..., G*32]``.

    Each value is ``FP4_VALUES[code] * 2^(scale - 127)``, computed exactly in fp32 and rounded
    once to `out_dtype`.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise InputError(
            f"mxfp4: expected uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}"
        )
    if (
        blocks.dim() < 2
        or blocks.shape[-1] != 16
        or tuple(blocks.shape[:-1]) != tuple(scales.shape)
    ):
        raise InputError(
            f"mxfp4: expected blocks [..., G, 16] and scales [..., G], got "
            f"{list(blocks.shape)} and {list(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1)  # [..., G, 16, 2]: low nibble first
    vals = vals.reshape(*blocks.shape[:-1], 32)
    out = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return out.reshape(*blocks.shape[:-2], -1).to(out_dtype)
