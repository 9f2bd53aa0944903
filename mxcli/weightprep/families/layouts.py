"""Expert layouts on disk, mapped to the kernel layouts (one declarative object per layout).

- `PerExpert`: one Linear weight per expert and projection (Qwen, DeepSeek, Mixtral names);
- `Fused`: one tensor per projection for all experts, gate/up halves or interleaved (gpt-oss,
  Llama-4, Granite-MoE, JetMoE), optionally MXFP4-coded;
- `Shared`: a dense shared expert (and its sigmoid gate).

Canonical kernel layouts every expert layout is mapped to (bwd spec §1):
``gate_up [E, H, 2, I]`` (gate = ``[:, :, 0]``, up = ``[:, :, 1]``) and ``down [E, I, H]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.weightprep.checkpoint import FP8_SOURCE_DTYPES, Checkpoint, CheckpointReader
from mxcli.weightprep.families.routing import ConfigError
from mxcli.weightprep.sources import CtQuant, decode_mxfp4, dequant_fp8_block

# -- expert layouts on disk ---------------------------------------------------------------------


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def t2(x: torch.Tensor) -> torch.Tensor:
    """Contiguous transpose of the last two dims (through an int16 view for 16-bit dtypes, which
    torch copies several times faster)."""
    if x.element_size() == 2:
        return x.view(torch.int16).transpose(-1, -2).contiguous().view(x.dtype)
    return x.transpose(-1, -2).contiguous()


class Scratch:
    """Reusable work buffers, one per key: page-faulting fresh memory for every expert chunk
    costs more than the copies themselves on many hosts."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._bufs[key] = buf
        return buf[:n].view(shape)

    def transpose(self, x: torch.Tensor, key: str = "t") -> torch.Tensor:
        """`t2` into a reused buffer (valid until the next call with the same key)."""
        if x.element_size() == 2:
            out = self.get(key, (x.shape[-1], x.shape[-2]), torch.int16)
            out.copy_(x.view(torch.int16).transpose(-1, -2))
            return out.view(x.dtype)
        return t2(x)


