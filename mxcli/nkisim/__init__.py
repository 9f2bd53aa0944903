"""mxcli's NKI interpreter: run NKI 0.6 kernels on a plain CPU with the hardware rules checked.

Nothing is installed on import. `activate()` (or ``with installed():``) puts the kernel-facing
modules of the subpackage ``mxcli.nkisim.nki`` (``nki``, ``nki.language``, ``nki.isa``,
``nki.isa.constants``, ``nki.dtype``) into ``sys.modules`` — only when no real ``nki`` is
importable, so a Neuron SDK installation is never shadowed. `simulate` runs a kernel on the
interpreter (with target, check-only mode and counters); see README.md beside this file.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mxcli.nkisim.errors import (
    NkiCapacityError,
    NkiNotActiveError,
    NkiOutOfBoundsError,
    NkiUninitializedReadError,
    NkiValidationError,
)
from mxcli.nkisim.frontend import (
    FrontendViolation,
    NkiFrontendError,
    assert_frontend,
    check_frontend,
)
from mxcli.nkisim.kernel import Kernel, SimulatedKernel, run_kernel
from mxcli.nkisim.machine import Counters, RunReport, UninitPolicy, UninitRead
from mxcli.nkisim.rules import NkiRuleError, Rule
from mxcli.nkisim.target import TARGETS, Target

__all__ = [
    "Counters",
    "FrontendViolation",
    "Kernel",
    "NkiFrontendError",
    "NkiRuleError",
    "Rule",
    "NkiCapacityError",
    "NkiNotActiveError",
    "NkiOutOfBoundsError",
    "NkiUninitializedReadError",
    "NkiValidationError",
    "RunReport",
    "SimulatedKernel",
    "TARGETS",
    "Target",
    "UninitPolicy",
    "UninitRead",
    "activate",
    "assert_frontend",
    "check_frontend",
    "deactivate",
    "installed",
    "is_active",
    "real_nki_available",
    "run_kernel",
    "shim_modules",
    "simulate",
]

MODULE_NAMES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.dtype")
_real_cache: dict[str, bool] = {}


def _shim_modules() -> dict[str, types.ModuleType]:
    from mxcli.nkisim import nki
    from mxcli.nkisim.nki import dtype, isa, language
    from mxcli.nkisim.nki.isa import constants

    return {
        "nki": nki,
        "nki.language": language,
        "nki.isa": isa,
        "nki.isa.constants": constants,
        "nki.dtype": dtype,
    }


def shim_modules() -> dict[str, types.ModuleType]:
    """The interpreter's modules by the ``nki`` names they stand for (for private loaders that
    resolve ``import nki`` without touching ``sys.modules``)."""
    return _shim_modules()


def is_active() -> bool:
    """True when this interpreter's modules are the ones in ``sys.modules['nki']``."""
    mod = sys.modules.get("nki")
    return bool(mod is not None and getattr(mod, "__mxcli_nkisim__", False))


def real_nki_available() -> bool:
    """Whether a real ``nki`` package imports and looks like NKI (cached).

    Detection catches every exception: the PyPI placeholder ``nki`` raises on import. A failed
    attempt leaves no ``nki*`` entries behind in ``sys.modules``.
    """
    if "real" in _real_cache:
        return _real_cache["real"]
    mod = sys.modules.get("nki")
    if mod is not None and not getattr(mod, "__mxcli_nkisim__", False):
        _real_cache["real"] = True
        return True
    saved = {k: v for k, v in sys.modules.items() if k == "nki" or k.startswith("nki.")}
    for k in saved:
        del sys.modules[k]
    ok = False
    try:
        if importlib.util.find_spec("nki") is not None:
            real = importlib.import_module("nki")
            importlib.import_module("nki.language")
            importlib.import_module("nki.isa")
            ok = callable(getattr(real, "jit", None)) and callable(getattr(real, "simulate", None))
    except BaseException as exc:  # noqa: BLE001 - the placeholder may raise anything
        if isinstance(exc, KeyboardInterrupt):
            raise
        ok = False
    if not ok:
        for k in [k for k in sys.modules if k == "nki" or k.startswith("nki.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    _real_cache["real"] = ok
    return ok


def activate() -> bool:
    """Install the interpreter's ``nki`` modules into ``sys.modules``.

    Returns True when the interpreter is (now) active, False when a real ``nki`` is importable
    (then nothing is changed and ``import nki`` gives the real package).
    """
    if is_active():
        return True
    if real_nki_available():
        return False
    sys.modules.update(_shim_modules())
    return True


def deactivate() -> None:
    """Remove the interpreter's modules from ``sys.modules`` (a real ``nki`` is never touched)."""
    shim = _shim_modules()
    for name in MODULE_NAMES:
        if sys.modules.get(name) is shim[name]:
            del sys.modules[name]


@contextmanager
def installed() -> Iterator[bool]:
    """``with installed() as active:`` — the interpreter's modules for the block (active is
    False when a real ``nki`` is used instead); previous ``sys.modules`` entries are restored."""
    saved = {name: sys.modules.get(name) for name in MODULE_NAMES}
    was_active = is_active()
    active = activate()
    try:
        yield active
    finally:
        if active and not was_active:
            for name, mod in saved.items():
                if mod is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = mod


def simulate(
    kernel: Kernel | Callable[..., Any],
    lnc: int | None = None,
    *,
    target: str | Target | None = None,
    check_only: bool = False,
    uninit: UninitPolicy | str = UninitPolicy.ERROR,
    check_capacity: bool = True,
    sub_version: int | None = None,
    frontend: bool = True,
) -> SimulatedKernel:
    """``simulate(kernel[, lnc])(*arrays)`` on this interpreter, mirroring ``nki.simulate``.

    kernel: an ``@nki.jit`` kernel (``kernel[2]`` selects LNC=2) or a plain function.
    lnc: LNC degree, overriding ``kernel[lnc]``. target: "trn2" or "trn3" (default: the env
    override ``NEURON_PLATFORM_TARGET_OVERRIDE``, else the kernel's ``platform_target``, else
    trn3). check_only: run control flow, allocations and every check, skipping float arithmetic.
    uninit: "error" (default) | "warn" | "ignore" for reads of never-written memory.
    check_capacity: raise when live SBUF/PSUM bytes per partition exceed the budget.
    sub_version: the value ``nisa.get_nc_sub_version()`` returns (default 0).
    frontend: run the NKI 0.6 front-end check (`check_frontend`) before tracing (default on).
    The returned callable takes NumPy arrays or torch tensors and returns the same kind; its
    ``.report`` (a `RunReport`) holds the counters of the last call.
    """
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return SimulatedKernel(
        k,
        lnc=lnc,
        target=target,
        check_only=check_only,
        uninit=uninit,
        check_capacity=check_capacity,
        sub_version=sub_version,
        frontend=frontend,
    )
