"""The CLI as a person meets it (#18, items 12-18): help screens, names, error hints and
screens at 80 columns. Every test runs mxcli as a fresh process, through a pseudo-terminal
where the terminal's width matters."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch

from mxcli.io.files import write_file
from mxcli.kernels.spec import read_kernel_file as read_file

_MAIN = "import sys; from mxcli.cli import main; sys.argv = ['mxcli', *sys.argv[1:]]; main()"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
JOURNEY = ["prep-weights", "make-inputs", "run-prefill", "run-bwd", "verify", "inspect",
           "profile", "demo", "emulate"]  # fmt: skip


def _env(columns: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return env


def run(
    *args: object, columns: int | None = 80, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """mxcli in a fresh process, stdout and stderr piped (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-c", _MAIN, *map(os.fspath, args)],  # type: ignore[arg-type]
        env=_env(columns),
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=300,
    )


def run_tty(
    *args: object, columns: int = 80, cwd: Path | None = None, timeout: float = 300
) -> tuple[int, list[str]]:
    """mxcli in a fresh process on a pseudo-terminal `columns` wide (stdout and stderr both);
    returns the exit code and the screen's lines as a person reads them: escape codes removed,
    each carriage-return redraw a line of its own. (Give `cwd` and short relative paths: a
    pytest temporary path alone can be wider than 80 columns.)"""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**_env(columns), "TERM": "xterm-256color"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN, *map(os.fspath, args)],  # type: ignore[arg-type]
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True, cwd=cwd,
    )  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []
    t0 = time.monotonic()
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out")
    code = proc.wait(timeout=timeout)
    os.close(master)
    text = _ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    lines = [piece for line in text.split("\n") for piece in line.split("\r")]
    return code, [line.rstrip() for line in lines if line.strip()]


def _too_wide(lines: list[str], columns: int = 80) -> list[str]:
    """Lines wider than the terminal, not counting a file path (a pytest temporary path alone
    can be wider than 80 columns, and a path is never broken)."""

    def width(line: str) -> int:
        paths = [w for w in re.split(r"[\s()]+", line) if w.startswith(("/", "."))]
        return len(line) - max([0, *(len(p) - 8 for p in paths)])

    return [line for line in lines if width(line) > columns]


