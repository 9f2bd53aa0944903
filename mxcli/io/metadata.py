"""``__metadata__`` of the files the run commands read and write (``make-inputs``, ``run-prefill``,
``run-bwd``, ``verify``).

Input files
-----------
- Tensors are named exactly as the kernel arguments (the kernel's `KernelSpec` tables):
  ``hidden_states``, ``gamma``, ``router_weights``, ``router_bias``, ``residual`` for
  ``rmsnorm_mx_prefill``; ``hidden_states``, ``expert_affinities_masked``,
  ``gate_up_proj_weight``, ``down_proj_weight``, ``token_position_to_id``, ``block_to_expert``,
  ``output_hidden_states_grad``, ``gate_up_proj_act_checkpoint_T``, ``gate_up_weight_scales``,
  ... for ``blockwise_mm_bwd_mxfp8``. A name that is not a tensor argument of the kernel is an
  error, and so is a missing required one.
- Scalar kwargs (``top_k``, ``router_act_fn``, ``block_size``, the bwd ``config``, ...) come from
  the file's ``__metadata__``: the key ``kwargs`` holds a JSON object of them. A metadata key named
  exactly like a kwarg is accepted too (its value parsed as JSON, else taken as a string); the
  ``kwargs`` object wins over such keys, and command-line flags win over both. Enums are written
  by name (``"SOFTMAX"``), the bwd config as a JSON object of its fields.
- ``mxcli make-inputs`` also records ``kernel``, ``format`` (``mxcli.inputs/1``), the
  ``generator`` (seed, shapes, source) and ``mxcli_version``.

Output files
------------
- Tensors are named as the API references name the returns: ``norm_quant_packed``,
  ``expert_index``, ``expert_affinities``, ``output_residual``, ``norm_bf16`` (prefill, only those
  the call returns); ``hidden_states_grad``, ``expert_affinities_masked_grad``,
  ``gate_up_proj_weight_grad``, ``down_proj_weight_grad`` and, with ``config.bias``,
  ``gate_and_up_proj_bias_grad``, ``down_proj_bias_grad`` (bwd).
- ``__metadata__`` (every value a string, JSON where structured): ``format``
  (``mxcli.outputs/1``), ``kernel``, ``kwargs`` (every scalar kwarg the kernel ran with, defaults
  included), ``backend`` and ``device`` that ran, ``mxcli_version``, ``input_file`` and
  ``input_sha256`` (a JSON object: tensor name -> sha256 of its stored bytes). No time: the
  same run gives the same bytes (the run's timing is in the command's summary, ``timing_s``).

Storage of the tensors: `mxcli.io.files`. Every file is written atomically (temporary file +
rename); an existing output needs ``force``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mxcli import __version__
from mxcli.io.files import tensor_sha256

INPUTS_FORMAT = "mxcli.inputs/1"
OUTPUTS_FORMAT = "mxcli.outputs/1"


def inputs_metadata(
    kernel: str, kwargs: Mapping[str, Any], generator: Mapping[str, Any]
) -> dict[str, Any]:
    """``__metadata__`` of an input file written by ``make-inputs`` (`kwargs` JSON-ready)."""
    return {
        "format": INPUTS_FORMAT,
        "kernel": kernel,
        "kwargs": dict(kwargs),
        "generator": dict(generator),
        "mxcli_version": __version__,
    }


def outputs_metadata(
    kernel: str,
    kwargs: Mapping[str, Any],
    *,
    backend: str,
    device: str,
    inputs: Mapping[str, torch.Tensor],
    input_file: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``__metadata__`` of an output file: kernel, every kwarg (JSON-ready), backend, device,
    version, input hashes."""
    meta: dict[str, Any] = {
        "format": OUTPUTS_FORMAT,
        "kernel": kernel,
        "kwargs": dict(kwargs),
        "backend": backend,
        "device": device,
        "mxcli_version": __version__,
        "input_sha256": {name: tensor_sha256(t) for name, t in inputs.items()},
    }
    if input_file is not None:
        meta["input_file"] = input_file
    if extra:
        meta.update(extra)
    return meta


__all__ = ["INPUTS_FORMAT", "OUTPUTS_FORMAT", "inputs_metadata", "outputs_metadata"]
