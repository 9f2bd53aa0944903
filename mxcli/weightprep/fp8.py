"""FP8 semantics of prepared and exported weights: element variant, range and scale rule.

The FP8 range is a mode, not a constant (issue 22):

- OCP E4M3FN, +-448: what llm-compressor / compressed-tensors write and GPU vLLM reads; Trn3's
  MX path uses it (AWS's Trn3 benchmarks set ``NEURON_RT_ENABLE_OCP=1``).
- Neuron FP8, +-240: NxD Inference documents that values outside +-240 become NaN on Neuron
  devices (Trn2's FP8 and the paths without OCP mode). ``--fp8-range 240`` scales for it (OCP's
  algorithm with the element's largest exponent 7: the NEURON rule's bytes, group max in
  [128, 256)), saturates every code above 240 to +-240 (E4M3FN code 0x77/0xF7) and counts what
  it clipped.

The scale rule (`mxcli.mx.ScaleRule`) says how a group's E8M0 byte follows from its largest
magnitude: NEURON (Trn3, the kernels' rule) puts the group maximum in [128, 256), one exponent
above OCP, which puts it in [256, 512) and saturates above 448.

Every manifest and export records `Fp8Semantics.to_dict`; `source_semantics` reads what a source
declares and `check_source_target` refuses a mismatch with one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.io.jsonfile import read_json

FP8_RANGES = (448, 240)
E4M3FN_MAX = 448.0
NEURON_FP8_MAX = 240.0
# E4M3FN codes: 0x77 = 1.875 * 2^7 = 240; 0x78..0x7E = 256..448; 0x7F = NaN (sign in bit 7).
_CODE_240 = 0x77
_CODE_NAN = 0x7F
EXPORT_SIDECAR = "mxcli-export.json"


_SCALE_EXPONENT = {
    "ocp": "E8M0 byte = exponent(amax) - 8 (group max in [256, 512), saturating at 448)",
    "neuron": "E8M0 byte = exponent(amax) - 7 (group max in [128, 256))",
    "ct": "E8M0 byte = exponent(amax) - 8, + 1 when amax's mantissa >= 1.75 (compressed-tensors' "
    "generate_mx_scales; group max in [224, 448])",
    "rceil": "E8M0 byte = ceil(log2(fl32(amax * fl32(1/448)))) + 127 (torchao RCEIL; group max "
    "in (224, 448])",
}


@dataclass(frozen=True)
class Fp8Semantics:
    """How FP8 codes in an output are to be read: variant, range and the scale rule."""

    fp8_range: int = 448
    scale_rule: str = "neuron"
    variant: str = "e4m3fn"

    def __post_init__(self) -> None:
        if self.fp8_range not in FP8_RANGES:
            raise InputError(f"--fp8-range: expected 448 or 240, got {self.fp8_range}")

    @property
    def max(self) -> float:
        return E4M3FN_MAX if self.fp8_range == 448 else NEURON_FP8_MAX

    @property
    def exponent_offset(self) -> int:
        """``byte = exponent(amax) - offset`` (RCEIL and CT add one for some groups). OCP's
        algorithm subtracts the element format's largest exponent: 8 for E4M3FN (+-448), 7 for
        a +-240 element, which is the NEURON rule's offset; so a +-240 target scales with 7."""
        return 7 if self.scale_rule == "neuron" or self.fp8_range == 240 else 8

    @property
    def rule_bytes(self) -> str:
        """The `mxcli.mx.ScaleRule` whose bytes these are."""
        return "neuron" if self.fp8_range == 240 else self.scale_rule

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "range": [-self.max, self.max],
            "max": self.max,
            "mode": "ocp" if self.fp8_range == 448 else "neuron",
            "description": (
                "OCP E4M3FN (+-448)"
                if self.fp8_range == 448
                else "Neuron FP8 (+-240): E4M3FN codes saturated at +-240"
            ),
            "scale_rule": self.scale_rule,
            "scale_exponent": _SCALE_EXPONENT.get(self.rule_bytes, "")
            if self.fp8_range == 448
            else "E8M0 byte = exponent(amax) - 7 (group max in [128, 256), saturating at 240)",
        }

    def metadata(self) -> dict[str, str]:
        """safetensors ``__metadata__`` entries (strings)."""
        return {
            "fp8_variant": self.variant,
            "fp8_max": str(self.max),
            "scale_rule": self.scale_rule,
        }


def clip_codes(codes: torch.Tensor, fp8_range: int) -> int:
    """Saturate E4M3FN codes above ``fp8_range`` in place (any integer tensor holding code
    bytes: uint8 codes or x4 uint32 words); return how many were clipped. NaN codes stay."""
    if fp8_range == 448:
        return 0
    b = codes.view(torch.uint8)
    mag = b & 0x7F
    over = (mag > _CODE_240) & (mag != _CODE_NAN)
    n = int(over.sum())
    if n:
        b.copy_(torch.where(over, (b & 0x80) | _CODE_240, b))
    return n


def source_semantics(config: dict[str, Any], root: Path | None = None) -> dict[str, Any] | None:
    """The FP8 semantics a source declares, or None when it holds no FP8 weights.

    compressed-tensors and DeepSeek ``fp8`` quantization_configs declare OCP E4M3FN (+-448), or
    E5M2 for DeepSeek's ``fmt: e5m2``. An mxcli export declares its own in `EXPORT_SIDECAR`.
    """
    if root is not None and (root / EXPORT_SIDECAR).is_file():
        try:
            fp8 = read_json(root / EXPORT_SIDECAR).get("fp8")
        except (InputError, AttributeError):
            fp8 = None
        if isinstance(fp8, dict) and "max" in fp8:
            return {"variant": fp8.get("variant", "e4m3fn"), "max": float(fp8["max"]),
                    "declared_by": EXPORT_SIDECAR}  # fmt: skip
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return {"variant": "e4m3fn", "max": E4M3FN_MAX, "declared_by": "compressed-tensors"}
    if method == "fp8":
        if q.get("fmt", "e4m3") == "e5m2":
            return {"variant": "e5m2", "max": 57344.0, "declared_by": "quantization_config.fmt"}
        return {"variant": "e4m3fn", "max": E4M3FN_MAX, "declared_by": "quantization_config"}
    return None


def check_source_target(source: dict[str, Any] | None, target: Fp8Semantics, where: str) -> None:
    """Refuse (one line) a source whose declared FP8 range is narrower than the target's.

    A source declared Neuron FP8 (+-240) was saturated for +-240 targets: preparing it for an
    OCP +-448 target would record a range its values never had, so the user must say
    ``--fp8-range 240`` (or go back to the unsaturated source).
    """
    if source is None:
        return
    if source["variant"] == "e4m3fn" and float(source["max"]) < target.max:
        raise InputError(
            f"{where}: the source declares FP8 {source['variant']} +-{source['max']:g} "
            f"({source['declared_by']}), the requested target is +-{target.max:g}: "
            f"pass --fp8-range {int(source['max'])}"
        )