def _one_line_error(r: subprocess.CompletedProcess[str], *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prep-weights folder of a tiny Qwen3-MoE checkpoint (E=8, top_k=2, H=512, I=128)."""
    from mxcli.weightprep import PrepOptions, build_checkpoint, prepare_weights

    d = tmp_path_factory.mktemp("surface")
    ck = build_checkpoint(
        "qwen3_moe", d / "hf", hidden_size=512, intermediate_size=128, num_experts=8, top_k=2
    )
    prepare_weights(ck.path, d / "out", PrepOptions(layers="0"))
    return d / "out"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mxcli.weightprep import build_checkpoint

    d = tmp_path_factory.mktemp("surface_ck")
    return build_checkpoint("qwen3_moe", d / "hf", hidden_size=256, intermediate_size=128).path


# ---------------------------------------------------------------- 16: mxcli --help


def _commands_section(lines: list[str]) -> list[tuple[str, str]]:
    start = lines.index("Commands:")
    rows = []
    for line in lines[start + 1 :]:
        parts = line.split(None, 1)
        if line.startswith("  ") and len(parts) == 2 and not line.startswith("    "):
            rows.append((parts[0], parts[1]))
    return rows


@pytest.mark.parametrize("columns", [80, pytest.param(100, marks=pytest.mark.slow), 120])
def test_help_lists_the_journey_in_order_with_whole_summaries(columns: int) -> None:
    code, lines = run_tty("--help", columns=columns)
    assert code == 0
    rows = _commands_section(lines)
    assert [name for name, _ in rows] == JOURNEY
    for name, summary in rows:
        assert not summary.endswith("..."), (name, summary)
        assert summary.endswith("."), (name, summary)  # a whole sentence, not a cut one
    assert not _too_wide(lines, columns)


USAGE = {
    ("prep-weights",): "Usage: mxcli prep-weights [OPTIONS] SOURCE [OUTPUT]",
    ("make-inputs",): "Usage: mxcli make-inputs [OPTIONS] {prefill|bwd}",
    ("run-prefill",): "Usage: mxcli run-prefill [OPTIONS] INPUT",
    ("run-bwd",): "Usage: mxcli run-bwd [OPTIONS] INPUT",
    ("verify",): "Usage: mxcli verify [OPTIONS] [OUTPUT]",
    ("inspect",): "Usage: mxcli inspect [OPTIONS] PATH",
    ("profile",): "Usage: mxcli profile [OPTIONS] [COMMAND [ARGS]...]",
    ("profile", "prefill"): "Usage: mxcli profile prefill [OPTIONS] [INPUT]",
    ("profile", "bwd"): "Usage: mxcli profile bwd [OPTIONS] [INPUT]",
    ("demo",): "Usage: mxcli demo [OPTIONS]",
}


@pytest.mark.parametrize("command", list(USAGE), ids=" ".join)
def test_every_help_screen_is_conventional_and_fits_80_columns(command: tuple[str, ...]) -> None:
    code, lines = run_tty(*command, "--help")
    assert code == 0
    assert lines[0] == USAGE[command]
    assert not _too_wide(lines), _too_wide(lines)
    text = "\n".join(lines)
    assert "{source}" not in text and "{input}" not in text and "{path}" not in text
    # click breaks lines at hyphens by default: "run-" / "prefill", "--" / "weights"
    assert not [line for line in lines if re.search(r"[a-z]-$", line)], text
    args = lines.index("Arguments:") + 1 if "Arguments:" in lines else None
    if args is not None:  # argument rows named as in the usage line
        assert lines[args].split()[0] in lines[0].replace("[", " ").replace("]", " ").split()
        assert "<" not in lines[args].split()[1], lines[args]  # no "source <str>"


def test_profile_subcommand_summaries_are_whole() -> None:
    code, lines = run_tty("profile", "--help")
    assert code == 0
    rows = _commands_section(lines)
    assert [n for n, _ in rows] == ["prefill", "bwd"]  # calibrating is `profile --calibrate`
    assert all(s.endswith(".") and not s.endswith("...") for _, s in rows), rows


# ---------------------------------------------------------------- 13: usage error hints


@pytest.mark.parametrize(
    "args,hint",
    [
        (["profile", "prefill", "--bogus"], "see 'mxcli profile prefill --help'"),
        (["profile", "bwd", "--top-k", "x"], "see 'mxcli profile bwd --help'"),
        (["profile", "bogus"], "see 'mxcli profile --help'"),
        (["make-inputs", "--bogus"], "see 'mxcli make-inputs --help'"),
        (["prep-weights"], "Missing argument 'SOURCE'"),
        (["bogus"], "see 'mxcli --help'"),
    ],
)
def test_usage_errors_name_the_whole_command_path(args: list[str], hint: str) -> None:
    _one_line_error(run(*args), hint)


# ---------------------------------------------------------------- 17: one name per concept


def test_one_spelling_per_flag_across_commands() -> None:
    helps = {c: " ".join(run(*c.split(), "--help").stdout.split()) for c in
             ("profile prefill", "profile bwd", "make-inputs", "prep-weights", "run-prefill",
              "run-bwd")}  # fmt: skip
    assert "--router-act" in helps["profile prefill"]
    assert not re.search(r"--router\b(?!-)", helps["profile prefill"])
    assert "--routing" in helps["make-inputs"]
    assert not re.search(r"--router\b(?!-)", helps["make-inputs"])
    assert "-f, --force" in helps["prep-weights"]
    for c in ("profile prefill", "profile bwd"):
        assert "-q, --quiet" in helps[c] and "-f, --force" in helps[c]
    # defaults that follow the kernel API say so where another command's default differs
    assert (
        "kernel API: 1)" in helps["run-prefill"] and "kernel API: sigmoid)" in helps["run-prefill"]
    )
    assert "kernel API: 4096)" in helps["run-bwd"]
    assert "kernel API's default: 1" in helps["make-inputs"]
    assert "kernel API's default: 4096" in helps["make-inputs"]


# ---------------------------------------------------------------- 14: make-inputs --weights


@pytest.mark.parametrize(
    "kind,flags,words",
    [
        ("prefill", ["--top-k", "5"], ["top_k", "--top-k 5", "expected 2"]),
        pytest.param(
            "prefill",
            ["--router-act", "sigmoid"],
            ["router_act", "--router-act sigmoid", "softmax"],
            marks=pytest.mark.slow,
        ),
        ("prefill", ["--hidden", "1024"], ["hidden", "--hidden 1024", "expected 512"]),
        pytest.param(
            "prefill",
            ["--experts", "16"],
            ["experts", "--experts 16", "expected 8"],
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "bwd",
            ["--intermediate", "256"],
            ["intermediate", "--intermediate 256", "expected 128"],
            marks=pytest.mark.slow,
        ),
        ("bwd", ["--routing", "prefill"], ["routing", "--routing", "--weights"]),
    ],
)
def test_make_inputs_refuses_flags_that_contradict_the_weights(
    prepared: Path, tmp_path: Path, kind: str, flags: list[str], words: list[str]
) -> None:
    out = tmp_path / "in.safetensors"
    r = run("make-inputs", kind, "--weights", prepared, "--layer", "0", *flags, "-o", out)
    _one_line_error(r, *words)
    assert not out.exists()


def test_make_inputs_accepts_flags_that_repeat_the_weights(prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "in.safetensors"
    r = run("make-inputs", "prefill", "--weights", prepared, "--layer", "0", "--top-k", "2",
            "--router-act", "SOFTMAX", "--hidden", "512", "--experts", "8", "--emit-norm-bf16",
            "--tokens", "128", "-o", out, "-q")  # fmt: skip
    assert r.returncode == 0, r.stderr
    kwargs = json.loads(read_file(out).metadata["kwargs"])
    assert (kwargs["top_k"], kwargs["router_act_fn"]) == (2, "SOFTMAX")
    assert kwargs["emit_norm_bf16"] is True  # an output kwarg, not a fact of the layer: applies


# ---------------------------------------------------------------- 15: flags that do nothing


@pytest.mark.parametrize(
    "args,words",
    [
        (["make-inputs", "prefill", "--prequantize"], ["prequantize", "--prequantize", "bwd"]),
        (["make-inputs", "prefill", "--block-size", "256"], ["block_size", "--block-size"]),
        (["make-inputs", "bwd", "--router-act", "sigmoid"], ["router_act", "prefill only"]),
        (["make-inputs", "bwd", "--scale-layout", "unpacked"],
         ["scale_layout", "--scale-layout", "--prequantize"]),
    ],
)  # fmt: skip
def test_make_inputs_refuses_flags_that_do_nothing(
    tmp_path: Path, args: list[str], words: list[str]
) -> None:
    out = tmp_path / "in.safetensors"
    _one_line_error(run(*args, "-o", out), *words)
    assert not out.exists()


def test_prep_weights_refuses_dry_run_check_and_empty_layers(checkpoint: Path) -> None:
    _one_line_error(run("prep-weights", checkpoint, "--dry-run", "--check"), "--check", "--dry-run")
    _one_line_error(run("prep-weights", checkpoint, "--dry-run", "--layers", ""), "--layers", "''")


def test_a_missing_checkpoint_is_named_as_the_io_contract_names_it(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    f = read_file(files["bwd"])
    tensors = {k: v for k, v in f.tensors.items() if k != "gate_up_proj_act_checkpoint_T"}
    src = tmp_path / "no_ckpt.safetensors"
    write_file(src, tensors, f.metadata)
    line = _one_line_error(
        run("run-bwd", src, "-o", tmp_path / "o.safetensors", "-b", "reference"),
        "gate_up_proj_act_checkpoint_T",
    )
    assert line.startswith("error: gate_up_proj_act_checkpoint_T:"), line


# ---------------------------------------------------------------- 12: non-UTF-8 paths


def test_files_at_non_utf8_paths_just_work(tmp_path: Path, files: dict[str, Path]) -> None:
    src = Path(os.fsdecode(os.fsencode(tmp_path) + b"/in\xff.safetensors"))
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/out\xfe.safetensors"))
    shutil.copy(files["prefill"], src)
    r = run("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    assert {t["name"] for t in json.loads(r.stdout)["tensors"]} >= {"hidden_states", "gamma"}
    r = run("run-prefill", src, "-o", out, "-b", "reference", "-q")
    assert r.returncode == 0, r.stderr
    got, want = read_file(out), read_file(files["prefill_out"])
    assert got.metadata["input_file"] == "in\\xff.safetensors"  # metadata is UTF-8
    for name, t in want.tensors.items():  # the same bytes as from a plain path
        assert got.tensors[name].view(torch.uint8).equal(t.view(torch.uint8)), name


@pytest.mark.slow
def test_prepared_folder_at_a_non_utf8_path(prepared: Path, tmp_path: Path) -> None:
    folder = Path(os.fsdecode(os.fsencode(tmp_path) + b"/prep\xff"))
    shutil.copytree(prepared, folder)
    r = run("inspect", folder, "--layer", "0", "--no-stats", "--json")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "in.safetensors"
    r = run("make-inputs", "prefill", "--weights", folder, "--layer", "0", "-o", out, "-q")
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- 18: screens at 80 columns


def test_inspect_shows_whole_distinct_names_at_80_columns(prepared: Path) -> None:
    layer_file = next((prepared / "rank0").glob("*.safetensors")).relative_to(prepared)
    code, lines = run_tty("inspect", layer_file, cwd=prepared)
    assert code == 0
    assert not _too_wide(lines), _too_wide(lines)
    names = [line.split()[0] for line in lines if line.startswith("  layers.0.")]
    assert "layers.0.gate_up_proj_weight" in names
    assert "layers.0.gate_up_proj_weight_mxfp8" in names
    row: dict[str, list[str]] = {}
    for line in lines:  # the tensors table comes first (then the values table)
        if line.startswith("  layers.0."):
            row.setdefault(line.split()[0], line.split())
    assert row["layers.0.gate_up_proj_weight"][1] == "BF16"
    assert row["layers.0.gate_up_proj_weight_mxfp8"][1] == "U32"
    code, lines = run_tty("inspect", ".", "--layer", "0", "--no-stats", cwd=prepared)
    assert code == 0 and not _too_wide(lines), _too_wide(lines)
    assert "gate_up_proj_weight_mxfp8" in [line.split()[0] for line in lines if line.strip()]


def test_inspect_input_hashes_fit_in_two_lines(files: dict[str, Path]) -> None:
    code, lines = run_tty("inspect", files["prefill_out"].name, cwd=files["prefill_out"].parent)
    assert code == 0 and not _too_wide(lines), _too_wide(lines)
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("input_sha256"))
    block = [lines[i]] + [x for x in lines[i + 1 : i + 4] if x.startswith("      ")]
    assert len(block) <= 2, block
    assert all(f"{name}=" in " ".join(block) for name in ("hidden_states", "gamma"))
    assert not any(re.search(r"[0-9a-f]{40}", line) for line in lines)  # no 64-digit walls


def test_profile_top_source_lines_keep_file_and_line_on_their_row() -> None:
    # --router-act: the name make-inputs and run-prefill use (was --router here)
    code, lines = run_tty("profile", "prefill", "--tokens", "128", "--hidden", "512",
                          "--experts", "8", "--top-k", "2", "--router-act", "softmax")  # fmt: skip
    assert code == 0
    assert not _too_wide(lines), _too_wide(lines)
    rows = [line for line in lines if re.search(r"\d us +\d", line)]
    assert len(rows) >= 5
    assert all(re.search(r"\.py:\d+$", row) for row in rows), rows
    assert not [line for line in lines if re.fullmatch(r"\s*\S+\.py:\d+", line)]


def test_prep_weights_progress_fits_and_stays_off_pipes(checkpoint: Path, tmp_path: Path) -> None:
    r = run("prep-weights", checkpoint, tmp_path / "piped", "--layers", "0", columns=None)
    assert r.returncode == 0, r.stderr
    assert "━" not in r.stderr and "prep-weights 0/1" not in r.stderr, r.stderr  # no bar in a pipe
    # the layer's rate in the unit that shows it (issue 28: never "0.00 GB/s")
    assert re.search(r"^layer 0: .* [1-9][0-9.]* [kMGT]?B/s$", r.stderr, re.M), r.stderr
    code, lines = run_tty("prep-weights", checkpoint, "tty", "--layers", "0", cwd=tmp_path)
    assert code == 0
    assert not _too_wide(lines), _too_wide(lines)
    assert any(line.startswith("layer 0: ") and line.endswith("B/s") for line in lines), lines
    assert any(line.startswith("prep-weights 0/1 layers ") for line in lines), lines  # the bar
