"""Non-finite kernel outputs that the inputs do not explain.

A finite input can still give NaN or Inf outputs: the fp32 sum of squares of a prefill row
overflows for ``|x| >= 2^64`` (and the fp16 compute dtype for ``|x * gamma| > 65504``), see
`mxcli.kernels.rmsnorm_mx_prefill.reference`. The kernels (and their references) follow IEEE
arithmetic there rather than guard against it, so ``run-prefill`` / ``run-bwd`` check every
output afterwards and name what they find.

*Explained* non-finite values are those an input already carries (only possible with
``--allow-nonfinite``): for the prefill kernel, tokens are independent, so a token's outputs are
explained by a non-finite value in its own ``hidden_states`` / ``residual`` row, and every token's
by a non-finite ``gamma``, ``router_weights`` or ``router_bias``. This holds on the NKI kernel
too: its only cross-token step, the inv_rms broadcast, is a PE transpose, i.e. a "Bit-exact copy
of elements" (api spec §7.4), not a matmul against the identity (whose NaN * 0 would reach the
whole 128-token tile); see step 4 of `mxcli.kernels.rmsnorm_mx_prefill.nki_kernel`. The backward
mixes all tokens and experts, so any non-finite input explains every output.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from mxcli.kernels.spec import get_spec


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor; (0, 0) for integer and byte tensors."""
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return 0, 0
    f = t.detach().float()
    return int(torch.isnan(f).sum()), int(torch.isinf(f).sum())


def input_nonfinite(name: str, t: torch.Tensor, x4_inputs: Collection[str] = ()) -> tuple[int, int]:
    """(NaN, Inf) counts of an input: float values, or the E4M3 codes of x4 words (inputs in
    `x4_inputs`, the kernel's `NonfiniteRule.x4_inputs`: four codes per 32-bit word; 0x7F and
    0xFF are NaN)."""
    if name in x4_inputs and t.dtype in (torch.uint32, torch.int32):
        b = t.detach().contiguous().view(torch.uint8)
        return int(((b & 0x7F) == 0x7F).sum()), 0
    return nonfinite_counts(t)


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t.detach().float())


def _rows_nonfinite(t: torch.Tensor | None, T: int) -> torch.Tensor:
    if t is None or not t.is_floating_point():
        return torch.zeros(T, dtype=torch.bool)
    return _nonfinite(t.reshape(T, -1)).any(dim=1).cpu()


def unexplained_nonfinite(
    kernel: str,
    inputs: Mapping[str, torch.Tensor],
    outputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
) -> dict[str, int]:
    """``{output name: count}`` of NaN/Inf output values the inputs do not explain (the
    kernel's `NonfiniteRule`, see the module doc); empty when there are none."""
    rule = get_spec(kernel).nonfinite

    def values() -> dict[str, torch.Tensor]:
        return dict(outputs) if rule.views is None else rule.views(outputs, kwargs, inputs)

    if rule.token_inputs is None:  # every output depends on every input
        if any_nonfinite_input(inputs, rule.x4_inputs):
            return {}
        totals = {
            name: int(_nonfinite(v).sum()) for name, v in values().items() if v.is_floating_point()
        }
        return {name: c for name, c in totals.items() if c}
    explained = explained_tokens(kernel, inputs)
    if explained is None or bool(explained.all()):
        return {}
    T = explained.numel()
    counts = {}
    for name, v in values().items():
        bad = _nonfinite(v.reshape(T, -1)).cpu() & ~explained[:, None]
        if bool(bad.any()):
            counts[name] = int(bad.sum())
    return counts


def explained_tokens(kernel: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``[T]`` bool: the tokens whose outputs a non-finite input explains (the kernel's
    `NonfiniteRule`, see the module doc): a token's own non-finite row of a per-token input, or
    every token when another input is non-finite. None for a kernel without per-token inputs."""
    rule = get_spec(kernel).nonfinite
    if rule.token_inputs is None:
        return None
    first = inputs[rule.token_inputs[0]]
    T = first.numel() // int(first.shape[-1])
    if any(
        t is not None and t.is_floating_point() and bool(_nonfinite(t).any())
        for n, t in inputs.items()
        if n not in rule.token_inputs
    ):
        return torch.ones(T, dtype=torch.bool)
    explained = torch.zeros(T, dtype=torch.bool)
    for token_input in rule.token_inputs:
        explained |= _rows_nonfinite(inputs.get(token_input), T)
    return explained


def any_nonfinite_input(
    inputs: Mapping[str, torch.Tensor], x4_inputs: Collection[str] = ()
) -> bool:
    """Whether any input holds a NaN or Inf (float values, or the codes of x4 words)."""
    return any(sum(input_nonfinite(n, t, x4_inputs)) for n, t in inputs.items())


def nonfinite_warnings(counts: Mapping[str, int]) -> list[str]:
    """One line per output holding unexplained NaN/Inf values."""
    return [
        f"warning: {name}: {n} NaN/Inf value(s) that the inputs do not explain "
        "(the inputs they depend on are finite: an overflow inside the kernel)"
        for name, n in counts.items()
    ]


__all__ = [
    "any_nonfinite_input",
    "explained_tokens",
    "input_nonfinite",
    "nonfinite_counts",
    "nonfinite_warnings",
    "unexplained_nonfinite",
]
