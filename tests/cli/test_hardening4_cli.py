"""Issue 28, items 8, 11, 12, 14, 17, 18 and 19, through the CLI as fresh processes: NaN/Inf
tokens explained by verify, a closed pipe that is not a failed check, memory refused before a
profile, inspect safe on hostile metadata and whole on exports, output that fits 80 columns, and
profile defaults that every offered kernel runs with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mxcli.inputs import write_inputs
from mxcli.kernels.blockwise_moe.inputs import make_bwd_inputs
from mxcli.kernels.rmsnorm_mx_prefill.inputs import make_prefill_inputs


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env.update(extra)
    return env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _mxcli(*args: object, cwd: Path | None = None, **env: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=cwd,
        timeout=300,
        preexec_fn=_default_sigint,
    )


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _edit(src: Path, dst: Path, edit: Any, meta_edit: Any = None) -> Path:
    """A copy of a safetensors file with `edit(tensors)` applied to its tensors."""
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    if meta_edit is not None:
        meta_edit(meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


# ---- 8. verify --inputs counts NaN/Inf tokens as explained -------------------------------------


def _nonfinite_prefill(tmp_path: Path, value: float) -> tuple[Path, Path]:
    """A prefill input whose token 5 holds one `value`, and its reference run."""
    inp = tmp_path / "in.safetensors"
    write_inputs(
        make_prefill_inputs(seq=64, hidden=512, experts=8, top_k=2, emit_norm_bf16=True, seed=5),
        inp,
    )

    def poison(t: dict[str, torch.Tensor]) -> None:
        h = t["hidden_states"].clone()
        h.reshape(-1, h.shape[-1])[5, 7] = value
        t["hidden_states"] = h

    bad = _edit(inp, tmp_path / "bad.safetensors", poison)
    out = tmp_path / "out.safetensors"
    r = _mxcli("run-prefill", bad, "-o", out, "--allow-nonfinite", "-b", "reference", "-q")
    assert r.returncode == 0, r.stderr
    return bad, out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_verify_inputs_explains_a_nonfinite_token(tmp_path: Path, value: float) -> None:
    bad, out = _nonfinite_prefill(tmp_path, value)
    r = _mxcli("verify", out, "--inputs", bad, "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    tensors = {t["name"]: t for c in json.loads(r.stdout)["cases"] for t in c["tensors"]}
    for name in ("norm_quant_packed.values", "norm_quant_packed.scales", "norm_bf16"):
        assert "1 of 64 tokens with NaN/Inf inputs (explained" in tensors[name]["message"], name


def test_verify_inputs_with_a_nonfinite_token_still_fails_wrong_values(tmp_path: Path) -> None:
    """The NaN token is explained; a wrong value in another token still fails (exit 1)."""
    bad, out = _nonfinite_prefill(tmp_path, float("nan"))

    def flip(t: dict[str, torch.Tensor]) -> None:
        q = t["norm_quant_packed"].view(torch.uint8).clone()
        q[9, :64] ^= 0x80  # token 9's codes change sign
        t["norm_quant_packed"] = q.view(torch.float8_e4m3fn)

    wrong = _edit(out, tmp_path / "wrong.safetensors", flip)
    r = _mxcli("verify", wrong, "--inputs", bad, "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    failed = [t["name"] for c in json.loads(r.stdout)["cases"] for t in c["tensors"]]
    assert "norm_quant_packed.values" in failed


def test_verify_inputs_explains_a_nan_in_the_backward(tmp_path: Path) -> None:
    inp = tmp_path / "in.safetensors"
    write_inputs(
        make_bwd_inputs(
            tokens=128, hidden=256, intermediate=128, experts=2, top_k=2, block_size=128, seed=3
        ),
        inp,
    )

    def poison(t: dict[str, torch.Tensor]) -> None:
        h = t["hidden_states"].clone()
        h[5, 7] = float("nan")
        t["hidden_states"] = h

    bad = _edit(inp, tmp_path / "bad.safetensors", poison)
    out = tmp_path / "out.safetensors"
    r = _mxcli("run-bwd", bad, "-o", out, "--allow-nonfinite", "-b", "reference", "-q")
    assert r.returncode == 0, r.stderr
    r = _mxcli("verify", out, "--inputs", bad, "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "explained by NaN/Inf inputs" in r.stdout


# ---- 12. a closed pipe is not a failed check ----------------------------------------------------


def _closed_pipe(*args: object) -> Any:
    """mxcli writing into a pipe whose reader has already gone (``| head -0``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "mxcli", *map(str, args)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            timeout=300,
            preexec_fn=_default_sigint,
        )
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def run_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("run")
    inp, out = d / "in.safetensors", d / "out.safetensors"
    write_inputs(make_prefill_inputs(seq=32, hidden=512, experts=8, top_k=2, seed=1), inp)
    r = _mxcli("run-prefill", inp, "-o", out, "-b", "reference", "-q")
    assert r.returncode == 0, r.stderr
    return {"in": inp, "out": out}


