"""The one launcher of every kernel's NKI implementations on the ``sim`` and ``neuron`` backends
(issue 32): mxcli's own kernels and third-party ones (``nkilib``, ``MODULE:FUNCTION``).

A kernel supplies only its host-side preparation, as hooks on its spec
(`mxcli.kernels.spec.NkiLaunch`): the call object from the arguments (validation), the planned
arguments of mxcli's own kernel, the API-named arguments of a third-party entry point
(`mxcli.kernels.spec.ThirdParty`), and the outputs in the reference's form. Which implementation
runs is `mxcli.kernels.selection`'s; how tensors cross into a simulator or onto a device is
`mxcli.kernels.nki_runtime`'s.

mxcli's own kernels run under ``uninit="error"``. A third-party kernel runs as the real simulator
would: on mxcli's interpreter a read of never-written memory is a warning naming its kernel sites
and counted (`SimResult.report.uninit_reads`); its ``kernel_assert`` is a
`selection.KernelUnsupportedError`; its compile-time prints go to stderr (stdout carries the
commands' ``--json`` results).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Mapping
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels import nki_runtime, selection
from mxcli.kernels.nki_runtime import SimEngine, SimResult
from mxcli.kernels.selection import ImplementationChoice
from mxcli.kernels.spec import KernelSpec, NkiLaunch, get_spec, load_target

__all__ = ["launch_sim", "run_neuron", "run_sim"]


def _launch(kernel: str | KernelSpec) -> tuple[KernelSpec, NkiLaunch]:
    spec = get_spec(kernel)
    if spec.nki is None:
        raise InputError(f"kernel: {spec.name} has no NKI implementation")
    return spec, spec.nki


def launch_sim(
    kernel: str | KernelSpec,
    /,
    *args: Any,
    lnc: int | None = None,
    check_only: bool = False,
    engine: SimEngine | str = SimEngine.AUTO,
    check_capacity: bool = True,
    implementation: Any = None,
    **kwargs: Any,
) -> SimResult:
    """Run an NKI implementation of `kernel` on a simulator; the full `SimResult` (outputs in the
    reference's form, the interpreter's counters, the engine that ran).

    Arguments: the kernel's call object, or those of its public function (validated here).
    `lnc`: 1 or 2 programs (default: the kernel's, `NkiLaunch.lnc`). `check_only` (interpreter
    only): every hardware rule and the SBUF/PSUM capacity are checked, arithmetic is skipped
    (outputs are then meaningless). `engine` forces a simulator for mxcli's kernel (a third-party
    one runs on the ``nki`` it was imported with). `implementation`: ``"mxcli"`` (default),
    ``"nkilib"``, ``"MODULE:FUNCTION"`` or a `selection.ImplementationChoice`.
    """
    spec, nki = _launch(kernel)
    choice = selection.parse_implementation(implementation, spec)
    call = nki.hook("as_call")(*args, **kwargs)
    n = nki.lnc if lnc is None else lnc
    if choice.is_own:
        pos, kw = nki.hook("prepare")(call)
        res = nki_runtime.run_sim(
            choice.implementation.kernel,
            pos,
            kw,
            lnc=n,
            check_only=check_only,
            engine=engine,
            check_capacity=check_capacity,
        )
        selection.record(choice, res.engine.value, res.report)
    else:
        res = _third_party_sim(
            choice, call, nki, lnc=n, check_only=check_only, check_capacity=check_capacity
        )
    res.outputs = list(nki.hook("finish")(call, res.outputs))
    return res


def run_sim(kernel: str | KernelSpec, /, *args: Any, **kwargs: Any) -> Any:
    """The ``sim`` backend: `launch_sim`'s outputs, as the reference returns them."""
    spec, nki = _launch(kernel)
    return nki.result(launch_sim(spec, *args, **kwargs).outputs)


