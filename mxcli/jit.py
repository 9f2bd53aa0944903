"""numba's ``njit`` for mxcli's fused CPU kernels: cached on disk, said once, never fatal.

The fused kernels (`mxcli.mx._fused` and the references' ``_fused`` modules) take seconds to tens
of seconds to compile (42 s for a first reference run on a loaded 2-core EPYC, issue 28), so
they are cached on disk (numba's ``cache=True``): next to their source in ``__pycache__`` for an
editable or a writable install, else in numba's per-user cache folder (``~/.cache/numba`` or
``NUMBA_CACHE_DIR``). Where no cache folder can be written numba refuses ``cache=True`` at
decoration time; the kernels are then compiled per process instead of the import failing (which
would drop the caller to its slower pure-torch path). A compile that the cache cannot serve is
said once on stderr, when stderr is a terminal (a person is waiting; logs and pipes stay as
they are).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

_NOTE = "note: compiling numba kernels for this CPU, once (then cached on disk)"
_STATE = {"said": False, "listening": False}


def _say_once() -> None:
    if _STATE["said"]:
        return
    _STATE["said"] = True
    stream = sys.stderr
    try:
        if stream is not None and stream.isatty():
            print(_NOTE, file=stream, flush=True)
    except (OSError, ValueError):  # a closed stderr: nothing to say it on
        pass


def _listen() -> None:
    """Say `_NOTE` at numba's first real compile of one of mxcli's functions (numba triggers
    ``numba:compile`` only on a cache miss, after the on-disk cache was looked up)."""
    if _STATE["listening"]:
        return
    _STATE["listening"] = True
    from numba.core import event

    class _Listener(event.Listener):  # type: ignore[misc]
        def on_start(self, ev: Any) -> None:
            disp = (ev.data or {}).get("dispatcher")
            module = getattr(getattr(disp, "py_func", None), "__module__", "") or ""
            if module.startswith("mxcli."):
                _say_once()

        def on_end(self, ev: Any) -> None:
            pass

    event.register("numba:compile", _Listener())


def njit_cached(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, **options)``, or without the cache where numba cannot write
    one (see the module doc)."""
    from numba import njit

    _listen()

    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available for file ..."
            return njit(**options)(fn)

    return decorate
