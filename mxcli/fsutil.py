"""Output files: checked before any work, written to a temporary file beside them, renamed into
place, and never one of the command's inputs.

A temporary file is named ``.<final name>.<host>.<pid>.<random>.tmp`` and holds an exclusive
`flock` for as long as its writer lives, so a cleaner can tell a stale temporary (its writer was
killed: the kernel released the lock) from one still being written by another process
(`remove_stale_temporaries`); the next writer of the same output removes those of processes
gone from this host (`remove_dead_temporaries`).
Outputs get the mode a plain ``open(path, "w")`` would give (0644 under umask 022), not
``mkstemp``'s 0600.

Without ``force`` the finished temporary is published with an operation that fails when the
target exists (`publish`: ``renameat2(RENAME_NOREPLACE)``, else a hard link), so of two writers
racing for one new output exactly one wins and the other reports it; the existence check made
before the work only saves that work. With ``force`` the output is replaced atomically
(``rename``). `hold_folder` gives a run exclusive (or, for runs that share a folder on disjoint
parts, shared) use of an output folder.

A temporary folder (`temporary_folder`, for outputs published as a whole folder) is named
``.<final name>.<host>.<pid>.<kind>.tmp``: its writer holds an flock on it, and a later run
removes it (`remove_dead_temporary_folders`) once that process is gone from this host, so a
SIGKILLed writer leaves nothing for ever.

Signals are deferred, not blocked, while a temporary is created (`signals_deferred`): Python runs
its handlers in the main thread whichever thread the kernel delivered the signal to (torch's
worker threads do not block it), so only swapping the handler closes the window between
creating a temporary and arming its clean-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

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
        if r in f.parents:  # --force on it would replace the source's parent folder
            raise MxcliError(
                f"{out}: output folder contains the {what} {folder}; write it elsewhere"
            )


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


_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back for the block and deliver the first one that came
    at its end: their handlers raise, and one raised after a temporary exists but before its
    owner's clean-up is armed would leave it behind.

    The handlers are swapped for one that only notes the signal (see the module docstring for
    why a signal mask does not do). Python runs handlers in the main thread only, so in another
    thread nothing can raise and nothing needs deferring.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        caught.append(signum)

    previous: dict[int, Any] = {}
    for sig in _DEFERRED:
        handler = signal.getsignal(sig)
        if callable(handler):  # SIG_DFL / SIG_IGN raise nothing and are left alone
            previous[sig] = handler
            signal.signal(sig, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            previous[caught[0]](caught[0], None)  # raises (KeyboardInterrupt, Terminated)


def _locked_temporary(final: Path) -> tuple[int, Path]:
    """Create ``.<name>.<random>.tmp`` beside `final` and hold its flock.

    A cleaner may have removed the file between its creation and the lock (it was not yet
    locked, so it looked stale): then the path no longer names our file and we start again.
    """
    while True:
        fd, name = tempfile.mkstemp(
            prefix=f".{final.name}.{_host_tag()}.{os.getpid()}.",
            suffix=TEMP_SUFFIX,
            dir=final.parent or ".",
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
    remove_dead_temporaries(final)
    fd, tmp = -1, None
    try:
        try:
            with signals_deferred():  # an interrupt cannot land between creating and owning it
                fd, tmp = _locked_temporary(final)
            yield tmp
            if os.stat(tmp).st_mode & 0o777 != default_mode():  # a writer that replaced the file
                os.chmod(tmp, default_mode())
            publish(tmp, final, replace=force)
        except BaseException:
            if tmp is not None:
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
        if fd >= 0:
            os.close(fd)


def remove_dead_temporaries(final: Path) -> list[Path]:
    """Delete the temporary files of `final` (``.<name>.<host>.<pid>.<random>.tmp``) that a
    process gone from this host left (SIGKILLed: nothing could remove them then). The process
    id, not only the flock, decides: a writer that replaces its temporary (safetensors'
    ``save_file``) leaves the new file unlocked while it lives."""
    parent = final.parent if str(final.parent) else Path(".")
    pattern = re.compile(
        re.escape(f".{final.name}.{_host_tag()}.") + r"(?P<pid>\d+)\.[A-Za-z0-9_]+"
        + re.escape(TEMP_SUFFIX)
    )  # fmt: skip
    dead = [
        p.name
        for p in parent.glob(f".*{TEMP_SUFFIX}")
        if (m := pattern.fullmatch(p.name)) is not None and not _pid_alive(int(m["pid"]))
    ]
    return _remove_unlocked([parent / n for n in sorted(dead)])


def _remove_unlocked(paths: list[Path]) -> list[Path]:
    """Unlink each of `paths` that no process holds the flock of."""
    removed = []
    for p in paths:
        try:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(p)):
                p.unlink()
                removed.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


# ``.<final name>.<random>.tmp``: what `_locked_temporary` names (mkstemp's random part)
_TEMP_NAME = re.compile(r"\.(?P<final>.+)\.[A-Za-z0-9_]+" + re.escape(TEMP_SUFFIX))
_WRITER = re.compile(r"\.[A-Za-z0-9_-]+\.\d+$")


def remove_stale_temporaries(folder: Path, finals: re.Pattern[str] | None = None) -> list[Path]:
    """Delete the temporary files in `folder` whose writer is gone (see the module docstring);
    those another live process is writing are left alone. Only names `_locked_temporary`
    gives are considered, of outputs whose final name matches `finals` (default: any), so a
    file of the same look that mxcli did not write is kept. Returns the paths removed."""
    if not folder.is_dir():
        return []
    found = []
    for p in sorted(folder.glob(f".*{TEMP_SUFFIX}")):
        m = _TEMP_NAME.fullmatch(p.name)
        if m is None:
            continue
        final = _WRITER.sub("", m["final"])  # without the writer's host and pid
        if finals is None or finals.fullmatch(final):
            found.append(p)
    return _remove_unlocked(found)


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


# -- temporary folders of whole-folder outputs ------------------------------------------------------


def _host_tag() -> str:
    """This host's name as it goes into a temporary folder's name (no separators, bounded)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname() or "host")[:64]


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _named_folder(final: Path, kind: str) -> Path:
    parent = final.parent if str(final.parent) else Path(".")
    return parent / f".{final.name}.{_host_tag()}.{os.getpid()}.{kind}"


