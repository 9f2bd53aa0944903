"""``mxcli demo`` end to end, in a subprocess started from a fresh temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mxcli.tensorio import read_file

STEPS = [
    "checkpoint",
    "prep-weights",
    "make-inputs prefill",
    "run-prefill",
    "make-inputs bwd",
    "run-bwd",
    "verify prefill",
    "verify bwd",
]


def test_demo_end_to_end(tmp_path: Path) -> None:
    cwd = tmp_path / "fresh"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mxcli", "demo", "--json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["passed"] is True
    out = Path(data["out"])
    try:
        assert out.is_dir() and out != cwd and list(cwd.iterdir()) == []  # a fresh temporary folder
        steps = [(r["model"], r["step"]) for r in data["steps"]]
        assert steps == [(m, s) for m in ("qwen3_moe", "deepseek_v3") for s in STEPS]
        assert all(r["passed"] for r in data["steps"])
        files = [Path(f) for f in data["files"]]
        assert all(f.is_file() for f in files)
        assert sorted(files) == sorted(p for p in out.rglob("*") if p.is_file())
        for model, router in (("qwen3_moe", "SOFTMAX"), ("deepseek_v3", "NOAUX_TC")):
            d = out / model
            assert (d / "prepared" / "manifest.json").is_file()
            pre = read_file(d / "prefill-outputs.safetensors")
            assert json.loads(pre.metadata["kwargs"])["router_act_fn"] == router
            bwd_in = read_file(d / "bwd-inputs.safetensors")
            assert "gate_up_weight_scales" in bwd_in.tensors  # the prepared MXFP8 path
            assert set(read_file(d / "bwd-outputs.safetensors").tensors) == {
                "hidden_states_grad",
                "expert_affinities_masked_grad",
                "gate_up_proj_weight_grad",
                "down_proj_weight_grad",
            }
        # the budget is a minute on this machine; leave room for a loaded CI box
        assert seconds < 120, seconds
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


def test_demo_rerun_needs_force(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mxcli.cli import app

    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--models", "qwen3_moe", "--tokens", "128", "--quiet"]
    runner = CliRunner()
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "--force" in again.output
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
