"""Kernels, launches and ``simulate`` (api spec §3.1, §3.2).

`run_kernel` is the engine: it wraps array arguments as HBM tensors (sharing memory with the
caller's arrays, so in-place writes are visible), runs the body once per LNC program (two
threads under LNC=2, each with its own ``program_id`` and its own copy of the kernel's module
state, `mxcli.nkisim.cores`), checks capacity per program, and
converts the returned HBM tensors back to NumPy arrays or torch tensors.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import torch

from mxcli.nkisim import machine
from mxcli.nkisim.cores import program_entry
from mxcli.nkisim.dtypes import DType, dtype_of_numpy
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.frontend import assert_frontend
from mxcli.nkisim.machine import Program, Run, RunConfig, RunReport, UninitPolicy
from mxcli.nkisim.races import RaceTracker
from mxcli.nkisim.target import Target, nc_version, resolve_target
from mxcli.nkisim.tensor import MemoryRegion, NkiTensor, resolve, wrap_array

__all__ = ["Kernel", "jit", "simulate", "run_kernel", "SimulatedKernel", "TypedArg"]


class Kernel:
    """An ``@nki.jit`` kernel; ``kernel[lnc]`` sets the LNC degree (api spec §3.1)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        lnc: int | None = None,
        platform_target: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        while isinstance(fn, Kernel):  # stacked decorators
            fn = fn.fn
        self.fn: Callable[..., Any] = fn
        self.lnc = lnc
        self.platform_target = platform_target
        self.options = dict(options or {})
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc: Any) -> Kernel:
        if isinstance(lnc, tuple):
            if len(lnc) != 1:
                raise TypeError(
                    f"kernel[...]: the bracket holds exactly one int (the LNC degree), got {lnc!r}"
                )
            lnc = lnc[0]
        if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc < 1:
            raise TypeError(f"kernel[...]: the LNC degree must be a positive int, got {lnc!r}")
        return Kernel(self.fn, lnc, self.platform_target, self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if machine.current_or_none() is not None:
            return self.fn(*args, **kwargs)  # a kernel called from inside a kernel: inline
        outputs, _ = run_kernel(self, args, kwargs)
        return outputs

    def __repr__(self) -> str:
        return f"Kernel({getattr(self.fn, '__name__', self.fn)!r}, lnc={self.lnc})"


def jit(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``@nki.jit`` / ``@nki.jit(...)``. ``platform_target=`` and ``mode=`` are deprecated
    (api spec §3.1); ``platform_target`` is honoured when no explicit or env target is set."""
    pt = kwargs.pop("platform_target", None)
    if pt is not None or "mode" in kwargs:
        warnings.warn(
            "nki.jit(platform_target=..., mode=...) is deprecated since NKI 0.3; set "
            "NEURON_PLATFORM_TARGET_OVERRIDE instead",
            DeprecationWarning,
            stacklevel=2,
        )
    kwargs.pop("mode", None)

    def wrap(f: Callable[..., Any]) -> Kernel:
        return Kernel(f, None, pt, kwargs)

    return wrap(fn) if fn is not None else wrap


# -- argument conversion ---------------------------------------------------------------------


_TORCH_VIEW = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
    torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
}


def _torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing memory with a contiguous CPU tensor."""
    if t.dtype in _TORCH_VIEW:
        via, np_dt = _TORCH_VIEW[t.dtype]
        return t.view(via).numpy().view(np_dt)
    return t.numpy()


def _numpy_to_torch(a: np.ndarray, dt: DType) -> torch.Tensor:
    if dt.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if dt.name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    if dt.name == "float8_e5m2":
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e5m2)
    if dt.name in ("float8_e8m0fnu", "float8_e4m3"):
        return torch.from_numpy(a.view(np.uint8))
    return torch.from_numpy(a)


class _Arg:
    """One array argument: the HBM tensor and how to give results back to the caller."""

    def __init__(self, value: Any, name: str, buffer: MemoryRegion) -> None:
        declared: DType | None = None
        if isinstance(value, TypedArg):
            value, declared = value.value, value.dtype
        self.value = value
        self.is_torch = isinstance(value, torch.Tensor)
        self.copy_back: Callable[[], None] | None = None
        if self.is_torch:
            t = value
            if t.dtype in (torch.int64, torch.float64) or t.is_complex():
                raise TypeError(
                    f"argument {name}: NKI has no {t.dtype} dtype (use int32 / float32)"
                )
            host = t.detach()
            shared = host.device.type == "cpu" and host.is_contiguous()
            if not shared:
                host = host.cpu().contiguous()
            arr = _torch_to_numpy(host)
            if not shared:

                def back(t: torch.Tensor = t, host: torch.Tensor = host) -> None:
                    with torch.no_grad():
                        t.copy_(host.to(t.device))

                self.copy_back = back
        else:
            arr = value
            if not (arr.flags.c_contiguous and arr.flags.writeable):
                orig = arr
                arr = np.ascontiguousarray(arr).copy()
                if orig.flags.writeable:

                    def back_np(orig: np.ndarray = orig, arr: np.ndarray = arr) -> None:
                        orig[...] = arr

                    self.copy_back = back_np
        dt = dtype_of_numpy(arr.dtype)
        if dt is None:
            raise TypeError(
                f"argument {name}: dtype {arr.dtype} has no NKI equivalent (64-bit types are not "
                "supported; pass int32 / float32)"
            )
        if declared is not None:
            if declared.np_dtype != arr.dtype:
                raise TypeError(
                    f"argument {name}: declared {declared} needs {np.dtype(declared.np_dtype)} "
                    f"storage, got {arr.dtype}"
                )
            dt = declared
        self.array = arr
        self.tensor = wrap_array(arr, buffer, name, dt)


class TypedArg:
    """An array argument the launcher declares as an NKI dtype of the same storage (x4 MX data
    arrives as uint32 words: AWS's kernels tell MXFP8 x4 weights by their nki dtype, api spec
    §7.2 / dtypes.py), e.g. ``TypedArg(weights_u32, nl.float8_e4m3fn_x4)``."""

    def __init__(self, value: Any, dtype: DType) -> None:
        self.value = value
        self.dtype = dtype


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, torch.Tensor, TypedArg))


