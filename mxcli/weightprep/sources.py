"""Decoders for quantized *source* checkpoints: DeepSeek FP8 block weights, gpt-oss MXFP4 and
compressed-tensors MXFP8 / FP8 (per channel, per block, per tensor).

Each returns bf16, the dtype every later step (re-stacking, TP slicing, MXFP8 pre-quantization)
starts from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


# -- compressed-tensors sources ------------------------------------------------------------------
# The on-disk form below is read from the compressed_tensors library (0.20.1), the oracle of the
# tests: `compressors/mxfp8/base.py` (format "mxfp8-quantized": ``weight`` float8_e4m3fn
# ``[out, in]`` + ``weight_scale`` uint8 E8M0 ``[out, in/32]``, ``2^(byte - 127)``,
# `compressors/mx_utils.py`), `compressors/naive_quantized/base.py` and
# `quantization/lifecycle/forward_helpers.py` (format "float-quantized": ``weight`` float8 times
# a float ``weight_scale``: ``[out, 1]`` per channel, ``[ceil(out/bo), ceil(in/bi)]`` per block,
# ``[1]`` per tensor).

CT_QUANT_METHOD = "compressed-tensors"
CT_MXFP8_FORMAT = "mxfp8-quantized"
CT_FLOAT_FORMAT = "float-quantized"
CT_SCHEMES = ("mxfp8", "fp8-channel", "fp8-block", "fp8-tensor")


@dataclass(frozen=True)
class CtQuant:
    """A compressed-tensors source's weight scheme (its ``config.json`` quantization_config).

    ``scheme``: ``mxfp8`` (E8M0 per 32 along the input dim), ``fp8-channel``, ``fp8-block``
    (``block`` = (rows, cols)) or ``fp8-tensor``. Every FP8 weight ``X.weight`` has its scale in
    ``X.weight_scale``.
    """

    scheme: str
    block: tuple[int, int] | None = None

    @property
    def source_format(self) -> str:
        return f"ct-{self.scheme}"

    @staticmethod
    def scale_name(name: str) -> str:
        return name + "_scale"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out, inn = int(shape[0]), int(shape[1])
        if self.scheme == "mxfp8":
            return (out, inn // MX_GROUP)
        if self.scheme == "fp8-channel":
            return (out, 1)
        if self.scheme == "fp8-block":
            assert self.block is not None
            return (-(-out // self.block[0]), -(-inn // self.block[1]))
        return (1,)

    def dequant(
        self, weight: torch.Tensor, scale: torch.Tensor, name: str = "weight"
    ) -> torch.Tensor:
        """bf16 values of ``weight * scale``, the product taken exactly in fp32 and rounded once."""
        if weight.dim() != 2:
            raise InputError(f"{name}: expected a 2-D FP8 weight, got shape {list(weight.shape)}")
        want = self.scale_shape(tuple(weight.shape))
        if tuple(scale.shape) != want and not (self.scheme == "fp8-tensor" and scale.numel() == 1):
            raise InputError(
                f"{name}_scale: expected shape {list(want)} for a {self.scheme} weight of shape "
                f"{list(weight.shape)}, got {list(scale.shape)}"
            )
        if self.scheme == "mxfp8":
            return dequant_mxfp8(weight, scale, name)
        if self.scheme == "fp8-block":
            assert self.block is not None
            return dequant_fp8_block(weight, scale, self.block, name=name)
        s = (
            scale.to(torch.float32).reshape(-1, 1)
            if self.scheme == "fp8-channel"
            else (scale.to(torch.float32).reshape(1, 1))
        )
        return (weight.to(torch.float32) * s).to(torch.bfloat16)


MX_GROUP = 32


def dequant_mxfp8(weight: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """compressed-tensors MXFP8: ``weight [out, in]`` float8_e4m3fn (or its uint8 codes) times
    ``2^(scale - 127)`` per 32 along ``in`` (``scale [out, in/32]`` uint8). Exact in fp32 (a
    power-of-two scale), rounded once to bf16 (exact unless below bf16's subnormals)."""
    if scale.dtype != torch.uint8:
        raise InputError(f"{name}_scale: expected uint8 E8M0 bytes, got {scale.dtype}")
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    out, inn = weight.shape
    if inn % MX_GROUP:
        raise InputError(f"{name}: MXFP8 needs its input dim ({inn}) a multiple of {MX_GROUP}")
    e = scale.to(torch.int32)
    # 2^(e-127) as fp32 bits; byte 0 is the subnormal 2^-127 (bit 22), 255 is NaN
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    s = bits.view(torch.float32)
    w = weight.to(torch.float32).view(out, inn // MX_GROUP, MX_GROUP)
    return (w * s.unsqueeze(-1)).view(out, inn).to(torch.bfloat16)


def ct_quant(q: dict[str, Any]) -> CtQuant:
    """The weight scheme of a compressed-tensors ``quantization_config`` (one FP8 scheme for
    every quantized weight; anything else is refused with one line)."""
    _E = InputError
    fmt = q.get("format")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _E("config.json: compressed-tensors quantization_config has no config_groups")
    schemes = set()
    for gname, g in groups.items():
        w = (g or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise _E(
                f"config.json: compressed-tensors group {gname}: expected 8-bit float weights, "
                f"got type={w.get('type')!r} num_bits={w.get('num_bits')!r}"
            )
        strategy = w.get("strategy")
        gfmt = g.get("format") or fmt
        if (
            strategy == "group"
            and w.get("group_size") == MX_GROUP
            and "uint8" in str(w.get("scale_dtype"))
        ):
            schemes.add(CtQuant("mxfp8"))
        elif gfmt == CT_MXFP8_FORMAT:
            # name the fields that differ, with their values (issue 28: a channel strategy or
            # F32 scales were reported as "got group_size=32")
            ok = {
                "strategy": w.get("strategy") == "group",
                "group_size": w.get("group_size") == MX_GROUP,
                "scale_dtype": "uint8" in str(w.get("scale_dtype")),
            }
            bad = [f"{k}={w.get(k)!r}" for k, good in ok.items() if not good]
            raise _E(
                f"config.json: compressed-tensors group {gname}: mxfp8-quantized needs "
                f"weights strategy 'group', group_size {MX_GROUP} and scale_dtype uint8, got "
                + ", ".join(bad)
            )
        elif strategy == "channel":
            schemes.add(CtQuant("fp8-channel"))
        elif strategy == "tensor":
            schemes.add(CtQuant("fp8-tensor"))
        elif strategy == "block":
            b = w.get("block_structure")
            if not (isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b)):
                raise _E(
                    f"config.json: compressed-tensors group {gname}: bad block_structure {b!r}"
                )
            schemes.add(CtQuant("fp8-block", (b[0], b[1])))
        else:
            raise _E(
                f"config.json: compressed-tensors group {gname}: FP8 strategy {strategy!r} "
                "is not supported (supported: MXFP8 group 32, channel, block, tensor)"
            )
    if len(schemes) != 1:
        raise _E(
            "config.json: compressed-tensors groups use several weight schemes "
            f"({', '.join(sorted(s.scheme for s in schemes))}); one is supported"
        )
    return schemes.pop()
