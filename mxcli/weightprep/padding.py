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

PREFILL_H_MULTIPLE = 512  # prefill spec §2.3
BWD_MULTIPLE = 128  # bwd spec §10, both H and I


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


# bwd tensors: name -> {dim: "H" | "I"} (bwd spec §1 layouts; gradients share their layouts)
_BWD_INPUT_DIMS: dict[str, dict[int, str]] = {
    "hidden_states": {1: "H"},  # [T, H]
    "output_hidden_states_grad": {1: "H"},  # [T, H]
    "gate_up_proj_act_checkpoint_T": {2: "I"},  # [N, 2, I, B]
    "gate_act_checkpoint_T": {1: "I"},  # [N, I, B]
    "intermediate_checkpoint_T": {1: "I"},  # [N, I, B]
    "scaled_intermediate_checkpoint_T": {1: "I"},  # [N, I, B]
    "down_proj_act_checkpoint": {2: "H"},  # [N, B, H]
}
BWD_OUTPUT_DIMS: dict[str, dict[int, str]] = {
    "hidden_states_grad": {1: "H"},  # [T, H]
    "gate_up_proj_weight_grad": {1: "H", 3: "I"},  # [E, H, 2, I]
    "down_proj_weight_grad": {1: "I", 2: "H"},  # [E, I, H]
    "gate_and_up_proj_bias_grad": {2: "I"},  # [E, 2, I]
    "down_proj_bias_grad": {1: "H"},  # [E, H]
}


def _sizes(dims: Mapping[int, str], h: int, i: int) -> dict[int, int]:
    return {d: h if k == "H" else i for d, k in dims.items()}


def pad_bwd_inputs(
    tensors: Mapping[str, torch.Tensor], pad: Padding, shared: bool = False
) -> dict[str, torch.Tensor]:
    """Backward activations at the true sizes -> zero-padded to ``Hb`` / ``Ip``; tensors already
    at the padded sizes (and all others) pass through unchanged."""
    _, Hb, _, Ip = pad.bwd_sizes(shared)
    out = dict(tensors)
    for name, dims in _BWD_INPUT_DIMS.items():
        t = tensors.get(name)
        if t is not None:
            out[name] = pad_dims(t, _sizes(dims, Hb, Ip))
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
    """Prefill activations (``hidden_states``, ``residual`` ``[B, S, H]``) zero-padded to `Hp`."""
    out = dict(tensors)
    for name in ("hidden_states", "residual"):
        t = tensors.get(name)
        if t is not None:
            out[name] = pad_dims(t, {t.dim() - 1: Hp})
    return out
