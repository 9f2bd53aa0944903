from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import FAMILIES, build_checkpoint

# Per family: builder kwargs (I = 256 so that --tp 2 keeps I_TP a multiple of 128).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss_bf16": ("gpt_oss", {"quantized": False}),
    "llama4": ("llama4", {}),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for key, (family, kw) in VARIANTS.items():
        out[key] = build_checkpoint(family, root / key, intermediate_size=256, **kw).path
    return out


@pytest.fixture(scope="session")
def converted(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every variant converted with the defaults (bf16 + mxfp8, packed, neuron) and --check."""
    root = tmp_path_factory.mktemp("out")
    out = {}
    for key, src in checkpoints.items():
        prepare_weights(src, root / key, PrepOptions(check=True))
        out[key] = root / key
    return out


def family_of(key: str) -> str:
    return VARIANTS[key][0]


assert set(f for f, _ in VARIANTS.values()) == set(FAMILIES)
