"""Backend registry: which implementation runs a kernel.

A backend is a callable with the kernel's exact signature (minus `backend`). Backends are
registered per kernel by name, either directly or lazily as a ``"module:function"`` string so
that optional stacks (the NKI interpreter, the Neuron SDK) are imported only when chosen.

Names in use:
- ``reference``: the kernel-faithful torch reference (any CPU or CUDA device).
- ``sim``: the NKI kernel on the real ``nki.simulate`` when importable, else on mxcli's interpreter.
- ``neuron``: the NKI kernel on a Trainium device through torch-neuronx.
- ``auto`` (not a backend, a choice): ``neuron`` when it is available, else ``reference``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mxcli.errors import MxcliError


class UnknownBackendError(MxcliError, ValueError):
    """The requested backend name is not registered for this kernel."""


class BackendUnavailableError(MxcliError, RuntimeError):
    """The backend is registered but cannot run here (missing SDK or device)."""


@dataclass
class _Entry:
    target: Callable[..., Any] | str
    # Returns None when the backend can run here, else a one-line reason.
    probe: Callable[[], str | None] | None = None

    def load(self) -> Callable[..., Any]:
        if callable(self.target):
            return self.target
        module_name, _, attr = self.target.partition(":")
        fn = getattr(importlib.import_module(module_name), attr)
        self.target = fn
        return fn


_REGISTRY: dict[str, dict[str, _Entry]] = {}


def register(
    kernel: str,
    backend: str,
    target: Callable[..., Any] | str,
    probe: Callable[[], str | None] | None = None,
) -> None:
    """Register `target` (a callable or ``"module:function"``) as `backend` for `kernel`."""
    _REGISTRY.setdefault(kernel, {})[backend] = _Entry(target, probe)


def backend_names(kernel: str) -> list[str]:
    """Registered backend names for `kernel`, in registration order."""
    return list(_REGISTRY.get(kernel, {}))


def unavailable_reason(kernel: str, backend: str) -> str | None:
    """None when `backend` can run `kernel` here, else why not."""
    entry = _REGISTRY.get(kernel, {}).get(backend)
    if entry is None:
        return f"backend {backend!r} is not registered for {kernel}"
    if entry.probe is None:
        return None
    try:
        return entry.probe()
    except Exception as exc:  # detection must never crash: treat as unavailable
        return f"{type(exc).__name__}: {exc}"


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