def load_weight(
    rd: CheckpointReader,
    name: str,
    fp8_block: tuple[int, int] | CtQuant | None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """One 2-D source weight as bf16, FP8 block weights dequantized with ``name + "_scale_inv"``
    (compressed-tensors sources: with ``name + "_scale"``, `CtQuant`). ``dtype=float32``: a
    wider float source as stored (``--check`` compares the bf16 output with the source values)."""
    info = rd.ckpt.info(name)
    if isinstance(fp8_block, CtQuant) and info.dtype in FP8_SOURCE_DTYPES:
        sname = fp8_block.scale_name(name)
        if not rd.ckpt.has(sname):
            raise ConfigError(f"{name}: FP8 weight without its {sname} (cannot dequantize)")
        return fp8_block.dequant(rd.get(name), rd.get(sname), name)
    if info.dtype in FP8_SOURCE_DTYPES:
        assert not isinstance(fp8_block, CtQuant)
        scale_name = name + "_scale_inv"
        if not rd.ckpt.has(scale_name):
            raise ConfigError(f"{name}: FP8 weight without its {scale_name} (cannot dequantize)")
        return dequant_fp8_block(
            rd.get(name), rd.get(scale_name), fp8_block or (128, 128), name=name
        )
    return rd.get(name).to(dtype)


@dataclass(frozen=True)
class PerExpert:
    """One ``[I, H]`` gate, ``[I, H]`` up and ``[H, I]`` down Linear weight per expert (out x in).

    Qwen, DeepSeek (``gate_proj/up_proj/down_proj``) and Mixtral (``w1/w3/w2``).
    ``gate_up[e] = stack(gate.T, up.T, axis=1)`` -> ``[H, 2, I]``; ``down[e] = down.T`` -> ``[I, H]``.
    """

    gate: str = "mlp.experts.{e}.gate_proj.weight"
    up: str = "mlp.experts.{e}.up_proj.weight"
    down: str = "mlp.experts.{e}.down_proj.weight"

    def expected(self, prefix: str, E: int, H: int, I: int) -> dict[str, tuple[int, ...]]:  # noqa: E741
        out: dict[str, tuple[int, ...]] = {}
        for e in range(E):
            out[prefix + self.gate.format(e=e)] = (I, H)
            out[prefix + self.up.format(e=e)] = (I, H)
            out[prefix + self.down.format(e=e)] = (H, I)
        return out

    def load(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        H: int,
        I: int,  # noqa: E741
        fp8_block: Any,  # noqa: E741
        scratch: Scratch | None = None,
        key: str = "",
        dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1`` as ``(gate_up [c, H, 2, I], down [c, I, H])`` bf16, in `scratch`
        buffers (valid until the next load with the same `key`) when one is given."""
        c = e1 - e0
        sc = scratch or Scratch()
        gate_up = sc.get(key + "gate_up", (c, H, 2, I), dtype)  # [c, H, 2, I]
        down = sc.get(key + "down", (c, I, H), dtype)  # [c, I, H]
        for j, e in enumerate(range(e0, e1)):
            gate_up[j, :, 0, :] = sc.transpose(
                load_weight(rd, prefix + self.gate.format(e=e), fp8_block, dtype)
            )
            gate_up[j, :, 1, :] = sc.transpose(
                load_weight(rd, prefix + self.up.format(e=e), fp8_block, dtype)
            )
            down[j] = sc.transpose(
                load_weight(rd, prefix + self.down.format(e=e), fp8_block, dtype)
            )
        return gate_up, down


@dataclass(frozen=True)
class Fused:
    """All experts in one tensor per projection: ``gate_up [E, H, 2I]`` and ``down [E, I, H]``
    (in x out), or their MXFP4 form ``<name>_blocks [E, out, in/32, 16]`` + ``<name>_scales``.

    - ``interleaved`` (gpt-oss): gate = ``[..., 0::2]``, up = ``[..., 1::2]`` of the 2I axis, so
      ``view(E, H, I, 2).transpose(-1, -2)`` -> ``[E, H, 2, I]``.
    - otherwise (Llama-4): gate = first half, so ``view(E, H, 2, I)``.
    - ``out_in`` (Granite-MoE, JetMoE ``input_linear``/``output_linear``): stored out x in,
      ``[E, 2I, H]`` and ``[E, H, I]``, gate = first half; transposed on load.
    Biases (gpt-oss): ``gate_up_bias [E, 2I]`` (same interleave) -> ``[E, 2, I]``; ``down_bias [E, H]``.
    """

    gate_up: str
    down: str
    interleaved: bool
    gate_up_bias: str | None = None
    down_bias: str | None = None
    out_in: bool = False

    def mxfp4(self, ckpt: Checkpoint, prefix: str) -> bool:
        return ckpt.has(prefix + self.gate_up + "_blocks")

    def expected(
        self,
        prefix: str,
        E: int,
        H: int,
        I: int,  # noqa: E741
        ckpt: Checkpoint | None = None,  # noqa: E741
    ) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        if ckpt is not None and self.mxfp4(ckpt, prefix):
            # MXFP4 stores out x in, 32 values (16 bytes) per block along `in`
            for n, (o, i) in ((self.gate_up, (2 * I, H)), (self.down, (H, I))):
                if i % 32:
                    raise InputError(
                        f"{prefix + n}: MXFP4 needs its input dim ({i}) a multiple of 32"
                    )
                out[prefix + n + "_blocks"] = (E, o, i // 32, 16)
                out[prefix + n + "_scales"] = (E, o, i // 32)
        elif self.out_in:
            out[prefix + self.gate_up] = (E, 2 * I, H)
            out[prefix + self.down] = (E, H, I)
        else:
            out[prefix + self.gate_up] = (E, H, 2 * I)
            out[prefix + self.down] = (E, I, H)
        if self.gate_up_bias:
            out[prefix + self.gate_up_bias] = (E, 2 * I)
        if self.down_bias:
            out[prefix + self.down_bias] = (E, H)
        return out

    def _split_2i(self, x: torch.Tensor, I: int) -> torch.Tensor:  # noqa: E741
        """``[..., 2I]`` -> ``[..., 2, I]`` (gate, up)."""
        if self.interleaved:
            return x.view(*x.shape[:-1], I, 2).transpose(-1, -2)
        return x.view(*x.shape[:-1], 2, I)

    def load(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        H: int,
        I: int,  # noqa: E741
        fp8_block: Any,  # noqa: E741
        scratch: Scratch | None = None,
        key: str = "",
        dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1`` as ``(gate_up [c, H, 2, I], down [c, I, H])`` bf16 (see `PerExpert.load`)."""
        sc = scratch or Scratch()
        if self.mxfp4(rd.ckpt, prefix):
            gu_name, d_name = prefix + self.gate_up, prefix + self.down
            gu_oi = decode_mxfp4(
                rd.get_rows(gu_name + "_blocks", e0, e1), rd.get_rows(gu_name + "_scales", e0, e1)
            )
            d_oi = decode_mxfp4(
                rd.get_rows(d_name + "_blocks", e0, e1), rd.get_rows(d_name + "_scales", e0, e1)
            )
            gu = t2(gu_oi).to(dtype)  # [c, 2I, H] -> [c, H, 2I] (transformers: transpose(1, 2))
            down = t2(d_oi).to(dtype)  # [c, H, I] -> [c, I, H]
        elif self.out_in:
            gu = t2(
                rd.get_rows(prefix + self.gate_up, e0, e1).to(dtype)
            )  # [c, 2I, H] -> [c, H, 2I]
            down = t2(rd.get_rows(prefix + self.down, e0, e1).to(dtype))  # [c, H, I] -> [c, I, H]
        else:
            gu = rd.get_rows(prefix + self.gate_up, e0, e1).to(dtype)  # [c, H, 2I]
            down = rd.get_rows(prefix + self.down, e0, e1).to(dtype).contiguous()  # [c, I, H]
        gate_up = sc.get(key + "gate_up", (e1 - e0, H, 2, I), dtype)
        gate_up.copy_(self._split_2i(gu, I))  # [c, H, 2, I]
        return gate_up, down

    def load_biases(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        I: int,  # noqa: E741
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gub = db = None
        if self.gate_up_bias:
            gub = self._split_2i(
                rd.get_rows(prefix + self.gate_up_bias, e0, e1), I
            ).contiguous()  # [c, 2, I]
        if self.down_bias:
            db = rd.get_rows(prefix + self.down_bias, e0, e1).contiguous()  # [c, H]
        return gub, db


@dataclass(frozen=True)
class Stacked:
    """One tensor per projection holding every expert, out x in (Step-3.7 ``moe.*_proj``):
    gate and up ``[E, I, H]``, down ``[E, H, I]``; transposed into the kernel layouts on load."""

    gate: str
    up: str
    down: str

    def expected(self, prefix: str, E: int, H: int, I: int) -> dict[str, tuple[int, ...]]:  # noqa: E741
        return {
            prefix + self.gate: (E, I, H),
            prefix + self.up: (E, I, H),
            prefix + self.down: (E, H, I),
        }

    def load(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        H: int,
        I: int,  # noqa: E741
        fp8_block: Any,  # noqa: E741
        scratch: Scratch | None = None,
        key: str = "",
        dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1`` as ``(gate_up [c, H, 2, I], down [c, I, H])`` bf16."""
        sc = scratch or Scratch()
        gate_up = sc.get(key + "gate_up", (e1 - e0, H, 2, I), dtype)
        gate_up[:, :, 0, :] = t2(rd.get_rows(prefix + self.gate, e0, e1).to(dtype))
        gate_up[:, :, 1, :] = t2(rd.get_rows(prefix + self.up, e0, e1).to(dtype))
        down = sc.get(key + "down", (e1 - e0, I, H), dtype)
        down.copy_(t2(rd.get_rows(prefix + self.down, e0, e1).to(dtype)))
        return gate_up, down


@dataclass(frozen=True)
class FusedDense:
    """A dense MLP with gate and up fused, out x in (Granite-MoE-Shared ``shared_mlp``):
    ``input_linear [2I, H]`` (gate = first half), ``output_linear [H, I]``."""

    gate_up: str
    down: str

    def expected(self, prefix: str, E: int, H: int, I: int) -> dict[str, tuple[int, ...]]:  # noqa: E741
        return {prefix + self.gate_up: (2 * I, H), prefix + self.down: (H, I)}

    def load(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        H: int,
        I: int,  # noqa: E741
        fp8_block: Any,  # noqa: E741
        scratch: Scratch | None = None,
        key: str = "",
        dtype: torch.dtype = torch.bfloat16,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As an E=1 stack: ``(gate_up [1, H, 2, I], down [1, I, H])`` bf16."""
        gu = t2(rd.get(prefix + self.gate_up).to(dtype))  # [2I, H] -> [H, 2I]
        down = t2(rd.get(prefix + self.down).to(dtype))  # [H, I] -> [I, H]
        return gu.view(1, H, 2, I).contiguous(), down.view(1, I, H)


@dataclass(frozen=True)
class Shared:
    """A dense shared expert (``[Is, H]`` gate/up, ``[H, Is]`` down), written as an E=1 stack for
    the backward kernel's single-expert dense path; optionally its sigmoid gate ``[1, H]``."""

    mlp: PerExpert | FusedDense
    intermediate: str  # role name in the resolved config values
    gate_weight: str | None = None
