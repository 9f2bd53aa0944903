"""Issue 18, items 4-11, through the CLI as fresh processes: a verify gate that cannot pass on
nothing, no file lost, replaced or left behind (profile --trace, racing writers, full disks),
prepared weights checked against their manifest, and one line instead of a traceback (an empty
prefill, a size that cannot fit in memory, an out-of-range --seed)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests import procs


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}


def _preexec(fsize: int | None) -> Any:
    def run() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if fsize is not None:  # a full disk, as the kernel reports it: EFBIG past `fsize` bytes
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return run


def _mxcli(*args: object, cwd: Path | None = None, fsize: int | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=300,
        preexec_fn=_preexec(fsize),
    )


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _subset(src: Path, dst: Path, keep: list[str]) -> Path:
    """An output file holding only the tensors `keep` of `src`, with its metadata."""
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in keep}
    save_file(tensors, str(dst), metadata=meta)
    return dst


# ---- 4. a verify gate that cannot pass on nothing ----------------------------------------------


@pytest.mark.parametrize("kind", ["bwd", "prefill"])
def test_verify_input_file_given_as_output_is_one_line(files, kind) -> None:
    r = _mxcli("verify", files[kind], "--inputs", files[kind])
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert str(files[kind]) in line and "an input file" in line and "output file" in line
    assert "PASSED" not in r.stdout


def test_verify_output_file_given_as_inputs_is_one_line(files) -> None:
    r = _mxcli("verify", files["prefill_out"], "--inputs", files["prefill_out"])
    assert r.returncode == 2, r.stderr
    assert "an output file" in _one_error_line(r.stderr)


def _failed(stdout: str) -> dict[str, str]:
    data = json.loads(stdout)
    return {t["name"]: t["message"] for c in data["cases"] for t in c["tensors"] if not t["passed"]}


def test_verify_inputs_fails_on_a_missing_output(files, tmp_path: Path) -> None:
    """A bwd output holding only down_proj_weight_grad: the three other gradients are named as
    missing, exit 1 (it passed with 1 check)."""
    only = _subset(files["bwd_out"], tmp_path / "only.safetensors", ["down_proj_weight_grad"])
    r = _mxcli("verify", only, "--inputs", files["bwd"], "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    failed = _failed(r.stdout)
    assert set(failed) == {
        "hidden_states_grad",
        "expert_affinities_masked_grad",
        "gate_up_proj_weight_grad",
    }
    assert all("missing" in m and "only.safetensors" in m for m in failed.values())


def test_verify_inputs_fails_on_no_outputs(files, tmp_path: Path) -> None:
    """An output file with no tensor at all (prefill: norm_quant_packed and the router's
    outputs are missing); it must not crash on the absent packed rows either."""
    none = _subset(files["prefill_out"], tmp_path / "none.safetensors", [])
    r = _mxcli("verify", none, "--inputs", files["prefill"], "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    failed = _failed(r.stdout)
    assert {"norm_quant_packed", "expert_index", "expert_affinities", "norm_bf16"} <= set(failed)


def test_verify_golden_without_outputs_fails(files, tmp_path: Path) -> None:
    """A golden missing outputs cannot make a comparison pass on what is left."""
    only = _subset(files["bwd_out"], tmp_path / "only.safetensors", ["down_proj_weight_grad"])
    r = _mxcli("verify", files["bwd_out"], "--golden", only, "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    failed = _failed(r.stdout)
    assert set(failed) == {
        "hidden_states_grad",
        "expert_affinities_masked_grad",
        "gate_up_proj_weight_grad",
    }
    assert all("missing in the golden" in m for m in failed.values())


# ---- 5. profile --trace onto its input ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["prefill", "bwd"])
def test_profile_trace_refuses_the_input(files, tmp_path: Path, kind) -> None:
    inp = tmp_path / "in.safetensors"
    shutil.copy(files[kind], inp)
    before = inp.read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(inp)
    trace = inp if kind == "prefill" else link  # the file itself, or a symlink to it
    r = _mxcli("profile", kind, inp, "--trace", trace, "--force")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "would replace the input" in _one_error_line(r.stderr)
    assert inp.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors", "link.json"]


# ---- 6. racing writers: at most one wins without --force ----------------------------------------

# Each writer finishes its temporary file, then waits until the test says go: both have passed
# the early existence check, so only the publishing step can tell them apart.
_BARRIER_SCRIPT = r"""
import os, sys, time
from pathlib import Path
barrier = Path(sys.argv[1])
import safetensors.torch as st
real_save = st.save_file
def save_file(*args, **kwargs):
    real_save(*args, **kwargs)
    (barrier / f"ready-{os.getpid()}").touch()
    t0 = time.monotonic()
    while not (barrier / "go").exists() and time.monotonic() - t0 < 120:
        time.sleep(0.005)
