"""Issue 28, items 1, 2, 4 and 13, through the CLI as fresh processes: ``--force`` never deletes
what mxcli did not write, paths read from a manifest or an export record stay in their folder,
shards of one folder agree on their selection, and an interrupted or killed run leaves nothing
behind (the interrupts are raised at a fixed point by `tests.procs`, not timed)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mxcli.errors import MxcliError
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.shards import Shard
from mxcli.weightprep.synthetic import build_checkpoint
from tests import procs


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MXCLI_", "SLURM_"))}
    e.pop("RANK", None), e.pop("WORLD_SIZE", None)
    return e


def _mxcli(*args: object, cwd: Path | None = None, fsize: int | None = None) -> Any:
    def pre() -> None:
        if fsize is not None:  # a full disk, as the kernel reports it: EFBIG past `fsize` bytes
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)], capture_output=True, text=True,
        env=_env(), cwd=cwd, timeout=300, preexec_fn=pre,
    )  # fmt: skip


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) with its sha256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }  # fmt: skip


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer qwen3_moe checkpoint (bf16, H 256, I 128, 8 experts): every format exports it."""
    root = tmp_path_factory.mktemp("h4")
    return build_checkpoint("qwen3_moe", root / "ck", num_layers=3).path


FORMATS = ["mxcli", "compressed-tensors", "nxdi"]


# ---- 1. --force replaces only what mxcli wrote ---------------------------------------------------


def _models(tmp_path: Path, ck: Path) -> Path:
    models = tmp_path / "models"
    shutil.copytree(ck, models / "ck")
    (models / "NOTES.txt").write_text("mine\n")
    return models


def test_force_refuses_a_folder_holding_the_source(ck: Path, tmp_path: Path) -> None:
    """The issue's command: OUT is the source's parent (it also holds NOTES.txt). Refused,
    exit 2, nothing touched (the export deleted all of it)."""
    models = _models(tmp_path, ck)
    before = _snapshot(models)
    r = _mxcli("prep-weights", "models/ck", "models", "--output-format", "compressed-tensors",
               "--force", "-q", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "models: output folder contains the checkpoint folder" in _one_error_line(r.stderr)
    assert _snapshot(models) == before and sorted(os.listdir(tmp_path)) == ["models"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["parent", "same", "inside"])
def test_every_format_refuses_an_output_around_the_source(
    ck: Path, tmp_path: Path, fmt: str, where: str
) -> None:
    """For every output format, with --force: OUT containing, being or inside the source."""
    models = _models(tmp_path, ck)
    before = _snapshot(models)
    out = {"parent": models, "same": models / "ck", "inside": models / "ck" / "o"}[where]
    want = "contains the checkpoint folder" if where == "parent" else "inside the checkpoint"
    with pytest.raises(MxcliError, match=want):
        prepare_weights(models / "ck", out, PrepOptions(output_format=fmt, formats=("bf16",),
                        scale_rule="ocp" if fmt == "compressed-tensors" else "neuron"),
                        force=True)  # fmt: skip
    assert _snapshot(models) == before


@pytest.mark.parametrize("fmt", ["compressed-tensors", "nxdi"])
def test_export_force_keeps_unknown_files(ck: Path, tmp_path: Path, fmt: str) -> None:
    """An export with --force into a folder holding a file mxcli did not write: refused naming
    it, nothing deleted (the export deleted the whole folder)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "NOTES.txt").write_text("mine\n")
    r = _mxcli("prep-weights", ck, "work", "--output-format", fmt, "--force", "-q", cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = _one_error_line(r.stderr)
    assert "work: holds NOTES.txt and no mxcli-export.json: not an mxcli export" in line
    assert _snapshot(work) == {"NOTES.txt": hashlib.sha256(b"mine\n").hexdigest()}
    assert sorted(os.listdir(tmp_path)) == ["work"]
    # --dry-run says so
    opts = PrepOptions(output_format=fmt, formats=("bf16",),
                       scale_rule="ocp" if fmt == "compressed-tensors" else "neuron")  # fmt: skip
    plan = prepare_weights(ck, work, opts, force=True, dry_run=True)["plan"]
    assert (
        "the real run would refuse" in plan["would_refuse"] and "NOTES.txt" in plan["would_refuse"]
    )


def test_export_into_the_current_folder_is_refused(ck: Path, tmp_path: Path) -> None:
    """``--output-format nxdi --force`` with OUT ``.`` replaced the current folder (later
    commands then died loading libtorch)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "NOTES.txt").write_text("mine\n")
    r = _mxcli("prep-weights", ck, ".", "--output-format", "nxdi", "--force", "-q", cwd=work)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "cannot be done to the current folder" in _one_error_line(r.stderr)
    assert _snapshot(work) == {"NOTES.txt": hashlib.sha256(b"mine\n").hexdigest()}
    assert sorted(os.listdir(tmp_path)) == ["work"]


