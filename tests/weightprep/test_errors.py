"""Every user error: one `error:` line on stderr, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.weightprep.synthetic import build_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("base") / "q", intermediate_size=256
    ).path


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def run_cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, ["prep-weights", *map(str, args)])
    return r.exit_code, r.stdout, r.stderr


def assert_user_error(args: list, pattern: str, out: Path | None = None) -> None:
    code, stdout, stderr = run_cli(*args)
    assert code == 2, (code, stdout, stderr)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    import re

    assert re.search(pattern, lines[0]), lines[0]
    if out is not None:
        assert not out.exists() or not any(out.rglob("*.safetensors"))


def test_missing_config_key(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    edit_config(src, num_experts=None)
    assert_user_error(
        [src, tmp_path / "o"], r"config.json: missing key 'num_experts'", tmp_path / "o"
    )


def test_unsupported_model_type(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    edit_config(src, model_type="llama")
    assert_user_error([src, tmp_path / "o"], r"model_type 'llama' is not a supported MoE family")
    assert_user_error(
        [base, tmp_path / "o", "--model-type", "gpt2"], r"--model-type 'gpt2' is not supported"
    )
    edit_config(src, model_type=None)
    assert_user_error([src, tmp_path / "o"], r"missing key 'model_type'")


def test_model_type_override(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    edit_config(src, model_type=None)
    code, stdout, _ = run_cli(src, "--dry-run", "--json", "--model-type", "qwen3_moe")
    assert code == 0 and json.loads(stdout)["family"] == "qwen3_moe"


def test_unsupported_config_values(tmp_path: Path) -> None:
    ds = build_checkpoint("deepseek_v3", tmp_path / "ds")
    edit_config(ds.path, scoring_func="softmax")
    assert_user_error([ds.path, tmp_path / "o"], r"scoring_func='softmax' .* not expressible")
    edit_config(ds.path, scoring_func="sigmoid", quantization_config={"quant_method": "awq"})
    assert_user_error([ds.path, tmp_path / "o"], r"quant_method 'awq' is not supported")


def test_tensor_missing_from_every_shard(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))
    assert_user_error(
        [src, tmp_path / "o"],
        rf"{name}: tensor missing from the checkpoint \(model.safetensors.index.json maps it to",
    )
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_user_error([src, tmp_path / "o"], rf"{name}: tensor missing .*not in any of the 3 shard")


def test_shape_disagrees_with_config(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    edit_config(src, moe_intermediate_size=384)
    assert_user_error(
        [src, tmp_path / "o"],
        r"model.layers.0.mlp.experts.0.gate_proj.weight .*expected shape \[384, 256\], got \[256, 256\]",
    )


def test_tp_errors(base: Path, tmp_path: Path) -> None:
    assert_user_error([base, tmp_path / "o", "--tp", "3"], r"I \(256\) is not divisible by --tp 3")
    assert_user_error([base, tmp_path / "o", "--ep", "3"], r"E \(8\) is not divisible by --ep 3")


def test_truncated_and_corrupt_shards(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    shard = src / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert_user_error(
        [src, tmp_path / "o"],
        r"model-00002-of-00003.safetensors: truncated or corrupt safetensors file",
    )
    shard.write_bytes(data[:8] + b"{not json" + data[17:])
    assert_user_error(
        [src, tmp_path / "o"], r"model-00002-of-00003.safetensors: corrupt safetensors header"
    )
    shard.write_bytes(b"\x01\x02")
    assert_user_error([src, tmp_path / "o"], r"truncated or corrupt safetensors file")


def test_missing_shard_and_config(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "s")
    (src / "model-00003-of-00003.safetensors").unlink()
    assert_user_error(
        [src, tmp_path / "o"],
        r"shard model-00003-of-00003.safetensors listed in model.safetensors.index.json is "
        r"missing",
    )
    (src / "config.json").unlink()
    assert_user_error([src, tmp_path / "o"], r"config.json: not found")
    assert_user_error([tmp_path / "nope", tmp_path / "o"], r"checkpoint folder not found")


def test_unwritable_output(base: Path, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_user_error(
        [base, afile / "out"], r"cannot write|not writable|not a folder|does not exist"
    )
    assert_user_error([base, tmp_path / "missing" / "out"], r"parent folder .* does not exist")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert_user_error([base, ro / "out"], r"not writable")
        finally:
            ro.chmod(0o700)


def test_existing_output_refused(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("k")
    assert_user_error([base, out], r"output folder exists and is not empty \(use --force")


def test_bad_flags(base: Path, tmp_path: Path) -> None:
    assert_user_error([base, tmp_path / "o", "--layers", "3-x"], r"--layers: expected")
    assert_user_error([base, tmp_path / "o", "--layers", "0-9"], r"--layers: layer 9 out of range")
    assert_user_error([base, tmp_path / "o", "--formats", "fp16"], r"--formats")
    assert_user_error([base, tmp_path / "o", "--scale-layout", "tiled"], r"--scale-layout")
    assert_user_error([base, tmp_path / "o", "--scale-rule", "even"], r"--scale-rule")
    assert_user_error([base, tmp_path / "o", "--tp", "0"], r"--tp")
    assert_user_error([base], r"OUTPUT folder is required")


def test_dry_run_writes_nothing(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    code, stdout, _ = run_cli(base, out, "--dry-run", "--json", "--tp", "2")
    assert code == 0 and not out.exists()
    plan = json.loads(stdout)
    assert plan["layers"] == [0, 1] and plan["router"]["act_fn"] == "SOFTMAX"
    assert plan["intermediate_size_per_rank"] == 128 and len(plan["ranks"]) == 2
    shapes = {t["name"]: t["shape"] for t in plan["outputs_per_layer"]["rank1"]}
    assert shapes["gate_up_proj_weight"] == [8, 256, 2, 128] and shapes["router_weights"] == [
        512,
        8,
    ]
    assert plan["estimated_peak_memory_bytes"] > 0 and plan["output_bytes"] > 0
    code, stdout, _ = run_cli(base, "--dry-run")
    assert code == 0 and "SOFTMAX" in stdout and "peak memory" in stdout


def test_run_json_result(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    code, stdout, stderr = run_cli(base, out, "--json", "--formats", "bf16", "--check")
    assert code == 0, stderr
    res = json.loads(stdout)
    assert res["layers_written"] == [0, 1] and res["check"]["0"]["router_weights"]["exact"]
    assert "layer 1:" in stderr  # per-layer progress lines go to stderr


def test_quiet_prints_nothing_and_debug_shows_the_exception(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    code, stdout, stderr = run_cli(checkpoints["qwen3_moe"], tmp_path / "out", "--quiet")
    assert code == 0 and stdout == "" and stderr == ""
    assert (tmp_path / "out" / "manifest.json").is_file()
    r = CliRunner().invoke(app, ["prep-weights", str(tmp_path / "missing"), "--debug"])
    assert r.exit_code != 0 and isinstance(r.exception, Exception)
    assert "checkpoint folder not found" in str(r.exception)


def test_file_as_source_says_file(base: Path, tmp_path: Path) -> None:
    assert_user_error(
        [base / "config.json", tmp_path / "o"], r"is a file; expected the checkpoint folder"
    )


def test_output_in_source_folder_refused(base: Path, tmp_path: Path) -> None:
    src = clone(base, tmp_path / "src")
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src / "prepared"):
        assert_user_error([src, out, "--force"], r"inside the checkpoint folder")
    assert sorted(p.name for p in src.iterdir()) == before


def test_dry_run_says_the_real_run_would_refuse(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, stdout, _ = run_cli(base, out, "--dry-run")
    assert code == 0 and "the real run would refuse" in stdout and "--resume" in stdout
    code, stdout, _ = run_cli(base, out, "--dry-run", "--json")
    assert "would refuse" in json.loads(stdout)["would_refuse"]
    code, stdout, _ = run_cli(base, out, "--dry-run", "--force")
    assert code == 0 and "would refuse" not in stdout
    code, stdout, _ = run_cli(base, tmp_path / "new", "--dry-run")
    assert code == 0 and "would refuse" not in stdout
    assert (out / "notes.txt").read_text() == "mine" and not (tmp_path / "new").exists()