def _to_output(t: NkiTensor, like_torch: bool) -> Any:
    if t.buffer not in (MemoryRegion.private_hbm, MemoryRegion.shared_hbm):
        raise NkiValidationError(
            f"kernel return: {t.name or 'tensor'} is in {t.buffer.value}; kernels return HBM tensors"
        )
    acc = resolve(t, "kernel return", t.name or "output")
    arr = acc.read()
    return _numpy_to_torch(arr, t.dtype) if like_torch else arr


def _convert_outputs(res: Any, like_torch: bool) -> Any:
    if isinstance(res, NkiTensor):
        return _to_output(res, like_torch)
    if isinstance(res, (tuple, list)):
        return type(res)(_convert_outputs(r, like_torch) for r in res)
    if isinstance(res, dict):
        return {k: _convert_outputs(v, like_torch) for k, v in res.items()}
    return res


# -- running -----------------------------------------------------------------------------------


def run_kernel(
    kernel: Kernel | Callable[..., Any],
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    lnc: int | None = None,
    target: str | Target | None = None,
    check_only: bool = False,
    uninit: UninitPolicy | str = UninitPolicy.ERROR,
    check_capacity: bool = True,
    sub_version: int | None = None,
    frontend: bool = True,
) -> tuple[Any, RunReport]:
    """Run `kernel` on `args`; return ``(outputs, report)``.

    lnc: LNC degree (default: the kernel's ``[lnc]`` or 1). target: "trn2" / "trn3" (default:
    ``NEURON_PLATFORM_TARGET_OVERRIDE``, then the kernel's platform_target, then trn3).
    check_only: validate every rule and count, skipping float arithmetic (api issue: production
    shapes in seconds). uninit: what a read of never-written memory does. frontend: first check
    that everything the kernel reaches is inside the NKI 0.6 Python subset (`frontend`); raises
    `NkiFrontendError` listing every violation.
    """
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    kwargs = dict(kwargs or {})
    if frontend:
        assert_frontend(k.fn, args, kwargs)
    tgt = resolve_target(target, k.platform_target)
    if sub_version is not None:
        import dataclasses

        tgt = dataclasses.replace(tgt, sub_version=int(sub_version))
    n = int(lnc if lnc is not None else (k.lnc or 1))
    if n not in (1, 2) or (n == 2 and tgt.version < nc_version.gen3):
        raise NkiValidationError(
            f"launch: LNC degree must be 1{' or 2' if tgt.version >= nc_version.gen3 else ''} on "
            f"{tgt.name} (got {n})"
        )
    if not args and not kwargs:
        raise TypeError(f"{getattr(k.fn, '__name__', 'kernel')}: called with no arguments")
    config = RunConfig(
        target=tgt,
        lnc=n,
        check_only=bool(check_only),
        uninit=UninitPolicy(uninit),
        check_capacity=check_capacity,
    )
    run = Run(config, race=RaceTracker() if n > 1 else None)
    buffer = MemoryRegion.shared_hbm if n > 1 else MemoryRegion.private_hbm
    wrapped: list[_Arg] = []

    def wrap(x: Any, name: str) -> Any:
        if _is_array(x):
            a = _Arg(x, name, buffer)
            wrapped.append(a)
            return a.tensor
        return x

    names = _param_names(k.fn, len(args))
    targs = [wrap(a, nm) for a, nm in zip(args, names, strict=True)]
    tkwargs = {key: wrap(v, key) for key, v in kwargs.items()}
    like_torch = any(a.is_torch for a in wrapped)
    programs = [Program(run, i) for i in range(n)]
    # each logical core its own module state (cores.py): built here, before the threads start
    entries = [program_entry(k.fn, i, targs, tkwargs) for i in range(n)]
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []
    err_lock = threading.Lock()

    def body(i: int) -> None:
        prog = programs[i]
        try:
            fn, a, kw = entries[i]
            # the engines compute in IEEE arithmetic: a NaN or Inf input propagates as on the
            # device, and numpy's floating-point warnings about it are noise (issue 28); set
            # per thread, as numpy's error state is
            with machine.bind(prog), np.errstate(all="ignore"):
                results[i] = fn(*a, **kw)
                prog.finish_capacity()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            with err_lock:
                errors.append((i, exc))
            run.abort()
        finally:
            run.finish(i)

    if n == 1:
        body(0)
    else:
        threads = [
            threading.Thread(target=body, args=(i,), name=f"nki-program-{i}") for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if run.race is not None:
        run.race.enabled = False  # reading the outputs back is not an access by a core
    if errors:
        raise errors[0][1]
    with machine.bind(programs[0]):
        outputs = _convert_outputs(results[0], like_torch)
    for a in wrapped:
        if a.copy_back is not None:
            a.copy_back()
    report = RunReport(config, [p.counters for p in programs], run.uninit_reads())
    return outputs, report


def _param_names(fn: Callable[..., Any], n: int) -> list[str]:
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


class SimulatedKernel:
    """The callable returned by `simulate`; ``.report`` holds the last call's `RunReport`."""

    def __init__(self, kernel: Kernel, **options: Any) -> None:
        self.kernel = kernel
        self.options = options
        self.report: RunReport | None = None
        functools.update_wrapper(self, kernel.fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outputs, self.report = run_kernel(self.kernel, args, kwargs, **self.options)
        return outputs


def simulate(kernel: Any) -> SimulatedKernel:
    """``nki.simulate(kernel)`` (api spec §3.2): `kernel` is a Kernel (optionally ``k[2]``) or a
    plain function; the result runs it on NumPy arrays or torch tensors."""
    k = kernel if isinstance(kernel, Kernel) else Kernel(kernel)
    return SimulatedKernel(k)
