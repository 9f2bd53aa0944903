# ruff: noqa: E741  (spec notation: I is the intermediate size)
"""``--dry-run`` plans of the released MoE models at their real shapes, from config.json alone,
config.json + index, or index + shards whose headers are real and whose data were never written
(`tests.weightprep.real_models`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from tests.weightprep.real_models import (
    CONFIGS,
    MOE_LAYERS,
    moe_tensors,
    nbytes,
    write_meta_checkpoint,
)

# Kimi-K2's model_type kimi_k2 comes with its own code (not transformers); its architecture is
# DeepseekV3ForCausalLM, and the deepseek_v3 family lists kimi_k2 among its model types
_FORCED: dict[str, str] = {}
_ROUTER = {
    "deepseek_v3": "NOAUX_TC", "kimi_k2": "NOAUX_TC", "glm4_moe": "NOAUX_TC",
    "qwen3_moe": "SOFTMAX", "gpt_oss": "SOFTMAX", "mixtral": "SOFTMAX", "llama4": "SIGMOID",
}  # fmt: skip


def _plan(src: Path, repo: str, **kw: Any) -> dict[str, Any]:
    opts = PrepOptions(model_type=_FORCED.get(repo), **kw)
    res = prepare_weights(src, None, opts, dry_run=True)
    assert res["dry_run"] is True
    return dict(res["plan"])


def _sizes(repo: str) -> tuple[int, int, int]:
    c = CONFIGS[repo].get("text_config", CONFIGS[repo])
    E = c.get("n_routed_experts") or c.get("num_experts") or c["num_local_experts"]
    I = c.get("moe_intermediate_size") or c["intermediate_size"]  # noqa: E741
    return c["hidden_size"], I, E


@pytest.mark.parametrize("index", [True, False], ids=["index", "config-only"])
@pytest.mark.parametrize("repo", list(CONFIGS))
def test_dry_run_plans_the_released_model(repo: str, index: bool, tmp_path: Path) -> None:
    src = write_meta_checkpoint(tmp_path / "m", repo, index=index)
    plan = _plan(src, repo)
    H, I, E = _sizes(repo)
    assert plan["planned_from_config"] is True
    assert plan["moe_layers"] == plan["layers"] == MOE_LAYERS[repo]
    assert (plan["hidden_size"], plan["intermediate_size"], plan["num_experts"]) == (H, I, E)
    assert plan["router"]["act_fn"] == _ROUTER[CONFIGS[repo]["model_type"]]
    # bytes per layer: the sum over the real tensor list, dtype by dtype
    for entry in plan["per_layer"]:
        want = sum(nbytes(d, s) for d, s in moe_tensors(repo, entry["layer"]).values())
        assert entry["source_bytes"] == want, entry["layer"]
        assert entry["estimated_peak_memory_bytes"] == plan["estimated_peak_memory_bytes"] > 0
        assert entry["output_bytes"] > 0
    assert plan["source_bytes"] == sum(e["source_bytes"] for e in plan["per_layer"])
    # what the backward kernel gets at real size: [E, Hb, 2, Ip] with Hb, Ip multiples of 128
    gu = next(o for o in plan["outputs_per_layer"]["rank0"] if o["name"] == "gate_up_proj_weight")
    pad = plan["padding"]
    assert gu["shape"] == [
        E,
        pad["backward_hidden_size"],
        2,
        pad["padded_intermediate_size_per_rank"],
    ]
    if index:
        shards = {e["layer"]: e["source_shards"] for e in plan["per_layer"]}
        assert shards[MOE_LAYERS[repo][0]] == [f"model-{MOE_LAYERS[repo][0] + 1:05d}-of-"
                                               f"{MOE_LAYERS[repo][-1] + 1:05d}.safetensors"]  # fmt: skip


def test_real_numbers_of_some_plans(tmp_path: Path) -> None:
    """Worked values: per-layer bytes of DeepSeek-V3 (FP8 + fp32 block scales) and the padded
    gpt-oss stacks."""
    ds = _plan(write_meta_checkpoint(tmp_path / "ds", "deepseek-ai/DeepSeek-V3"),
               "deepseek-ai/DeepSeek-V3", layers="3")  # fmt: skip
    # 257 experts (256 routed + 1 shared) x 3 x 2048 x 7168 fp8, their 16 x 56 fp32 scales,
    # gate 256 x 7168 bf16, bias 256 fp32, gamma 7168 bf16
    assert ds["per_layer"][0]["source_bytes"] == (
        257 * 3 * (2048 * 7168 + 16 * 56 * 4) + 256 * 7168 * 2 + 256 * 4 + 7168 * 2
    )
    assert ds["source_format"] == "fp8-block"
    g = _plan(write_meta_checkpoint(tmp_path / "g", "openai/gpt-oss-120b"), "openai/gpt-oss-120b")
    assert g["source_format"] == "bf16+mxfp4"  # bf16 expert biases, MXFP4 weights
    shapes = {o["name"]: o["shape"] for o in g["outputs_per_layer"]["rank0"]}
    assert shapes["gamma"] == [3072] and shapes["router_weights"] == [3072, 128]
    assert shapes["gate_up_proj_weight"] == [128, 2944, 2, 2944]
    assert shapes["down_proj_weight"] == [128, 2944, 2944]
    assert shapes["gate_up_proj_bias"] == [128, 2, 2944] and shapes["down_proj_bias"] == [128, 2944]
    assert g["padding"]["prefill_hidden_size"] == 3072


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_oss_and_qwen3_tp4_prepare_at_real_shapes(tp: int, tmp_path: Path) -> None:
    q = _plan(write_meta_checkpoint(tmp_path / "q", "Qwen/Qwen3-30B-A3B", index=False),
              "Qwen/Qwen3-30B-A3B", tp=tp)  # fmt: skip
    assert len(q["ranks"]) == tp
    assert q["padding"]["intermediate_size_per_rank"] == 768 // tp
    assert q["padding"]["padded_intermediate_size_per_rank"] == {1: 768, 2: 384, 4: 256}[tp]
    o = _plan(write_meta_checkpoint(tmp_path / "o", "openai/gpt-oss-20b", index=False),
              "openai/gpt-oss-20b", tp=tp)  # fmt: skip
    assert o["padding"]["padded_intermediate_size_per_rank"] == {1: 2944, 2: 1536, 4: 768}[tp]


def test_headers_agree_with_the_config_only_plan(tmp_path: Path) -> None:
    """gpt-oss-20b layer 0 from a shard whose header is real (data never written): the header
    path validates every shape and dtype and gives the same bytes as the config-only plan."""
    repo = "openai/gpt-oss-20b"
    src = write_meta_checkpoint(tmp_path / "m", repo, shards_for=(0,))
    with_header = _plan(src, repo, layers="0")
    assert with_header["planned_from_config"] is False
    config_only = _plan(write_meta_checkpoint(tmp_path / "c", repo, index=False), repo, layers="0")
    assert (
        with_header["per_layer"][0]["source_bytes"] == config_only["per_layer"][0]["source_bytes"]
    )
    assert with_header["outputs_per_layer"] == config_only["outputs_per_layer"]
    # all 24 layers: layer 0 from its header, the others from config + index
    mixed = _plan(src, repo)
    assert mixed["planned_from_config"] is True and len(mixed["per_layer"]) == 24


def test_index_proves_names(tmp_path: Path) -> None:
    """With an index, a name the family expects but the index lacks is an error, not a guess."""
    from mxcli.errors import MxcliError

    repo = "Qwen/Qwen3-30B-A3B"
    src = write_meta_checkpoint(tmp_path / "m", repo)
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.layers.5.mlp.experts.7.up_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(MxcliError, match=r"model.layers.5.mlp.experts.7.up_proj.weight"):
        _plan(src, repo)


def test_cli_dry_run_from_config_only(tmp_path: Path) -> None:
    src = write_meta_checkpoint(tmp_path / "m", "Qwen/Qwen3-30B-A3B", index=False)
    r = CliRunner().invoke(app, ["prep-weights", str(src), "--dry-run", "--tp", "4"])
    assert r.exit_code == 0, r.output
    assert "planned from config.json" in r.stdout and "I_TP=192 is zero-padded to 256" in r.stdout
    r = CliRunner().invoke(app, ["prep-weights", str(src), str(tmp_path / "o")])
    assert r.exit_code == 2 and "missing" in r.output  # converting needs the shards


@pytest.mark.parametrize(
    "repo",
    [
        "moonshotai/Kimi-K2-Instruct",
        "zai-org/GLM-4.5",
    ],
)
def test_families_detected_from_model_type(repo: str, tmp_path: Path) -> None:
    src = write_meta_checkpoint(tmp_path / "m", repo, index=False)
    res = prepare_weights(src, None, PrepOptions(), dry_run=True)
    assert res["plan"]["moe_layers"] == MOE_LAYERS[repo]


@pytest.mark.slow
def test_deepseek_v3_layer_from_real_headers(tmp_path: Path) -> None:
    """DeepSeek-V3 layer 3 (11 GB of FP8 experts, never written) validated from its header."""
    repo = "deepseek-ai/DeepSeek-V3"
    src = write_meta_checkpoint(tmp_path / "m", repo, shards_for=(3,))
    plan = _plan(src, repo, layers="3")
    assert plan["planned_from_config"] is False
    want = sum(nbytes(d, s) for d, s in moe_tensors(repo, 3).values())
    assert plan["per_layer"][0]["source_bytes"] == want
