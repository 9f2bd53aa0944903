"""CLI start-up loads no kernel and no torch (the regression of issue 32's generated commands:
``mxcli --help`` imported torch and both kernels, 0.36 s became 2-3 s, in every one of the
suite's fresh CLI processes).

The generated commands (make-inputs, ``run-<short>``, ``profile <short>``) are built only when
invoked or their own ``--help`` is asked for; their groups list them from the kernels' identity
modules (`mxcli.kernels.spec.kernel_identities`), which the spec tables must agree with. Which
modules a process imported is read from ``python -X importtime`` (every import, one line each),
not from timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer

import mxcli
from mxcli.cli import app
from mxcli.commands._kernel_flags import LazyCommands
from mxcli.kernels.spec import (
    KernelIdentity,
    KernelSpec,
    TensorArg,
    all_specs,
    kernel_identities,
    read_identity,
    register_spec,
)
from tests.cli.test_toy_kernel import _write_toy

ROOT = Path(mxcli.__file__).resolve().parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    paths = [*extra.pop("PYTHONPATH", "").split(os.pathsep), str(ROOT.parent)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*paths, env.get("PYTHONPATH")] if p)
    env["COLUMNS"] = "100"
    env.update(extra)
    return env


def _imported(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """A fresh ``python -X importtime ARGS`` and the names of the modules it imported."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=300,
    )
    names = {
        line.split("|")[-1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "mxcli" in names, r.stderr[-2000:]  # the importtime lines were read
    return r, names


def _kernel_modules(names: set[str]) -> list[str]:
    """torch, and any module of a kernel package (not the shared spec registry)."""
    packages = {spec.package for spec in all_specs()}
    return sorted(
        n
        for n in names
        if n.split(".")[0] == "torch" or any(n == p or n.startswith(p + ".") for p in packages)
    )


def test_mxcli_help_imports_no_torch_and_lists_every_kernels_commands() -> None:
    r, names = _imported("-m", "mxcli", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _kernel_modules(names) == []
    out = " ".join(r.stdout.split())
    for spec in all_specs():  # names and one-line help from the specs' tables
        assert f"run-{spec.short} Run {spec.name} on an input file." in out
    assert "make-inputs Write a kernel input file: synthetic, or from --weights." in out


@pytest.mark.parametrize(
    "args",
    [
        ["-c", "import mxcli.cli"],
        ["-m", "mxcli", "--version"],
        ["-m", "mxcli", "profile", "--help"],
        ["-m", "mxcli", "verify", "--help"],
        ["-m", "mxcli", "run-bdw"],  # a typo: the usage error suggests run-bwd
    ],
)
def test_commands_that_need_no_kernel_import_no_torch(args: list[str]) -> None:
    r, names = _imported(*args)
    assert _kernel_modules(names) == [], r.stderr[-2000:]
    if args[-1] == "run-bdw":
        assert r.returncode == 2 and "Did you mean 'run-bwd'?" in r.stderr
    if args[-1] == "--help" and "profile" in args:
        out = " ".join(r.stdout.split())
        for spec in all_specs():
            assert f"{spec.short} Profile {spec.name} from a file or shape flags." in out


def test_a_generated_command_loads_its_kernel_when_asked_for() -> None:
    """The check above cannot pass by loading nothing ever: ``run-bwd --help`` shows the
    flags read from the spec, which needs the kernel (and torch)."""
    r, names = _imported("-m", "mxcli", "run-bwd", "--help")
    assert r.returncode == 0 and "--block-size <int>" in r.stdout, r.stdout
    assert "torch" in names and _kernel_modules(names)


def test_the_identities_say_what_the_specs_say() -> None:
    """The torch-free listing is the specs' own: every built-in package has an identity
    module, and it equals the loaded spec's name, short name, title and slice parts."""
    assert all(read_identity(spec.package) is not None for spec in all_specs())
    assert kernel_identities() == [KernelIdentity.of(spec) for spec in all_specs()]


def _groups() -> list[tuple[str, LazyCommands]]:
    root = typer.main.get_command(app)
    profile = root.commands["profile"]  # type: ignore[attr-defined]
    return [("", root.commands), ("profile ", profile.commands)]  # type: ignore[attr-defined]


def test_each_listed_help_line_is_the_built_commands_own() -> None:
    """What a group's ``--help`` lists for a command not yet built is what the built command
    says (its help comes from the same function, fed from the identity instead of the spec)."""
    for prefix, commands in _groups():
        names = list(commands)
        pending = [n for n in names if n not in commands.built]
        assert pending, prefix  # the generated ones are not built by listing them
        for name in pending:
            listed = commands.listed(name)
            for limit in (40, 80, 200):
                want = commands[name].get_short_help_str(limit)
                assert listed.get_short_help_str(limit) == want, (prefix + name, limit)
        assert list(commands) == names  # building keeps the order --help shows


def test_a_registration_that_contradicts_its_identity_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "idkern"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "identity.py").write_text('NAME = "id_kernel"\nSHORT = "idk"\nTITLE = "A kernel."\n')
    monkeypatch.syspath_prepend(str(tmp_path))

    def id_kernel(x: object, *, backend: str = "reference") -> object:
        return x

    def spec(short: str) -> KernelSpec:
        return KernelSpec(
            id_kernel,
            short=short,
            tensors=(TensorArg("x", "[N]", ()),),
            scalars=(),
            outputs=("y",),
            validate=lambda *a, **k: None,  # type: ignore[arg-type, return-value]
            package="idkern",
            title="A kernel.",
        )

    assert read_identity("idkern") == KernelIdentity("id_kernel", "idk", "A kernel.", "idkern", ())
    with pytest.raises(TypeError, match="idkern.identity says"):
        register_spec(spec("other"))


TOY_IDENTITY = """
    NAME = "toy_scale"
    SHORT = "toy"
    TITLE = "A toy kernel: y = alpha * x + bias."
"""


def test_a_third_party_kernel_with_an_identity_module_is_listed_without_loading_it(
    tmp_path: Path,
) -> None:
    """``MXCLI_KERNEL_PACKAGES`` kernels are listed too; with an identity module of its own
    a third-party kernel keeps ``mxcli --help`` torch-free (without one it is loaded to be
    listed: tests/cli/test_toy_kernel.py)."""
    _write_toy(tmp_path)
    (tmp_path / "toykern" / "identity.py").write_text(textwrap.dedent(TOY_IDENTITY).lstrip())
    env = {"PYTHONPATH": str(tmp_path), "MXCLI_KERNEL_PACKAGES": "toykern"}
    r, names = _imported("-m", "mxcli", "--help", **env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(n.split(".")[0] in ("torch", "toykern") for n in names)
    assert "run-toy Run toy_scale on an input file." in " ".join(r.stdout.split())
    r, names = _imported("-m", "mxcli", "run-toy", "--help", **env)  # registration agrees
    assert r.returncode == 0 and "Scale factor (kernel API: 3.0)." in " ".join(r.stdout.split())


@pytest.mark.parametrize("args", [["--help"], ["--json", "--help"], ["run-bwd", "--help"],
                                  ["verify", "--suite", "quick", "--backend", "reference"]])  # fmt: skip
def test_a_kernel_package_that_does_not_exist_is_one_line_naming_the_variable(args) -> None:
    """``MXCLI_KERNEL_PACKAGES`` is user input: a package that cannot be imported is one line
    naming the variable, exit 2, never a traceback (listing the commands for ``--help`` runs
    outside a command's body, so the root's entry point reports it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mxcli", *args], capture_output=True, text=True, timeout=300,
        env=_env(MXCLI_KERNEL_PACKAGES="no_such_kernel_pkg"),
    )  # fmt: skip
    line = (
        "MXCLI_KERNEL_PACKAGES: no module 'no_such_kernel_pkg' (expected importable kernel "
        "packages, comma-separated; got 'no_such_kernel_pkg')"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {line}"]
    assert "Traceback" not in proc.stderr
    if "--json" in args:
        assert json.loads(proc.stdout) == {"error": line, "exit_code": 2}
