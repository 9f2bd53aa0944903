"""The CLI's root (issue 32): the global flags are declared and parsed once, by the root, and
accepted before or after the command's name; the one error boundary lives there too; the
package uses no private module of typer or click. Through fresh processes, as a user runs it."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mxcli
from tests import procs

ROOT = Path(mxcli.__file__).resolve().parent

# every command, as a user types it (profile's are a group's)
COMMANDS = [
    ["prep-weights"], ["make-inputs"], ["run-prefill"], ["run-bwd"], ["verify"], ["inspect"],
    ["profile", "prefill"], ["profile", "bwd"], ["demo"], ["emulate"],
]  # fmt: skip
# the commands that write an output, and so take --force
WRITERS = {"prep-weights", "make-inputs", "run-prefill", "run-bwd", "verify", "profile prefill",
           "profile bwd", "demo", "emulate"}  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env.update(COLUMNS="100", **extra)
    return env


def _mxcli(*args: object, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=300,
    )


# ------------------------------------------------------------------ the flags in both places


@pytest.mark.parametrize(
    "before,after",
    [
        (["--json", "verify", "--suite", "quick", "--list"],
         ["verify", "--suite", "quick", "--list", "--json"]),
        (["-q", "--json", "verify", "--suite", "quick", "--list"],
         ["verify", "--json", "--suite", "quick", "--list", "-q"]),
    ],
)  # fmt: skip
def test_global_flags_before_or_after_the_command(before: list[str], after: list[str]) -> None:
    a, b = _mxcli(*before), _mxcli(*after)
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout
    rows = json.loads(a.stdout)
    assert rows[0]["case"].startswith("prefill/") and {"case", "kernel", "quick"} <= set(rows[0])


def test_a_user_error_as_json_from_either_position(tmp_path: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    expected = {"error": f"{missing}: no such file", "exit_code": 2}
    for args in (
        ["--json", "verify", missing, "--golden", missing],
        ["verify", missing, "--golden", missing, "--json"],
        ["verify", "--json", missing, "--golden", missing],
    ):
        r = _mxcli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert json.loads(r.stdout) == expected, args
        assert r.stderr == f"error: {missing}: no such file\n"


def test_a_usage_error_as_json_from_either_position() -> None:
    for args in (["--json", "verify", "--bogus"], ["verify", "--bogus", "--json"]):
        r = _mxcli(*args)
        assert r.returncode == 2, (args, r.stderr)
        message = "No such option: --bogus (see 'mxcli verify --help')"
        assert json.loads(r.stdout) == {"error": message, "exit_code": 2}
        assert r.stderr == f"error: {message}\n"


def test_global_flags_reach_a_command_of_a_group() -> None:
    """``profile`` is a group: the flags work before it, between it and its command, and
    after; the error is one JSON line each time."""
    expected = {"error": "hidden: --hidden is required without an input file", "exit_code": 2}
    for args in (
        ["--json", "profile", "prefill", "--tokens", "128"],
        ["profile", "--json", "prefill", "--tokens", "128"],
        ["profile", "prefill", "--tokens", "128", "--json"],
    ):
        r = _mxcli(*args)
        assert r.returncode == 2 and json.loads(r.stdout) == expected, (args, r.stderr)


def test_quiet_from_either_position_silences_the_listing() -> None:
    loud = _mxcli("verify", "--suite", "quick", "--list")
    assert loud.returncode == 0 and "prefill/" in loud.stdout
    # --list prints the names even with --quiet (it is what was asked); --quiet silences a
    # report: a checkpoint verify that passes prints nothing
    for args in (["-q", "verify", "--suite", "quick", "--list"],
                 ["verify", "--suite", "quick", "--list", "--quiet"]):  # fmt: skip
        r = _mxcli(*args)
        assert r.returncode == 0 and r.stdout == loud.stdout


# ------------------------------------------------------------------ --debug


@pytest.mark.parametrize(
    "args,env",
    [
        (["--debug", "verify", "{m}", "--golden", "{m}"], {}),
        (["verify", "{m}", "--golden", "{m}", "--debug"], {}),
        (["verify", "{m}", "--golden", "{m}"], {"MXCLI_DEBUG": "1"}),
    ],
)
def test_debug_lets_the_traceback_through(tmp_path: Path, args: list[str], env: Any) -> None:
    missing = str(tmp_path / "missing.safetensors")
    r = _mxcli(*(a.format(m=missing) for a in args), **env)
    assert r.returncode == 1, r.stderr  # an uncaught exception: Python's own exit code
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == (
        f"mxcli.errors.InputError: {missing}: no such file"
    )


def test_without_debug_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.safetensors"
    for env in ({}, {"MXCLI_DEBUG": "0"}):
        r = _mxcli("verify", missing, "--golden", missing, **env)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: {missing}: no such file\n")


def test_an_interrupt_is_one_line_through_the_root_boundary(tmp_path: Path) -> None:
    """Ctrl-C inside a command: one line from the root's boundary, exit 130 (the command's
    own hint comes through the context object: prep-weights names --resume elsewhere)."""
    import torch
    from safetensors.torch import save_file

    f = tmp_path / "t.safetensors"
    save_file({"x": torch.zeros(2)}, str(f))
    p = procs.start(["inspect", f], mode="signal-after=mxcli.inspection:inspect_path:SIGINT")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, err
    assert err == "error: interrupted (Ctrl-C); no output was written\n"


# ------------------------------------------------------------------ help


def _option_rows(help_text: str) -> list[str]:
    """The option names of a help's Options section (``-q, --quiet``, ``--json``, ...)."""
    rows = []
    for line in help_text.splitlines():
        m = re.match(r"^  (-\w, )?(--[\w-]+(/--[\w-]+)?)", line)
        if m:
            rows.append(m.group(2))
    return rows


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_each_help_lists_the_global_flags_once(command: list[str]) -> None:
    r = _mxcli(*command, "--help")
    assert r.returncode == 0, r.stderr
    rows = _option_rows(r.stdout)
    for flag in ("--json", "--quiet", "--debug", "--help"):
        assert rows.count(flag) == 1, (flag, rows)
    assert "-q, --quiet" in r.stdout
    # --force only where the command writes something
    assert rows.count("--force") == (1 if " ".join(command) in WRITERS else 0), rows
    # the description: each sentence once
    head = r.stdout.split("\nArguments:")[0].split("\nOptions:")[0]
    sentences = [s for s in re.split(r"(?<=\.)\s+", " ".join(head.split()[1:])) if s]
    assert len(sentences) == len(set(sentences)), sentences


