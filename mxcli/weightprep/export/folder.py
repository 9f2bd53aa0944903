"""Publishing an export folder: written under a temporary name beside OUT, renamed into place.

A folder is renamed onto OUT only where OUT does not exist (or is an empty folder): rename(2)
fails on a non-empty one, so two racing writers never replace each other's output, and an
interrupted run leaves no partial folder under the final name. ``--force`` moves an existing
OUT aside first and removes it after the new one is in place.
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

from mxcli import __version__
from mxcli.errors import MxcliError, OutputExistsError
from mxcli.fsutil import default_mode, refuse_inputs
from mxcli.io.jsonfile import read_json

SIDECAR = "mxcli-export.json"
FORMAT = "mxcli.export"


def _refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputExistsError(f"{out}: output folder exists and is not empty (use --force)")


@contextlib.contextmanager
def export_folder(out: Path, source: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it becomes `out` (see module doc)."""
    refuse_inputs(out, folders=[("checkpoint folder", source)])
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise MxcliError(f"{out}: parent folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MxcliError(f"{out}: output folder {parent} is not writable")
    _refuse_existing(out, force)
    tmp = parent / f".{out.name}.{os.getpid()}.export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()  # the umask gives its mode
    try:
        yield tmp
        _publish(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path, force: bool) -> None:
    old = None
    if force and out.exists():
        old = out.parent / f".{out.name}.{os.getpid()}.old"
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


def sidecar(plan: Any, output_format: str, extra: dict[str, Any]) -> dict[str, Any]:
    """``mxcli-export.json``: what was exported from what, with its FP8 semantics."""
    m = plan.model
    return {
        "format": FORMAT,
        "output_format": output_format,
        "tool": {"name": "mxcli", "version": __version__},
        "source": {
            "path": str(plan.source),
            "family": m.family.name,
            "model_type": plan.model_type,
            "source_format": plan.source_format,
            "fp8": plan.source_fp8,
        },
        "model": {
            "num_layers": m.num_layers,
            "moe_layers": plan.layers,
            "num_experts": m.E,
            "hidden_size": m.H,
            "intermediate_size": m.I,
        },
        "settings": plan.options.settings(),
        "fp8": plan.options.fp8().to_dict(),
        **extra,
    }


def read_sidecar(folder: Path) -> dict[str, Any] | None:
    p = folder / SIDECAR
    if not p.is_file():
        return None
    data = read_json(p, MxcliError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise MxcliError(f"{p}: not an mxcli export sidecar")
    return data
