"""A checkpoint whose router weights are all zero: every token's logits tie exactly (issue 18).

prep-weights --check compares the kernel reference's routing with the family's own fp32 math;
both now decide ties as the hardware does (api spec §8.14: ascending expert order), so the
check passes with full agreement. make-inputs bwd routes through the prefill reference, whose
old first-occurrence rule gave duplicate experts ([0, 0]) that the block plan refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.kernels.spec import read_kernel_file
from mxcli.weightprep.synthetic import build_checkpoint


# ~10 s (prep-weights --check, the bwd forward); the fast cases of the same rule are
# tests/kernels/test_prefill_router_ties.py and test_families.py::test_route_fp32_breaks_exact_ties*
@pytest.mark.slow
def test_zero_router_checkpoint_checks_and_routes(tmp_path: Path) -> None:
    def cli(*args: object):  # type: ignore[no-untyped-def]
        return CliRunner().invoke(app, [str(a) for a in args])

    ck = build_checkpoint("qwen3_moe", tmp_path / "ck", num_layers=1, hidden_size=512,
                          intermediate_size=256, num_shards=1).path  # fmt: skip
    (shard,) = ck.glob("*.safetensors")
    t = load_file(shard)
    t["model.layers.0.mlp.gate.weight"] = torch.zeros_like(t["model.layers.0.mlp.gate.weight"])
    save_file(t, shard, metadata={"format": "pt"})
    prep = tmp_path / "prep"
    r = cli("prep-weights", ck, prep, "--check", "--quiet", "--json")
    assert r.exit_code == 0, r.output
    rc = json.loads(r.stdout)["routing_check"]["0"]
    assert rc["passed"] and rc["topk_agreement"] == 1.0 and rc["max_weight_error"] == 0.0
    out = tmp_path / "bwd.safetensors"
    r = cli("make-inputs", "bwd", "--weights", prep, "--layer", "0", "--tokens", "128", "-o", out)
    assert r.exit_code == 0, r.output
    f = read_kernel_file(out).tensors
    # top-2 of 8 equal logits: experts 0 and 1, softmax 1/2 each, for every token
    aff = f["expert_affinities_masked"].float().view(128, 8)
    expect = torch.zeros(128, 8)
    expect[:, :2] = 0.5
    assert torch.equal(aff, expect)
    assert f["block_to_expert"].flatten().tolist()[:2] == [0, 1]