st.save_file = save_file
from mxcli.cli import main
sys.argv = ["mxcli", *sys.argv[2:]]
main()
"""


def _race_make_inputs(tmp_path: Path, rnd: int) -> None:
    folder = tmp_path / f"round{rnd}"
    barrier = tmp_path / f"barrier{rnd}"
    folder.mkdir()
    barrier.mkdir()
    out = folder / "same.safetensors"
    seeds = (11, 22)
    ps = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BARRIER_SCRIPT,
                str(barrier),
                "make-inputs",
                "prefill",
                "-o",
                str(out),
                "--seed",
                str(seed),
                "--tokens",
                "64",
                "-q",
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_preexec(None),
        )  # fmt: skip
        for seed in seeds
    ]
    t0 = time.monotonic()
    while len(list(barrier.glob("ready-*"))) < 2:
        assert all(p.poll() is None for p in ps), [p.communicate() for p in ps]
        assert time.monotonic() - t0 < 120, "the writers did not get ready"
        time.sleep(0.01)
    (barrier / "go").touch()
    results = [(p.wait(timeout=120), *p.communicate()) for p in ps]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    (winner,) = [seed for seed, (rc, _, _) in zip(seeds, results, strict=True) if rc == 0]
    (loser_err,) = [err for rc, _, err in results if rc == 2]
    line = _one_error_line(loser_err)
    assert "output exists" in line and "--force" in line, line
    # the winner's file is whole and is the winner's: nothing replaced it, nothing left beside it
    assert _files_under(folder) == [out]
    with safe_open(str(out), framework="pt") as f:
        assert json.loads(f.metadata()["generator"])["seed"] == winner
        assert tuple(f.get_tensor("hidden_states").shape) == (1, 64, 512)


def test_make_inputs_race_one_writer_wins(tmp_path: Path) -> None:
    _race_make_inputs(tmp_path, 0)


@pytest.mark.slow
def test_make_inputs_race_rounds(tmp_path: Path) -> None:
    for rnd in range(1, 5):
        _race_make_inputs(tmp_path, rnd)


def test_publish_never_replaces_without_force(tmp_path: Path, monkeypatch) -> None:
    """`publish` onto an existing file fails and leaves it, by renameat2, by the hard-link
    fallback and by the last resort; with replace=True it replaces atomically."""
    from mxcli import fsutil
    from mxcli.errors import OutputExistsError

    final = tmp_path / "out"
    final.write_text("first")
    for mode in ("renameat2", "link", "neither"):
        if mode != "renameat2":
            monkeypatch.setattr(fsutil, "_renameat2_noreplace", lambda a, b: False)
        if mode == "neither":

            def no_link(a: Any, b: Any) -> None:
                raise OSError(1, "Operation not permitted")

            monkeypatch.setattr(fsutil.os, "link", no_link)
        tmp = tmp_path / f".out.{mode}.tmp"
        tmp.write_text(mode)
        with pytest.raises(OutputExistsError, match="--force"):
            fsutil.publish(tmp, final, replace=False)
        assert final.read_text() == "first" and tmp.exists()
        fresh = tmp_path / f"new-{mode}"
        fsutil.publish(tmp, fresh, replace=False)
        assert fresh.read_text() == mode and not tmp.exists()
    tmp = tmp_path / ".out.force.tmp"
    tmp.write_text("second")
    fsutil.publish(tmp, final, replace=True)
    assert final.read_text() == "second" and not tmp.exists()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mxcli.weightprep.synthetic import build_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return build_checkpoint("qwen3_moe", root / "ck", hidden_size=512, num_layers=1).path


@pytest.fixture(scope="module")
def prepared(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint prepared (H = 512, bf16 + mxfp8); never modified (tests copy it)."""
    from mxcli.weightprep.plan import PrepOptions
    from mxcli.weightprep.runner import prepare_weights

    out = tmp_path_factory.mktemp("prepared") / "p"
    prepare_weights(checkpoint, out, PrepOptions())
    return out


