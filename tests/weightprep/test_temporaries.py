"""Temporary folders of whole-folder outputs (`mxcli.fsutil.temporary_folder`): what a killed
writer left is cleaned by the next run on the same host, and only that; and what a resumed
run or a shard must repeat."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from mxcli.fsutil import (
    _host_tag,
    aside_name,
    remove_dead_temporary_folders,
    signals_deferred,
    temporary_folder,
)


def _dead_pid() -> int:
    """A PID no process can have: above the kernel's limit."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _left(final: Path, host: str, pid: int, what: str) -> Path:
    p = final.parent / f".{final.name}.{host}.{pid}.export.{what}"
    p.mkdir()
    (p / "f").write_text("x")
    return p


def test_dead_writers_temporaries_are_removed_live_and_foreign_kept(tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    dead = _left(final, _host_tag(), _dead_pid(), "tmp")
    live = _left(final, _host_tag(), os.getppid(), "tmp")  # our parent: alive
    other_host = _left(final, "another-host", _dead_pid(), "tmp")
    other_out = _left(tmp_path / "out2", _host_tag(), _dead_pid(), "tmp")
    assert remove_dead_temporary_folders(final) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", live.name, other_host.name, other_out.name]
    )


def test_held_temporary_is_kept_even_if_its_pid_looks_dead(tmp_path: Path) -> None:
    """Another PID namespace on this kernel: the flock says the writer lives."""
    final = tmp_path / "out"
    held = _left(final, _host_tag(), _dead_pid(), "tmp")
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_dead_temporary_folders(final) == []
    finally:
        os.close(fd)
    assert remove_dead_temporary_folders(final) == [held] and not held.exists()


def test_replaced_output_left_aside_is_restored_when_out_is_missing(tmp_path: Path) -> None:
    """Killed between moving the old output aside and publishing the new one: OUT comes back."""
    final = tmp_path / "out"
    aside = _left(final, _host_tag(), _dead_pid(), "old")
    assert remove_dead_temporary_folders(final) == [aside]
    assert (final / "f").read_text() == "x" and not aside.exists()
    aside = _left(final, _host_tag(), _dead_pid(), "old")  # OUT is there: the old one goes
    assert remove_dead_temporary_folders(final) == [aside]
    assert not aside.exists() and (final / "f").exists()


def test_temporary_folder_removed_on_error_kept_on_success(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), temporary_folder(final) as tmp:
        (tmp / "a").write_text("x")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with temporary_folder(final) as tmp:
        assert tmp.name == f".out.{_host_tag()}.{os.getpid()}.export.tmp"
        tmp.rename(final)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert aside_name(final).name == f".out.{_host_tag()}.{os.getpid()}.export.old"


def test_signals_deferred_delivers_the_first_signal_at_the_end() -> None:
    import signal

    before = signal.getsignal(signal.SIGINT)
    seen: list[str] = []
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        signal.raise_signal(signal.SIGINT)
        seen.append("body finished")  # the handler did not raise inside the block
    assert seen == ["body finished"]
    assert signal.getsignal(signal.SIGINT) is before


def test_resume_and_shards_refuse_another_hub_commit() -> None:
    """A Hub source read at another commit gives other bytes: refused naming both commits."""
    from mxcli.errors import InputError
    from mxcli.weightprep.runner import _check_compatible

    def manifest(commit: str) -> dict:
        hub = {"repo_id": "org/m", "revision": "main", "commit": commit}
        return {
            "source": {"family": "qwen3_moe", "hub": hub, "files": {}},
            "settings": {"fp8_range": 448},
        }

    _check_compatible(manifest("a" * 40), manifest("a" * 40), None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=f"commit {'a' * 40} of org/m, this run reads commit b"):
        _check_compatible(manifest("a" * 40), manifest("b" * 40), None)  # type: ignore[arg-type]


def test_dead_writers_file_temporaries_only(tmp_path: Path) -> None:
    """A file temporary of a dead process on this host goes; a live process's stays even
    unlocked (safetensors' save_file replaces the locked file with a new one), and so do
    another output's and another host's."""
    from mxcli.fsutil import remove_dead_temporaries

    final = tmp_path / "in.safetensors"
    host = _host_tag()
    names = {
        "dead": f".in.safetensors.{host}.{_dead_pid()}.k2j_x9aa.tmp",
        "live": f".in.safetensors.{host}.{os.getppid()}.k2j_x9ab.tmp",
        "other host": f".in.safetensors.elsewhere.{_dead_pid()}.k2j_x9ac.tmp",
        "other output": f".in2.safetensors.{host}.{_dead_pid()}.k2j_x9ad.tmp",
    }
    for n in names.values():
        (tmp_path / n).write_text("x")
    assert remove_dead_temporaries(final) == [tmp_path / names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for k, n in names.items() if k != "dead"
    )