@contextlib.contextmanager
def temporary_folder(final: Path, kind: str = "export") -> Iterator[Path]:
    """A new folder ``.<name>.<host>.<pid>.<kind>.tmp`` beside `final`, held (flock) by this
    process for the block and removed when the block raises (an interrupt included: it is
    created with signals deferred, so no interrupt lands before its clean-up is armed). On
    success it is left for the caller to rename into place."""
    tmp = _named_folder(final, kind + TEMP_SUFFIX)
    fd = -1
    try:
        with signals_deferred():
            fd = _locked_temporary_folder(tmp)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def _locked_temporary_folder(tmp: Path) -> int:
    """Create `tmp` (a leftover of this pid is an earlier, finished use of it: replaced) and
    hold an flock on it; the descriptor."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()  # the umask gives its mode
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def aside_name(final: Path) -> Path:
    """Where a replaced output folder waits (``.<name>.<host>.<pid>.<kind>.old``) until its
    replacement is in place; a killed process's is cleaned by `remove_dead_temporary_folders`."""
    return _named_folder(final, "export.old")


def remove_dead_temporary_folders(final: Path, kind: str = "export") -> list[Path]:
    """Clean what killed writers of `final` left beside it: a temporary folder is removed, a
    replaced output waiting aside is put back when `final` is missing (the killed run had moved
    it aside and not yet published its own), else removed. Only those of a process gone from
    this host whose flock nobody holds; those of live or other hosts' processes are kept.
    Returns the paths removed or restored."""
    parent = final.parent if str(final.parent) else Path(".")
    pattern = re.compile(
        re.escape(f".{final.name}.") + r"(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\."
        + re.escape(kind) + r"\.(?P<what>tmp|old)"
    )  # fmt: skip
    done: list[Path] = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return done
    for p in entries:
        m = pattern.fullmatch(p.name)
        if m is None or m["host"] != _host_tag() or _pid_alive(int(m["pid"])):
            continue
        if p.is_symlink() or not p.is_dir():
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer lives after all (another PID namespace)
            os.close(fd)
            continue
        try:
            if m["what"] == "old" and not os.path.lexists(final):
                os.rename(p, final)
            else:
                shutil.rmtree(p)
            done.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


# -- paths read from a record ----------------------------------------------------------------------


def confined(
    base: Path,
    rel: object,
    key: str,
    record: Path,
    what: str = "manifest",
    error: type[MxcliError] = MxcliError,
) -> Path:
    """``base / rel`` for a path `rel` read from the file `record` under `key`, refused (one
    line naming the key and the path) unless it is a relative path that stays inside `base`,
    symbolic links resolved: a record may only name its own folder's files."""
    bad = None
    if not isinstance(rel, str) or not rel or "\0" in rel:
        bad = "not a relative path"
    elif os.path.isabs(rel) or ".." in Path(rel).parts:
        bad = f"outside {base}"
    else:  # a symbolic link on the way may lead out: resolved only where there is one
        root, cur = _resolved(base), _resolved(base)
        for part in Path(rel).parts:
            cur = cur / part
            if os.path.islink(cur):
                target = _resolved(base / rel)
                if target != root and root not in target.parents:
                    bad = f"outside {base} (it resolves to {target})"
                break
    if bad is not None:
        raise error(f"{record}: {key} is {rel!r}, {bad}; a corrupt {what}")
    return base / str(rel)
