"""Publishing an export folder: written under a temporary name beside OUT, renamed into place.

A folder is renamed onto OUT only where OUT does not exist (or is an empty folder): rename(2)
fails on a non-empty one, so two racing writers never replace each other's output, and an
interrupted run leaves no partial folder under the final name. The temporary folder is
``.OUT.<host>.<pid>.export.tmp`` (`mxcli.fsutil.temporary_folder`): one a killed run left is
removed by the next run on that host.

The sidecar ``mxcli-export.json`` records every file the export wrote (``files``, relative
paths). ``--force`` replaces an existing OUT only when it holds nothing else, so a file mxcli
did not write is never deleted (`check_replaceable`); it moves OUT aside, publishes the new
one, then removes the old. An output folder that is, contains or lies inside the source
checkpoint is refused, with or without ``--force``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mxcli.errors import MxcliError, OutputExistsError
from mxcli.fsutil import (
    aside_name,
    confined,
    default_mode,
    refuse_inputs,
    remove_dead_temporary_folders,
    temporary_folder,
)
from mxcli.weightprep.manifest import (
    ExportRecord,
    new_export_record,
    read_export_record,
    write_export_record,
)

SIDECAR = "mxcli-export.json"
# errors of the file system being written (a full disk), reported naming the output
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}


def _refuse_existing(out: Path, force: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputExistsError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputExistsError(f"{out}: output folder exists and is not empty (use --force)")
        check_replaceable(out)


def _entries(folder: Path) -> list[str]:
    """Every file or link under `folder` (relative, sorted; links not followed). Empty folders
    hold no data and are not listed."""
    found: list[str] = []
    for top, dirs, files in os.walk(folder):
        rel = Path(top).relative_to(folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            found.append((rel / name).as_posix())
    return sorted(found)


def recorded_files(folder: Path, side: ExportRecord) -> set[str] | None:
    """The files the sidecar says the export wrote (each confined to `folder`, else the record
    is corrupt), or None for a sidecar of an mxcli that did not list them."""
    files = side.files
    if files is None:
        return None
    path = folder / SIDECAR
    if not isinstance(files, list):
        raise MxcliError(f"{path}: files is not a list; a corrupt export record")
    for i, rel in enumerate(files):
        confined(folder, rel, f"files[{i}]", path, "export record")
    return {Path(f).as_posix() for f in files}


def check_replaceable(out: Path) -> None:
    """``--force``: refuse (one line, naming a file) unless everything in `out` is a file its
    sidecar says this tool wrote there."""
    have = _entries(out)
    if not have:  # an empty folder holds nothing to lose
        return
    tip = "--force replaces only an export mxcli wrote; move it away or choose another folder"
    side = read_record(out)
    if side is None:
        raise OutputExistsError(
            f"{out}: holds {_some(have)} and no {SIDECAR}: not an mxcli export; {tip}"
        )
    files = recorded_files(out, side)
    if files is None:
        raise OutputExistsError(
            f"{out}: written by an mxcli that did not record its files in {SIDECAR}; "
            "remove the folder yourself to replace it"
        )
    unknown = [e for e in have if e != SIDECAR and e not in files]
    if unknown:
        raise OutputExistsError(f"{out}: holds {_some(unknown)}, not written by mxcli; {tip}")


def _some(names: list[str]) -> str:
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{names[0]}{more}" if names else "nothing"


@contextlib.contextmanager
def export_folder(out: Path, source: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it becomes `out` (see module doc)."""
    refuse_inputs(out, folders=[("checkpoint folder", source)])
    if out.name in ("", ".", ".."):  # no name to publish under beside it
        raise MxcliError(
            f"{out}: an export is published by renaming a new folder into place, which cannot "
            "be done to the current folder or its parent; give a folder name (such as ./export)"
        )
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise MxcliError(f"{out}: parent folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MxcliError(f"{out}: output folder {parent} is not writable")
    remove_dead_temporary_folders(out)
    _refuse_existing(out, force)
    try:
        with temporary_folder(out) as tmp:
            yield tmp
            _record_files(tmp)
            _publish(tmp, out, force)
    except OSError as exc:
        if isinstance(exc, MxcliError) or exc.errno not in _WRITE_ERRNOS:
            raise
        what = f"{out}"
        if exc.filename is not None:  # a file of the temporary folder: named as in OUT
            what = f"{out / Path(os.fsdecode(exc.filename)).name}"
        raise MxcliError(f"{what}: cannot write ({exc.strerror or exc}); nothing written") from None


def _record_files(tmp: Path) -> None:
    """Add the list of the files written to the sidecar (what a later --force may replace)."""
    path = tmp / SIDECAR
    if not path.is_file():
        return
    record = read_export_record(path)
    record.files = [e for e in _entries(tmp) if e != SIDECAR]
    write_export_record(path, record)


def _publish(tmp: Path, out: Path, force: bool) -> None:
    old = None
    if force and out.exists():
        check_replaceable(out)  # again: a file may have been added while this run worked
        old = aside_name(out)
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError as exc:
        if old is not None:
            os.rename(old, out)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise OutputExistsError(
                f"{out}: another writer created it meanwhile (use --force to replace)"
            ) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
    os.chmod(path, default_mode())


def write_record(folder: Path, plan: Any, output_format: str, result: dict[str, Any]) -> None:
    """Write the export's ``mxcli-export.json`` in `folder` (`ExportRecord`): what was exported
    from what, with its FP8 semantics and `result`."""
    write_export_record(folder / SIDECAR, new_export_record(plan, output_format, result))


def read_record(folder: Path) -> ExportRecord | None:
    """`folder`'s export record, or None where it has none."""
    p = folder / SIDECAR
    return read_export_record(p) if p.is_file() else None


def read_sidecar(folder: Path) -> dict[str, Any] | None:
    """`read_record` as JSON (for readers that show it whole)."""
    rec = read_record(folder)
    return None if rec is None else rec.to_dict()
