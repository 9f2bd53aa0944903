"""``mxcli demo`` end to end, in a subprocess started from a fresh temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mxcli.kernels.spec import read_kernel_file

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
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env["TMPDIR"] = str(tmpdir)
    proc = subprocess.run(
        [sys.executable, "-m", "mxcli", "demo", "--json", "--keep"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["passed"] is True
    out = Path(data["out"])
    try:
        assert out.is_dir() and out.parent == tmpdir and list(cwd.iterdir()) == []  # kept
        steps = [(r["model"], r["step"]) for r in data["steps"]]
        assert steps == [(m, s) for m in ("qwen3_moe", "deepseek_v3") for s in STEPS]
        assert all(r["passed"] for r in data["steps"])
        files = [Path(f) for f in data["files"]]
        assert all(f.is_file() for f in files)
        assert sorted(files) == sorted(p for p in out.rglob("*") if p.is_file())
        for model, router in (("qwen3_moe", "SOFTMAX"), ("deepseek_v3", "NOAUX_TC")):
            d = out / model
            assert (d / "prepared" / "manifest.json").is_file()
            pre = read_kernel_file(d / "prefill-outputs.safetensors")
            assert json.loads(pre.metadata["kwargs"])["router_act_fn"] == router
            bwd_in = read_kernel_file(d / "bwd-inputs.safetensors")
            assert "gate_up_weight_scales" in bwd_in.tensors  # the prepared MXFP8 path
            assert set(read_kernel_file(d / "bwd-outputs.safetensors").tensors) == {
                "hidden_states_grad",
                "expert_affinities_masked_grad",
                "gate_up_proj_weight_grad",
                "down_proj_weight_grad",
            }
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


def test_demo_removes_its_temporary_folder(tmp_path: Path, monkeypatch) -> None:
    """Without --out the demo's folder is removed at the end (after an error too), and the
    summary says where it was; --keep keeps it. The journey itself is replaced by a stub that
    writes one file: what is tested here is the folder's life, not the steps."""
    import tempfile

    from typer.testing import CliRunner

    from mxcli import demo
    from mxcli.cli import app
    from mxcli.errors import InputError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fail = {"now": False}

    def journey(model: str, d: Path, *args: object) -> list[dict[str, object]]:
        d.mkdir(parents=True)
        (d / "prefill-inputs.safetensors").write_bytes(b"x" * 1000)
        if fail["now"]:
            raise InputError("stub: step failed")
        return [{"model": model, "step": "checkpoint", "command": "c", "seconds": 0.0,
                 "passed": True, "detail": ""}]  # fmt: skip

    monkeypatch.setattr(demo, "journey", journey)
    runner = CliRunner()
    r = runner.invoke(app, ["demo", "--models", "qwen3_moe"])
    assert r.exit_code == 0, r.output
    assert list(tmp_path.iterdir()) == []
    assert "now removed" in r.stdout and "mxcli-demo-" in r.stdout and "--keep" in r.stdout
    fail["now"] = True
    r = runner.invoke(app, ["demo", "--models", "qwen3_moe"])
    assert r.exit_code == 2 and "stub: step failed" in r.stderr
    assert list(tmp_path.iterdir()) == []
    fail["now"] = False
    r = runner.invoke(app, ["demo", "--models", "qwen3_moe", "--keep", "--json"])
    kept = Path(json.loads(r.stdout)["out"])
    assert kept.parent == tmp_path and (kept / "qwen3_moe" / "prefill-inputs.safetensors").is_file()


def test_demo_tokens_help_says_multiple_of_128() -> None:
    from typer.testing import CliRunner

    from mxcli.cli import app

    r = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "80"})
    assert "multiple of 128" in " ".join(r.stdout.split())