@pytest.mark.parametrize("json_out", [False, True])
def test_verify_into_a_closed_pipe_keeps_its_exit_code(run_files, json_out: bool) -> None:
    extra = ["--json"] if json_out else []
    r = _closed_pipe("verify", run_files["out"], "--inputs", run_files["in"], *extra)
    assert (r.returncode, r.stderr) == (0, "")


def test_failing_verify_into_a_closed_pipe_exits_1(run_files, tmp_path: Path) -> None:
    def flip(t: dict[str, torch.Tensor]) -> None:
        q = t["norm_quant_packed"].view(torch.uint8).clone()
        q[3, :64] ^= 0x80
        t["norm_quant_packed"] = q.view(torch.float8_e4m3fn)

    wrong = _edit(run_files["out"], tmp_path / "wrong.safetensors", flip)
    r = _closed_pipe("verify", wrong, "--inputs", run_files["in"])
    assert (r.returncode, r.stderr) == (1, "")


def test_inspect_into_a_closed_pipe_exits_0(run_files) -> None:
    r = _closed_pipe("inspect", run_files["out"])
    assert (r.returncode, r.stderr) == (0, "")


def test_bad_input_into_a_closed_pipe_is_still_exit_2(run_files) -> None:
    r = _closed_pipe("verify", run_files["in"], "--inputs", run_files["in"])
    assert r.returncode == 2
    assert "an input file" in _one_error_line(r.stderr)