def test_root_help_lists_the_global_flags() -> None:
    r = _mxcli("--help")
    rows = _option_rows(r.stdout)
    assert r.returncode == 0 and [f for f in rows if f in ("--json", "--quiet", "--debug")] == [
        "--json",
        "--quiet",
        "--debug",
    ]


def test_inspect_takes_no_force(tmp_path: Path) -> None:
    r = _mxcli("inspect", tmp_path, "--force")
    assert r.returncode == 2
    assert r.stderr == "error: No such option: --force (see 'mxcli inspect --help')\n"


# ------------------------------------------------------------------ no private typer / click


def _private(name: str) -> bool:
    parts = name.split(".")
    return parts[0] in ("typer", "click") and any(p.startswith("_") for p in parts[1:])


def test_the_package_imports_nothing_private_from_typer_or_click() -> None:
    """typer >= 0.20 runs its own private copy of click (``typer._click``), older typer runs
    click itself: a private module may be absent from any version the floor admits (typer
    0.12's has no ``typer._click``). Import statements and module names in strings
    (``importlib.import_module("typer._click.exceptions")``) both count."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if re.fullmatch(r"[\w.]+", node.value) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if _private(n)]  # type: ignore[attr-defined]
    assert found == []


def test_the_private_module_check_sees_a_private_import() -> None:
    assert _private("typer._click.formatting") and _private("click._compat")
    assert not _private("typer.core") and not _private("click.exceptions")