def test_prep_weights_refuses_a_folder_another_run_holds(checkpoint: Path, tmp_path: Path) -> None:
    """A run in progress holds its folder (the run lock, taken here as a live run would): a
    second run into it exits 2 with one line and writes nothing."""
    from mxcli.fsutil import hold_folder
    from mxcli.weightprep.runner import RUN_LOCK_NAME

    out = tmp_path / "out"
    out.mkdir()
    with hold_folder(out, RUN_LOCK_NAME, shared=False, busy="held by the test"):
        r = _mxcli("prep-weights", checkpoint, out, "-q")
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "another prep-weights run is writing" in _one_error_line(r.stderr)
        assert [p.name for p in out.iterdir()] == [RUN_LOCK_NAME]
    assert list(out.iterdir()) == []  # the last holder removes the lock file


@pytest.mark.slow
def test_prep_weights_race_one_writer_wins(checkpoint: Path, tmp_path: Path) -> None:
    """Two real prep-weights runs into one new folder, several rounds: exactly one wins, the
    other exits 2 with one line, and the winner's folder is whole (every tensor's sha256)."""
    from mxcli.weightprep.manifest import load_manifest, verify_layer_file

    for rnd in range(3):
        out = tmp_path / f"out{rnd}"
        ps = [
            procs.start(["prep-weights", checkpoint, out, "-q"], mode="slow-pieces=0.02")
            for _ in range(2)
        ]
        results = [(p.wait(timeout=300), *p.communicate()) for p in ps]
        assert sorted(rc for rc, _, _ in results) == [0, 2], results
        (err,) = [e for rc, _, e in results if rc == 2]
        line = _one_error_line(err)
        assert "another prep-weights run is writing" in line or "not empty" in line, line
        m = load_manifest(out)
        assert m.layers == [0]
        verify_layer_file(m, 0)
        assert not procs.temporaries(out)


