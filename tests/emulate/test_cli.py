"""``mxcli emulate`` as a fresh process."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", "emulate", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["--seq-len", "4"], "--seq-len: expected at least 8, got 4"),
        (["--device", "tpu"], "--device: expected cpu or cuda, got 'tpu'"),
        (["--model", "nowhere"], "--model: nowhere: expected a folder with config.json"),
    ],
)
def test_bad_flags_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    p = _run(*args, cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == f"error: {needle}" or p.stderr.strip().endswith(needle)
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_tiny_study_json_and_plot(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_bytes(bytes(range(256)) * 40)
    png = tmp_path / "loss.png"
    p = _run(
        "--steps", "3", "--batch", "2", "--seq-len", "16", "--data", "data.txt",
        "--plot", str(png), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert set(r["runs"]) == {"bf16", "neuron", "ocp", "bf16_seed2"}
    for run in r["runs"].values():
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
    # step 1 sees identical weights and batch: losses agree to MX noise, not exactly
    first = [r["runs"][k]["losses"][0] for k in ("bf16", "neuron", "ocp")]
    assert max(first) - min(first) < 0.05
    assert set(r["final_loss_gap"]) == {"neuron", "ocp"}
    for layers in r["expert_grad_sqnr_db"].values():
        assert layers and all(5 < v < 60 for t in layers.values() for v in t.values())
    assert r["mx_value_stats"]["neuron"]["saturated_fraction"] == 0.0  # NEURON cannot saturate
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and r["plot"] == str(png)
        again = _run("--steps", "1", "--data", "data.txt", "--plot", str(png), cwd=tmp_path)
        assert again.returncode == 2 and "--force" in again.stderr
    else:
        assert not png.exists() and "matplotlib is not installed" in p.stderr