def test_make_inputs_with_stdout_closed(tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    r = subprocess.run(
        [sys.executable, "-m", "mxcli", "make-inputs", "prefill", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        timeout=300,
        preexec_fn=lambda: (_default_sigint(), os.close(1)),
    )
    assert (r.returncode, r.stderr) == (0, "")
    assert out.stat().st_size > 0
    with safe_open(str(out), framework="pt") as f:  # nothing meant for stdout went into it
        assert "hidden_states" in f.keys()  # noqa: SIM118


# ---- 14. inspect: control characters escaped, long values cut ----------------------------------


def test_inspect_escapes_control_characters_and_cuts_long_values(tmp_path: Path) -> None:
    evil = tmp_path / "evil.safetensors"
    title = "\x1b[2J\x1b[31mred\u202eevil\nline2"
    big = "A" * 1_000_000
    save_file(
        {"x\x1b[2Jname": torch.zeros(2)},
        str(evil),
        metadata={"title": title, "big": big, "k\x07ey": "v"},
    )
    r = _mxcli("inspect", evil, COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert not any(c in r.stdout for c in "\x1b\x07\u202e")  # nothing reaches the terminal raw
    assert r"title    \x1b[2J\x1b[31mred\u202eevil\nline2" in r.stdout
    assert r"k\x07ey" in r.stdout and r"x\x1b[2Jname" in r.stdout
    assert "(1,000,000 characters; --json shows all)" in r.stdout
    assert len(r.stdout) < 5_000
    r = _mxcli("inspect", evil, "--json")
    meta = json.loads(r.stdout)["metadata"]
    assert meta["title"] == title and meta["big"] == big  # --json: whole and exact


# ---- 18. inspect: one layer, every rank; export folders; make-inputs --rank ---------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mxcli.weightprep.synthetic import build_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return build_checkpoint("qwen3_moe", root / "ck", hidden_size=512, num_layers=2).path


@pytest.fixture(scope="module")
def tp2(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "p"
    r = _mxcli("prep-weights", checkpoint, out, "--tp", 2, "-q")
    assert r.returncode == 0, r.stderr
    return out


def test_inspect_layer_shows_that_layer_on_every_rank(tp2: Path) -> None:
    r = _mxcli("inspect", tp2, "--layer", 1, "--no-stats", COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert "layer 0" not in r.stdout and "layers.0." not in r.stdout
    assert "layer 1, rank 0 (rank0/layer_001.safetensors)" in r.stdout
    assert "layer 1, rank 1 (rank1/layer_001.safetensors)" in r.stdout
    assert "rank1/layer_001.safetensors (" in r.stdout  # rank 1's file in detail
    data = json.loads(_mxcli("inspect", tp2, "--layer", 1, "--no-stats", "--json").stdout)
    assert list(data["layers"]) == ["1"]
    assert [d["rank"] for d in data["layer_details"]] == [0, 1]
    assert set(data["layers"]["1"]["rank_tensors"]) == {"0", "1"}
    one = json.loads(_mxcli("inspect", tp2, "--layer", 1, "--rank", 1, "--json").stdout)
    assert [d["rank"] for d in one["layer_details"]] == [1]


@pytest.mark.parametrize("fmt", ["nxdi", "compressed-tensors"])
def test_inspect_export_folder_shows_every_file(checkpoint: Path, tmp_path: Path, fmt) -> None:
    out = tmp_path / "export"
    r = _mxcli("prep-weights", checkpoint, out, "--output-format", fmt, "-q")
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "mxcli-export.json").read_text())
    listed = [f for f in record["result"]["files"] if f.endswith(".safetensors")]
    r = _mxcli("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["kind"] == "export" and data["output_format"] == fmt
    assert [Path(f["path"]).relative_to(out).as_posix() for f in data["files"]] == listed
    # every shard's tensors, not only the first shard's
    names = {t["name"] for f in data["files"] for t in f["tensors"]}
    with safe_open(str(out / listed[-1]), framework="pt") as f:
        assert set(f.keys()) <= names  # noqa: SIM118
    r = _mxcli("inspect", out, COLUMNS="80")
    assert r.returncode == 0 and f"{fmt} export of a qwen3_moe checkpoint" in r.stdout
    assert all(f"{name} (" in r.stdout for name in listed)


def test_make_inputs_weights_rank(tp2: Path, tmp_path: Path) -> None:
    out = tmp_path / "in.safetensors"
    r = _mxcli("make-inputs", "prefill", "--weights", tp2, "--layer", 1, "-o", out, COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert "has 2 ranks; using rank 0" in r.stderr
    assert "layer 1, rank 0 of 2" in r.stdout
    r = _mxcli(
        "make-inputs", "bwd", "--weights", tp2, "--layer", 1, "--rank", 1, "--tokens", 64,
        "-o", out, "--force", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    gen = json.loads(r.stdout)["generator"]
    assert (gen["rank"], gen["ranks"]) == (1, 2)
    with safe_open(str(out), framework="pt") as f:  # rank 1's down_proj slice, not rank 0's
        down = f.get_tensor("down_proj_weight")
    with safe_open(str(tp2 / "rank1" / "layer_001.safetensors"), framework="pt") as f:
        assert torch.equal(down, f.get_tensor("layers.1.down_proj_weight"))
    with safe_open(str(tp2 / "rank0" / "layer_001.safetensors"), framework="pt") as f:
        assert not torch.equal(down, f.get_tensor("layers.1.down_proj_weight"))
    r = _mxcli("make-inputs", "bwd", "--weights", tp2, "--layer", 1, "--rank", 2, "-o", out, "-f")
    assert r.returncode == 2
    assert "rank 2: not in" in _one_error_line(r.stderr)


# ---- 11. profile refuses what cannot fit in memory ---------------------------------------------


@pytest.mark.parametrize("kind", ["prefill", "bwd"])
def test_profile_refuses_what_cannot_fit_in_memory(kind: str) -> None:
    # 1e11 tokens x 7168 x 6 bytes (make-inputs' lower bound): no machine has 4.3 PB
    extra = ["--intermediate", 2048] if kind == "bwd" else []
    r = _mxcli("profile", kind, "--tokens", 10**11, "--hidden", 7168, "--experts", 256, *extra)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "tokens: 100000000000 tokens" in line and "need at least" in line
    assert "available" in line


def test_profile_memory_estimate_is_make_inputs(monkeypatch) -> None:
    """The issue's case, on a 24 GB machine: refused with the figure before any allocation."""
    from mxcli import memory
    from mxcli.errors import InputError
    from mxcli.kernels.rmsnorm_mx_prefill import profile as profiling

    monkeypatch.setattr(memory, "available_bytes", lambda: 24 * 10**9)
    shape = profiling.PrefillShape(1048576, 7168, 256, 8, "noaux_tc", 8, 4, False)
    with pytest.raises(InputError, match=r"need at least 45\.1 GB of memory, 24 GB available"):
        profiling.prefill_inputs(shape)


# ---- 19. profile prefill: the kernel API's defaults, which every offered kernel runs -----------


def _nkilib_fork(root: Path) -> Path:
    """A package ``nkilib`` whose ``core.rmsnorm.rmsnorm_mx_prefill`` is the test-time fork
    (`tests.kernels.forks`): ``--kernel nkilib`` with ``--kernel-path root``."""
    from tests.kernels.forks import write_prefill_fork

    spec = write_prefill_fork(root / "forks", "nkifork")
    src = root / "forks" / Path(*spec.split(":")[0].split("."))
    core = root / "src" / "nkilib" / "core"
    core.mkdir(parents=True)
    for d in (core.parent, core):
        (d / "__init__.py").write_text("")
    (core / "rmsnorm.py").write_text(src.with_suffix(".py").read_text())
    return root / "src"


@pytest.mark.parametrize("kernel", ["mxcli", "nkilib", "MODULE:FUNCTION"])
def test_profile_prefill_runs_every_kernel_with_its_defaults(tmp_path: Path, kernel: str) -> None:
    from tests.kernels.forks import write_prefill_fork

    path: list[object] = []
    if kernel == "nkilib":
        path = ["--kernel-path", _nkilib_fork(tmp_path)]
    elif kernel == "MODULE:FUNCTION":
        kernel = write_prefill_fork(tmp_path / "src", "mxfork_defaults")
        path = ["--kernel-path", tmp_path / "src"]
    r = _mxcli("profile", "prefill", "--tokens", 128, "--hidden", 512, "--experts", 16,
               "--lnc", 1, "--kernel", kernel, *path, "--json")  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    s = json.loads(r.stdout)
    assert s["nki_kernel"]["kernel"] == kernel
    # the kernel API's defaults (api/rmsnorm_mx_prefill.txt): top_k 1, SIGMOID, 1 group, 1 kept,
    # no packed affinities
    assert {k: s["shape"][k] for k in ("top_k", "router_act", "n_group", "topk_group",
                                       "pack_affinities")} == {
        "top_k": 1, "router_act": "sigmoid", "n_group": 1, "topk_group": 1,
        "pack_affinities": False,
    }  # fmt: skip


def test_profile_help_names_the_api_defaults() -> None:
    from mxcli.kernels.rmsnorm_mx_prefill import rmsnorm_mx_prefill

    api = __import__("inspect").signature(rmsnorm_mx_prefill).parameters
    text = " ".join(_mxcli("profile", "prefill", "--help").stdout.split())
    for flag, value in (
        ("--top-k", api["top_k"].default),
        ("--router-act", api["router_act_fn"].default.name.lower()),
        ("--n-group", api["n_group"].default),
        ("--topk-group", api["topk_group"].default),
    ):
        assert f"[default: {value}]" in text.split(flag, 1)[1].split(" --", 1)[0], flag
    assert not api["pack_affinities"].default
    assert "[default: no-pack-affinities]" in text
    text = " ".join(_mxcli("profile", "bwd", "--help").stdout.split())
    assert "the kernel API's default: 4096" in text


# ---- 17. one tool at 80 columns ------------------------------------------------------------------


def _fits(text: str, width: int = 80) -> list[str]:
    """Lines wider than `width` that could have been broken (more than one word after the
    indentation: a single long path or name is never broken)."""
    return [ln for ln in text.splitlines() if len(ln) > width and len(ln.split()) > 1]


def test_kernel_line_fits_80_columns(run_files, tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    r = _mxcli("run-prefill", run_files["in"], "-o", out, "-b", "sim", COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert "kernel: mxcli rmsnorm_mx_prefill" in r.stdout and "sha256" in r.stdout
    assert _fits(r.stdout.replace(str(out), "OUT")) == []
    r = _mxcli("profile", "prefill", "--tokens", 128, "--hidden", 512, "--experts", 8,
               "--lnc", 1, COLUMNS="80")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "  kernel: mxcli rmsnorm_mx_prefill" in r.stdout and _fits(r.stdout) == []


@pytest.mark.parametrize("fmt", ["nxdi", "compressed-tensors"])
def test_export_summary_fits_80_columns(checkpoint: Path, tmp_path: Path, fmt: str) -> None:
    r = _mxcli("prep-weights", checkpoint, "out", "--output-format", fmt, "--check",
               COLUMNS="80", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert _fits(r.stdout) == [], r.stdout
    if fmt == "nxdi":
        assert "note: world rank r = ep_rank * tp + tp_rank" in r.stdout
    else:  # what changed relative to what
        assert " values differ from the bf16 source, worst SQNR" in " ".join(r.stdout.split())
        assert "MXFP8 changed" not in r.stdout


def test_prep_weights_check_prints_no_meaningless_rate(checkpoint: Path, tmp_path: Path) -> None:
    r = _mxcli("prep-weights", checkpoint, "out", "--check", COLUMNS="80", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "GB/s" not in r.stdout and "(with --check)" in r.stdout
    assert "MXFP8 values differ from the source's" in " ".join(r.stdout.split())
    assert _fits(r.stdout) == []


def test_verify_help_says_each_sentence_once() -> None:
    r = _mxcli("verify", "--help", COLUMNS="80")
    text = " ".join(r.stdout.split())
    assert text.count("OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full") == 1


def _tty(args: list[object], env: dict[str, str], cwd: Path) -> tuple[int, bytes]:
    """mxcli on a pseudo-terminal 80 columns wide; the exit code and the raw bytes shown."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 80, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    code = proc.wait(timeout=300)
    os.close(master)
    return code, b"".join(chunks)


def _locale_env(lang: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in _env().items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8"))}
    return {**env, "LANG": lang, "TERM": "xterm-256color", "COLUMNS": "80", **extra}


def _has_locale(name: str) -> bool:
    import locale

    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, name)
    except locale.Error:
        return False
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    return True


def test_lang_c_progress_is_ascii(checkpoint: Path, tmp_path: Path) -> None:
    code, shown = _tty(["prep-weights", checkpoint, "c"], _locale_env("C"), tmp_path)
    assert code == 0, shown
    assert b"prep-weights" in shown and max(shown) < 0x80, shown  # the bar, in ASCII
    code, shown = _tty(["prep-weights", checkpoint, "utf"], _locale_env("C.UTF-8"), tmp_path)
    assert code == 0
    if _has_locale("C.UTF-8"):  # a UTF-8 terminal keeps rich's glyphs
        assert "━".encode() in shown


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sim_with_a_nonfinite_input_prints_no_numpy_warning(tmp_path: Path, value) -> None:
    """Inf * 0 in the interpreter's arithmetic: numpy's 'invalid value' warning is noise."""
    bad, _ = _nonfinite_prefill(tmp_path, value)
    out = tmp_path / "sim.safetensors"
    r = _mxcli("run-prefill", bad, "-o", out, "--allow-nonfinite", "-b", "sim", "-q")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_numba_cache_falls_back_when_no_folder_is_writable(monkeypatch) -> None:
    """No writable cache folder (read-only install, read-only home): compiled per process."""
    import numba.core.caching as caching

    from mxcli.jit import njit_cached

    def refuse(self: Any) -> None:
        raise PermissionError(13, "Read-only file system", self.get_cache_path())

    monkeypatch.setattr(caching._CacheLocator, "ensure_cache_path", refuse)

    def plus_one(x: int) -> int:
        return x + 1

    fn = njit_cached()(plus_one)
    assert fn(41) == 42 and type(fn._cache).__name__ == "NullCache"


def test_numba_compile_is_said_once_on_a_terminal(monkeypatch, tmp_path) -> None:
    import io

    import numba

    from mxcli import jit

    # a fresh on-disk cache: these throwaway functions must compile here, not load an earlier
    # run's entry (numba reads CACHE_DIR when it locates a function's cache)
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setitem(jit._STATE, "said", False)

    def twice(x: int) -> int:
        return 2 * x

    def thrice(x: int) -> int:
        return 3 * x

    for f in (twice, thrice):
        f.__module__ = "mxcli.test_fake"  # one of mxcli's kernels, for the listener
        assert jit.njit_cached()(f)(2) in (4, 6)
    assert err.getvalue() == jit._NOTE + "\n"


@pytest.mark.slow
def test_first_reference_run_says_it_compiles_then_uses_the_cache(run_files, tmp_path) -> None:
    cache = tmp_path / "numba"
    cache.mkdir()
    env = _locale_env("C.UTF-8", NUMBA_CACHE_DIR=str(cache))
    args = ["run-prefill", run_files["in"], "-o", "o.safetensors", "-b", "reference", "-q", "-f"]
    code, first = _tty(args, env, tmp_path)
    assert code == 0 and first.decode().count("note: compiling numba kernels") == 1, first
    assert any(cache.rglob("*.nbi"))
    code, second = _tty(args, env, tmp_path)
    assert code == 0 and b"compiling" not in second, second
