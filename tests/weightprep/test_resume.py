"""Atomic outputs, --resume after an interruption, --force, refusing an existing folder."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mxcli.errors import InputError, OutputExistsError
from mxcli.weightprep import writer
from mxcli.weightprep.manifest import load_manifest
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from tests import procs


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.safetensors"))}


def _hashes(out: Path) -> dict:
    m = load_manifest(out)
    return {
        L: {k: v["sha256"] for k, v in m.rank_entry(L, r)["tensors"].items()}
        for L in m.layers
        for r in m.ranks
    }


class Interrupt(KeyboardInterrupt):
    pass


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n_writes: int) -> None:
    """Make the n-th tensor piece written raise, as a Ctrl-C in the middle of a layer would."""
    real = writer.StreamingWriter.write
    count = {"n": 0}

    def write(self, name, piece):  # type: ignore[no-untyped-def]
        count["n"] += 1
        if count["n"] == n_writes:
            raise Interrupt()
        return real(self, name, piece)

    monkeypatch.setattr(writer.StreamingWriter, "write", write)


def test_interrupted_run_then_resume_is_identical(
    checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = checkpoints["deepseek_v3"]
    opts = PrepOptions(tp=2)
    clean = tmp_path / "clean"
    prepare_weights(src, clean, opts)

    out = tmp_path / "out"
    # layer 1 writes 2 ranks x 11 tensors in ~12 pieces each; interrupt midway through layer 2
    _interrupt_after(monkeypatch, 40)
    with pytest.raises(Interrupt):
        prepare_weights(src, out, opts)
    monkeypatch.undo()
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert not any(f.endswith(".tmp") for f in files), files  # no partial file
    assert load_manifest(out).layers == [1]  # the finished layer is recorded
    assert sorted(p.name for p in (out / "rank0").glob("*.safetensors")) == [
        "layer_001.safetensors"
    ]

    with pytest.raises(OutputExistsError, match="--resume"):
        prepare_weights(src, out, opts)
    res = prepare_weights(src, out, opts, resume=True)
    assert res["layers_skipped"] == [1] and res["layers_written"] == [2]
    assert _snapshot(out) == _snapshot(clean)
    assert _hashes(out) == _hashes(clean)


def test_resume_redoes_corrupted_layer(checkpoints: dict, tmp_path: Path) -> None:
    src = checkpoints["qwen3_moe"]
    out = tmp_path / "out"
    prepare_weights(src, out, PrepOptions(formats=("bf16",)))
    before = _snapshot(out)
    f = out / "rank0" / "layer_001.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside a tensor
    f.write_bytes(bytes(data))
    (out / "rank0" / ".layer_000.safetensors.abc.tmp").write_bytes(b"junk from a killed run")
    res = prepare_weights(src, out, PrepOptions(formats=("bf16",)), resume=True)
    assert res["layers_skipped"] == [0] and res["layers_written"] == [1]
    assert _snapshot(out) == before
    assert not list(out.rglob("*.tmp"))


def test_resume_refuses_other_settings(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(formats=("bf16",)))
    with pytest.raises(InputError, match="formats"):
        prepare_weights(
            checkpoints["qwen3_moe"], out, PrepOptions(formats=("bf16", "mxfp8")), resume=True
        )
    with pytest.raises(InputError, match="exclude"):
        prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(), resume=True, force=True)


def test_resume_adds_layers(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(layers="0"))
    res = prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(layers="1"), resume=True)
    assert res["layers_written"] == [1]
    assert load_manifest(out).layers == [0, 1]


def test_force_starts_over(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions())
    keep = out / "notes.txt"
    keep.write_text("mine")
    res = prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(layers="1", tp=2), force=True)
    assert res["layers_written"] == [1]
    assert not (out / "rank0" / "layer_000.safetensors").exists()  # stale output removed
    assert load_manifest(out).layers == [1] and keep.read_text() == "mine"


def test_existing_nonempty_folder_refused(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(OutputExistsError, match="--force"):
        prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions())
    assert sorted(p.name for p in out.iterdir()) == ["x"]


# ---- temporaries, the lock file, interrupts (issue 13) ----------------------------------------


def test_only_stale_temporaries_are_removed(tmp_path: Path) -> None:
    """A temporary whose writer is alive (it holds the file's flock) is kept; one whose writer
    is gone is removed. This is what lets parallel --resume runs share a folder."""
    from mxcli.fsutil import atomic_output, remove_stale_temporaries

    stale = tmp_path / ".layer_009.safetensors.abcd1234.tmp"
    stale.write_bytes(b"left by a killed run")
    with atomic_output(tmp_path / "layer_003.safetensors") as live:
        live.write_bytes(b"being written")
        assert remove_stale_temporaries(tmp_path) == [stale]
        assert live.read_bytes() == b"being written"
    assert (tmp_path / "layer_003.safetensors").read_bytes() == b"being written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer_003.safetensors"]


def test_lock_file_removed_after_a_run(checkpoints: dict, tmp_path: Path) -> None:
    from mxcli.weightprep.runner import LOCK_NAME

    out = tmp_path / "out"
    prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(layers="0"))
    assert not (out / LOCK_NAME).exists()
    (out / LOCK_NAME).touch()  # left by a killed run: harmless, and removed by the next
    prepare_weights(checkpoints["qwen3_moe"], out, PrepOptions(layers="1"), resume=True)
    assert not (out / LOCK_NAME).exists()
    assert load_manifest(out).layers == [0, 1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_cleans_up_and_resume_is_identical(checkpoints: dict, tmp_path: Path, sig) -> None:
    """A real process is signalled while a layer's temporary file is being written: no
    temporary nor lock file is left, it prints one line naming --resume and exits 128 + signal;
    --resume then gives the bytes of an uninterrupted run."""
    src = checkpoints["qwen3_moe"]
    clean = tmp_path / "clean"
    prepare_weights(src, clean, PrepOptions())
    out = tmp_path / "out"
    proc = procs.start(["prep-weights", src, out], mode="slow-pieces=0.05")
    procs.wait_for(lambda: any((out / "rank0").glob(".layer_*.tmp")), proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "interrupted" in lines[0] and "--resume" in lines[0], stderr
    assert "Traceback" not in stderr
    assert procs.temporaries(out) == []  # no .layer_*.tmp, no .prep-weights.lock
    prepare_weights(src, out, PrepOptions(), resume=True)
    assert _snapshot(out) == _snapshot(clean)
    assert _hashes(out) == _hashes(clean)
