"""AWS's NKI Library (``nkilib``, https://github.com/aws-neuron/nki-library): what mxcli knows
about the package, shared by the kernels' adapters (``<kernel>/nkilib.py``), which add AWS's
import path of their kernel and its refusals.

nkilib is optional: its implementations are probed (`probe`) before anything is imported, and a
missing package is one line naming how to install it (`INSTALL_HINT`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mxcli.kernels.selection import module_probe
from mxcli.kernels.spec import Implementation

NAME = "nkilib"  # the --kernel value
INSTALL_HINT = (
    "install AWS's NKI Library (git clone https://github.com/aws-neuron/nki-library && "
    "pip install -e nki-library) or pass --kernel-path DIR (the folder holding nkilib/)"
)
# the distribution names its version is looked up under (a source checkout has no __version__)
DISTRIBUTIONS = ("nki-library", "nkilib")


def probe() -> str | None:
    """None when the ``nkilib`` package is found on the path, else why not."""
    return module_probe("nkilib")


def implementation(
    kernel: str,
    *,
    modules: tuple[str, ...] = (),
    refusal: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> Implementation:
    """A kernel's nkilib implementation: `kernel` is the API reference's import path
    (``module:function``, the module being the package that re-exports the function or the
    submodule holding it), `modules` where newer nkilib versions define it, `refusal` the
    combinations its own ``kernel_assert``\\ s refuse."""
    return Implementation(
        NAME,
        kernel,
        probe=probe,
        modules=modules,
        refusal=refusal,
        install_hint=INSTALL_HINT,
        distributions=DISTRIBUTIONS,
        doc="AWS's NKI Library kernel (nkilib, the API reference's import path)",
    )


__all__ = ["DISTRIBUTIONS", "INSTALL_HINT", "NAME", "implementation", "probe"]