def test_export_force_replaces_its_own_export_only(ck: Path, tmp_path: Path) -> None:
    """The export records the files it wrote; --force replaces such a folder, and refuses one
    that gained a file since (naming it, the folder left as it was)."""
    out = tmp_path / "out"
    prepare_weights(ck, out, PrepOptions(output_format="nxdi", formats=("bf16",)))
    side = json.loads((out / "mxcli-export.json").read_text())
    assert side["files"] == ["weights/tp0_moe_only.safetensors"]
    first = _snapshot(out)
    r = _mxcli("prep-weights", ck, out, "--output-format", "nxdi", "--force", "-q")
    assert r.returncode == 0, r.stderr
    assert _snapshot(out) == first  # deterministic: the same bytes again
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder holds nothing to lose
    prepare_weights(ck, empty, PrepOptions(output_format="nxdi", formats=("bf16",)), force=True)
    w = "weights/tp0_moe_only.safetensors"
    assert _snapshot(empty)[w] == first[w]
    shutil.rmtree(empty)
    (out / "weights" / "extra.bin").write_bytes(b"\x01")
    r = _mxcli("prep-weights", ck, out, "--output-format", "nxdi", "--force", "-q")
    assert r.returncode == 2
    assert "weights/extra.bin" in _one_error_line(r.stderr)
    assert _snapshot(out) == {**first, "weights/extra.bin": hashlib.sha256(b"\x01").hexdigest()}
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_mxcli_force_never_deletes_unknown_files(ck: Path, tmp_path: Path) -> None:
    """mxcli's layout: --force removes the files the manifest lists and nothing else (it
    removed whole rank folders), and refuses to replace a file at one of its paths that no
    manifest lists."""
    out = tmp_path / "out"
    prepare_weights(ck, out, PrepOptions(layers="0-1", formats=("bf16",)))
    (out / "rank0" / "NOTES.txt").write_text("mine\n")
    (out / "NOTES.txt").write_text("mine too\n")
    (out / ".draft.tmp").write_text("a temporary, not mxcli's\n")
    r = _mxcli("prep-weights", ck, out, "--layers", "2", "--force", "-q")
    assert r.returncode == 0, r.stderr
    assert (out / "rank0" / "NOTES.txt").read_text() == "mine\n"
    assert (out / "NOTES.txt").read_text() == "mine too\n"
    assert (out / ".draft.tmp").read_text() == "a temporary, not mxcli's\n"
    assert sorted(p.name for p in (out / "rank0").iterdir()) == [
        "NOTES.txt", "layer_002.safetensors", "manifest.json", "model.safetensors.index.json",
    ]  # fmt: skip
    # a layer file that no manifest lists (the manifest is gone): not replaced
    (out / "manifest.json").unlink()
    (out / "rank0" / "manifest.json").unlink()
    (out / "rank0" / "model.safetensors.index.json").unlink()
    before = _snapshot(out)
    r = _mxcli("prep-weights", ck, out, "--layers", "2", "--force", "-q")
    assert r.returncode == 2
    line = _one_error_line(r.stderr)
    assert "rank0/layer_002.safetensors" in line and "mxcli wrote" in line
    assert _snapshot(out) == before


# ---- 2. paths read from a manifest or an export record stay in its folder -------------------------


def _victim(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    victim = tmp_path / "rank_victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me\n")
    return victim, _snapshot(victim)


def _point_outside(out: Path, victim: Path, how: str) -> str:
    m = json.loads((out / "manifest.json").read_text())
    if how == "symlink":
        (out / "rank_link").symlink_to(victim)
        m["ranks"][0]["dir"] = "rank_link"
    else:
        m["ranks"][0]["dir"] = "../rank_victim" if how == "dotdot" else str(victim)
    (out / "manifest.json").write_text(json.dumps(m))
    return str(m["ranks"][0]["dir"])


def test_force_with_a_manifest_pointing_outside(ck: Path, tmp_path: Path) -> None:
    """A rank ``dir`` of ``../rank_victim``: --force deleted that folder; now exit 2, naming
    the manifest key and the path."""
    out = tmp_path / "out"
    prepare_weights(ck, out, PrepOptions(layers="0", formats=("bf16",)))
    victim, before = _victim(tmp_path)
    _point_outside(out, victim, "dotdot")
    r = _mxcli("prep-weights", ck, out, "--layers", "0", "--formats", "bf16", "--force", "-q")
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "ranks[0].dir is '../rank_victim', outside" in line and "corrupt manifest" in line
    assert _snapshot(victim) == before