def run_neuron(
    kernel: str | KernelSpec,
    /,
    *args: Any,
    lnc: int | None = None,
    implementation: Any = None,
    **kwargs: Any,
) -> Any:
    """The ``neuron`` backend: an NKI implementation of `kernel` on a Trainium (Trn3) device
    through torch-neuronx, its outputs as the reference returns them.

    `lnc`: the launch's LNC degree (default ``NEURON_LOGICAL_NC_CONFIG``, else 2). Raises
    `BackendUnavailableError` listing what is missing (SDK packages, device) before validating
    anything.
    """
    spec, nki = _launch(kernel)
    choice = selection.parse_implementation(implementation, spec)
    nki_runtime.require_neuron(spec.name if choice.is_own else selection.describe_name(choice))
    call = nki.hook("as_call")(*args, **kwargs)
    if choice.is_own:
        pos, kw = nki.hook("prepare")(call)
        outs = nki_runtime.run_neuron(choice.implementation.kernel, pos, kw, lnc=lnc)
    else:
        kw = _entry_arguments(choice, _api_arguments(choice, call, nki))
        with contextlib.redirect_stdout(sys.stderr):
            outs = nki_runtime.run_neuron(_jit(selection.load(choice)), (), kw, lnc=lnc)
    selection.record(choice, "neuron", None)
    return nki.result(nki.hook("finish")(call, list(outs)))


# -- third-party entry points -----------------------------------------------------------------


def _api_arguments(choice: ImplementationChoice, call: Any, nki: NkiLaunch) -> dict[str, Any]:
    """The call's arguments by the API reference's names (`ThirdParty.arguments`)."""
    if nki.third_party is None:
        raise InputError(f"kernel: {choice.label}: {choice.kernel} runs only mxcli's own kernel")
    return load_target(nki.third_party.arguments, "arguments")(call)  # type: ignore[no-any-return]


def _entry_arguments(choice: ImplementationChoice, args: Mapping[str, Any]) -> dict[str, Any]:
    """The entry's keyword arguments: the API-named ones adapted to the entry
    (`selection.api_arguments`), int64 index tensors as int32 (NKI has no 64-bit types)."""
    kw = selection.api_arguments(choice, args)
    return {
        k: v.to(torch.int32) if isinstance(v, torch.Tensor) and v.dtype == torch.int64 else v
        for k, v in kw.items()
    }


def _jit(kern: Any) -> Any:
    """A plain traced function (an nkilib entry point can be one) wrapped as the active nki's
    jit kernel."""
    if hasattr(kern, "__getitem__"):
        return kern
    return importlib.import_module("nki").jit(kern)


def _third_party_sim(
    choice: ImplementationChoice,
    call: Any,
    nki: NkiLaunch,
    *,
    lnc: int,
    check_only: bool,
    check_capacity: bool,
) -> SimResult:
    """Run a third-party entry point on the ``nki`` it was imported with: the Neuron SDK's
    ``nki.simulate`` when that is installed, else mxcli's interpreter with ``uninit="warn"``."""
    from mxcli import nkisim

    args = _api_arguments(choice, call, nki)
    kw = _entry_arguments(choice, args)
    kern = _jit(selection.load(choice))
    real = nkisim.real_nki_available()
    third = nki.third_party
    if not real and third is not None and third.interpreter_arguments is not None:
        load_target(third.interpreter_arguments, "interpreter_arguments")(args, kw)
    if real and check_only:
        raise InputError(
            f"kernel: {choice.label} was imported with the Neuron SDK's nki; check-only mode "
            "needs mxcli's interpreter"
        )
    engine = SimEngine.REAL if real else SimEngine.INTERPRETER
    try:
        # a kernel's compile-time prints (nkilib's logger prints) go to stderr: stdout carries
        # the commands' --json results
        with contextlib.redirect_stdout(sys.stderr):
            res = nki_runtime.run_sim(
                kern,
                (),
                kw,
                lnc=lnc,
                check_only=check_only,
                engine=engine,
                uninit="warn",
                check_capacity=check_capacity,
            )
    except AssertionError as exc:
        if not selection.is_kernel_refusal(exc):
            raise
        raise selection.KernelUnsupportedError(
            f"kernel: {selection.describe_name(choice)} refused this launch: {_short(str(exc))}"
        ) from None
    selection.record(choice, engine.value, res.report)
    return res


def _short(message: str) -> str:
    """A kernel_assert message without its boilerplate (``[INTERNAL_ERROR] [NCC_...] ...``)."""
    text = " ".join(message.split())
    marker = "Kernel validation exception:"
    if marker in text:
        text = text.split(marker, 1)[1]
        text = text.split(" - Please check", 1)[0]
    return text.strip()[:300]
