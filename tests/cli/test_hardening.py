"""Issue 13's CLI items: usage errors with click installed, one-line errors (and JSON ones),
outputs that would replace an input, full disks, file modes, the JUnit report, interrupts, and
what an 80-column terminal shows."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mxcli.cli import app
from tests import procs


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def _mxcli(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


# ---- usage errors -------------------------------------------------------------------------------


def test_usage_errors_with_click_installed(tmp_path: Path) -> None:
    """With click importable (it is in the test extra), typer's vendored click exceptions must
    still become one line and exit 2: the console entry point, in a real process."""
    assert importlib.util.find_spec("click") is not None, "the test extra installs click"
    r = _mxcli("run-prefill", "--top-k", "two", "in.safetensors", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "--top-k" in line and "integer" in line and r.stdout == ""
    r = _mxcli("make-inputs", cwd=tmp_path)  # click's multi-line "Choose from" message
    assert r.returncode == 2
    assert "Choose from: prefill, bwd" in _one_error_line(r.stderr)
    r = _mxcli("make-inputs", "--json", cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["exit_code"] == 2
    assert "kind" in json.loads(r.stdout)["error"]
    r = _mxcli("verify", "--bogus", cwd=tmp_path)
    assert r.returncode == 2 and "--bogus" in _one_error_line(r.stderr)
    assert list(tmp_path.iterdir()) == []


def test_errors_with_json_also_go_to_stdout(cli, tmp_path: Path, files) -> None:
    r = cli("run-prefill", tmp_path / "nope.safetensors", "-o", tmp_path / "o.st", "--json")
    assert r.exit_code == 2
    data = json.loads(r.stdout)
    assert data == {"error": _one_error_line(r.stderr)[len("error: ") :], "exit_code": 2}
    assert "nope.safetensors" in data["error"]
    r = cli("verify", files["prefill_out"], "--golden", files["bwd_out"], "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["exit_code"] == 2


@pytest.mark.parametrize(
    "args,words",
    [
        (["--tokens", "0"], ["tokens", "positive", "0"]),
        (["--batch", "0"], ["batch", "positive", "0"]),
    ],
)
def test_make_inputs_names_the_flag(cli, tmp_path: Path, args, words) -> None:
    out = tmp_path / "in.safetensors"
    r = cli("make-inputs", "prefill", "-o", out, *args)
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.stderr)
    assert all(w in line for w in words) and "seq" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--rtol", "-1", ["rtol", ">= 0", "-1"]),
        ("--atol", "-0.5", ["atol", ">= 0"]),
        ("--min-cosine", "2", ["min_cosine", "[-1, 1]", "2"]),
        ("--min-cosine", "nan", ["min_cosine", "nan"]),
    ],
)
def test_verify_bad_tolerance_is_a_usage_error(cli, files, flag, value, words) -> None:
    r = cli("verify", files["prefill_out"], "--golden", files["prefill_out"], flag, value)
    assert r.exit_code == 2, r.output  # not 1, the code of a failed check
    line = _one_error_line(r.stderr)
    assert all(w in line for w in words), line


# ---- outputs ------------------------------------------------------------------------------------


def test_output_that_is_an_input_is_refused(cli, tmp_path: Path, files) -> None:
    inp = tmp_path / "in.safetensors"
    shutil.copy(files["prefill"], inp)
    before = inp.read_bytes()
    link = tmp_path / "link.safetensors"
    link.symlink_to(inp)
    for out in (inp, link, tmp_path / "." / "in.safetensors"):
        r = cli("run-prefill", inp, "-o", out, "--force", "-b", "reference")
        assert r.exit_code == 2, r.output
        assert "would replace the input" in _one_error_line(r.stderr)
    assert inp.read_bytes() == before
    cfg = tmp_path / "cfg.json"
    cfg.write_text("{}")
    r = cli("run-bwd", files["bwd"], "-o", cfg, "--config", cfg, "--force")
    assert r.exit_code == 2 and "--config file" in _one_error_line(r.stderr)
    assert cfg.read_text() == "{}"
    gold = tmp_path / "gold.safetensors"
    shutil.copy(files["prefill_out"], gold)
    r = cli("verify", files["prefill_out"], "--golden", gold, "--junit", gold, "--force")
    assert r.exit_code == 2 and "--golden file" in _one_error_line(r.stderr)
    assert gold.read_bytes() == files["prefill_out"].read_bytes()


def test_output_inside_weights_folder_is_refused(cli, tmp_path: Path) -> None:
    weights = tmp_path / "prepared"
    weights.mkdir()
    (weights / "manifest.json").write_text("{}")
    r = cli("make-inputs", "prefill", "-o", weights / "manifest.json", "--force",
            "--weights", weights, "--layer", "0")  # fmt: skip
    assert r.exit_code == 2 and "--weights folder" in _one_error_line(r.stderr)
    assert (weights / "manifest.json").read_text() == "{}"


def test_folder_as_output_is_one_line(cli, tmp_path: Path, files) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    for args in (
        ["run-prefill", files["prefill"], "-o", folder, "--force"],
        ["make-inputs", "prefill", "-o", folder, "--force"],
        ["verify", files["prefill_out"], "--golden", files["prefill_out"], "--junit", folder],
    ):
        r = cli(*args)
        assert r.exit_code == 2, (args, r.output)
        assert "is a folder" in _one_error_line(r.stderr)
        assert list(folder.iterdir()) == []


def test_junit_checked_before_any_work(cli, tmp_path: Path) -> None:
    r = cli("verify", "--suite", "quick", "--junit", tmp_path)
    assert r.exit_code == 2 and "is a folder" in _one_error_line(r.stderr)
    assert r.stdout == ""  # the suite did not run
    r = cli("verify", "--suite", "quick", "--junit", tmp_path / "no" / "r.xml")
    assert r.exit_code == 2 and "does not exist" in _one_error_line(r.stderr)


def test_junit_existing_needs_force(cli, tmp_path: Path, files) -> None:
    report = tmp_path / "r.xml"
    report.write_text("keep")
    args = ["verify", files["prefill_out"], "--golden", files["prefill_out"], "--junit", report]
    r = cli(*args)
    assert r.exit_code == 2 and "--force" in _one_error_line(r.stderr)
    assert report.read_text() == "keep"
    r = cli(*args, "--force")
    assert r.exit_code == 0, r.output
    assert report.read_text().startswith("<?xml")


@pytest.mark.parametrize(
    "error",
    ["safetensors", "oserror"],
)
def test_disk_full_is_one_line_and_leaves_nothing(
    cli, tmp_path: Path, files, monkeypatch, error
) -> None:
    """A full disk while writing (the safetensors writer's error, or the OS's) is reported as
    one line naming the output, exit 2, and no file is left, temporary or final."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
        Path(filename).write_bytes(b"partial")  # some bytes went out before the disk filled
        if error == "safetensors":
            raise SafetensorError("Error while serializing: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for args in (
        ["run-prefill", files["prefill"], "-o", out_dir / "o.safetensors", "-b", "reference"],
        ["make-inputs", "prefill", "-o", out_dir / "in.safetensors"],
    ):
        r = cli(*args)
        assert r.exit_code == 2, r.output
        line = _one_error_line(r.stderr)
        assert "cannot write" in line and "No space left on device" in line
        assert list(out_dir.iterdir()) == []


