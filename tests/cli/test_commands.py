"""Every command and option group through typer's test runner."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from mxcli.cli import app
from mxcli.io.files import tensor_sha256, write_file
from mxcli.kernels.spec import read_kernel_file

COMMANDS = ["run-prefill", "run-bwd", "make-inputs", "verify", "inspect", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help(cli, command: str) -> None:
    r = cli(command, "--help")
    assert r.exit_code == 0, r.output
    for flag in ("--json", "--quiet", "--debug"):
        assert flag in r.stdout


def test_root_help_lists_the_commands(cli) -> None:
    r = cli("--help")
    assert r.exit_code == 0
    for command in COMMANDS:
        assert command in r.stdout


def test_shell_completion_of_backends(cli) -> None:
    from mxcli.commands._shared import complete_backend

    assert complete_backend("") == sorted(set(complete_backend("")))
    assert "reference" in complete_backend("") and "auto" in complete_backend("")
    assert complete_backend("ref") == ["reference"]
    # what bash's completion hook asks for (independent of shell detection, which needs a TTY)
    env = {
        "_MXCLI_COMPLETE": "complete_bash",
        "COMP_WORDS": "mxcli run-prefill --backend re",
        "COMP_CWORD": "3",
    }
    r = cli.runner.invoke(app, [], prog_name="mxcli", env=env)
    assert r.exit_code == 0 and r.stdout.split() == ["reference"]


# ---------------------------------------------------------------- make-inputs


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--tokens", "64", "--experts", "0"], {"hidden_states", "gamma"}),
        (
            [
                "--tokens",
                "64",
                "--batch",
                "2",
                "--hidden",
                "1024",
                "--experts",
                "8",
                "--top-k",
                "2",
                "--router-act",
                "sigmoid",
                "--router-bias",
                "--residual",
                "--unpadded-hidden-size",
                "1000",
                "--no-pack-scales",
                "--emit-norm-bf16",
                "--router-dtype",
                "bf16",
            ],
            {"hidden_states", "gamma", "router_weights", "router_bias", "residual"},
        ),
        (
            [
                "--tokens",
                "32",
                "--experts",
                "16",
                "--router-act",
                "noaux_tc",
                "--n-group",
                "4",
                "--topk-group",
                "2",
                "--routed-scaling-factor",
                "2.5",
                "--pack-affinities",
            ],
            {"hidden_states", "gamma", "router_weights", "router_bias"},
        ),
    ],
    ids=["norm-only", "sigmoid-all-options", "noaux"],
)
def test_make_inputs_prefill(cli, tmp_path: Path, args: list[str], expect: set[str]) -> None:
    out = tmp_path / "in.safetensors"
    r = cli("make-inputs", "prefill", "-o", out, *args, "--seed", "7", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    f = read_kernel_file(out)
    assert set(f.tensors) == expect == set(summary["tensors"])
    assert f.metadata["kernel"] == "rmsnorm_mx_prefill"
    assert json.loads(f.metadata["generator"])["seed"] == 7
    if "--batch" in args:
        assert list(f.tensors["hidden_states"].shape) == [2, 32, 1024]
        assert f.tensors["router_weights"].dtype == torch.bfloat16
        assert f.kwargs["unpadded_hidden_size"] == 1000 and f.kwargs["pack_scales"] is False
        assert bool((f.tensors["hidden_states"][..., 1000:] == 0).all())
    # same flags, same bytes
    again = tmp_path / "again.safetensors"
    assert cli("make-inputs", "prefill", "-o", again, *args, "--seed", "7", "-q").exit_code == 0
    assert {k: tensor_sha256(t) for k, t in read_kernel_file(again).tensors.items()} == {
        k: v["sha256"] for k, v in summary["tensors"].items()
    }


@pytest.mark.parametrize(
    "args",
    [
        ["--tokens", "128", "--hidden", "256", "--experts", "4", "--top-k", "2"],
        ["--tokens", "256", "--hidden", "256", "--experts", "1", "--top-k", "1", "--dense"],
        [
            "--tokens",
            "128",
            "--hidden",
            "384",
            "--experts",
            "2",
            "--top-k",
            "2",
            "--bias",
            "--clamp",
            "-1,1,,0.5",
            "--prequantize",
            "--scale-layout",
            "unpacked",
        ],
        [
            "--tokens",
            "128",
            "--hidden",
            "512",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--routing",
            "prefill",
            "--block-size",
            "256",
            "--intermediate",
            "256",
        ],
    ],
    ids=["routed", "dense", "bias-clamp-prequant", "prefill-router"],
)
def test_make_inputs_bwd_then_run_and_verify(cli, tmp_path: Path, args: list[str]) -> None:
    inp, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    r = cli("make-inputs", "bwd", "-o", inp, *args)
    assert r.exit_code == 0, r.output
    assert "wrote" in r.stdout
    f = read_kernel_file(inp)
    cfg = f.kwargs["config"]
    if "--dense" in args:
        assert cfg["single_expert_dense"] is True
    if "--prequantize" in args:
        assert f.tensors["gate_up_proj_weight"].dtype == torch.uint32
        assert cfg["phase1_config"]["enable_scale_packing"] is False
    if "--clamp" in args:
        assert cfg["clamp_limits"]["linear_clamp_lower_limit"] is None
        assert cfg["clamp_limits"]["linear_clamp_upper_limit"] == 0.5
    r = cli("run-bwd", inp, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    names = set(json.loads(r.stdout)["outputs"])
    assert ("gate_and_up_proj_bias_grad" in names) == ("--bias" in args)
    r = cli("verify", out, "--inputs", inp)
    assert r.exit_code == 0, r.output
    assert "PASSED" in r.stdout


# ---------------------------------------------------------------- run-prefill / run-bwd


def test_run_prefill_flags_override_the_file(cli, tmp_path: Path, files) -> None:
    out = tmp_path / "o.safetensors"
    r = cli(
        "run-prefill",
        files["prefill"],
        "-o",
        out,
        "--top-k",
        "1",
        "--router-act",
        "sigmoid",
        "--pack-affinities",
        "--no-emit-norm-bf16",
        "--eps",
        "1e-5",
        "--backend",
        "reference",
        "--device",
        "cpu",
        "--json",
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["kwargs"]["top_k"] == 1 and s["kwargs"]["router_act_fn"] == "SIGMOID"
    assert s["kwargs"]["eps"] == 1e-5 and s["backend"] == "reference" and s["device"] == "cpu"
    assert list(s["outputs"]) == ["norm_quant_packed", "expert_index", "output_residual"]
    assert s["outputs"]["expert_index"]["shape"] == [64, 1]
    assert set(s["timing_s"]) == {"read", "run", "write"}
    assert json.loads(read_kernel_file(out).metadata["kwargs"])["pack_affinities"] is True


def test_run_prefill_human_output_quiet_and_force(cli, tmp_path: Path, files) -> None:
    out = tmp_path / "o.safetensors"
    r = cli("run-prefill", files["noaux"], "-o", out)
    assert r.exit_code == 0, r.output
    assert "rmsnorm_mx_prefill on reference (cpu)\n  ran in" in r.stdout
    assert "norm_quant_packed" in r.stdout and f"wrote {out}" in r.stdout
    r = cli("run-prefill", files["noaux"], "-o", out)
    assert r.exit_code == 2 and "output exists" in r.stderr
    r = cli("run-prefill", files["noaux"], "-o", out, "--force", "--quiet")
    assert r.exit_code == 0 and r.stdout == ""


def test_run_bwd_config_file_and_block_size(cli, tmp_path: Path, files) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"bias": True, "phase3_config": {"tile_k": 128}}))
    out = tmp_path / "o.safetensors"
    r = cli("run-bwd", files["bwd"], "-o", out, "--config", cfg, "--block-size", "128", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert "down_proj_bias_grad" in s["outputs"]
    assert s["kwargs"]["config"]["bias"] is True
    assert s["kwargs"]["config"]["phase3_config"]["tile_k"] == 128
    # the rest of the file's config is kept (field-by-field update)
    assert s["kwargs"]["config"]["single_expert_dense"] is False
    r = cli("run-bwd", files["bwd"], "-o", tmp_path / "o2.safetensors", "--block-size", "256")
    assert r.exit_code == 2 and "token_position_to_id" in r.stderr


def test_run_with_prepared_weights(cli, tmp_path: Path, prepared) -> None:
    folder, layer = prepared
    inp, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    r = cli(
        "make-inputs", "prefill", "-o", inp, "--weights", folder, "--layer", layer, "--tokens", "64"
    )
    assert r.exit_code == 0, r.output
    # keep only the activations: the weights come from --weights at run time
    f = read_kernel_file(inp)
    slim = tmp_path / "slim.safetensors"
    write_file(slim, {"hidden_states": f.tensors["hidden_states"]}, {"kernel": f.kernel})
    r = cli("run-prefill", slim, "-o", out, "--weights", folder, "--layer", layer, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kwargs"]["router_act_fn"] == "SOFTMAX"
    golden = tmp_path / "golden.safetensors"
    assert cli("run-prefill", inp, "-o", golden, "-q").exit_code == 0
    # the weights from --weights are the file's own: same input hashes, bit-identical outputs
    r = cli("verify", out, "--golden", golden, "--exact")
    assert r.exit_code == 0, r.stdout
    r = cli(
        "run-prefill",
        inp,
        "-o",
        tmp_path / "dup.safetensors",
        "--weights",
        folder,
        "--layer",
        layer,
    )
    assert r.exit_code == 2 and "given both" in r.stderr
    bwd_in, bwd_out = tmp_path / "b.safetensors", tmp_path / "bo.safetensors"
    r = cli(
        "make-inputs",
        "bwd",
        "-o",
        bwd_in,
        "--weights",
        folder,
        "--layer",
        layer,
        "--tokens",
        "128",
        "--prequantize",
    )
    assert r.exit_code == 0, r.output
    assert cli("run-bwd", bwd_in, "-o", bwd_out, "-q").exit_code == 0
    r = cli("verify", bwd_out, "--inputs", bwd_in)
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    from mxcli.weightprep import PrepOptions, build_checkpoint, prepare_weights

    d = tmp_path_factory.mktemp("prep")
    ck = build_checkpoint(
        "qwen3_moe", d / "hf", hidden_size=512, intermediate_size=128, num_experts=8
    )
    layer = ck.moe_layers[0]
    prepare_weights(ck.path, d / "out", PrepOptions(layers=str(layer)))
    return d / "out", layer


# ---------------------------------------------------------------- verify


def test_verify_golden_pass_and_reports(cli, tmp_path: Path, files) -> None:
    junit = tmp_path / "report.xml"
    r = cli("verify", files["prefill_out"], "--golden", files["prefill_out"], "--junit", junit)
    assert r.exit_code == 0, r.output
    assert "PASSED" in r.stdout and "norm_quant_packed.codes" in r.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0" and int(suite.get("tests")) >= 6
    r = cli("verify", files["bwd_out"], "--golden", files["bwd_out"], "--json")
    data = json.loads(r.stdout)
    assert r.exit_code == 0 and data["passed"] is True
    names = [t["name"] for t in data["cases"][0]["tensors"]]
    assert names == [
        "hidden_states_grad",
        "expert_affinities_masked_grad",
        "gate_up_proj_weight_grad",
        "down_proj_weight_grad",
    ]
    assert all(t["bit_exact"] for t in data["cases"][0]["tensors"])


def _rewrite(src: Path, dst: Path, **changes: torch.Tensor) -> Path:
    f = read_kernel_file(src)
    write_file(dst, {**f.tensors, **changes}, f.metadata)
    return dst


def test_verify_fails_on_a_corrupted_output(cli, tmp_path: Path, files) -> None:
    f = read_kernel_file(files["prefill_out"])
    b = f.tensors["norm_quant_packed"].view(torch.uint8).clone()
    b[5, 100] ^= 0x01  # one code off by one step
    bad = _rewrite(
        files["prefill_out"],
        tmp_path / "bad.safetensors",
        norm_quant_packed=b.view(torch.float8_e4m3fn),
    )
    junit = tmp_path / "r.xml"
    r = cli("verify", bad, "--golden", files["prefill_out"], "--junit", junit)
    assert r.exit_code == 1
    assert "FAIL" in r.stdout and "norm_quant_packed.codes" in r.stdout
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "2"  # codes + values
    # a tolerance loose enough for one flipped code lets it pass
    r = cli("verify", bad, "--golden", files["prefill_out"], "--max-mismatch", "0.001", "--json")
    assert r.exit_code == 0, r.stdout
    # against exact math the corrupted code is out of the MXFP8 bound only if large: flip the sign
    b[5, 100] ^= 0x81
    worse = _rewrite(
        files["prefill_out"],
        tmp_path / "worse.safetensors",
        norm_quant_packed=b.view(torch.float8_e4m3fn),
    )
    r = cli("verify", worse, "--inputs", files["prefill"])
    assert r.exit_code == 1 and "norm_quant_packed.values" in r.stdout


def test_verify_fails_on_a_perturbed_golden(cli, tmp_path: Path, files) -> None:
    f = read_kernel_file(files["bwd_out"])
    g = f.tensors["down_proj_weight_grad"]
    perturbed = _rewrite(
        files["bwd_out"],
        tmp_path / "golden.safetensors",
        down_proj_weight_grad=(g.float() * 1.05).to(g.dtype),
    )
    r = cli("verify", files["bwd_out"], "--golden", perturbed, "--json")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    failed = [t["name"] for t in data["cases"][0]["tensors"] if not t["passed"]]
    assert failed == ["down_proj_weight_grad"]
    # --rtol loosens float tolerances
    assert cli("verify", files["bwd_out"], "--golden", perturbed, "--rtol", "0.1").exit_code == 0
    # different kwargs or inputs are a failure of provenance
    meta = dict(f.metadata)
    meta["input_sha256"] = json.dumps({"hidden_states": "0" * 64})
    other = tmp_path / "other.safetensors"
    write_file(other, f.tensors, meta)
    r = cli("verify", files["bwd_out"], "--golden", other)
    assert r.exit_code == 1 and "input sha256 differ" in r.stdout


def test_verify_exact_flag_and_hardware_profile(cli, tmp_path: Path, files) -> None:
    f = read_kernel_file(files["noaux_out"])
    aff = f.tensors["norm_quant_packed"].view(torch.uint8).clone()
    golden = files["noaux_out"]
    # a different golden run with one affinity byte changed in the (packed) tail
    aff[0, -1] ^= 0x01
    near = _rewrite(
        golden, tmp_path / "near.safetensors", norm_quant_packed=aff.view(torch.float8_e4m3fn)
    )
    assert cli("verify", near, "--golden", golden).exit_code == 0  # 1 ulp of fp32: close
    assert cli("verify", near, "--golden", golden, "--exact").exit_code == 1
    assert cli("verify", near, "--golden", golden, "--profile", "hardware").exit_code == 0


def test_verify_suite_quick_reference(cli, tmp_path: Path) -> None:
    junit = tmp_path / "suite.xml"
    r = cli("verify", "--suite", "quick", "--backend", "reference", "--junit", junit, "--json")
    assert r.exit_code == 0, r.stdout[-3000:]
    data = json.loads(r.stdout)
    assert data["passed"] and data["backends"] == {
        "blockwise_mm_bwd_mxfp8": "reference",
        "rmsnorm_mx_prefill": "reference",
    }
    from mxcli.verification.cases import select

    assert [c["case"] for c in data["cases"]] == [c.name for c in select("quick")]
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "0"


def test_verify_suite_list_and_filter(cli) -> None:
    r = cli("verify", "--suite", "full", "--list")
    assert r.exit_code == 0 and "bwd/upstream-h2048-t1024-e2-b128-k1-i512" in r.stdout
    r = cli("verify", "--suite", "quick", "--case", "noaux", "--json")
    assert r.exit_code == 0, r.output
    assert [c["case"] for c in json.loads(r.stdout)["cases"]] == [
        "prefill/noaux-e32-g4-tg2-k2",
        "prefill/noaux-e32-g4-tg2-k2-packaff",
    ]
    r = cli("verify", "--suite", "quick", "--case", "bwd/dense*")
    assert r.exit_code == 0 and "PASSED: 1 case(s)" in r.stdout


def test_verify_suite_fails_on_a_corrupting_backend(cli, corrupt_backend: str) -> None:
    r = cli("verify", "--suite", "quick", "--backend", corrupt_backend, "--case", "e16", "--json")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    failed = {t["name"] for c in data["cases"] for t in c["tensors"] if not t["passed"]}
    assert failed == {"norm_quant_packed.codes", "norm_quant_packed.values"}


# ---------------------------------------------------------------- inspect


def test_inspect_prefill_outputs(cli, files) -> None:
    r = cli("inspect", files["noaux_out"], "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["metadata"]["kernel"] == "rmsnorm_mx_prefill"
    t = {row["name"]: row for row in data["tensors"]}
    assert t["norm_quant_packed"]["dtype"] == "float8_e4m3fn"
    assert len(t["norm_quant_packed"]["sha256"]) == 64
    mx = data["mx"][0]
    assert mx["tensor"] == "norm_quant_packed" and sum(mx["scale_exponents"].values()) == 32 * 16
    assert mx["packed_affinities"]["max"] > 0
    r = cli("inspect", files["noaux_out"])
    assert r.exit_code == 0 and "scale exponents" in r.stdout and "2^-" in r.stdout


def test_inspect_x4_weights_and_nonfinite_counts(cli, tmp_path: Path, files) -> None:
    r = cli("inspect", files["bwd_pq"], "--json")
    assert r.exit_code == 0, r.output
    mx = {m["tensor"]: m for m in json.loads(r.stdout)["mx"]}
    assert set(mx) == {"gate_up_proj_weight", "down_proj_weight"}
    assert mx["down_proj_weight"]["scale_layout"] == "packed"
    assert mx["down_proj_weight"]["dequantized"]["max"] <= 0.11
    nan = tmp_path / "nan.safetensors"
    write_file(nan, {"x": torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])}, {})
    row = json.loads(cli("inspect", nan, "--json").stdout)["tensors"][0]
    assert row["nan"] == 1 and row["inf"] == 2 and row["max"] == 1.0
    r = cli("inspect", files["bwd_pq"], "--no-stats", "--json")
    assert json.loads(r.stdout)["mx"] == []


def test_inspect_prepared_folder(cli, prepared) -> None:
    folder, layer = prepared
    r = cli("inspect", folder, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "prep-weights" and str(layer) in data["layers"]
    r = cli("inspect", folder, "--layer", layer, "--json")
    detail = json.loads(r.stdout)["layer_detail"]
    assert {m["scale_layout"] for m in detail["mx"]} == {"packed"}
    assert len(detail["mx"]) == 2
    r = cli("inspect", folder, "--layer", layer)
    assert r.exit_code == 0 and "router" in r.stdout and "scale exponents" in r.stdout


def test_inspect_plain_folder(cli, tmp_path: Path, files) -> None:
    shutil.copy(files["prefill"], tmp_path / "a.safetensors")
    r = cli("inspect", tmp_path, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["kind"] == "folder"


# ---------------------------------------------------------------- demo and global options


def test_demo_option_errors(cli, tmp_path: Path) -> None:
    r = cli("demo", "--models", "gpt9")
    assert r.exit_code == 2 and "models" in r.stderr
    (tmp_path / "x").write_text("busy")
    r = cli("demo", "--out", tmp_path)
    assert r.exit_code == 2 and "not empty" in r.stderr


def test_debug_shows_the_traceback(cli, tmp_path: Path) -> None:
    r = cli("run-prefill", tmp_path / "missing.safetensors", "-o", tmp_path / "o.safetensors")
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = cli(
        "run-prefill", tmp_path / "missing.safetensors", "-o", tmp_path / "o.safetensors", "--debug"
    )
    assert r.exit_code != 2 and r.exception is not None
    assert "no such file" in str(r.exception)