@pytest.mark.parametrize("how", ["absolute", "symlink"])
def test_force_with_a_manifest_pointing_outside_other_ways(
    ck: Path, tmp_path: Path, how: str
) -> None:
    out = tmp_path / "out"
    opts = PrepOptions(layers="0", formats=("bf16",))
    prepare_weights(ck, out, opts)
    victim, before = _victim(tmp_path)
    rel = _point_outside(out, victim, how)
    with pytest.raises(MxcliError, match=rf"ranks\[0\]\.dir is '{rel}', outside .*corrupt"):
        prepare_weights(ck, out, opts, force=True)
    assert _snapshot(victim) == before


def test_finalize_with_a_manifest_pointing_outside(ck: Path, tmp_path: Path) -> None:
    """--finalize wrote the indexes where the manifest's rank ``dir`` said."""
    out = tmp_path / "out"
    for i in (0, 1):
        prepare_weights(ck, out, PrepOptions(formats=("bf16",)), shard=Shard(i, 2))
    victim, before = _victim(tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    m["ranks"][0]["dir"] = "../rank_victim"
    (out / "manifest.json").write_text(json.dumps(m))
    r = _mxcli("prep-weights", ck, out, "--formats", "bf16", "--finalize")
    assert r.returncode == 2
    assert "ranks[0].dir is '../rank_victim'" in _one_error_line(r.stderr)
    assert _snapshot(victim) == before


def test_readers_refuse_a_layer_file_outside(ck: Path, tmp_path: Path) -> None:
    """A layer ``file`` naming a (valid) file outside the folder is not read."""
    out = tmp_path / "out"
    prepare_weights(ck, out, PrepOptions(layers="0", formats=("bf16",)))
    shutil.copy(out / "rank0" / "layer_000.safetensors", tmp_path / "elsewhere.safetensors")
    m = json.loads((out / "manifest.json").read_text())
    m["layers"]["0"]["ranks"]["0"]["file"] = "../elsewhere.safetensors"
    (out / "manifest.json").write_text(json.dumps(m))
    r = _mxcli("make-inputs", "prefill", "--weights", out, "--layer", "0", "-o",
               tmp_path / "in.safetensors")  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "layers.0.ranks.0.file is '../elsewhere.safetensors'" in _one_error_line(r.stderr)
    assert not (tmp_path / "in.safetensors").exists()


def test_export_record_pointing_outside(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_weights(ck, out, PrepOptions(output_format="nxdi", formats=("bf16",)))
    victim, before = _victim(tmp_path)
    side = json.loads((out / "mxcli-export.json").read_text())
    side["files"].append("../rank_victim/precious.txt")
    (out / "mxcli-export.json").write_text(json.dumps(side))
    r = _mxcli("prep-weights", ck, out, "--output-format", "nxdi", "--force", "-q")
    assert r.returncode == 2
    line = _one_error_line(r.stderr)
    assert "files[1] is '../rank_victim/precious.txt'" in line and "corrupt" in line
    assert _snapshot(victim) == before


# ---- 4. shards of one folder agree on what they convert ------------------------------------------


def test_shards_with_different_selections_are_refused(ck: Path, tmp_path: Path) -> None:
    """``--shard 0/2 --layers 1-2`` then ``--shard 1/2 --layers 1``: both passed and the
    manifest called the model complete without layer 2. The second is refused naming the
    option and both values."""
    out = tmp_path / "out"
    r = _mxcli("prep-weights", ck, out, "--shard", "0/2", "--layers", "1-2", "-q", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shard"]["layers"] == [1]
    r = _mxcli("prep-weights", ck, out, "--shard", "1/2", "--layers", "1", "-q")
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "shard 1/2 (--shard): --layers selects layers 1, the first shard recorded layers " \
        "1-2" in line  # fmt: skip
    m = json.loads((out / "manifest.json").read_text())
    assert m["shards"] == {"count": 2, "complete": False, "layers": [1, 2]}
    assert sorted(m["layers"]) == ["1"]


def test_shard_and_finalize_disagreements_in_process(ck: Path, tmp_path: Path) -> None:
    """--finalize with another selection, and a shard with an option that changes the bytes,
    are refused naming the option and both values; the same selection completes the run."""
    out = tmp_path / "out"
    opts = PrepOptions(layers="1-2", formats=("bf16",))
    prepare_weights(ck, out, opts, shard=Shard(0, 2))
    with pytest.raises(MxcliError, match="--finalize: --layers selects layers 1, the first "
                       "shard recorded layers 1-2"):  # fmt: skip
        prepare_weights(ck, out, PrepOptions(layers="1", formats=("bf16",)), finalize=True)
    with pytest.raises(MxcliError, match=r"shard 1/2 \(--shard\): the output was written with "
                       "fp8_range=448, this run asks fp8_range=240"):  # fmt: skip
        prepare_weights(ck, out, PrepOptions(layers="1-2", formats=("bf16",), fp8_range=240),
                        shard=Shard(1, 2))  # fmt: skip
    res = prepare_weights(ck, out, opts, shard=Shard(1, 2))
    assert res["shard"]["finalized"] is True and res["layers_written"] == [2]


def test_first_shard_records_its_selection_before_converting(ck: Path, tmp_path: Path) -> None:
    """The selection is in the manifest as soon as the first shard has started (a shard
    starting meanwhile sees it): shown by a shard killed when it writes its first layer."""
    out = tmp_path / "out"
    p = procs.start(["prep-weights", ck, out, "--shard", "0/2", "--layers", "0-1", "-q"],
                    mode="kill-after=mxcli.weightprep.writer:StreamingWriter")  # fmt: skip
    p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL
    m = json.loads((out / "manifest.json").read_text())
    assert m["shards"]["layers"] == [0, 1] and m["layers"] == {}
    with pytest.raises(MxcliError, match="recorded layers 0-1"):
        prepare_weights(ck, out, PrepOptions(layers="0-2"), shard=Shard(1, 2))


# ---- 13. interrupts, kills and full disks leave nothing ------------------------------------------


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_right_after_the_temporary_is_created(tmp_path: Path, sig: str) -> None:
    """The signal arrives (on another thread, as with torch's) as the temporary file has just
    been created: it used to stay behind, under a message saying nothing was written."""
    out = tmp_path / "in.safetensors"
    p = procs.start(["make-inputs", "prefill", "-o", out],
                    mode=f"signal-after=mxcli.fsutil:_locked_temporary:{sig}", cwd=tmp_path)  # fmt: skip
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 128 + getattr(signal, sig), stderr
    line = _one_error_line(stderr)
    assert "interrupted" in line and "no output was written" in line
    assert list(tmp_path.iterdir()) == []


def test_sigkilled_writer_temporary_is_cleaned_by_the_next_run(tmp_path: Path) -> None:
    """A SIGKILLed make-inputs leaves its temporary (nothing can remove it then); the next run
    writing that output removes it (its flock died with its writer)."""
    out = tmp_path / "in.safetensors"
    p = procs.start(["make-inputs", "prefill", "-o", out, "--tokens", "8"], cwd=tmp_path,
                    mode="kill-after=mxcli.fsutil:_locked_temporary")  # fmt: skip
    p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".in.safetensors.") and left.name.endswith(".tmp")
    (tmp_path / ".other.safetensors.abcd1234.tmp").write_text("another output's")
    r = _mxcli("make-inputs", "prefill", "-o", out, "--tokens", "8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        ".other.safetensors.abcd1234.tmp", "in.safetensors",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "fmt,point",
    [("nxdi", "mxcli.fsutil:_locked_temporary_folder:SIGINT"),
     ("compressed-tensors", "mxcli.weightprep.export.folder:_record_files:SIGTERM")],
)  # fmt: skip
def test_interrupted_export_leaves_nothing_and_advises_a_rerun(
    ck: Path, tmp_path: Path, fmt: str, point: str
) -> None:
    """Interrupted as its temporary folder is created, or with files written in it: nothing
    is left and the message advises what works (an export cannot --resume)."""
    out = tmp_path / "out"
    p = procs.start(["prep-weights", ck, out, "--output-format", fmt, "-q"],
                    mode=f"signal-after={point}")  # fmt: skip
    _, stderr = p.communicate(timeout=300)
    assert p.returncode in (130, 143), stderr
    line = _one_error_line(stderr)
    assert "--resume" not in line and "nothing was written; run the same command again" in line
    assert list(tmp_path.iterdir()) == []


def test_sigkilled_export_is_cleaned_by_the_next_run(ck: Path, tmp_path: Path) -> None:
    """A SIGKILLed export's hidden temporary folder stayed for ever; the next run on this host
    removes it (its process is gone), then exports."""
    out = tmp_path / "out"
    p = procs.start(["prep-weights", ck, out, "--output-format", "nxdi", "-q"],
                    mode="kill-after=mxcli.fsutil:_locked_temporary_folder")  # fmt: skip
    p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL
    left = [x.name for x in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".out.") and left[0].endswith(".export.tmp")
    assert left[0].split(".")[-3] == str(p.pid)
    r = _mxcli("prep-weights", ck, out, "--output-format", "nxdi", "-q")
    assert r.returncode == 0, r.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["out"]


def test_full_disk_during_an_export_names_the_path(ck: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _mxcli("prep-weights", ck, out, "--output-format", "compressed-tensors", "-q",
               fsize=200_000)  # fmt: skip
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert str(out) in line and "cannot write (File too large)" in line
    assert "nothing written" in line
    assert list(tmp_path.iterdir()) == []