def test_outputs_follow_the_umask(cli, tmp_path: Path, files) -> None:
    old = os.umask(0o022)
    try:
        inp, out, report = tmp_path / "in.st", tmp_path / "out.st", tmp_path / "r.xml"
        assert cli("make-inputs", "prefill", "-o", inp, "-q").exit_code == 0
        assert cli("run-prefill", inp, "-o", out, "-b", "reference", "-q").exit_code == 0
        r = cli("verify", out, "--golden", out, "--junit", report, "-q")
        assert r.exit_code == 0, r.output
        for p in (inp, out, report):
            assert p.stat().st_mode & 0o777 == 0o644, (p, oct(p.stat().st_mode))
        os.umask(0o077)
        assert cli("run-prefill", inp, "-o", out, "-b", "reference", "-q", "-f").exit_code == 0
        assert out.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_self_comparison_warns(cli, tmp_path: Path, files) -> None:
    out = files["prefill_out"]
    copy = tmp_path / "copy.safetensors"
    shutil.copy(out, copy)
    r = cli("verify", out, "--golden", out)
    assert r.exit_code == 0 and "same file" in r.stderr and "proves nothing" in r.stderr
    r = cli("verify", out, "--golden", copy, "--json")
    assert r.exit_code == 0 and "same sha256" in r.stderr
    assert "proves nothing" in json.loads(r.stdout)["warnings"][0]
    r = cli("verify", files["noaux_out"], "--golden", out, "--json")
    assert "proves nothing" not in r.stderr


