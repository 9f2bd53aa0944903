"""Output files: checked before any work, written to a temporary file beside them, renamed into
place, and never one of the command's inputs.

A temporary file is named ``.<final name>.<random>.tmp`` and holds an exclusive `flock` for as long
as its writer lives, so a cleaner can tell a stale temporary (its writer was killed: the kernel
released the lock) from one still being written by another process (`remove_stale_temporaries`).
Outputs get the mode a plain ``open(path, "w")`` would give (0644 under umask 022), not
``mkstemp``'s 0600.

Without ``force`` the finished temporary is published with an operation that fails when the
target exists (`publish`: ``renameat2(RENAME_NOREPLACE)``, else a hard link), so of two writers
racing for one new output exactly one wins and the other reports it; the existence check made
before the work only saves that work. With ``force`` the output is replaced atomically
(``rename``). `hold_folder` gives a run exclusive (or, for runs that share a folder on disjoint
parts, shared) use of an output folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from mxcli.errors import InputError, MxcliError, OutputExistsError

TEMP_SUFFIX = ".tmp"
# errors of the file system being written (as opposed to a bad path, reported as it is)
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``os.umask`` can only
    be read by setting it, which races with other threads creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """0o666 less the umask: the mode of a file created with ``open(path, "w")``."""
    return 0o666 & ~current_umask()


def _resolved(p: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.path.realpath(p)))


def _same_file(a: Path, b: Path) -> bool:
    if _resolved(a) == _resolved(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def refuse_inputs(
    output: str | os.PathLike[str],
    inputs: Iterable[tuple[str, str | os.PathLike[str] | None]] = (),
    folders: Iterable[tuple[str, str | os.PathLike[str] | None]] = (),
) -> None:
    """Refuse an output that is one of the inputs (``(what, path)`` pairs) or lies in or is one
    of the input `folders` (the same path, a symlink or a hard link to it count alike)."""
    out = Path(output)
    for what, path in inputs:
        if path is not None and _same_file(out, Path(path)):
            raise MxcliError(f"{out}: this output would replace the {what} {path}")
    r = _resolved(out)
    for what, folder in folders:
        if folder is None:
            continue
        f = _resolved(folder)
        if r == f or f in r.parents:
            raise MxcliError(f"{out}: output inside the {what} {folder}; write it elsewhere")


def check_output_path(path: str | os.PathLike[str], force: bool) -> Path:
    """Refuse a folder, or an existing output without `force`; check that the folder is
    writable. Called before any work is done."""
    p = Path(path)
    if p.is_dir():
        raise MxcliError(f"{p}: is a folder; expected a file name")
    if p.exists() and not force:
        raise OutputExistsError(f"{p}: output exists (use --force to overwrite)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise MxcliError(f"{p}: output folder {parent} does not exist")
    if not parent.is_dir():
        raise MxcliError(f"{p}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise MxcliError(f"{p}: output folder {parent} is not writable")
    return p


def _locked_temporary(final: Path) -> tuple[int, Path]:
    """Create ``.<name>.<random>.tmp`` beside `final` and hold its flock.

    A cleaner may have removed the file between its creation and the lock (it was not yet
    locked, so it looked stale): then the path no longer names our file and we start again.
    """
    while True:
        fd, name = tempfile.mkstemp(
            prefix=f".{final.name}.", suffix=TEMP_SUFFIX, dir=final.parent or "."
        )
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(name)):
                os.fchmod(fd, default_mode())
                return fd, Path(name)
        except FileNotFoundError:
            pass
        os.close(fd)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1  # linux/fs.h
# what a kernel, libc or file system without renameat2's flag (or hard links) answers
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


def _renameat2_noreplace(src: Path, dst: Path) -> bool:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (musl has it too; macOS does not)
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(dst))


def publish(tmp: Path, final: Path, *, replace: bool) -> None:
    """Move the finished `tmp` onto `final`: replacing it atomically with `replace`, else only
    if `final` does not exist yet, atomically too (`OutputExistsError` when it does: another
    writer published first). Falls back to a hard link + unlink where renameat2 is missing, and
    to a checked rename on a file system that has neither."""
    if replace:
        os.replace(tmp, final)
        return
    try:
        if _renameat2_noreplace(tmp, final):
            return
        try:
            os.link(tmp, final)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            if final.exists():  # no atomic way on this file system: the best check there is
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(final)) from None
            os.rename(tmp, final)
            return
        os.unlink(tmp)
    except FileExistsError:
        raise OutputExistsError(
            f"{final}: output exists, written meanwhile by another process "
            "(use --force to overwrite)"
        ) from None


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success move it onto `path` (`publish`:
    without `force` only while `path` does not exist, so a racing writer cannot be replaced).

    On any exception (an interrupt included) the temporary file is removed, so an interrupted
    run never leaves a partial output under the final name nor a temporary one. An `OSError`
    while writing (a full disk) becomes an `MxcliError` naming the output.
    """
    final = check_output_path(path, force)
    fd, tmp = _locked_temporary(final)
    try:
        try:
            yield tmp
            if os.stat(tmp).st_mode & 0o777 != default_mode():  # a writer that replaced the file
                os.chmod(tmp, default_mode())
            publish(tmp, final, replace=force)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
    except OSError as exc:
        if isinstance(exc, MxcliError) or exc.errno not in _WRITE_ERRNOS:
            raise
        raise MxcliError(
            f"{final}: cannot write ({exc.strerror or exc}); nothing written"
        ) from None
    finally:
        os.close(fd)


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the temporary files in `folder` whose writer is gone (see the module docstring);
    those another live process is writing are left alone. Returns the paths removed."""
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.glob(f".*{TEMP_SUFFIX}")):
        try:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)  # NFS locks need write access
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked: a live writer
            os.close(fd)
            continue
        try:
            if os.path.samestat(os.fstat(fd), os.stat(p)):
                p.unlink()
                removed.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def utf8_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """A path string for libraries that accept only UTF-8 paths (safetensors' ``safe_open``
    rejects a name holding byte 0xff, which POSIX allows). A non-UTF-8 path is opened here and
    named by its descriptor (``/proc/self/fd/N``, ``/dev/fd/N``), valid inside the block; the
    library opens its own handle, which stays valid after it."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        yield text
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        for folder in ("/proc/self/fd", "/dev/fd"):
            if os.path.isdir(folder):
                yield f"{folder}/{fd}"
                return
        raise InputError(
            f"{display_path(path)}: the path is not valid UTF-8 and this system has no "
            "/proc/self/fd or /dev/fd to open it by; rename the file"
        )
    finally:
        os.close(fd)


def display_path(path: str | os.PathLike[str]) -> str:
    """A path for messages: bytes that are not UTF-8 shown as ``\\xff`` escapes (printing the
    raw surrogates would fail on a UTF-8 stdout)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


class FolderBusyError(MxcliError):
    """Another live process holds the folder (`hold_folder`)."""


@contextlib.contextmanager
def hold_folder(folder: Path, lock_name: str, *, shared: bool, busy: str) -> Iterator[None]:
    """Hold an flock on ``folder/lock_name`` for the block, or fail at once with `busy`.

    Exclusive by default: a run that rewrites the folder; ``shared``: runs that share it on
    disjoint parts (they exclude the exclusive kind only). The lock file is removed at the end
    when no other process holds it; one that a finishing run removed between our open and our
    lock is no lock, so it is taken again on the file the path names now. A killed holder's
    lock is released by the kernel: its file is left, unlocked, and taken by the next run.
    """
    path = folder / lock_name
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    tries = 0
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, default_mode())
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            tries += 1
            if tries > 3:
                raise FolderBusyError(f"{folder}: {busy}") from None
            time.sleep(0.05)  # a finishing holder takes it exclusively for a moment to remove it
            continue
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        try:  # the last holder removes the file (an upgrade fails while others hold it)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)
