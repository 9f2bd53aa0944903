"""compressed-tensors in and out (issue 22), against the real compressed_tensors library.

The sources are made by the library's own compressors (`ct_tiny.compress_experts`) from a tiny
Qwen3-MoE checkpoint that transformers writes; the exports are read back with the library's own
offline dequantizer (`CompressedTensorsDequantizer`, which validates config.json's
quantization_config with its pydantic schema, decompresses every targeted module with the
registered compressor and fails on a leftover quantization parameter).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.blockwise_moe.prequant import (
    PrequantizedWeights,
    ScaleLayout,
    dequantize_weights,
)
from mxcli.mx import ScaleRule, dequantize_mx, fake_quantize_mx, quantize_mx
from mxcli.weightprep.manifest import load_backward_weights, load_manifest
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from tests.weightprep.ct_tiny import compress_experts  # noqa: E402
from tests.weightprep.hf_tiny import build_tiny  # noqa: E402

E, LAYERS = 8, (0, 1)
EXPERT = "model.layers.{L}.mlp.experts.{e}.{p}_proj.weight"


def _library_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `folder` as the compressed_tensors library decompresses it (bf16)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

    deq = CompressedTensorsDequantizer(str(folder))
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(deq.validate(load_file(str(shard))))
    return out


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    bf16 = build_tiny("qwen3_moe", root / "bf16")
    return {
        "bf16": bf16,
        "mxfp8": compress_experts(bf16, root / "mxfp8", "MXFP8"),
        "fp8_channel": compress_experts(bf16, root / "fp8_channel", "FP8_DYNAMIC"),
        "fp8_block": compress_experts(bf16, root / "fp8_block", "FP8_BLOCK"),
    }


def test_library_made_an_mxfp8_checkpoint(ckpts: dict[str, Path]) -> None:
    """The fixture is what llm-compressor saves: fp8 weight + uint8 E8M0 scale per 32 inputs."""
    t = _all_tensors(ckpts["mxfp8"])
    w = EXPERT.format(L=1, e=3, p="gate")
    assert t[w].dtype == torch.float8_e4m3fn and t[w].shape == (128, 128)
    assert t[w + "_scale"].dtype == torch.uint8 and t[w + "_scale"].shape == (128, 4)
    q = json.loads((ckpts["mxfp8"] / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp8-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32


@pytest.mark.parametrize("kind", ["mxfp8", "fp8_channel", "fp8_block"])
def test_quantized_source_prepares_to_exact_bf16(
    ckpts: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    """Item 1 + 5: the bf16 experts prep-weights writes are exactly the library's own
    decompression of the source (``--formats bf16``: the dequantize escape hatch)."""
    out = tmp_path / "out"
    res = prepare_weights(ckpts[kind], out, PrepOptions(formats=("bf16",)))
    ref = _library_dequantized(ckpts[kind])
    m = load_manifest(out)
    assert m.data["source"]["source_format"] == f"ct-{kind.replace('_', '-')}"
    assert m.data["source_fp8"]["max"] == 448.0
    for L in LAYERS:
        w = load_backward_weights(out, L, fmt="bf16")
        for e in range(E):
            gate = ref[EXPERT.format(L=L, e=e, p="gate")]
            up = ref[EXPERT.format(L=L, e=e, p="up")]
            down = ref[EXPERT.format(L=L, e=e, p="down")]
            assert torch.equal(_bits(w["gate_up_proj_weight"][e, :, 0, :]), _bits(gate.T))
            assert torch.equal(_bits(w["gate_up_proj_weight"][e, :, 1, :]), _bits(up.T))
            assert torch.equal(_bits(w["down_proj_weight"][e]), _bits(down.T))
    assert res["layers_written"] == list(LAYERS)


def test_mxfp8_source_requantized_counts_changed_values(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """Item 1: re-quantized to the kernel's rule, the values that changed are counted in
    ``--check`` (and so the manifest); every other value passes through exactly."""
    out = tmp_path / "out"
    res = prepare_weights(
        ckpts["mxfp8"], out, PrepOptions(formats=("mxfp8",), check=True, layers="1")
    )
    ref = _library_dequantized(ckpts["mxfp8"])
    m = load_manifest(out)
    for L in (1,):
        w = load_backward_weights(out, L, fmt="mxfp8")
        lay = ScaleLayout(w["scale_layout"])
        pq = PrequantizedWeights(
            w["gate_up_proj_weight"], w["gate_up_weight_scales"], w["down_proj_weight"],
            w["down_weight_scales"], Grouping(), Grouping(), lay, lay, ScaleRule.NEURON,
        )  # fmt: skip
        gu, dn = dequantize_weights(pq)
        assert gu is not None and dn is not None
        src_gu = torch.stack(
            [
                torch.stack([ref[EXPERT.format(L=L, e=e, p=p)].T for p in ("gate", "up")], dim=1)
                for e in range(E)
            ]
        ).to(torch.float32)
        src_dn = torch.stack([ref[EXPERT.format(L=L, e=e, p="down")].T for e in range(E)])
        changed_gu = int((gu.to(torch.float32) != src_gu).sum())
        changed_dn = int((dn.to(torch.float32) != src_dn.to(torch.float32)).sum())
        check = m.layer(L)["check"]["0"]
        assert check["gate_up_proj_weight_mxfp8"]["changed_values"] == changed_gu
        assert check["down_proj_weight_mxfp8"]["changed_values"] == changed_dn
        assert check["gate_up_proj_weight_mxfp8"]["values"] == src_gu.numel()
        # most values pass (the kernel groups run along another axis, so a value changes only
        # where its new group's scale leaves it fewer mantissa bits), and some do change
        assert 0 < changed_gu + changed_dn < (src_gu.numel() + src_dn.numel()) // 20
    assert "changed_values" in res["check"]["1"]["gate_up_proj_weight_mxfp8"]


def test_neuron_rule_changes_exactly_the_codes_that_halving_loses() -> None:
    """The NEURON rule's exponent is one above OCP's: re-quantizing OCP MXFP8 data (same groups)
    halves every code, and a value changes exactly where ml_dtypes says ``code / 2`` is not an
    E4M3FN value. Every other value passes through bit for bit."""
    g = torch.Generator().manual_seed(22)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 256)).to(torch.bfloat16)
    codes, scales = quantize_mx(x, rule="ocp")
    v = dequantize_mx(codes, scales)  # the OCP MXFP8 source's exact values
    amax_codes = codes.view(torch.float8_e4m3fn).to(torch.float32).abs().view(64, 8, 32).amax(-1)
    assert bool((amax_codes >= 256).all())  # OCP puts every group max in [256, 448]
    back = fake_quantize_mx(v, rule="neuron")
    half = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy() / 2
    representable = half.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == half
    changed = (back != v).numpy()
    assert int(changed.sum()) == int((~representable).sum()) > 0
    assert np.array_equal(changed, ~representable)


def test_export_roundtrips_through_the_library(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Item 2: the export loads with compressed_tensors and decompresses to exactly mxcli's own
    dequantized MXFP8 (OCP rule) of the source experts; everything else is copied unchanged."""
    out = tmp_path / "ct"
    res = prepare_weights(
        ckpts["bf16"], out, PrepOptions(output_format="compressed-tensors", scale_rule="ocp")
    )
    src = _all_tensors(ckpts["bf16"])
    raw = _all_tensors(out)
    lib = _library_dequantized(out)
    n_experts = 0
    for name, t in src.items():
        if ".mlp.experts." in name:
            n_experts += 1
            assert raw[name].dtype == torch.float8_e4m3fn
            assert raw[name + "_scale"].shape == (t.shape[0], t.shape[1] // 32)
            mine = fake_quantize_mx(t, rule="ocp").to(torch.bfloat16)
            assert torch.equal(_bits(lib[name]), _bits(mine)), name
        else:
            assert torch.equal(_bits(raw[name]), _bits(t)), name
            assert torch.equal(_bits(lib[name]), _bits(t)), name
    assert n_experts == res["expert_tensors"] == 2 * E * 3
    from compressed_tensors.quantization import QuantizationConfig

    cfg = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.format == "mxfp8-quantized"
    side = json.loads((out / "mxcli-export.json").read_text())
    assert side["fp8"]["scale_rule"] == "ocp" and side["fp8"]["max"] == 448.0
    assert res["fp8"]["description"] == "OCP E4M3FN (+-448)"


def test_export_of_an_mxfp8_source_passes_it_through(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "ct"
    res = prepare_weights(ckpts["mxfp8"], out, PrepOptions(output_format="compressed-tensors"))
    src, raw = _all_tensors(ckpts["mxfp8"]), _all_tensors(out)
    assert set(src) == set(raw)
    for name, t in src.items():
        assert torch.equal(_bits(raw[name]), _bits(t)), name
    assert res["passed_through"] == res["expert_tensors"] == 2 * E * 3


def test_export_bf16_escape_hatch(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Item 5: ``--formats bf16`` gives exact bf16 experts and no quantization_config."""
    out = tmp_path / "bf16"
    prepare_weights(
        ckpts["fp8_block"],
        out,
        PrepOptions(output_format="compressed-tensors", scale_rule="ocp", formats=("bf16",)),
    )
    lib = _library_dequantized(ckpts["fp8_block"])
    raw = _all_tensors(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert set(raw) == set(lib)
    for name, t in lib.items():
        assert torch.equal(_bits(raw[name]), _bits(t)), name


def test_fp8_range_240_saturates_and_counts(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """Item 4: ``--fp8-range 240`` clips every code above 240 and counts them; the export
    still decompresses to exactly mxcli's own dequantized (clipped) weights."""
    out = tmp_path / "ct240"
    res = prepare_weights(
        ckpts["bf16"],
        out,
        PrepOptions(output_format="compressed-tensors", scale_rule="ocp", fp8_range=240),
    )
    src, raw, lib = _all_tensors(ckpts["bf16"]), _all_tensors(out), _library_dequantized(out)
    expected_clipped = 0
    for name, t in src.items():
        if ".mlp.experts." not in name:
            continue
        codes, scales = quantize_mx(t, rule="neuron")  # OCP's algorithm for a +-240 element
        vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
        expected_clipped += int((vals.abs() > 240).sum())
        clipped = vals.clamp(-240, 240)  # saturation, independently
        assert torch.equal(raw[name].to(torch.float32), clipped), name
        mine = dequantize_mx(raw[name].view(torch.uint8), scales).to(torch.bfloat16)
        assert torch.equal(_bits(lib[name]), _bits(mine)), name
    assert res["fp8_clipped"] == expected_clipped > 0
    assert res["worst_sqnr_db"] > 30  # scaled for +-240: only the (240, 256) codes clip
    fp8 = json.loads((out / "mxcli-export.json").read_text())["fp8"]
    assert fp8["max"] == 240.0 and "exponent(amax) - 7" in fp8["scale_exponent"]


def test_fp8_range_240_in_the_mxcli_layout(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_weights(ckpts["bf16"], out, PrepOptions(formats=("mxfp8",), fp8_range=240))
    m = load_manifest(out)
    assert m.data["fp8"]["max"] == 240.0 and m.data["fp8"]["scale_rule"] == "neuron"
    for L in LAYERS:
        w = load_backward_weights(out, L, fmt="mxfp8")
        for k in ("gate_up_proj_weight", "down_proj_weight"):
            b = w[k].view(torch.uint8) & 0x7F
            assert int(((b > 0x77) & (b != 0x7F)).sum()) == 0
        assert m.layer(L)["fp8_clipped"] >= 0
    plain = tmp_path / "plain"
    prepare_weights(ckpts["bf16"], plain, PrepOptions(formats=("mxfp8",)))
    assert load_manifest(plain).data["fp8"]["max"] == 448.0


def _mxcli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)], capture_output=True, text=True
    )


def _cli(*args: object) -> tuple[int, str]:
    """The CLI in this process (CliRunner): exit code and stderr."""
    from typer.testing import CliRunner

    from mxcli.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stderr


@pytest.fixture(scope="module")
def declared_240(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("d240") / "ct240"
    prepare_weights(
        ckpts["bf16"],
        src,
        PrepOptions(output_format="compressed-tensors", scale_rule="ocp", fp8_range=240),
    )
    return src


def test_declared_240_source_to_448_target_is_refused(declared_240: Path, tmp_path: Path) -> None:
    """Item 4: a source that declares Neuron FP8 (+-240) is refused for a +-448 target, with
    one line and exit code 2, before anything is written."""
    code, err = _cli("prep-weights", declared_240, tmp_path / "out")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "+-240" in lines[0] and "--fp8-range 240" in lines[0]
    assert not (tmp_path / "out").exists()
    code, err = _cli("prep-weights", declared_240, tmp_path / "ok", "--fp8-range", "240", "-q")
    assert code == 0, err


@pytest.mark.slow
def test_declared_240_refusal_as_a_fresh_process(declared_240: Path, tmp_path: Path) -> None:
    r = _mxcli("prep-weights", declared_240, tmp_path / "out")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_default_export_is_byte_identical_to_the_library_compressor(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """Issue 30: by default the export's expert codes and scale bytes are exactly what
    compressed_tensors' own MXFP8 compressor writes for the same bf16 weights (`ct_tiny`), and
    the sidecar and shard metadata record the rule."""
    out = tmp_path / "ct"
    res = prepare_weights(ckpts["bf16"], out, PrepOptions(output_format="compressed-tensors"))
    mine, lib = _all_tensors(out), _all_tensors(ckpts["mxfp8"])
    n = 0
    for name, t in lib.items():
        if ".mlp.experts." in name:
            n += 1
            assert torch.equal(_bits(mine[name]), _bits(t)), name
    assert n == 2 * E * 3 * 2  # weight + weight_scale
    side = json.loads((out / "mxcli-export.json").read_text())
    assert res["scale_rule"] == side["fp8"]["scale_rule"] == "ct"
    from safetensors import safe_open

    shard = next(out.glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        assert f.metadata()["scale_rule"] == "ct"


@pytest.mark.parametrize("rule", ["neuron", "ocp", "rceil"])
def test_other_scale_rules_are_written_and_recorded(
    ckpts: dict[str, Path], tmp_path: Path, rule: str
) -> None:
    """``--scale-rule neuron|ocp|rceil`` writes that rule's bytes (the library still decodes
    them to exactly mxcli's dequantized values) and records the rule; NEURON, RCEIL and CT
    beat OCP's SQNR on the same weights (OCP saturates groups whose max is above 448)."""
    out = tmp_path / rule
    code, err = _cli(
        "prep-weights", ckpts["bf16"], out, "--output-format", "compressed-tensors",
        "--scale-rule", rule, "-q",
    )  # fmt: skip
    assert code == 0, err
    src, raw, lib = _all_tensors(ckpts["bf16"]), _all_tensors(out), _library_dequantized(out)
    for name, t in src.items():
        if ".mlp.experts." in name:
            codes, scales = quantize_mx(t, rule=rule)
            assert torch.equal(_bits(raw[name + "_scale"]), scales), name
            assert torch.equal(_bits(raw[name]), codes), name
            mine = dequantize_mx(codes, scales).to(torch.bfloat16)
            assert torch.equal(_bits(lib[name]), _bits(mine)), name
    side = json.loads((out / "mxcli-export.json").read_text())
    assert side["fp8"]["scale_rule"] == rule


def _sqnr(rule: str, w: torch.Tensor) -> float:
    d = fake_quantize_mx(w, rule=rule).double() - w.double()
    return float(10 * torch.log10(w.double().pow(2).sum() / d.pow(2).sum()))


def test_rounding_rules_beat_floor_on_the_tiny_experts(ckpts: dict[str, Path]) -> None:
    """The SQNR ordering the README reports, on the tiny model's (random-init) experts."""
    src = _all_tensors(ckpts["bf16"])
    w = torch.cat([t.flatten() for n, t in sorted(src.items()) if ".mlp.experts." in n])
    w = w.view(-1, 32)
    db = {r: _sqnr(r, w) for r in ("ocp", "neuron", "rceil", "ct")}
    # measured: ocp 30.69 dB, neuron 31.50, rceil 31.50, ct 31.50 (transformers 5.23 init, seed 0)
    assert db["ocp"] + 0.5 < min(db["neuron"], db["rceil"], db["ct"]), db


def test_rounding_rules_refused_outside_compressed_tensors(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    for args in (("--scale-rule", "ct"), ("--scale-rule", "rceil", "--output-format", "nxdi")):
        code, err = _cli("prep-weights", ckpts["bf16"], tmp_path / "o", *args)
        assert code == 2
        assert len(err.strip().splitlines()) == 1 and "--scale-rule" in err, err
        assert not (tmp_path / "o").exists()
    code, err = _cli(
        "prep-weights", ckpts["bf16"], tmp_path / "o", "--output-format", "compressed-tensors",
        "--scale-rule", "ct", "--fp8-range", "240",
    )  # fmt: skip
    assert code == 2 and "--fp8-range 240" in err and not (tmp_path / "o").exists()
