"""Package basics: version, `python -m mxcli`, atomic outputs, backend registry, error reporting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mxcli
from mxcli.cli import app
from mxcli.errors import InputError, OutputExistsError, report_exception
from mxcli.fsutil import atomic_output
from mxcli.kernels import backends


def test_version_flag() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"mxcli {mxcli.__version__}"


def test_python_dash_m() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mxcli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().startswith("mxcli ")


def test_atomic_output_renames_on_success(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with atomic_output(target) as tmp:
        assert tmp != target and tmp.parent == tmp_path
        tmp.write_bytes(b"abc")
        assert not target.exists()
    assert target.read_bytes() == b"abc"
    assert list(tmp_path.iterdir()) == [target]


def test_atomic_output_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), atomic_output(target) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_refuses_existing_without_force(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(OutputExistsError, match="--force"), atomic_output(target):
        pass
    with atomic_output(target, force=True) as tmp:
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"


def test_report_exception_gives_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    exc = InputError("hidden_states: expected shape (1, 128, 512), got (1, 128, 500)")
    assert report_exception(exc) == 2
    err = capsys.readouterr().err
    assert err == "error: hidden_states: expected shape (1, 128, 512), got (1, 128, 500)\n"
    assert report_exception(KeyboardInterrupt(), interrupt_hint="resume") == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C); resume\n"
    assert report_exception(RuntimeError("a bug")) is None  # keeps its traceback
    assert capsys.readouterr().err == ""


def test_backend_registry() -> None:
    calls: list[int] = []
    backends.register("toy_kernel", "reference", lambda x: calls.append(x) or x)
    backends.register("toy_kernel", "neuron", lambda x: -x, probe=lambda: "no Neuron device")
    assert backends.backend_names("toy_kernel") == ["reference", "neuron"]
    assert backends.get("toy_kernel", "auto")(3) == 3  # neuron unavailable -> reference
    assert calls == [3]
    with pytest.raises(backends.UnknownBackendError, match="available: auto, reference, neuron"):
        backends.get("toy_kernel", "tpu")
    with pytest.raises(backends.BackendUnavailableError, match="no Neuron device"):
        backends.get("toy_kernel", "neuron")
    backends.register("toy_kernel", "broken", lambda: None, probe="no.such.module:probe")
    reason = backends.unavailable_reason("toy_kernel", "broken")
    assert reason is not None and "ModuleNotFoundError" in reason


def test_neuron_backend_unavailable_here() -> None:
    # The Neuron SDK is not installed on CI machines: the probe must say so, never raise.
    reason = backends.unavailable_reason("rmsnorm_mx_prefill", "neuron")
    assert reason


def test_usage_errors_are_one_line_with_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mxcli", "run-prefill", "--top-k", "two", "in.safetensors"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--top-k" in lines[0]
    assert "Traceback" not in out.stderr


def test_help_lists_only_working_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in (
        "prep-weights",
        "make-inputs",
        "run-prefill",
        "run-bwd",
        "verify",
        "inspect",
        "demo",
    ):
        assert name in result.output


def test_kernel_functions_are_exported_as_functions() -> None:
    import mxcli.kernels.rmsnorm_mx_prefill.reference  # noqa: F401  (a submodule first)
    from mxcli.kernels import blockwise_mm_bwd_mxfp8, rmsnorm_mx_prefill

    assert callable(rmsnorm_mx_prefill) and rmsnorm_mx_prefill.__name__ == "rmsnorm_mx_prefill"
    assert blockwise_mm_bwd_mxfp8.__name__ == "blockwise_mm_bwd_mxfp8"