# ---- interrupts, in real processes ---------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupted_run_leaves_nothing(tmp_path: Path, files, sig) -> None:
    """The signal arrives while the output's temporary file exists: it is removed, the run
    prints one line and exits 128 + the signal (130 for Ctrl-C)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "o.safetensors"
    proc = procs.start(["run-bwd", files["bwd"], "-o", out, "-b", "reference"], mode="slow-save")
    procs.wait_for(lambda: any(out_dir.glob(".o.safetensors.*.tmp")), proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)
    line = _one_error_line(stderr)
    assert "interrupted" in line and ("Ctrl-C" if sig == signal.SIGINT else "SIGTERM") in line
    assert list(out_dir.iterdir()) == []


def test_interrupted_make_inputs_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C as the temporary output has just been created (raised there by the test script,
    not timed: it failed under load while the signal raced the creation)."""
    out = tmp_path / "in.safetensors"
    proc = procs.start(["make-inputs", "prefill", "-o", out], cwd=tmp_path,
                       mode="signal-after=mxcli.fsutil:_locked_temporary:SIGINT")  # fmt: skip
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in _one_error_line(stderr)
    assert list(tmp_path.iterdir()) == []


# ---- an 80-column terminal -------------------------------------------------------------------------


def _commands() -> dict[str, typer.core.TyperCommand]:
    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


def test_help_fits_80_columns_with_whole_flag_names(cli) -> None:
    commands = _commands()
    assert len(commands) >= 7
    for name, command in commands.items():
        r = cli(name, "--help", env={"COLUMNS": "80"})
        assert r.exit_code == 0, (name, r.output)
        text = r.stdout
        assert "<bool>" not in text, name
        assert "…" not in text, name
        for line in text.splitlines():
            assert len(line) <= 80, (name, line)
        for param in command.params:
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("-"):
                    assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text), (name, opt)


def _tokens(text: str) -> set[str]:
    return {t.strip(",;()") for t in text.split()}


def test_verify_table_fits_80_columns(cli, files) -> None:
    """Rendered at 80 columns: no line is longer, and every tensor name and every number of the
    JSON report appears whole on one line (nothing is split across lines)."""
    from mxcli.verification.report import _fmt

    for out, kw in (
        ("prefill_out", ["--golden", files["prefill_out"], "--inputs", files["prefill"]]),
        ("bwd_out", ["--golden", files["bwd_out"], "--inputs", files["bwd"]]),
    ):
        args = ["verify", files[out], *kw]
        r = cli(*args, env={"COLUMNS": "80"})
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), [x for x in lines if len(x) > 80]
        tokens = _tokens(r.stdout)
        data = json.loads(cli(*args, "--json").stdout)
        for case in data["cases"]:
            for t in case["tensors"]:
                assert t["name"] in tokens, t["name"]
                for key, spec in (("cosine", ".6f"), ("max_abs", ".3g"), ("max_rel", ".3g")):
                    if isinstance(t[key], float):
                        assert _fmt(t[key], spec) in tokens, (t["name"], key)
                if t["numel"]:
                    assert f"{t['mismatches']}/{t['numel']}" in tokens


def test_verify_table_long_names_narrow_console() -> None:
    """A name that leaves no room for the numbers moves them to the details line."""
    from rich.console import Console

    from mxcli.verification.compare import TensorReport
    from mxcli.verification.report import CaseResult, render_table

    name = "shared_expert.gate_up_proj_weight_grad.scales.very_long_suffix"
    rep = TensorReport(name=name, check="output vs golden", passed=False, tolerance="rtol 0.0312, "
                       "atol 0.00391*max, cos>=0.9999", numel=2097152, mismatches=12345,
                       max_abs=1.234e-05, max_rel=0.000123, cosine=0.99876543, message="too far")  # fmt: skip
    con = Console(record=True, width=80)
    render_table([CaseResult(case="bwd-e8-k2-t4096-b512-mxfp8", kernel="k", reports=[rep])], con)
    text = con.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for token in (name, "0.998765", "1.23e-05", "0.000123", "12345/2097152", "0.00391*max"):
        assert token in _tokens(text), token
