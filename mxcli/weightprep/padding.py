"""Zero padding to the kernels' multiples, and its inverse for results.

The kernels need sizes the released models do not have (gpt-oss: H = I = 2880; Qwen3-30B-A3B
with ``--tp 4``: I_TP = 192):

- prefill (prefill spec §2.3): ``H % 512 == 0``; the real H is passed as
  ``unpadded_hidden_size`` and only changes the RMS divisor (§3);
- backward (bwd spec §10): ``H % 128 == 0`` and ``I % 128 == 0``.

`prep-weights` zero-pads each weight to those sizes, so each side gets the smallest size its
kernel accepts: ``Hp = ceil(H/512)*512`` for gamma and the router, ``Hb = ceil(H/128)*128``
and ``Ip = ceil(I_TP/128)*128`` for the expert stacks. The manifest records them (`Padding`).

Zero padding is exact for the MoE MLP (bwd spec §2): a zero hidden column meets zero weight
rows, so ``g`` and ``u`` are unchanged; a zero weight column gives ``g = u = 0``, so ``h =
silu(0) * 0 = 0`` meets a zero row of ``W_d``, and ``y`` is unchanged. In the backward every
gradient then has exactly zero pad rows and columns, provided the output gradient's pad
columns are zero too (``dW_d = S^T dY`` reads them): `pad_bwd_inputs` makes them so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.kernels.blockwise_moe.contract import DIM_MULTIPLE as BWD_MULTIPLE  # bwd spec §10
from mxcli.kernels.blockwise_moe.spec import SPEC as BWD_SPEC
from mxcli.kernels.rmsnorm_mx_prefill.contract import HIDDEN_MULTIPLE as PREFILL_H_MULTIPLE
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC as PREFILL_SPEC


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


@dataclass(frozen=True)
class Padding:
    """True and padded sizes of one prepared model (per TP rank for the intermediate sizes)."""

    hidden_size: int  # H, the model's
    prefill_hidden_size: int  # Hp: gamma, router rows, prefill hidden_states
    backward_hidden_size: int  # Hb: expert stacks, backward hidden_states and gradients
    intermediate_size: int  # I_TP, the real slice of one rank
    padded_intermediate_size: int  # Ip
    shared_intermediate_size: int | None = None  # Is_TP
    padded_shared_intermediate_size: int | None = None

    @staticmethod
    def of(H: int, I_tp: int, shared_I_tp: int | None = None) -> Padding:  # noqa: N803
        """The padded sizes for hidden size `H` and the per-rank intermediate sizes."""
        return Padding(
            int(H),
            round_up(H, PREFILL_H_MULTIPLE),
            round_up(H, BWD_MULTIPLE),
            int(I_tp),
            round_up(I_tp, BWD_MULTIPLE),
            int(shared_I_tp) if shared_I_tp else None,
            round_up(shared_I_tp, BWD_MULTIPLE) if shared_I_tp else None,
        )

    @property
    def any(self) -> bool:
        """Whether some size is padded."""
        return (
            self.prefill_hidden_size != self.hidden_size
            or self.backward_hidden_size != self.hidden_size
            or self.padded_intermediate_size != self.intermediate_size
            or self.padded_shared_intermediate_size != self.shared_intermediate_size
        )

    def bwd_sizes(self, shared: bool = False) -> tuple[int, int, int, int]:
        """``(H, Hb, I, Ip)`` of the routed experts, or of the shared expert with `shared`."""
        if shared:
            assert self.shared_intermediate_size and self.padded_shared_intermediate_size
            return (
                self.hidden_size,
                self.backward_hidden_size,
                self.shared_intermediate_size,
                self.padded_shared_intermediate_size,
            )
        return (
            self.hidden_size,
            self.backward_hidden_size,
            self.intermediate_size,
            self.padded_intermediate_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "prefill_hidden_size": self.prefill_hidden_size,
            "backward_hidden_size": self.backward_hidden_size,
            "intermediate_size_per_rank": self.intermediate_size,
            "padded_intermediate_size_per_rank": self.padded_intermediate_size,
            "shared_intermediate_size_per_rank": self.shared_intermediate_size,
            "padded_shared_intermediate_size_per_rank": self.padded_shared_intermediate_size,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Padding:
        return Padding(
            int(d["hidden_size"]),
            int(d["prefill_hidden_size"]),
            int(d["backward_hidden_size"]),
            int(d["intermediate_size_per_rank"]),
            int(d["padded_intermediate_size_per_rank"]),
            d.get("shared_intermediate_size_per_rank"),
            d.get("padded_shared_intermediate_size_per_rank"),
        )


def pad_dims(x: torch.Tensor, sizes: Mapping[int, int]) -> torch.Tensor:
    """`x` zero-padded at the end of each dim in `sizes` (dim -> new size); `x` itself when no
    dim grows."""
    shape = list(x.shape)
    for d, n in sizes.items():
        if n < shape[d]:
            raise ValueError(f"cannot pad dim {d} of {tuple(x.shape)} down to {n}")
        shape[d] = n
    if shape == list(x.shape):
        return x
    out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


# tensor name -> {dim: "H" | "I"}: the kernels' padded dims (their `KernelSpec`)
assert BWD_SPEC.padded is not None and PREFILL_SPEC.padded is not None
_BWD_INPUT_DIMS = BWD_SPEC.padded.inputs
BWD_OUTPUT_DIMS = BWD_SPEC.padded.outputs
_PREFILL_INPUT_DIMS = PREFILL_SPEC.padded.inputs


def _sizes(dims: Mapping[int, str], h: int, i: int) -> dict[int, int]:
    return {d: h if k == "H" else i for d, k in dims.items()}


def pad_bwd_inputs(
    tensors: Mapping[str, torch.Tensor], pad: Padding, shared: bool = False
) -> dict[str, torch.Tensor]:
    """Backward activations at the true sizes -> zero-padded to ``Hb`` / ``Ip``; a dim of any
    other size (already padded, or wrong: the kernel's checks report it) is left as it is."""
    H, Hb, I, Ip = pad.bwd_sizes(shared)  # noqa: E741
    out = dict(tensors)
    for name, dims in _BWD_INPUT_DIMS.items():
        t = tensors.get(name)
        if t is not None:
            true, padded = _sizes(dims, H, I), _sizes(dims, Hb, Ip)
            grow = {d: padded[d] for d in dims if d < t.dim() and t.shape[d] == true[d]}
            out[name] = pad_dims(t, grow)
    return out


def unpad_bwd_outputs(
    outputs: Mapping[str, torch.Tensor], pad: Padding, shared: bool = False
) -> dict[str, torch.Tensor]:
    """The backward's gradients cut back to the model's true ``H`` and ``I_TP``."""
    H, _, I, _ = pad.bwd_sizes(shared)  # noqa: E741
    out = dict(outputs)
    for name, dims in BWD_OUTPUT_DIMS.items():
        t = outputs.get(name)
        if t is not None:
            idx = [slice(None)] * t.dim()
            for d, n in _sizes(dims, H, I).items():
                idx[d] = slice(0, n)
            out[name] = t[tuple(idx)].contiguous()
    return out


def pad_region_max_abs(
    outputs: Mapping[str, torch.Tensor], pad: Padding, shared: bool = False
) -> dict[str, float]:
    """Per padded gradient: the largest ``|value|`` in its pad rows and columns (0.0 when the
    padding is exact, as it must be)."""
    H, _, I, _ = pad.bwd_sizes(shared)  # noqa: E741
    out: dict[str, float] = {}
    for name, dims in BWD_OUTPUT_DIMS.items():
        t = outputs.get(name)
        if t is None:
            continue
        worst = 0.0
        for d, n in _sizes(dims, H, I).items():
            if t.shape[d] > n:
                region = t.narrow(d, n, t.shape[d] - n).float()
                worst = max(worst, float(region.abs().max()) if region.numel() else 0.0)
        out[name] = worst
    return out


def pad_prefill_inputs(tensors: Mapping[str, torch.Tensor], Hp: int) -> dict[str, torch.Tensor]:  # noqa: N803
    """Prefill activations (``hidden_states``, ``residual`` ``[B, S, H]``) zero-padded to `Hp`
    (an H dim of `Hp` or more is left as it is)."""
    out = dict(tensors)
    for name, dims in _PREFILL_INPUT_DIMS.items():
        t = tensors.get(name)
        if t is not None and t.dim():
            grow = {d % t.dim(): Hp for d in dims if t.shape[d] < Hp}
            if grow:
                out[name] = pad_dims(t, grow)
    return out


def repad_bwd_outputs(
    outputs: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Un-padded gradients (`mxcli.runs.unpad_run_outputs` metadata `meta`) zero-padded back
    to the kernel's sizes, for a comparison with math done at the padded sizes."""
    if meta.get("outputs") != "unpadded":
        return dict(outputs)
    pad = Padding.from_dict(meta)
    shared = meta.get("expert_stack") == "shared"
    _, Hb, _, Ip = pad.bwd_sizes(shared)
    out = dict(outputs)
    for name, dims in BWD_OUTPUT_DIMS.items():
        t = outputs.get(name)
        if t is not None:
            out[name] = pad_dims(t, _sizes(dims, Hb, Ip))
    return out
