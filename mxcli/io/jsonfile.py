"""The one JSON reader for user files and user strings (config.json, an index, a safetensors
header, a manifest, an export record, ``--config``, kwargs metadata).

Malformed JSON of any kind, a file that cannot be read, and nesting deeper than Python's
parser recurses (``RecursionError``: 100,000 ``[`` take it down) all become one `InputError`
line (or the caller's own error class) naming the file or field, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mxcli.errors import InputError


def loads(text: str | bytes, source: str, error: type[Exception] | None = None) -> Any:
    """`text` parsed as JSON; `error` (default `InputError`) naming `source` when it is not."""
    err = error or InputError
    try:
        return json.loads(text)
    except RecursionError:
        raise err(f"{source}: not valid JSON (nested too deeply for the JSON parser)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise err(f"{source}: not valid JSON ({exc})") from None


def read_json(
    path: str | Path, error: type[Exception] | None = None, label: str | None = None
) -> Any:
    """The JSON file at `path`, parsed (`loads`); an unreadable file is `error` too. `label`
    names it in the message (default: the path; e.g. ``"config: PATH"`` for a flag's file)."""
    label = label or str(path)
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise (error or InputError)(f"{label}: cannot read ({exc.strerror or exc})") from None
    return loads(text, label, error)


__all__ = ["loads", "read_json"]
