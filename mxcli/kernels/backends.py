"""Backend registry: which backend runs a kernel (which NKI implementation the ``sim`` and
``neuron`` backends launch is `mxcli.kernels.selection`'s).

A backend is a callable taking the kernel's validated call object (`PrefillCall`, `BwdCall`,
see `mxcli.kernels.spec`). Backends are registered per kernel by name, either directly or lazily as a ``"module:function"`` string so
that optional stacks (the NKI interpreter, the Neuron SDK) are imported only when chosen.

Names in use:
- ``reference``: the kernel-faithful torch reference (any CPU or CUDA device).
- ``sim``: the NKI kernel on the real ``nki.simulate`` when importable, else on mxcli's interpreter.
- ``neuron``: the NKI kernel on a Trainium device through torch-neuronx.
- ``auto`` (not a backend, a choice): ``neuron`` when it is available, else ``reference``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mxcli.errors import MxcliError
from mxcli.kernels.spec import find_spec, load_target, probe_reason


class UnknownBackendError(MxcliError, ValueError):
    """The requested backend name is not registered for this kernel."""


class BackendUnavailableError(MxcliError, RuntimeError):
    """The backend is registered but cannot run here (missing SDK or device)."""


@dataclass
class _Entry:
    target: Callable[..., Any] | str
    # Returns None when the backend can run here, else a one-line reason (callable or
    # "module:function", loaded lazily).
    probe: Callable[[], str | None] | str | None = None

    def load(self) -> Callable[..., Any]:
        self.target = load_target(self.target, "backend")
        return self.target


_REGISTRY: dict[str, dict[str, _Entry]] = {}


def register(
    kernel: str,
    backend: str,
    target: Callable[..., Any] | str,
    probe: Callable[[], str | None] | str | None = None,
) -> None:
    """Register `target` (a callable or ``"module:function"``) as `backend` for `kernel`."""
    _REGISTRY.setdefault(kernel, {})[backend] = _Entry(target, probe)


def _launcher(which: str, kernel: str, *args: Any, **kwargs: Any) -> Any:
    """`mxcli.kernels.launcher`'s ``run_sim`` / ``run_neuron`` of `kernel`, imported now."""
    return load_target(f"mxcli.kernels.launcher:{which}", "launcher")(kernel, *args, **kwargs)


def register_nki(kernel: str) -> None:
    """Register the ``sim`` and ``neuron`` backends of `kernel`: the one launcher
    (`mxcli.kernels.launcher`) with the hooks of the kernel's spec (`NkiLaunch`). Nothing of the
    NKI stack is imported until one of them is chosen or probed."""
    register(
        kernel,
        "sim",
        functools.partial(_launcher, "run_sim", kernel),
        "mxcli.kernels.nki_runtime:sim_unavailable_reason",
    )
    register(
        kernel,
        "neuron",
        functools.partial(_launcher, "run_neuron", kernel),
        "mxcli.kernels.nki_runtime:neuron_unavailable_reason",
    )


_ORDER = {"reference": 0, "sim": 1, "neuron": 2}


def _ensure_loaded(kernel: str) -> None:
    """Import the kernel's package (through its spec) so that its backends are registered."""
    if kernel not in _REGISTRY:
        find_spec(kernel)


def backend_names(kernel: str) -> list[str]:
    """Registered backend names for `kernel`: reference, sim, neuron, then any others."""
    _ensure_loaded(kernel)
    return sorted(_REGISTRY.get(kernel, {}), key=lambda n: (_ORDER.get(n, 99), n))


def unavailable_reason(kernel: str, backend: str) -> str | None:
    """None when `backend` can run `kernel` here, else why not."""
    _ensure_loaded(kernel)
    entry = _REGISTRY.get(kernel, {}).get(backend)
    if entry is None:
        return f"backend {backend!r} is not registered for {kernel}"
    return probe_reason(entry.probe)


def availability(kernel: str) -> dict[str, str | None]:
    """Map backend name -> None (available) or the reason it is not."""
    return {name: unavailable_reason(kernel, name) for name in backend_names(kernel)}


def resolve_name(kernel: str, backend: str) -> str:
    """Turn ``auto`` into a concrete backend name; check that the name exists."""
    names = backend_names(kernel)
    if backend == "auto":
        if "neuron" in names and unavailable_reason(kernel, "neuron") is None:
            return "neuron"
        return "reference"
    if backend not in names:
        raise UnknownBackendError(
            f"backend: unknown backend {backend!r} for {kernel}; available: "
            + ", ".join(["auto", *names])
        )
    return backend


def get(kernel: str, backend: str = "reference") -> Callable[..., Any]:
    """The callable implementing `kernel` on `backend` (``auto`` allowed)."""
    name = resolve_name(kernel, backend)
    reason = unavailable_reason(kernel, name)
    if reason is not None:
        raise BackendUnavailableError(f"backend: {name!r} cannot run {kernel} here: {reason}")
    return _REGISTRY[kernel][name].load()


@dataclass(frozen=True)
class Resolved:
    """What runs a kernel call: the concrete backend, the callable taking the kernel's call
    object, and the NKI implementation it launches (None for a backend that runs no NKI kernel,
    or for mxcli's own kernel when none was chosen)."""

    backend: str
    run: Callable[..., Any]
    implementation: Any = None  # a `selection.ImplementationChoice`


def resolve(kernel: str, backend: str = "auto", implementation: Any = None) -> Resolved:
    """The one resolution of a call: `backend` (``auto`` allowed) for `kernel`, available here,
    and the NKI implementation the ``sim`` / ``neuron`` backends launch (``--kernel``: mxcli's
    own when None, ``nkilib``, ``MODULE:FUNCTION`` or a parsed choice; `mxcli.kernels.selection`).
    A non-default implementation with a backend that runs no NKI kernel is an error."""
    from mxcli.kernels import selection

    name = resolve_name(kernel, backend)
    extra = selection.backend_kwargs(implementation, name, kernel)
    fn = get(kernel, name)
    choice = extra.get("implementation")
    return Resolved(name, functools.partial(fn, **extra) if extra else fn, choice)
