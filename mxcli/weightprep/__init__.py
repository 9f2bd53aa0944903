"""Hugging Face MoE checkpoint -> kernel-ready weights (``mxcli prep-weights``).

Modules: `checkpoint` (config, shard index, headers, lazy loads), `families` (one declarative
entry per model family), `sources` (FP8 block and MXFP4 source decoders), `plan` (validation and
the dry-run plan), `convert` (one layer, streamed by expert chunk), `writer` (streaming
safetensors, index, atomic JSON), `manifest` (the output schema and its loaders), `check`
(``--check``), `runner` (resume, workers, progress), `synthetic` (tiny checkpoints of every family).

Downstream commands read the outputs with `load_manifest`, `load_layer_tensors`,
`load_prefill_inputs` and `load_backward_weights`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "Manifest": "mxcli.weightprep.manifest",
    "load_manifest": "mxcli.weightprep.manifest",
    "load_layer_tensors": "mxcli.weightprep.manifest",
    "load_prefill_inputs": "mxcli.weightprep.manifest",
    "load_backward_weights": "mxcli.weightprep.manifest",
    "PrepOptions": "mxcli.weightprep.plan",
    "build_plan": "mxcli.weightprep.plan",
    "prepare_weights": "mxcli.weightprep.runner",
    "build_checkpoint": "mxcli.weightprep.synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mxcli.weightprep' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
