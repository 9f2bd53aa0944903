"""Outputs of every family against the source: bf16 exact, MXFP8 == prequantize_weights bit for
bit, router un-arrangement exact, gamma/bias exact, padding, file metadata and index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mxcli.kernels.blockwise_moe import prequantize_weights
from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType, unarrange_router_weights
from mxcli.weightprep.manifest import (
    load_backward_weights,
    load_layer_tensors,
    load_manifest,
    load_prefill_inputs,
)
from tests.weightprep.conftest import VARIANTS, family_of
from tests.weightprep.reference import Source, restack, router_and_gamma

KEYS = list(VARIANTS)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("key", KEYS)
def test_bf16_and_mxfp8_match_source(key: str, checkpoints: dict, converted: dict) -> None:
    fam = family_of(key)
    src = Source(checkpoints[key])
    m = load_manifest(converted[key])
    assert m.layers, "no layer converted"
    for L in m.layers:
        ref = restack(src, fam, L)
        t = load_layer_tensors(converted[key], L, verify=True)
        assert _bits_equal(t["gate_up_proj_weight"], ref["gate_up"].to(torch.bfloat16))
        assert _bits_equal(t["down_proj_weight"], ref["down"].to(torch.bfloat16))
        pq = prequantize_weights(ref["gate_up"], ref["down"], scale_layout="packed", rule="neuron")
        assert _bits_equal(t["gate_up_proj_weight_mxfp8"], pq.gate_up_proj_weight)
        assert _bits_equal(t["gate_up_weight_scales"], pq.gate_up_weight_scales)
        assert _bits_equal(t["down_proj_weight_mxfp8"], pq.down_proj_weight)
        assert _bits_equal(t["down_weight_scales"], pq.down_weight_scales)
        if "shared_gate_up" in ref:
            assert _bits_equal(t["shared_expert.gate_up_proj_weight"], ref["shared_gate_up"])
            assert _bits_equal(t["shared_expert.down_proj_weight"], ref["shared_down"])
            spq = prequantize_weights(
                ref["shared_gate_up"], ref["shared_down"], scale_layout="packed"
            )
            assert _bits_equal(
                t["shared_expert.gate_up_proj_weight_mxfp8"], spq.gate_up_proj_weight
            )
            assert _bits_equal(t["shared_expert.down_weight_scales"], spq.down_weight_scales)
        else:
            assert not any(k.startswith("shared_expert") for k in t)
        if "gate_up_bias" in ref:
            assert _bits_equal(t["gate_up_proj_bias"], ref["gate_up_bias"])
            assert _bits_equal(t["down_proj_bias"], ref["down_bias"])


@pytest.mark.parametrize("key", KEYS)
def test_router_gamma_bias_and_kwargs(key: str, checkpoints: dict, converted: dict) -> None:
    fam = family_of(key)
    src = Source(checkpoints[key])
    m = load_manifest(converted[key])
    expected_act = {"deepseek_v3": "NOAUX_TC", "llama4": "SIGMOID"}.get(fam, "SOFTMAX")
    for L in m.layers:
        ref = router_and_gamma(src, fam, L)
        tensors, kw = load_prefill_inputs(converted[key], L)
        H = ref["gamma"].shape[0]
        Hp = tensors["gamma"].shape[0]
        assert Hp % 512 == 0 and Hp >= H
        assert kw["unpadded_hidden_size"] == H
        assert kw["router_act_fn"] is RouterActFnType[expected_act]
        assert _bits_equal(tensors["gamma"][:H], ref["gamma"])
        assert not tensors["gamma"][H:].any()
        natural = unarrange_router_weights(tensors["router_weights"], kw["router_act_fn"])
        assert _bits_equal(natural[:H], ref["router_natural"])
        assert not natural[H:].any()
        if "router_bias" in ref:
            assert _bits_equal(tensors["router_bias"], ref["router_bias"])
        else:
            assert "router_bias" not in tensors
        cfg = src.config.get("text_config", src.config)
        assert kw["top_k"] == cfg["num_experts_per_tok"]
        if fam == "deepseek_v3":
            assert (kw["n_group"], kw["topk_group"]) == (cfg["n_group"], cfg["topk_group"])
            assert kw["routed_scaling_factor"] == cfg["routed_scaling_factor"]
            assert tensors["router_bias"].dtype == torch.float32


def test_layer_selection(converted: dict) -> None:
    assert load_manifest(converted["deepseek_v3"]).layers == [
        1,
        2,
    ]  # dense layer 0 and MTP layer 3 skipped
    assert load_manifest(converted["llama4"]).layers == [1]  # interleave_moe_layer_step 2
    assert load_manifest(converted["qwen3_moe"]).layers == [0, 1]


def test_router_exactness_and_routing_check_recorded(converted: dict) -> None:
    m = load_manifest(converted["llama4"])
    assert any("PRE_SCALE" in n for n in m.data["router"]["backward_notes"])
    assert m.data["router"]["backward_exact"] is False and m.data["router"]["exact"] is True
    q = load_manifest(converted["qwen3_moe"]).data["router"]
    assert q["exact"] is True and q["backward_exact"] is True
    for key, out in converted.items():  # --check ran the routing check on every layer
        m = load_manifest(out)
        for L in m.layers:
            rc = m.data["layers"][str(L)]["routing_check"]
            assert rc["passed"] and rc["topk_agreement"] >= 0.98, (key, L, rc)
            assert rc["max_weight_error"] <= 0.02, (key, L, rc)


def test_files_index_metadata(converted: dict) -> None:
    out = converted["qwen3_moe"]
    index = json.loads((out / "rank0" / "model.safetensors.index.json").read_text())
    m = load_manifest(out)
    names = {t["name"] for L in m.layers for t in m.rank_entry(L)["tensors"].values()}
    assert set(index["weight_map"]) == names
    assert index["metadata"]["total_size"] == sum(
        (out / "rank0" / f).stat().st_size for f in set(index["weight_map"].values())
    )
    with safe_open(str(out / "rank0" / "layer_000.safetensors"), "pt") as f:
        md = f.metadata()
        assert md["layer"] == "0" and md["router_act_fn"] == "SOFTMAX" and md["format"] == "pt"
        assert set(f.keys()) == {t["name"] for t in m.rank_entry(0)["tensors"].values()}
    # the rank folder's own manifest is a self-contained view
    mr = load_manifest(out / "rank0")
    assert mr.data["rank_view"] == 0 and mr.layers == m.layers
    assert torch.equal(
        load_layer_tensors(out / "rank0", 0)["gamma"], load_layer_tensors(out, 0)["gamma"]
    )
    src_files = m.data["source"]["files"]
    assert "config.json" in src_files and all(len(f["sha256"]) == 64 for f in src_files.values())
    assert m.data["settings"]["scale_rule"] == "neuron" and m.data["settings"]["formats"] == [
        "bf16",
        "mxfp8",
    ]


def test_check_numbers_in_manifest(converted: dict) -> None:
    m = load_manifest(converted["deepseek_v3"])
    for L in m.layers:
        chk = m.layer(L)["check"]["0"]
        assert chk["router_weights"]["exact"] and chk["gate_up_proj_weight"]["exact"]
        assert chk["gamma"]["exact"] and chk["router_bias"]["exact"]
        for k in (
            "gate_up_proj_weight_mxfp8",
            "down_proj_weight_mxfp8",
            "shared_expert.down_proj_weight_mxfp8",
        ):
            assert 25.0 < chk[k]["sqnr_db"] < 40.0
    # MXFP4 values are representable in MXFP8 groups: the round trip is lossless
    chk = load_manifest(converted["gpt_oss"]).layer(0)["check"]["0"]
    assert (
        chk["gate_up_proj_weight_mxfp8"]["exact"]
        and chk["gate_up_proj_weight_mxfp8"]["sqnr_db"] is None
    )


def test_backward_weights_loader(converted: dict) -> None:
    out = converted["deepseek_v3"]
    w = load_backward_weights(out, 1)
    assert set(w) == {
        "gate_up_proj_weight",
        "gate_up_weight_scales",
        "down_proj_weight",
        "down_weight_scales",
        "scale_layout",
    }
    assert w["gate_up_proj_weight"].dtype == torch.uint32 and w["scale_layout"] == "packed"
    s = load_backward_weights(out, 1, fmt="bf16", shared=True)
    assert s["gate_up_proj_weight"].shape[0] == 1 and s["down_proj_weight"].dtype == torch.bfloat16
    with pytest.raises(Exception, match="no shared expert"):
        load_backward_weights(converted["qwen3_moe"], 0, shared=True)


def test_loader_errors(converted: dict, tmp_path: Path) -> None:
    from mxcli.errors import MxcliError

    with pytest.raises(MxcliError, match="layer 7: not in"):
        load_layer_tensors(converted["qwen3_moe"], 7)
    with pytest.raises(MxcliError, match="rank 3: not in"):
        load_layer_tensors(converted["qwen3_moe"], 0, rank=3)
    with pytest.raises(MxcliError, match="manifest.json: not found"):
        load_manifest(tmp_path)
