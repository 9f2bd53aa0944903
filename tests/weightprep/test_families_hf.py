"""Every convertible family on a tiny checkpoint written by transformers itself.

Per family: build the model from transformers' own config class (H=128, E=8, top-k 2), save it
in bf16, convert it with ``prep-weights --check`` and compare routing on seeded hidden states:

- the manifest's ``routing_check`` (kernel reference vs the family math in fp32) passes;
- the kernel reference on the *written* tensors vs the model's own MoE block (the indices and
  weights its router hands to its experts, run in fp32 on the same bf16 weights): top-k
  agreement >= 98 % of tokens and weight error <= 0.02 on agreeing tokens (issue 12). The gap
  is the kernel's bf16 activations (prefill spec §3.3): only near-ties flip, and a bf16
  weight is within 2**-8 relative.

One bf16 conversion per family runs by default; the MXFP8 + --ep 2 conversions are slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mxcli.weightprep.check import kernel_affinities, seeded_hidden_states
from mxcli.weightprep.families import FAMILIES, compare_routing, detect_family
from mxcli.weightprep.manifest import MANIFEST_NAME, load_prefill_inputs
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights

pytest.importorskip("transformers")
from tests.weightprep import hf_tiny  # noqa: E402

MODEL_TYPES = sorted(hf_tiny.OVERRIDES)
BACKWARD_NOT_EXACT = {"gpt_oss", "llama4", "jetmoe"}
TOKENS = 256


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_tiny")
    for sub in ("src", "out", "mx", "fold"):
        (root / sub).mkdir()
    return root


def _tiny(root: Path, model_type: str) -> Path:
    path = root / "src" / model_type
    if not (path / "config.json").is_file():
        hf_tiny.build_tiny(model_type, path)
    return path


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tiny_transformers_checkpoint_routes_like_the_model(
    model_type: str, tiny_root: Path
) -> None:
    src = _tiny(tiny_root, model_type)
    out = tiny_root / "out" / model_type
    res = prepare_weights(src, out, PrepOptions(check=True, formats=("bf16",)))
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["router"]["exact"] is True
    assert manifest["router"]["backward_exact"] is (model_type not in BACKWARD_NOT_EXACT)
    assert res["routing_check"], "no layer checked"
    for L, rc in res["routing_check"].items():
        assert rc["passed"], (L, rc)
        assert manifest["layers"][L]["routing_check"] == rc

    fam = detect_family(hf_tiny.config_of(src))
    model = hf_tiny.load_model(src)
    x = seeded_hidden_states(TOKENS, 128, seed=7)
    norm = fam.gamma.removesuffix(".weight")
    block = fam.router_weight.split(".")[0]
    for L in map(int, res["routing_check"]):
        tensors, kwargs = load_prefill_inputs(out, L)
        aff = kernel_affinities(x, tensors, kwargs)  # [T, E]
        index, weights = hf_tiny.model_routing(model, L, norm, block, x, kwargs["top_k"])
        scale = float(getattr(model.config.get_text_config(), "moe_router_scaling_factor", 1.0))
        got = compare_routing(aff, index, weights * scale, kwargs["top_k"])
        assert got["topk_agreement"] >= 0.98 and got["max_weight_error"] <= 0.02, (L, got)


# The model's experts module has the (hidden, top_k_index, top_k_weights) interface and a
# plain SwiGLU: its output for one token on one expert checks our layouts. (gpt-oss: clamped
# SwiGLU with biases; Llama-4: input-scaled; JetMoE: its own interface.)
LAYOUT_CHECKED = [mt for mt in MODEL_TYPES if mt not in ("gpt_oss", "llama4", "jetmoe")]


@pytest.mark.parametrize("model_type", LAYOUT_CHECKED)
def test_expert_layouts_compute_the_models_experts(model_type: str, tiny_root: Path) -> None:
    """Kernel layouts ``gate_up [E, H, 2, I]``, ``down [E, I, H]`` (and the shared E=1 stack)
    give each expert's SwiGLU exactly as the model's own modules compute it (fp32)."""
    from mxcli.weightprep.manifest import load_layer_tensors

    src = _tiny(tiny_root, model_type)
    out = tiny_root / "out" / model_type
    if not (out / MANIFEST_NAME).is_file():
        prepare_weights(src, out, PrepOptions(formats=("bf16",)))
    model = hf_tiny.load_model(src)
    L = int(json.loads((out / MANIFEST_NAME).read_text())["model"]["moe_layers"][0])
    t = load_layer_tensors(out, L, 0)
    x = seeded_hidden_states(3, 128, seed=5).float()
    lay = hf_tiny.decoder_layer(model, L)
    moe = next(
        getattr(lay, b)
        for b in ("mlp", "feed_forward", "moe", "block_sparse_moe")
        if hasattr(lay, b)
    )

    def swiglu(gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
        g, u = x @ gu[:, 0, :].float(), x @ gu[:, 1, :].float()
        return (torch.nn.functional.silu(g) * u) @ dn.float()

    for e in (0, 5):
        with torch.no_grad():
            want = moe.experts(x, torch.full((3, 1), e), torch.ones(3, 1))
        got = swiglu(t["gate_up_proj_weight"][e], t["down_proj_weight"][e])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if "shared_expert.gate_up_proj_weight" in t:
        shared = next(
            getattr(moe, n) for n in ("shared_experts", "shared_expert", "shared_mlp")
            if hasattr(moe, n)
        ) if not hasattr(lay, "shared_mlp") else lay.shared_mlp  # fmt: skip
        with torch.no_grad():
            want = shared(x)
        got = swiglu(
            t["shared_expert.gate_up_proj_weight"][0], t["shared_expert.down_proj_weight"][0]
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tiny_transformers_checkpoint_mxfp8_ep2(model_type: str, tiny_root: Path) -> None:
    """bf16 + MXFP8 outputs over two expert-parallel ranks (I = 128: --tp needs the I_TP
    zero-padding of issue 12 item 3 at this size)."""
    src = _tiny(tiny_root, model_type)
    res = prepare_weights(src, tiny_root / "mx" / model_type, PrepOptions(check=True, ep=2))
    for L, per_key in res["check"].items():
        for key, r in per_key.items():
            if "_mxfp8" in key:
                assert r["sqnr_db"] is None or r["sqnr_db"] > 25, (L, key, r)
            else:
                assert r["exact"], (L, key, r)
    assert all(rc["passed"] for rc in res["routing_check"].values())


def test_every_family_has_a_tiny_case() -> None:
    covered = {detect_family({"model_type": mt}).name for mt in MODEL_TYPES}
    assert covered == set(FAMILIES)


def test_fold_one_plus_w_is_the_models_fp32_factor(tiny_root: Path) -> None:
    """step3p7 / qwen3_next: gamma is written as fp32 1 + w, bit-equal to the model's factor."""
    from safetensors import safe_open

    for mt in ("qwen3_next", "step3p7"):
        src = _tiny(tiny_root, mt)
        out = tiny_root / "fold" / mt
        prepare_weights(src, out, PrepOptions(formats=("bf16",)))
        model = hf_tiny.load_model(src)
        lay = hf_tiny.decoder_layer(model, 1)
        w = lay.post_attention_layernorm.weight.detach()
        with safe_open(str(out / "rank0" / "layer_001.safetensors"), "pt") as f:
            gamma = f.get_tensor("layers.1.gamma")
        assert gamma.dtype == torch.float32
        assert torch.equal(gamma[:128], 1.0 + w.float())
        assert bool((gamma[128:] == 0).all())


def test_forced_family_refuses_an_ignored_router_bias(tiny_root: Path) -> None:
    """MiniMax-M2 stores Mixtral's tensor names plus a selection bias: forced to mixtral (with
    a model_type nothing in the table knows) the bias tensor alone gives it away."""
    import shutil

    from mxcli.weightprep.families import RouterRefused

    src = tiny_root / "src" / "custom_moe"
    shutil.copytree(_tiny(tiny_root, "minimax_m2"), src)
    cfg = hf_tiny.config_of(src)
    cfg["model_type"] = "custom_moe"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RouterRefused, match="selection bias .*e_score_correction_bias"):
        prepare_weights(src, tiny_root / "out" / "forced", PrepOptions(model_type="mixtral"))
    with pytest.raises(RouterRefused, match="norm rmsnorm\\(1\\+w\\) vs rmsnorm"):
        prepare_weights(
            _tiny(tiny_root, "qwen3_next"),
            tiny_root / "out" / "forced2",
            PrepOptions(model_type="qwen2_moe"),
        )
