"""Atomic output files: write to a temporary file in the same folder, then rename into place."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mxcli.errors import MxcliError, OutputExistsError


def check_output_path(path: str | os.PathLike[str], force: bool) -> Path:
    """Refuse an existing output without `force`; check that the folder is writable."""
    p = Path(path)
    if p.exists() and not force:
        raise OutputExistsError(f"{p}: output exists (use --force to overwrite)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise MxcliError(f"{p}: output folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise MxcliError(f"{p}: output folder {parent} is not writable")
    return p


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success rename it onto `path`.

    On any exception the temporary file is removed, so an interrupted run never leaves a
    partial output under the final name.
    """
    final = check_output_path(path, force)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
