"""Complete, valid kernel inputs: seeded synthetic data, or a prepared checkpoint layer.

The generic machinery: the `KernelInputs` record, the seeded draws every generator uses, and
dispatch to the kernel's own inputs part (``mxcli/kernels/<kernel>/inputs.py``, `InputsPart`),
which holds its generator, its make-inputs parameters and its inputs from a prepared folder
(prefill spec §7 and bwd spec §11.1 for the two built-in kernels' distributions).

Every generator draws from one ``torch.Generator`` seeded with ``seed`` (`seeded`): the same
arguments give the same bytes.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.io.files import describe_tensors, write_file
from mxcli.io.metadata import inputs_metadata
from mxcli.kernels.spec import KernelSpec, get_spec


@dataclass
class KernelInputs:
    """Input tensors named as the kernel arguments, their scalar kwargs, and how they were made."""

    kernel: str
    tensors: dict[str, torch.Tensor]
    kwargs: dict[str, Any]
    generator: dict[str, Any] = field(default_factory=dict)
    # not written to the file: what a check needs besides it (e.g. the bf16 weights behind
    # pre-quantized ones)
    extras: dict[str, Any] = field(default_factory=dict)


# the seeded bwd router draws from numpy's legacy RNG, which takes 32-bit seeds; one range for
# every kernel keeps a seed valid whatever it is used for
SEED_MAX = 2**32 - 1


def seeded(seed: int) -> torch.Generator:
    """The generator of a seeded input file (`SEED_MAX` bounds the seed)."""
    if not 0 <= int(seed) <= SEED_MAX:
        raise InputError(f"seed (--seed): expected an integer in [0, {SEED_MAX}], got {seed}")
    return torch.Generator().manual_seed(int(seed))


def normal(
    g: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0
) -> torch.Tensor:
    """fp32 ``mean + std * N(0, 1)`` of `shape` from `g`."""
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


def uniform(g: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    """fp32 ``U[low, high)`` of `shape` from `g`."""
    return torch.rand(shape, generator=g, dtype=torch.float32) * (high - low) + low


def check_positive(**values: int | None) -> None:
    """One line naming the first value that is not a positive integer (None: not given)."""
    for name, v in values.items():
        if v is not None and int(v) < 1:
            raise InputError(f"{name}: expected a positive integer, got {v}")


# --------------------------------------------------------------------------------------------
# Synthetic inputs
# --------------------------------------------------------------------------------------------


def make_inputs(kernel: str | KernelSpec, **params: Any) -> KernelInputs:
    """Seeded synthetic inputs of `kernel` (its inputs part's ``generate``)."""
    made: KernelInputs = get_spec(kernel).inputs().generate(**params)
    return made


def inputs_from_flags(kernel: str | KernelSpec, flags: Mapping[str, Any]) -> KernelInputs:
    """Seeded synthetic inputs of `kernel` from make-inputs' flag values (by parameter name)."""
    made: KernelInputs = get_spec(kernel).inputs().from_flags(dict(flags))
    return made


# --------------------------------------------------------------------------------------------
# From a prepared checkpoint (``mxcli prep-weights`` output folder)
# --------------------------------------------------------------------------------------------


def _layer_hook(spec: KernelSpec, name: str) -> Any:
    hook = getattr(spec.inputs(), name, None)
    if hook is None:
        raise InputError(f"weights: {spec.name} takes no inputs from a prepared folder")
    return hook


def layer_run_inputs(
    kernel: str, weights: str | os.PathLike[str], layer: int, *, verify_hashes: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and kwargs a prepared layer supplies to a run command (``--weights --layer``):
    the kernel's ``from_layer``."""
    from mxcli.weightprep.manifest import load_manifest

    spec = get_spec(kernel)
    hook = _layer_hook(spec, "from_layer")
    m = load_manifest(Path(weights), verify_hashes=verify_hashes)
    tensors, kwargs = hook(m, layer)
    return dict(tensors), dict(kwargs)


def inputs_from_weights(
    kernel: str | KernelSpec,
    weights: str | os.PathLike[str],
    layer: int,
    *,
    verify_hashes: bool = True,
    rank: int = 0,
    **params: Any,
) -> KernelInputs:
    """Inputs for one layer and `rank` of a prepared checkpoint (the kernel's
    ``from_weights``; the rank is recorded: a TP/EP folder's ranks hold different slices).
    `params` are make-inputs parameters; those the hook does not take are ignored."""
    from mxcli.weightprep.manifest import load_manifest

    spec = get_spec(kernel)
    hook = _layer_hook(spec, "from_weights")
    m = load_manifest(Path(weights), verify_hashes=verify_hashes)  # checked against its files
    m.rank_entry(layer, rank)  # a rank the folder lacks: one line naming those it has
    names = inspect.signature(hook).parameters
    made: KernelInputs = hook(
        m, weights, layer, rank, **{k: v for k, v in params.items() if k in names}
    )
    return made


def layer_facts(
    kernel: str | KernelSpec, weights: str | os.PathLike[str], layer: int, rank: int = 0
) -> dict[str, Any]:
    """What a prepared layer fixes, by make-inputs parameter (the kernel's ``layer_facts``,
    read from the manifest alone; ``{}`` when the kernel says nothing)."""
    from mxcli.weightprep.manifest import load_manifest

    hook = getattr(get_spec(kernel).inputs(), "layer_facts", None)
    if hook is None:
        return {}
    facts: dict[str, Any] = hook(load_manifest(Path(weights)), layer, rank)
    return facts


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def describe_inputs(inputs: KernelInputs, path: str | os.PathLike[str]) -> dict[str, Any]:
    """JSON-ready summary of written inputs (``make-inputs --json``)."""
    spec = get_spec(inputs.kernel)
    return {
        "kernel": inputs.kernel,
        "output": str(path),
        "generator": inputs.generator,
        "kwargs": spec.dump_kwargs(spec.resolve_kwargs(inputs.kwargs)),
        "tensors": describe_tensors(inputs.tensors),
    }


def write_inputs(
    inputs: KernelInputs, path: str | os.PathLike[str], *, force: bool = False
) -> None:
    """Write an input file: tensors by argument name, kwargs and generator in the metadata."""
    spec = get_spec(inputs.kernel)
    kwargs = spec.dump_kwargs(spec.resolve_kwargs(inputs.kwargs))
    write_file(
        path, inputs.tensors, inputs_metadata(spec.name, kwargs, inputs.generator), force=force
    )


__all__ = [
    "SEED_MAX",
    "KernelInputs",
    "check_positive",
    "describe_inputs",
    "inputs_from_flags",
    "inputs_from_weights",
    "layer_facts",
    "layer_run_inputs",
    "make_inputs",
    "normal",
    "seeded",
    "uniform",
    "write_inputs",
]
