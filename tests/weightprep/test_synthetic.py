"""The synthetic checkpoints: real naming, deterministic, a layer's experts across two files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxcli.weightprep.checkpoint import Checkpoint
from mxcli.weightprep.synthetic import FAMILIES, build_checkpoint


@pytest.mark.parametrize("family", FAMILIES)
def test_first_moe_layer_spans_two_files(family: str, tmp_path: Path) -> None:
    ck = build_checkpoint(family, tmp_path / family)
    c = Checkpoint(ck.path)
    L = ck.moe_layers[0]
    experts = [n for n in c._infos if f"layers.{L}." in n and ".experts." in n]
    assert len({c.info(n).file for n in experts}) == 2, family
    assert len(ck.files) == 3 and (ck.path / "model.safetensors.index.json").is_file()
    assert (
        json.loads((ck.path / "config.json").read_text())["model_type"] == ck.config["model_type"]
    )


def test_quantized_sources(tmp_path: Path) -> None:
    ds = Checkpoint(build_checkpoint("deepseek_v3", tmp_path / "ds").path)
    w = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert ds.info(w).dtype == "F8_E4M3" and ds.info(w + "_scale_inv").shape == (1, 2)
    assert ds.has(
        "model.layers.3.mlp.experts.0.up_proj.weight"
    )  # the MTP layer past num_hidden_layers
    assert ds.config["quantization_config"]["weight_block_size"] == [128, 128]
    go = Checkpoint(build_checkpoint("gpt_oss", tmp_path / "go").path)
    assert go.info("model.layers.0.mlp.experts.gate_up_proj_blocks").shape == (8, 256, 8, 16)
    assert go.info("model.layers.0.mlp.experts.down_proj_scales").dtype == "U8"


def test_deterministic(tmp_path: Path) -> None:
    a = build_checkpoint("qwen2_moe", tmp_path / "a", seed=3)
    b = build_checkpoint("qwen2_moe", tmp_path / "b", seed=3)
    c = build_checkpoint("qwen2_moe", tmp_path / "c", seed=4)
    for f in a.files:
        assert (a.path / f).read_bytes() == (b.path / f).read_bytes()
    assert (a.path / a.files[1]).read_bytes() != (c.path / c.files[1]).read_bytes()


def test_single_file_checkpoint(tmp_path: Path) -> None:
    ck = build_checkpoint("mixtral", tmp_path / "m", num_shards=1)
    assert (
        ck.files == ["model.safetensors"]
        and not (ck.path / "model.safetensors.index.json").exists()
    )
    assert Checkpoint(ck.path).files == ["model.safetensors"]
