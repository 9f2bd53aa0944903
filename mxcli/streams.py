"""The process's standard streams as the CLI needs them: a closed or broken stdout is not an error.

``mxcli verify ... | head -1`` closes the pipe once ``head`` has its line; ``mxcli ... >&-``
starts with no stdout at all. Neither is a failed check (exit 1) or a user error (exit 2), and
neither may print a traceback: what the command would still print is discarded, and its exit
code keeps its meaning (verify: 0 passed, 1 failed, 2 bad input). `guard_std_streams` is called
once, by the console entry point, before any command runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class PipeSafe:
    """A stream whose writes to a closed pipe are discarded: the first ``EPIPE`` points the
    file descriptor at ``/dev/null`` (so the bytes still buffered, and everything written
    later, go nowhere) instead of raising. Everything else is the wrapped stream's."""

    def __init__(self, stream: Any, fd: int) -> None:
        self._stream = stream
        self._fd = fd

    def _discard(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._fd)
        finally:
            os.close(null)

    def write(self, data: Any) -> int:
        try:
            return int(self._stream.write(data))
        except BrokenPipeError:
            self._discard()
            return len(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()
            try:  # the buffered bytes now go to /dev/null
                self._stream.flush()
            except OSError:
                pass

    @property
    def buffer(self) -> Any:  # click writes through the binary buffer of an ASCII stream
        inner = getattr(self._stream, "buffer", None)
        return None if inner is None else PipeSafe(inner, self._fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _usable(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def guard_std_streams() -> None:
    """Make stdout and stderr safe to write: a closed descriptor (``>&-``) becomes
    ``/dev/null``, and a pipe whose reader has gone discards what is written (`PipeSafe`)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if isinstance(stream, PipeSafe):
            continue
        if stream is None or not _usable(fd):
            # a descriptor opened now could take number `fd` and receive output meant for
            # nothing; open /dev/null on that very number instead
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            stream = open(fd, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        setattr(sys, name, PipeSafe(stream, fd))


def ascii_only() -> bool:
    """Whether the terminal's locale cannot show UTF-8 (``LANG=C``): progress bars and
    spinners then use ASCII. A non-UTF-8 stream encoding says so; so does Python's UTF-8 mode
    when nothing asked for it (``PYTHONUTF8``, ``-X utf8``): Python <= 3.14 turns it on by
    itself only when the locale is C or POSIX (PEP 540; PEP 538 also coerces the locale), and
    the streams then say utf-8 although the terminal's locale is C."""
    encoding = (getattr(sys.stderr, "encoding", None) or "").lower().replace("-", "")
    if not encoding.startswith("utf"):
        return True
    asked = os.environ.get("PYTHONUTF8") is not None or "utf8" in sys._xoptions
    return bool(sys.flags.utf8_mode) and not asked and sys.version_info < (3, 15)


def rich_console(**kwargs: Any) -> Any:
    """A rich ``Console(**kwargs)`` that draws with ASCII where the terminal's locale cannot
    show UTF-8 (`ascii_only`: rich's bars then use ``-`` instead of box-drawing glyphs)."""
    from rich.console import Console

    if not ascii_only():
        return Console(**kwargs)

    class AsciiConsole(Console):
        @property
        def encoding(self) -> str:
            return "ascii"

    return AsciiConsole(**kwargs)


def spinner_name() -> str:
    """rich's spinner for progress lines: braille dots, or ``-\\|/`` under `ascii_only`."""
    return "line" if ascii_only() else "dots"