# ---- 7. full disks --------------------------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "empty-folder"])
def test_prep_weights_full_disk_leaves_nothing(checkpoint: Path, tmp_path: Path, existing) -> None:
    """The disk fills on the first layer file: one line, exit 2, and nothing is left (no
    OUT/rank0), so the same command can simply run again."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    r = _mxcli("prep-weights", checkpoint, out, "-q", fsize=100_000)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "cannot write" in line and "File too large" in line
    if existing:
        assert list(out.iterdir()) == []
    else:
        assert not out.exists()


@pytest.mark.slow
def test_prep_weights_after_a_full_disk_a_plain_rerun_works(checkpoint: Path, tmp_path) -> None:
    out = tmp_path / "out"
    assert _mxcli("prep-weights", checkpoint, out, "-q", fsize=100_000).returncode == 2
    r = _mxcli("prep-weights", checkpoint, out, "-q")
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").is_file()


def test_demo_full_disk_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    r = _mxcli("demo", "--out", out, "-q", fsize=100_000)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "cannot write" in line and "File too large" in line and "SafetensorError" not in line
    assert _files_under(out) == []  # no partial shard, no temporary


# ---- 8. prepared weights against their manifest ------------------------------------------------


def _flip_bit(layer_file: Path, name: str) -> None:
    raw = bytearray(layer_file.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    raw[8 + n + header[name]["data_offsets"][0] + 10] ^= 0x04
    layer_file.write_bytes(bytes(raw))


@pytest.fixture
def flipped(prepared: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "flipped"
    shutil.copytree(prepared, folder)
    _flip_bit(folder / "rank0" / "layer_000.safetensors", "layers.0.gate_up_proj_weight")
    return folder


def test_make_inputs_refuses_a_bit_flipped_layer(flipped: Path, tmp_path: Path) -> None:
    out = tmp_path / "in.safetensors"
    r = _mxcli("make-inputs", "bwd", "-o", out, "--weights", flipped, "--layer", 0, "-q")
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "layer_000.safetensors" in line and "gate_up_proj_weight" in line
    assert "sha256" in line and "--no-verify-hashes" in line
    assert not out.exists()


def test_inspect_refuses_a_bit_flipped_layer(flipped: Path) -> None:
    r = _mxcli("inspect", flipped, "--layer", 0, "-q")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "sha256" in _one_error_line(r.stderr)


def test_no_verify_hashes_skips_only_the_hashes(flipped: Path, tmp_path: Path) -> None:
    out = tmp_path / "in.safetensors"
    r = _mxcli("make-inputs", "prefill", "-o", out, "--weights", flipped, "--layer", 0, "-q",
               "--no-verify-hashes")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.is_file()


def _edit_manifests(folder: Path, edit: Any) -> None:
    for p in (folder / "manifest.json", folder / "rank0" / "manifest.json"):
        m = json.loads(p.read_text())
        edit(m)
        p.write_text(json.dumps(m))


def test_hand_edited_padding_is_refused(prepared: Path, tmp_path: Path) -> None:
    """padding.hidden_size 300 over H = 512 weights: refused with the field, expected and
    actual (it made run-bwd cut hidden_states_grad to [128, 300])."""
    folder = tmp_path / "edited"
    shutil.copytree(prepared, folder)
    _edit_manifests(folder, lambda m: m["padding"].update(hidden_size=300))
    out = tmp_path / "in.safetensors"
    r = _mxcli("make-inputs", "bwd", "-o", out, "--weights", folder, "--layer", 0, "-q")
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "padding.backward_hidden_size is 512, expected 384" in line and "300" in line
    assert not out.exists()


def test_consistently_edited_padding_is_caught_by_the_data(prepared: Path, tmp_path) -> None:
    """Every size field edited to H = 500: the manifest is self-consistent, but the weights are
    not zero where it says they are padding."""
    folder = tmp_path / "edited"
    shutil.copytree(prepared, folder)

    def edit(m: dict[str, Any]) -> None:
        m["padding"]["hidden_size"] = m["model"]["hidden_size"] = 500
        for entry in m["layers"].values():
            entry["prefill_kwargs"]["unpadded_hidden_size"] = 500

    _edit_manifests(folder, edit)
    r = _mxcli("inspect", folder, "--layer", 0, "-q")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "gamma is not zero past index 500" in _one_error_line(r.stderr)


@pytest.mark.parametrize(
    "hidden,words",
    [
        (300, ["padding.backward_hidden_size is 256, expected 384", "generator.padding"]),
        (200, ["hidden_states", "not zero past column 200", "generator.padding"]),
    ],
    ids=["impossible", "not-zero"],
)
def test_run_bwd_refuses_a_recorded_padding_that_does_not_fit(
    files, tmp_path: Path, hidden, words
) -> None:
    """An input file whose generator.padding gives a true H that the [T, 256] hidden states do
    not have: the gradients would be cut to its width; refused before the run."""
    with safe_open(str(files["bwd"]), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    gen = json.loads(meta["generator"])
    gen["padding"] = {
        "hidden_size": hidden, "prefill_hidden_size": 512, "backward_hidden_size": 256,
        "intermediate_size_per_rank": 128, "padded_intermediate_size_per_rank": 128,
    }  # fmt: skip
    meta["generator"] = json.dumps(gen)
    inp = tmp_path / "in.safetensors"
    save_file(tensors, str(inp), metadata=meta)
    out = tmp_path / "out.safetensors"
    r = _mxcli("run-bwd", inp, "-o", out, "-b", "reference", "-q")
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert all(w in line for w in words), line
    assert not out.exists()


# ---- 9-11. one line instead of a traceback ----------------------------------------------------------


def test_run_prefill_without_tokens_is_one_line(files, tmp_path: Path) -> None:
    with safe_open(str(files["prefill"]), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors["hidden_states"] = torch.zeros(1, 0, 512, dtype=torch.bfloat16)
    tensors.pop("residual", None)
    inp = tmp_path / "empty.safetensors"
    save_file(tensors, str(inp), metadata=meta)
    out = tmp_path / "out.safetensors"
    r = _mxcli("run-prefill", inp, "-o", out, "-b", "reference")
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "hidden_states" in line and "at least one token" in line and "(1, 0, 512)" in line
    assert not out.exists()


def test_run_bwd_without_tokens_is_one_line(files, tmp_path: Path) -> None:
    with safe_open(str(files["bwd"]), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for name in ("hidden_states", "output_hidden_states_grad", "expert_affinities_masked"):
        tensors[name] = tensors[name][:0]
    inp = tmp_path / "empty.safetensors"
    save_file(tensors, str(inp), metadata=meta)
    out = tmp_path / "out.safetensors"
    r = _mxcli("run-bwd", inp, "-o", out, "-b", "reference")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "at least one token" in _one_error_line(r.stderr)
    assert not out.exists()


def test_make_inputs_refuses_what_cannot_fit_in_memory(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = _mxcli("make-inputs", "prefill", "--tokens", "100000000000", "-o", "in.safetensors",
               cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    # 1e11 tokens x 512 x 6 bytes: the figure, and what there is
    assert "tokens" in line and "100000000000" in line and "307 TB" in line and "available" in line
    assert time.monotonic() - t0 < 60  # refused up front, not after the allocator gave up
    assert list(tmp_path.iterdir()) == []


def test_memory_check_figures(monkeypatch) -> None:
    from mxcli import memory
    from mxcli.errors import InputError

    monkeypatch.setattr(memory, "available_bytes", lambda: 8 * 10**9)
    memory.check_fits("tokens: small", 8 * 10**9)  # exactly what there is fits
    with pytest.raises(InputError, match=r"tokens: big need at least 8\.5 GB .* 8 GB available"):
        memory.check_fits("tokens: big", 8_500_000_000)
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    memory.check_fits("tokens: unknown", 10**18)  # nothing known: nothing refused


@pytest.mark.parametrize("kind,seed", [("prefill", "99999999999999999999"), ("bwd", "4294967296")])
def test_make_inputs_seed_out_of_range_names_the_flag(tmp_path: Path, kind, seed) -> None:
    r = _mxcli("make-inputs", kind, "-o", "in.safetensors", "--seed", seed, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "--seed" in line and "[0, 4294967295]" in line and seed in line
    assert "Overflow" not in line
    assert list(tmp_path.iterdir()) == []


def test_largest_seed_is_accepted() -> None:
    from mxcli.inputs import SEED_MAX
    from mxcli.kernels.blockwise_moe.inputs import make_bwd_inputs
    from mxcli.kernels.rmsnorm_mx_prefill.inputs import make_prefill_inputs

    assert SEED_MAX == 2**32 - 1
    a = make_prefill_inputs(seq=4, experts=None, seed=SEED_MAX)
    assert a.generator["seed"] == SEED_MAX
    b = make_bwd_inputs(tokens=128, hidden=128, experts=2, top_k=1, seed=SEED_MAX)
    assert b.tensors["hidden_states"].shape == (128, 128)
