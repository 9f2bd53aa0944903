"""The compressed-tensors export's quantization targets (issue 30), per family.

For every family whose experts the export takes (PerExpert layouts), the family's transformers
5.23 model is built on the meta device from a tiny config and its checkpoint names are taken
from transformers' own `revert_weight_conversion` (what `save_pretrained` writes). The routed
experts are, independently of mxcli's family table, the names that come from the parameters of
the model's ``*.experts`` modules. compressed_tensors' own matcher (`match_name`, what its
offline decompressor and `ModelCompressor` use on checkpoint names) must select exactly those.

vLLM (not installable here) picks a FusedMoE layer's scheme by probing ``<layer>.0.gate_proj``,
``<layer>.0.up_proj`` and ``<layer>.0.down_proj`` whatever the checkpoint calls them, and serves
the experts unquantized when the probe matches nothing (vllm-project/vllm@0043d6b5,
vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/
compressed_tensors_moe.py:40-42 and :57-58; the MXFP8 MoE method at :73-78). Its layer name is
the module path of the experts, ``<block>.experts``; the probe names must match too.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from mxcli.weightprep.export.compressed_tensors import expert_targets, quantization_config
from mxcli.weightprep.families import PerExpert
from mxcli.weightprep.families.table import FAMILY_LIST

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from tests.weightprep.hf_tiny import OVERRIDES, TEXT_CONFIG, TINY, VISION  # noqa: E402

PER_EXPERT = [f for f in FAMILY_LIST if isinstance(f.experts, PerExpert)]
VLLM_PROBE = (".0.gate_proj", ".0.up_proj", ".0.down_proj")  # compressed_tensors_moe.py:40-42


def _skeleton_names(model_type: str) -> tuple[set[str], set[str]]:
    """(every checkpoint module name of a Linear weight, the routed experts' ones)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    warnings.filterwarnings("ignore")
    kw = {**TINY, **OVERRIDES.get(model_type, {})}
    cls = CONFIG_MAPPING[model_type]
    cfg = (
        cls(text_config=kw, vision_config=VISION.get(model_type))
        if model_type in TEXT_CONFIG
        else cls(**kw)
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sd = model.state_dict()
    routed_params = {n: t for n, t in sd.items() if n.rsplit(".", 1)[0].endswith(".experts")}
    names = revert_weight_conversion(model, dict(sd))
    routed = revert_weight_conversion(model, routed_params)

    def modules(ns: dict[str, torch.Tensor]) -> set[str]:
        return {
            n[: -len(".weight")] for n, t in ns.items() if n.endswith(".weight") and t.dim() == 2
        }

    return modules(names), modules(routed)


@pytest.mark.parametrize("family", PER_EXPERT, ids=lambda f: f.name)
def test_targets_select_exactly_the_routed_experts(family) -> None:  # type: ignore[no-untyped-def]
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    allm, routed = _skeleton_names(family.name)
    assert routed and routed < allm
    qc = quantization_config(family)
    QuantizationConfig.model_validate(qc)  # the library's own schema
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    assert targets == expert_targets(family)

    def quantized(name: str) -> bool:
        return any(match_name(name, t) for t in targets) and not any(
            match_name(name, i) for i in qc["ignore"]
        )

    chosen = {m for m in allm if quantized(m)}
    assert chosen == routed, sorted(chosen ^ routed)[:6]
    blocks = {re.sub(r"\.\d+\.[^.]+$", "", m) for m in routed}  # "<...>.experts"
    assert all(b.endswith(".experts") for b in blocks)
    for b in blocks:
        assert all(quantized(b + p) for p in VLLM_PROBE), b


def test_mixtral_targets_name_both_spellings() -> None:
    """The case the issue found: Mixtral's checkpoint says w1/w3/w2, vLLM's probe gate/up/down."""
    from compressed_tensors.utils.match import match_name

    fam = next(f for f in FAMILY_LIST if f.name == "mixtral")
    (t,) = expert_targets(fam)
    for p in ("w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"):
        assert match_name(f"model.layers.3.block_sparse_moe.experts.7.{p}", t)
    assert not match_name("model.layers.3.block_sparse_moe.gate", t)
    assert not match_name("model.layers.3.block_sparse_moe.experts.7.w4", t)


def test_verify_flags_targets_vllm_would_miss(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An export whose targets name only the checkpoint's w1/w3/w2 (what mxcli wrote before
    issue 30): ``verify --checkpoint`` fails and names vLLM's probe."""
    import json

    from mxcli.verification.checkpoints import verify_checkpoint
    from mxcli.weightprep.plan import PrepOptions
    from mxcli.weightprep.runner import prepare_weights
    from tests.weightprep.hf_tiny import build_tiny

    src = build_tiny("mixtral", tmp_path / "src")
    out = tmp_path / "ct"
    prepare_weights(src, out, PrepOptions(output_format="compressed-tensors"))
    assert verify_checkpoint(out, src)["passed"]
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = [
        r"re:.*\.(block_sparse_moe\.experts\.\d+\.w1|block_sparse_moe\.experts\.\d+\.w3|"
        r"block_sparse_moe\.experts\.\d+\.w2)$"
    ]
    (out / "config.json").write_text(json.dumps(cfg))
    rep = verify_checkpoint(out, src)
    assert not rep["passed"]
    assert any(
        "model.layers.1.block_sparse_moe.experts.0.gate_proj" in u and "vLLM" in u
        for u in rep["unquantized"]
    ), rep["unquantized"]


def _exported_set(model_type: str, root) -> tuple[set[str], set[str], set[str]]:  # type: ignore[no-untyped-def]
    """(modules the export stores as FP8, modules the library decompresses, the routed experts)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from safetensors.torch import load_file

    from mxcli.weightprep.plan import PrepOptions
    from mxcli.weightprep.runner import prepare_weights
    from tests.weightprep.hf_tiny import build_tiny

    src = build_tiny(model_type, root / "src")
    out = root / "ct"
    prepare_weights(src, out, PrepOptions(output_format="compressed-tensors"))
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    fp8 = {n[: -len(".weight")] for n, t in raw.items() if t.dtype == torch.float8_e4m3fn}
    deq = CompressedTensorsDequantizer(str(out), dtype=torch.float32).validate(dict(raw))
    decompressed = {
        n[: -len(".weight")]
        for n, t in deq.items()
        if raw[n].dtype == torch.float8_e4m3fn and t.dtype == torch.float32
    }
    assert not any(n.endswith("_scale") for n in deq)  # every scale consumed
    _, routed = _skeleton_names(model_type)
    return fp8, decompressed, routed


@pytest.mark.parametrize(
    "model_type",
    ["mixtral", pytest.param("deepseek_v3", marks=pytest.mark.slow),
     pytest.param("qwen2_moe", marks=pytest.mark.slow)],
)  # fmt: skip
def test_the_export_quantizes_exactly_the_routed_experts(model_type: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The written export itself: its FP8 tensors, and what compressed_tensors' decompressor
    decompresses, are exactly the skeleton's routed experts (shared experts, routers and
    attention stay as they were)."""
    fp8, decompressed, routed = _exported_set(model_type, tmp_path)
    assert fp8 == decompressed == routed
