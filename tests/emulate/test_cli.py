"""``mxcli emulate`` as a fresh process (issue 31; issue 28 item 15)."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", "emulate", *args],
        cwd=cwd, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def _strict(text: str) -> Any:
    def refuse(c: str) -> Any:
        raise AssertionError(f"not strict JSON: {c}")

    return json.loads(text, parse_constant=refuse)


def _one_line(p: subprocess.CompletedProcess[str], needle: str) -> None:
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["--seq-len", "4"], "--seq-len: expected at least 8, got 4"),
        (["--device", "tpu"], "--device: expected cpu or cuda, got 'tpu'"),
        (["--model", "nowhere"], "--model: nowhere: expected a folder with config.json"),
        (["--seeds", "1"], "--seeds: expected at least 2 (an interval needs two), got 1"),
        (["--scope", "all"], "--scope: expected experts or experts+dense, got 'all'"),
        (["--arms", "neuron,fp4"], "--arms: expected a comma-separated subset"),
        (["--preset", "huge"], "--preset: expected one of tiny, default, cuda-small, got 'huge'"),
        # issue 28 item 15: not a NaN loss reported as a result
        (["--lr", "inf"], "--lr: expected a finite positive number, got inf"),
        (["--lr", "nan"], "--lr: expected a finite positive number, got nan"),
        (["--data", "/dev/null"], "--data: /dev/null: expected a regular text file, got a device"),
        (["--data", "."], "--data: .: expected a text file, got a folder"),
        (["--data", "missing.txt"], "--data: missing.txt: no such file"),
    ],
)
def test_bad_flags_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    p = _run(*args, cwd=tmp_path)
    _one_line(p, needle)
    assert not list(tmp_path.iterdir())


def test_empty_data_file(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    _one_line(
        _run("--data", "empty.txt", cwd=tmp_path),
        "--data: empty.txt: expected text, got an empty file",
    )


def test_short_data_file(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_bytes(b"abc")
    p = _run("--preset", "tiny", "--data", "short.txt", "--no-plot", cwd=tmp_path)
    _one_line(
        p, "--data: expected at least 350 tokens for --seq-len 32 (a tenth is held out), got 3"
    )


def test_fp8_checkpoint_refused(tmp_path: Path) -> None:
    """Issue 28 item 15: an FP8 checkpoint gave an ImportError traceback (accelerate)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    cfg = {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8"}}
    (ck / "config.json").write_text(json.dumps(cfg))
    p = _run("--model", "ck", "--no-plot", cwd=tmp_path)
    _one_line(p, "--model: ck: a quantized checkpoint (quantization_config quant_method 'fp8')")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", head[16:24])
    return w, h


@pytest.mark.slow
def test_tiny_study_twice_identical_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "loss.png"
    args = ("--preset", "tiny", "--steps", "2", "--plot", str(png), "--json")
    p = _run(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    r = _strict(p.stdout)
    assert r["arms"] == ["fp32", "bf16", "neuron", "ocp", "rceil"]
    for arm in ("fp32", "neuron", "ocp", "rceil"):
        g = r["gap_to_bf16"][arm]
        assert len(g["per_seed"]) == 2 and g["low"] <= g["mean"] <= g["high"]
        assert g["verdict"] in (
            "not distinguishable from bf16",
            "distinguishable from bf16: higher loss",
            "distinguishable from bf16: lower loss",
        )
    assert r["data"]["sha256"] == "323190785a07fe7b88011d3eacac599c2fe2c936db4c769ef7eaa54506e1400e"
    if importlib.util.find_spec("matplotlib") is not None:
        assert _png_size(png)[0] >= 1200 and r["plot"] == str(png)
        again = _run(*args, cwd=tmp_path)
        assert again.returncode == 2 and "--force" in again.stderr
    p2 = _run(*args, "--force", cwd=tmp_path)
    assert p2.returncode == 0, p2.stderr
    r2 = _strict(p2.stdout)
    for x in (r, r2):
        x.pop("timing")
        x.pop("command")
    assert r == r2


@pytest.mark.slow
def test_divergence_reported_in_strict_json(tmp_path: Path) -> None:
    p = _run("--preset", "tiny", "--steps", "3", "--arms", "ocp", "--lr", "1e30", "--json",
             "--no-plot", cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = _strict(p.stdout)
    assert r["status"] == "diverged" and "diverged" in r["verdict"]
    assert r["gap_to_bf16"]["ocp"]["mean"] is None or r["runs"]["bf16"][0]["status"] == "ok"
