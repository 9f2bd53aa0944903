"""Run mxcli in a real subprocess, optionally with a slowed-down writer so that a signal can be
sent while a temporary output file exists, or with a signal raised at a chosen point (the
slowing and the signals are done here, in the test's script; the product has no such hook).

``signal-after=MODULE:FUNC:SIGNAME`` delivers the signal as soon as ``MODULE.FUNC`` returns, the
way a signal reaches a process whose other threads (torch's) leave it unblocked: to a helper
thread, whose C-level handler has run (it writes Python's wakeup fd) before the function
returns, so the Python handler runs in the main thread at its next instruction. No timing is
involved. ``kill-after=MODULE:FUNC`` SIGKILLs the process there instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

_SCRIPT = r"""
import sys, time
mode = sys.argv[1]
if mode == "slow-save":  # the safetensors file is complete, then the writer lingers
    import safetensors.torch as st
    real_save = st.save_file
    def save_file(*args, **kwargs):
        real_save(*args, **kwargs)
        time.sleep(120)
    st.save_file = save_file
elif mode.startswith("slow-pieces="):  # prep-weights: every tensor piece takes a while
    import mxcli.weightprep.writer as w
    delay = float(mode.split("=", 1)[1])
    real_write = w.StreamingWriter.write
    def write(self, name, piece):
        time.sleep(delay)
        return real_write(self, name, piece)
    w.StreamingWriter.write = write
elif mode.startswith(("signal-after=", "kill-after=")):
    import importlib, os, signal, threading
    kind, spec = mode.split("=", 1)
    mod_name, func_name, *sig_name = spec.split(":")
    mod = importlib.import_module(mod_name)
    real = getattr(mod, func_name)
    helper = threading.Thread(target=threading.Event().wait, daemon=True)
    helper.start()  # started now, before any signal mask: like torch's threads
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    def hooked(*args, **kwargs):
        result = real(*args, **kwargs)
        if kind == "kill-after":
            os.kill(os.getpid(), signal.SIGKILL)
        signal.pthread_kill(helper.ident, getattr(signal, sig_name[0]))
        os.read(wake_r, 1)  # the signal has been taken: its Python handler is due now
        return result
    setattr(mod, func_name, hooked)
from mxcli.cli import main
sys.argv = ["mxcli", *sys.argv[2:]]
main()
"""


def _default_sigint() -> None:
    # a shell running the tests in the background starts them with SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str], *, mode: str = "plain", cwd: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, mode, *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen, timeout: float = 120) -> None:
    """Poll until `cond()`; fail if the process ends first or the time runs out."""
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended early ({proc.returncode}): {out[-2000:]}{err}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the process")
        time.sleep(0.01)


def temporaries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob(".*") if p.is_file())
