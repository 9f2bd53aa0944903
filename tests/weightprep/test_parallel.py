"""TP slices concatenate back to the full tensors; EP splits the experts; --workers agrees."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mxcli.kernels.blockwise_moe import prequantize_weights
from mxcli.weightprep.manifest import load_layer_tensors, load_manifest
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights


def test_tp_and_ep_slices(checkpoints: dict, converted: dict, tmp_path: Path) -> None:
    full_dir = converted["deepseek_v3"]
    out = tmp_path / "tp2ep2"
    res = prepare_weights(
        checkpoints["deepseek_v3"], out, PrepOptions(tp=2, ep=2, scale_layout="unpacked")
    )
    assert res["ranks"] == 4
    m = load_manifest(out)
    assert [(r["tp_rank"], r["ep_rank"]) for r in m.data["ranks"]] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    for L in m.layers:
        full = load_layer_tensors(full_dir, L)
        parts = {r: load_layer_tensors(out, L, rank=r) for r in m.ranks}
        # rank = ep * tp + tp_rank: I slices concatenate along the I axis, EP ranges along experts
        gu = torch.cat(
            [
                torch.cat([parts[ep * 2 + tp]["gate_up_proj_weight"] for tp in (0, 1)], dim=-1)
                for ep in (0, 1)
            ]
        )
        dn = torch.cat(
            [
                torch.cat([parts[ep * 2 + tp]["down_proj_weight"] for tp in (0, 1)], dim=1)
                for ep in (0, 1)
            ]
        )
        assert torch.equal(gu, full["gate_up_proj_weight"]) and torch.equal(
            dn, full["down_proj_weight"]
        )
        sgu = torch.cat([parts[tp]["shared_expert.gate_up_proj_weight"] for tp in (0, 1)], dim=-1)
        assert torch.equal(sgu, full["shared_expert.gate_up_proj_weight"])
        for r, t in parts.items():
            # prefill tensors are replicated; MXFP8 is quantized from each rank's own slice
            assert torch.equal(t["router_weights"], full["router_weights"])
            pq = prequantize_weights(
                t["gate_up_proj_weight"], t["down_proj_weight"], scale_layout="unpacked"
            )
            assert torch.equal(t["gate_up_proj_weight_mxfp8"], pq.gate_up_proj_weight)
            assert torch.equal(t["down_weight_scales"], pq.down_weight_scales)
            assert t["gate_up_weight_scales"].shape[1] == 2 * 128 // 4  # unpacked: K/4 rows
            rank = m.data["ranks"][r]
            assert rank["expert_range"] == [rank["ep_rank"] * 4, rank["ep_rank"] * 4 + 4]
            assert rank["intermediate_range"] == [
                rank["tp_rank"] * 128,
                rank["tp_rank"] * 128 + 128,
            ]


def test_gpt_oss_bias_tp_slices(checkpoints: dict, converted: dict, tmp_path: Path) -> None:
    out = tmp_path / "gpt"
    prepare_weights(checkpoints["gpt_oss"], out, PrepOptions(tp=2, formats=("bf16",)))
    full = load_layer_tensors(converted["gpt_oss"], 0)
    a, b = load_layer_tensors(out, 0, 0), load_layer_tensors(out, 0, 1)
    assert torch.equal(
        torch.cat([a["gate_up_proj_bias"], b["gate_up_proj_bias"]], -1), full["gate_up_proj_bias"]
    )
    assert torch.equal(a["down_proj_bias"], full["down_proj_bias"]) and torch.equal(
        b["down_proj_bias"], full["down_proj_bias"]
    )
    assert "gate_up_proj_weight_mxfp8" not in a


def test_workers_match_single_process(checkpoints: dict, converted: dict, tmp_path: Path) -> None:
    out = tmp_path / "w2"
    res = prepare_weights(checkpoints["qwen2_moe"], out, PrepOptions(workers=2))
    assert sorted(res["layers_written"]) == [0, 1]
    a, b = load_manifest(out), load_manifest(converted["qwen2_moe"])
    for L in a.layers:
        ta = {k: v["sha256"] for k, v in a.rank_entry(L)["tensors"].items()}
        tb = {k: v["sha256"] for k, v in b.rank_entry(L)["tensors"].items()}
        assert ta == tb


def test_layers_selection_and_formats(checkpoints: dict, converted: dict, tmp_path: Path) -> None:
    out = tmp_path / "sel"
    res = prepare_weights(
        checkpoints["deepseek_v3"],
        out,
        PrepOptions(layers="0-1", formats=("mxfp8",), scale_rule="ocp"),
    )
    assert res["layers_written"] == [1]  # layer 0 is dense
    m = load_manifest(out)
    assert m.layers == [1] and m.settings["scale_rule"] == "ocp"
    t = load_layer_tensors(out, 1)
    assert "gate_up_proj_weight" not in t and "gate_up_proj_weight_mxfp8" in t
    full = load_layer_tensors(converted["deepseek_v3"], 1)
    pq = prequantize_weights(
        full["gate_up_proj_weight"], full["down_proj_weight"], scale_layout="packed", rule="ocp"
    )
    assert torch.equal(t["gate_up_proj_weight_mxfp8"], pq.gate_up_proj_weight)
    assert torch.equal(t["down_weight_scales"], pq.down_weight_scales)
    assert not torch.equal(t["down_weight_scales"], full["down_weight_scales"])  # neuron != ocp


def test_parallel_resume_runs_on_disjoint_layers(tmp_path: Path) -> None:
    """Two `prep-weights --resume` processes on disjoint --layers write into one folder: the
    second starts while the first is writing a layer (its temporary file exists and the
    manifest already records a finished layer), so the second's clean-up of stale temporaries
    must leave the first's in-flight file alone. Every layer ends complete, byte for byte as a
    single run writes it, with no temporary or lock file left."""
    from mxcli.weightprep.runner import layer_is_complete
    from mxcli.weightprep.synthetic import build_checkpoint
    from tests import procs

    src = build_checkpoint("qwen3_moe", tmp_path / "src", num_layers=4, intermediate_size=256).path
    clean = tmp_path / "clean"
    prepare_weights(src, clean, PrepOptions())
    out = tmp_path / "out"
    prepare_weights(src, out, PrepOptions(layers="0"))  # a manifest exists: --resume cleans up
    # the first run writes layer 1 slowly (8 pieces of 1 s): the second starts (and cleans up)
    # while that layer's temporary file is open
    first = procs.start(["prep-weights", src, out, "--resume", "--layers", "1", "-q"],
                        mode="slow-pieces=1.0")  # fmt: skip
    procs.wait_for(lambda: any((out / "rank0").glob(".layer_001*.tmp")), first)
    second = procs.start(["prep-weights", src, out, "--resume", "--layers", "2-3", "-q"])
    results = [p.communicate(timeout=300) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], results
    m = load_manifest(out)
    assert m.layers == [0, 1, 2, 3]
    snap = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}
    ref = {str(p.relative_to(clean)): p.read_bytes() for p in sorted(clean.rglob("*.safetensors"))}
    assert snap == ref
    assert procs.temporaries(out) == []
    from mxcli.weightprep.checkpoint import Checkpoint
    from mxcli.weightprep.plan import build_plan

    plan = build_plan(src, PrepOptions(), Checkpoint(src))
    raw = json.loads((out / "manifest.json").read_text())
    assert all(layer_is_complete(out, raw["layers"][str(L)], plan) for L in range(4))
