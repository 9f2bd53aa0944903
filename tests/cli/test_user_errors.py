"""The user-error matrix: exit code 2, one line on stderr naming the problem, no traceback, and no
output file (nor a temporary one) left behind."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mxcli.io.files import write_file
from mxcli.kernels.spec import read_kernel_file


def _edit(
    src: Path,
    dst: Path,
    *,
    drop: tuple[str, ...] = (),
    meta: dict[str, str] | None = None,
    **changes: torch.Tensor,
) -> Path:
    f = read_kernel_file(src)
    tensors = {k: v for k, v in f.tensors.items() if k not in drop}
    tensors.update(changes)
    write_file(dst, tensors, {**f.metadata, **(meta or {})})
    return dst


def _nan_hidden(src: Path, dst: Path) -> Path:
    hs = read_kernel_file(src).tensors["hidden_states"].clone()
    hs.view(-1)[7] = float("nan")
    return _edit(src, dst, hidden_states=hs)


def _inf_grad(src: Path, dst: Path) -> Path:
    g = read_kernel_file(src).tensors["output_hidden_states_grad"].clone()
    g[0, 0] = float("inf")
    g[1, 1] = -float("inf")
    return _edit(src, dst, output_hidden_states_grad=g)


def _shaped(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path, Path], Path]:
    def make(src: Path, dst: Path) -> Path:
        return _edit(src, dst, **{name: fn(read_kernel_file(src).tensors[name])})

    return make


# (id, kernel file key, how to make the input (None = use as is), extra flags, words in the message)
MATRIX: list[tuple[str, str, Callable[[Path, Path], Path] | None, list[str], list[str]]] = [
    (
        "missing-tensor",
        "prefill",
        lambda s, d: _edit(s, d, drop=("gamma",)),
        [],
        ["missing tensor", "gamma"],
    ),
    (
        "missing-bwd-tensor",
        "bwd",
        lambda s, d: _edit(s, d, drop=("block_to_expert",)),
        [],
        ["missing tensor", "block_to_expert"],
    ),
    (
        "extra-tensor",
        "prefill",
        lambda s, d: _edit(s, d, bogus=torch.zeros(3)),
        [],
        ["unexpected tensor", "bogus"],
    ),
    (
        "wrong-shape-gamma",
        "prefill",
        _shaped("gamma", lambda t: t[:, :256].contiguous()),
        [],
        ["gamma", "expected shape", "(512,)", "(1, 256)"],
    ),
    (
        "wrong-shape-hidden",
        "prefill",
        _shaped("hidden_states", lambda t: t[..., :500].contiguous()),
        [],
        ["hidden_states", "multiple of 512", "500"],
    ),
    (
        "wrong-shape-bwd",
        "bwd",
        _shaped("down_proj_weight", lambda t: t[:, :, :128].contiguous()),
        [],
        ["down_proj_weight", "expected shape", "(2, 128, 256)", "(2, 128, 128)"],
    ),
    (
        "wrong-dtype-hidden",
        "prefill",
        _shaped("hidden_states", lambda t: t.float()),
        [],
        ["hidden_states", "expected dtype", "bfloat16 or float16", "got float32"],
    ),
    (
        "wrong-dtype-plan",
        "bwd",
        _shaped("token_position_to_id", lambda t: t.float()),
        [],
        ["token_position_to_id", "expected dtype", "int32", "float32"],
    ),
    ("nan-input", "prefill", _nan_hidden, [], ["hidden_states", "1 NaN"]),
    ("inf-input", "bwd", _inf_grad, [], ["output_hidden_states_grad", "2 Inf"]),
    (
        "bad-kwargs-json",
        "prefill",
        lambda s, d: _edit(s, d, meta={"kwargs": "{top_k: 2"}),
        [],
        ["kwargs", "not valid JSON"],
    ),
    (
        "unknown-kwarg",
        "prefill",
        lambda s, d: _edit(s, d, meta={"kwargs": '{"topk": 2}'}),
        [],
        ["unknown kwarg", "topk"],
    ),
    ("top-k-too-large", "prefill", None, ["--top-k", "9"], ["top_k", "8", "9"]),
    ("top-k-not-int", "prefill", None, ["--top-k", "two"], ["--top-k", "integer"]),
    ("bad-router-act", "prefill", None, ["--router-act", "relu"], ["router_act_fn", "relu"]),
    (
        "bad-qmx-dtype",
        "prefill",
        None,
        ["--qmx-output-dtype", "e3m2"],
        ["qmx_output_dtype", "e3m2"],
    ),
    (
        "bad-unpadded",
        "prefill",
        None,
        ["--unpadded-hidden-size", "4096"],
        ["unpadded_hidden_size", "4096"],
    ),
    ("bad-block-size", "bwd", None, ["--block-size", "100"], ["block_size", "100"]),
    ("bad-device", "prefill", None, ["--device", "tpu"], ["device", "tpu"]),
    (
        "unknown-backend",
        "prefill",
        None,
        ["--backend", "nope"],
        ["unknown backend 'nope'", "available: auto, reference"],
    ),
    (
        "unknown-backend-bwd",
        "bwd",
        None,
        ["--backend", "nope"],
        ["unknown backend 'nope'", "available:", "reference"],
    ),
    ("layer-without-weights", "prefill", None, ["--layer", "1"], ["--layer needs --weights"]),
    (
        "weights-not-a-folder",
        "prefill",
        None,
        ["--weights", "/nonexistent", "--layer", "0"],
        ["/nonexistent"],
    ),
    ("wrong-kernel-file", "bwd", None, [], ["input file is for blockwise_mm_bwd_mxfp8"]),
]


@pytest.mark.parametrize("case", MATRIX, ids=[m[0] for m in MATRIX])
def test_run_user_errors(cli, tmp_path: Path, files: dict[str, Path], case) -> None:
    name, key, make, flags, words = case
    src = files[key]
    inp = make(src, tmp_path / "in.safetensors") if make else src
    kernel_cmd = "run-bwd" if key.startswith("bwd") else "run-prefill"
    if name == "wrong-kernel-file":
        kernel_cmd = "run-prefill"
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    r = cli(kernel_cmd, inp, "-o", out, *flags)
    _assert_user_error(r, words, out)


def _assert_user_error(r, words: list[str], out: Path | None = None) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output
    err = r.stderr.strip()
    for w in words:
        assert w in err, (w, err)
    if out is not None:
        assert not out.exists()
        assert list(out.parent.iterdir()) == []  # no temporary file either


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage" * 10, "truncated", "header-only", "bad-header-length"],
    ids=["empty", "garbage", "truncated", "header-only", "bad-header-length"],
)
def test_corrupt_or_truncated_safetensors(
    cli, tmp_path: Path, files: dict[str, Path], content
) -> None:
    data = files["prefill"].read_bytes()
    if content == "truncated":
        content = data[: len(data) // 2]
    elif content == "header-only":
        content = data[:200]
    elif content == "bad-header-length":
        content = (10**12).to_bytes(8, "little") + data[8:]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    r = cli("run-prefill", bad, "-o", out)
    _assert_user_error(r, ["bad.safetensors"], out)
    r = cli("verify", bad, "--golden", files["prefill_out"])
    _assert_user_error(r, ["bad.safetensors"])
    r = cli("inspect", bad)
    _assert_user_error(r, ["bad.safetensors"])


def test_missing_input_and_existing_output(cli, tmp_path: Path, files: dict[str, Path]) -> None:
    out = tmp_path / "o.safetensors"
    _assert_user_error(
        cli("run-prefill", tmp_path / "nope.safetensors", "-o", out),
        ["nope.safetensors", "no such file"],
    )
    assert not out.exists()
    out.write_bytes(b"keep me")
    r = cli("run-prefill", files["prefill"], "-o", out)
    _assert_user_error(r, ["output exists", "--force"])
    assert out.read_bytes() == b"keep me"
    r = cli("run-prefill", files["prefill"], "-o", tmp_path / "no-dir" / "o.safetensors")
    _assert_user_error(r, ["does not exist"])


@pytest.mark.parametrize(
    "config,words",
    [
        ("missing", ["config", "no such file"]),
        ("{not json", ["config", "not valid JSON"]),
        ('{"no_such_field": 1}', ["unknown field", "no_such_field"]),
        ('{"affinity_option": "SIDEWAYS"}', ["affinity_option", "SIDEWAYS"]),
        ('{"single_expert_dense": true}', ["single_expert_dense"]),
        ("[1, 2]", ["expected a JSON object"]),
    ],
    ids=["missing", "not-json", "unknown-field", "bad-enum", "invalid-combination", "not-object"],
)
def test_bad_bwd_config(
    cli, tmp_path: Path, files: dict[str, Path], config: str, words: list[str]
) -> None:
    cfg = tmp_path / "cfg.json"
    if config != "missing":
        cfg.write_text(config)
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    _assert_user_error(cli("run-bwd", files["bwd"], "-o", out, "--config", cfg), words, out)


@pytest.mark.parametrize(
    "args,words",
    [
        (["prefill", "--hidden", "500"], ["hidden", "multiple of 512", "500"]),
        (["prefill", "--tokens", "10", "--batch", "3"], ["tokens", "--batch 3"]),
        (["prefill", "--router-act", "gelu"], ["router_act_fn", "gelu"]),
        (["prefill", "--unpadded-hidden-size", "600"], ["unpadded_hidden_size", "600"]),
        (["bwd", "--top-k", "5", "--experts", "4"], ["top_k", "4"]),
        (["bwd", "--dense", "--experts", "4"], ["dense", "experts=4"]),
        (["bwd", "--block-size", "100"], ["block_size", "100"]),
        (["bwd", "--clamp", "1,2"], ["clamp", "4 values"]),
        (["bwd", "--routing", "magic"], ["--routing", "magic"]),
        (["bwd", "--prequantize", "--scale-layout", "diagonal"], ["scale_layout", "diagonal"]),
        (["bwd", "--weights", "/nonexistent"], ["--weights DIR and --layer L"]),
        (["moe"], ["moe"]),
    ],
    ids=[
        "hidden",
        "batch",
        "act",
        "unpadded",
        "top-k",
        "dense",
        "block-size",
        "clamp",
        "router",
        "scale-layout",
        "weights-without-layer",
        "kind",
    ],
)
def test_make_inputs_errors(cli, tmp_path: Path, args: list[str], words: list[str]) -> None:
    out = tmp_path / "out" / "in.safetensors"
    out.parent.mkdir()
    _assert_user_error(cli("make-inputs", *args, "-o", out), words, out)


def test_verify_errors(cli, tmp_path: Path, files: dict[str, Path]) -> None:
    _assert_user_error(cli("verify"), ["--golden", "--suite"])
    _assert_user_error(cli("verify", files["prefill_out"]), ["--golden", "--inputs"])
    _assert_user_error(cli("verify", files["prefill_out"], "--suite", "quick"), ["not both"])
    _assert_user_error(cli("verify", "--suite", "weekly"), ["weekly"])
    _assert_user_error(
        cli("verify", "--suite", "quick", "--backend", "nope"),
        ["unknown backend 'nope'", "available: auto, reference"],
    )
    _assert_user_error(cli("verify", "--suite", "quick", "--case", "zzz"), ["no quick case", "zzz"])
    _assert_user_error(cli("verify", "--suite", "quick", "--device", "cuda:7"), ["device"])
    _assert_user_error(
        cli("verify", files["prefill_out"], "--golden", tmp_path / "g.safetensors"),
        ["g.safetensors", "no such file"],
    )
    _assert_user_error(
        cli("verify", files["prefill_out"], "--golden", files["bwd_out"]),
        ["rmsnorm_mx_prefill", "blockwise_mm_bwd_mxfp8"],
    )
    _assert_user_error(
        cli("verify", files["prefill_out"], "--golden", files["prefill"]), ["not an output file"]
    )
    _assert_user_error(
        cli("verify", files["prefill_out"], "--inputs", files["bwd"]),
        ["inputs of blockwise_mm_bwd_mxfp8"],
    )
    _assert_user_error(
        cli(
            "verify", files["prefill_out"], "--golden", files["prefill_out"], "--max-mismatch", "2"
        ),
        ["max_mismatch", "[0, 1]"],
    )
    junit = tmp_path / "out" / "r.xml"
    junit.parent.mkdir()
    _assert_user_error(
        cli("verify", files["prefill_out"], "--golden", files["bwd_out"], "--junit", junit),
        ["blockwise_mm_bwd_mxfp8"],
        junit,
    )


def test_inspect_errors(cli, tmp_path: Path, files: dict[str, Path]) -> None:
    _assert_user_error(cli("inspect", tmp_path / "nothing"), ["no such file or folder"])
    _assert_user_error(cli("inspect", tmp_path), ["no manifest.json", "no .safetensors"])
    _assert_user_error(cli("inspect", files["prefill"], "--layer", "1"), ["--layer"])
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    _assert_user_error(cli("inspect", tmp_path), ["not a prep-weights manifest"])
