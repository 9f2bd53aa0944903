"""Shared NKI runtime of mxcli's kernels: detection, kernel loading and launching.

mxcli's NKI kernels are written against the real NKI 0.6 API (``import nki``), and so are
third-party ones. This module runs them (`mxcli.kernels.launcher` prepares each launch):

- ``sim`` backend (`run_sim`): on the real ``nki.simulate`` when a real ``nki`` is importable
  (Neuron SDK), else on mxcli's interpreter `mxcli.nkisim`. Check-only mode (every hardware rule
  and SBUF/PSUM capacity, no arithmetic, with counters) exists only on the interpreter, so
  ``check_only=True`` always uses it.
- ``neuron`` backend (`run_neuron`): on a Trainium device through torch-neuronx — the torch-xla
  device for torch <= 2.9, ``device="neuron"`` with an ``nki_op`` custom op for torch >= 2.10
  (nki_execution.md §7.1). Nothing of it is imported until called.

The interpreter is never installed into ``sys.modules`` (a real ``nki`` is never shadowed): a
kernel module is loaded privately, its ``import nki`` statements resolved to the interpreter's
modules through the module's own ``__builtins__`` (`load_kernel_module`).

Tensors cross the boundary as NumPy arrays (sim) or device tensors (neuron): bf16 and fp8 keep
their dtype (ml_dtypes on the NumPy side), MX data crosses as uint8 / uint32 (nki_execution.md
§7.2), NKI has no 64-bit types (`to_numpy` refuses them).
"""

from __future__ import annotations

import builtins
import enum
import functools
import glob
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "DTypeName",
    "KernelObject",
    "SimEngine",
    "SimResult",
    "load_kernel_module",
    "neuron_unavailable_reason",
    "real_nki_available",
    "require_neuron",
    "resolve_kernel",
    "run_neuron",
    "run_sim",
    "sim_unavailable_reason",
    "to_numpy",
    "to_torch",
]


class SimEngine(str, enum.Enum):
    """Which simulator runs a kernel for the ``sim`` backend.

    - ``AUTO``: the real ``nki.simulate`` when importable, else the interpreter (check-only
      runs always use the interpreter).
    - ``REAL``: the Neuron SDK's ``nki.simulate`` (error when it is not importable).
    - ``INTERPRETER``: mxcli's `mxcli.nkisim` (always available; hardware rules and capacity
      checked, counters reported).
    """

    AUTO = "auto"
    REAL = "nki.simulate"
    INTERPRETER = "mxcli.nkisim"


@dataclass(frozen=True)
class DTypeName:
    """An NKI dtype named in kernel arguments (``DTypeName("float8_e4m3fn_x4")``).

    Backends cannot import ``nki.language``; the runtime replaces each `DTypeName` by the
    dtype object of the NKI flavour that runs the kernel.
    """

    name: str


@dataclass(frozen=True)
class KernelObject:
    """An ``nl.NKIObject`` kernel argument (a config), described on the host side.

    ``cls`` names the class, ``"package.module:Class"``, in the kernel module; ``fields`` are
    its constructor arguments (ints, floats, bools, strings, enums, `DTypeName`s). The runtime
    builds the instance from the kernel module loaded for the engine that runs the kernel, so
    the class and its dtypes are that engine's (a privately loaded interpreter module has its
    own class objects), and the object is built before the kernel is traced.
    """

    cls: str
    fields: tuple[tuple[str, Any], ...]


@dataclass
class SimResult:
    """Outputs of one simulated launch.

    ``outputs``: the kernel's returned HBM tensors as CPU torch tensors, in order.
    ``report``: the interpreter's `mxcli.nkisim.RunReport` (counters), None on ``nki.simulate``.
    ``engine``: which simulator ran (`SimEngine.REAL` or `SimEngine.INTERPRETER`).
    """

    outputs: list[torch.Tensor]
    report: Any
    engine: SimEngine


# -- detection ---------------------------------------------------------------------------------


def real_nki_available() -> bool:
    """Whether a real ``nki`` (Neuron SDK) imports; every exception counts as "no" (the PyPI
    placeholder raises on import). Never installs anything."""
    try:
        from mxcli import nkisim

        return bool(nkisim.real_nki_available())
    except Exception:  # pragma: no cover - the interpreter ships with mxcli
        return False


def sim_unavailable_reason() -> str | None:
    """None when the ``sim`` backend can run here (real ``nki.simulate`` or the interpreter),
    else a one-line reason."""
    if real_nki_available():
        return None
    try:
        importlib.import_module("mxcli.nkisim")
        importlib.import_module("ml_dtypes")
    except Exception as exc:  # detection never raises
        return f"neither the Neuron SDK's nki nor mxcli's interpreter is usable ({type(exc).__name__}: {exc})"
    return None


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except BaseException as exc:  # noqa: BLE001 - placeholders may raise anything, even SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        return False


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _native_neuron_torch() -> bool:
    """TorchNeuron (``device="neuron"`` + ``nki_op``) replaces torch-xla from torch 2.10 on."""
    return _torch_version() >= (2, 10)


@functools.lru_cache(maxsize=1)
def _neuron_missing() -> tuple[str, ...]:
    missing: list[str] = []
    if not real_nki_available():
        missing.append("the nki package of the Neuron SDK")
    if _native_neuron_torch():
        ok = False
        if _importable("torch_neuronx"):
            try:
                ok = hasattr(importlib.import_module("torch_neuronx"), "nki_op")
            except Exception:
                ok = False
        if not ok:
            missing.append(f"torch-neuronx with nki_op (TorchNeuron for torch {torch.__version__})")
    else:
        if not _importable("torch_neuronx"):
            missing.append("torch-neuronx")
        if not _importable("torch_xla"):
            missing.append(f"torch-xla (torch {torch.__version__} <= 2.9 runs NKI through XLA)")
    try:
        devices = glob.glob("/dev/neuron*")
    except Exception:
        devices = []
    if not devices:
        missing.append("a Neuron device (/dev/neuron*; a Trn3 instance)")
    return tuple(missing)


def neuron_unavailable_reason() -> str | None:
    """None when the ``neuron`` backend can run here, else a one-line reason listing everything
    that is missing (SDK packages, device). Never raises; imports nothing it does not need."""
    try:
        missing = _neuron_missing()
    except Exception as exc:  # detection never raises
        return f"neuron detection failed ({type(exc).__name__}: {exc})"
    if not missing:
        return None
    return "missing " + "; ".join(missing)


def require_neuron(kernel: str | None = None) -> None:
    """Raise `BackendUnavailableError` (naming `kernel` when given) listing what the ``neuron``
    backend misses here; return when it can run."""
    reason = neuron_unavailable_reason()
    if reason is not None:
        from mxcli.kernels.backends import BackendUnavailableError

        what = f" {kernel}" if kernel else ""
        raise BackendUnavailableError(f"backend: 'neuron' cannot run{what} here: {reason}")


# -- loading kernel modules ----------------------------------------------------------------------

_load_lock = threading.Lock()
_loaded: dict[tuple[str, SimEngine], types.ModuleType] = {}


def _interpreter_builtins() -> dict[str, Any]:
    """A ``__builtins__`` dict whose ``__import__`` resolves ``nki`` and its submodules to the
    interpreter's modules and everything else normally (no ``sys.modules`` change)."""
    from mxcli import nkisim

    shim = nkisim.shim_modules()
    real_import = builtins.__import__

    def _import(
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> types.ModuleType:
        if level == 0 and (name == "nki" or name.startswith("nki.")):
            if name not in shim:
                raise ModuleNotFoundError(f"No module named {name!r} in mxcli's NKI interpreter")
            # `import nki.isa` binds the top package; `from nki.isa import x` the submodule
            return shim[name] if fromlist else shim["nki"]
        if level > 0 and globals is not None and globals.get("__builtins__") is table:
            # a relative import inside a privately loaded kernel package: its modules are
            # loaded privately too (same builtins), so that their `nki` is the interpreter
            package = str(globals.get("__package__") or "")
            base = importlib.util.resolve_name("." * level + name, package)
            _private_submodule(base, table)
            for item in fromlist or ():
                if name == "":
                    _private_submodule(f"{base}.{item}", table)
        return real_import(name, globals, locals, fromlist, level)

    table = dict(vars(builtins))
    table["__import__"] = _import
    return table


def _private_submodule(fullname: str, table: dict[str, Any]) -> None:
    """Load module `fullname` of a privately loaded package (`load_kernel_module`) with the
    builtins `table`, registered under its private name; nothing when it is loaded already or
    is not a module file of the package (the normal import then answers)."""
    if fullname in sys.modules:
        return
    parent = sys.modules.get(fullname.rpartition(".")[0])
    path = getattr(parent, "__path__", None)
    if path is None:
        return
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__["__builtins__"] = table
    sys.modules[fullname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[fullname]
        raise


def load_kernel_module(module: str, engine: SimEngine = SimEngine.AUTO) -> types.ModuleType:
    """Import the NKI kernel module `module` (dotted name) for `engine`.

    ``REAL`` (or ``AUTO`` with the Neuron SDK installed): a normal import. ``INTERPRETER`` (or
    ``AUTO`` without it): a private copy of the module whose ``nki`` imports are the
    interpreter's, cached, registered in ``sys.modules`` only under a private alias
    (``<module>.__nkisim__``) — ``nki`` itself is never installed there. A package's modules
    reached by relative imports are loaded the same way, under ``<module>.__nkisim__.<name>``.
    """
    eng = _pick_engine(engine, check_only=False)
    key = (module, eng)
    with _load_lock:
        if key in _loaded:
            return _loaded[key]
        if eng is SimEngine.REAL:
            mod = importlib.import_module(module)
        else:
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                raise ModuleNotFoundError(f"No module named {module!r}")
            alias = f"{module}.__nkisim__"
            private = importlib.util.spec_from_file_location(alias, spec.origin)
            assert private is not None and private.loader is not None
            mod = importlib.util.module_from_spec(private)
            mod.__dict__["__builtins__"] = _interpreter_builtins()
            # registered under its private alias (dataclasses and pickling look modules up
            # there); the name cannot collide with `nki` or the module's public name
            sys.modules[alias] = mod
            try:
                private.loader.exec_module(mod)
            except BaseException:
                del sys.modules[alias]
                raise
        _loaded[key] = mod
        return mod


def resolve_kernel(kernel: str, engine: SimEngine = SimEngine.AUTO) -> Any:
    """``"package.module:attr"`` -> the kernel object (an ``nki.jit`` kernel) for `engine`."""
    module, _, attr = kernel.partition(":")
    if not attr:
        raise ValueError(f"kernel: expected 'module:attribute', got {kernel!r}")
    return getattr(load_kernel_module(module, engine), attr)


def _pick_engine(engine: SimEngine | str, check_only: bool) -> SimEngine:
    eng = SimEngine(engine)
    if check_only:
        if eng is SimEngine.REAL:
            raise ValueError("engine: check-only mode needs mxcli's interpreter, got nki.simulate")
        return SimEngine.INTERPRETER
    if eng is SimEngine.AUTO:
        return SimEngine.REAL if real_nki_available() else SimEngine.INTERPRETER
    if eng is SimEngine.REAL and not real_nki_available():
        from mxcli.kernels.backends import BackendUnavailableError

        raise BackendUnavailableError("engine: the Neuron SDK's nki.simulate is not importable")
    return eng


# -- tensor conversion ------------------------------------------------------------------------


def _ml_dtypes() -> Any:
    import ml_dtypes

    return ml_dtypes


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU NumPy copy of `t` with the NKI-compatible dtype.

    bf16 -> ``ml_dtypes.bfloat16``; fp8 e4m3fn / e5m2 -> the ml_dtypes fp8 types; e8m0 -> uint8
    (scale bytes); uint32 -> uint32 (x4 words); 64-bit and complex dtypes are refused (NKI has
    none: convert indices to int32 first).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_numpy: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype in (torch.int64, torch.float64, torch.uint64) or t.is_complex():
        raise TypeError(f"to_numpy: NKI has no {t.dtype} dtype (use int32 / float32)")
    host = t.detach().to("cpu").contiguous()
    md = _ml_dtypes()
    views: dict[torch.dtype, tuple[torch.dtype, Any]] = {
        torch.bfloat16: (torch.int16, md.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, md.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, md.float8_e5m2),
        torch.float8_e8m0fnu: (torch.uint8, np.uint8),
    }
    if host.dtype in views:
        via, np_dt = views[host.dtype]
        return host.view(via).numpy().copy().view(np_dt)
    if host.dtype == torch.bool:
        return host.to(torch.uint8).numpy().copy()
    return host.numpy().copy()


def to_torch(a: Any) -> torch.Tensor:
    """A CPU torch tensor from a NumPy array returned by a simulator (or a torch tensor as is).

    ml_dtypes bf16 / fp8 -> the torch dtype; e8m0 and the legacy IEEE e4m3 -> uint8 bytes.
    """
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu")
    arr = np.ascontiguousarray(np.asarray(a))
    md = _ml_dtypes()
    dt = arr.dtype
    if dt == np.dtype(md.bfloat16):
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    if dt == np.dtype(md.float8_e4m3fn):
        return torch.from_numpy(arr.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if dt == np.dtype(md.float8_e5m2):
        return torch.from_numpy(arr.view(np.uint8).copy()).view(torch.float8_e5m2)
    if dt in (np.dtype(md.float8_e8m0fnu), np.dtype(md.float8_e4m3)):
        return torch.from_numpy(arr.view(np.uint8).copy())
    return torch.from_numpy(arr.copy())


def _nl_module(engine: SimEngine) -> Any:
    if engine is SimEngine.INTERPRETER:
        from mxcli.nkisim.nki import language

        return language
    return importlib.import_module("nki.language")


def _convert_arg(
    x: Any, nl_mod: Any, convert: Callable[[torch.Tensor], Any], engine: SimEngine
) -> Any:
    if isinstance(x, torch.Tensor):
        return convert(x)
    if isinstance(x, DTypeName):
        return getattr(nl_mod, x.name)
    if isinstance(x, KernelObject):
        fields = {k: _convert_arg(v, nl_mod, convert, engine) for k, v in x.fields}
        return resolve_kernel(x.cls, engine)(**fields)
    return x


def _as_list(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


# -- sim -----------------------------------------------------------------------------------------


def _kernel_name(kernel: Any) -> str:
    if isinstance(kernel, str):
        return kernel
    fn = getattr(kernel, "fn", kernel)
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__name__', 'kernel')}"


def run_sim(
    kernel: str | Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    lnc: int = 1,
    check_only: bool = False,
    engine: SimEngine | str = SimEngine.AUTO,
    target: str = "trn3",
    uninit: str = "error",
    check_capacity: bool = True,
    serialize_programs: bool = False,
) -> SimResult:
    """Run the NKI kernel ``"module:attr"`` (or an already imported kernel object, for
    third-party kernels imported with ``nki`` installed, `mxcli.kernels.selection`) on a
    simulator.

    `args` / `kwargs`: torch tensors (converted with `to_numpy`; any device), `DTypeName`s,
    `KernelObject`s, Python scalars, enums, tuples, None. `lnc`: LNC degree (1 or 2; tokens/work split by the kernel).
    `check_only`: interpreter only — validate every rule and the SBUF/PSUM capacity and count
    instructions, skipping arithmetic (outputs are then meaningless zeros). `target`,
    `uninit`, `check_capacity`: interpreter options (`mxcli.nkisim.simulate`).
    `serialize_programs` (interpreter, LNC 2): run program 1 after program 0 has finished
    instead of concurrently. Only for kernels whose programs never communicate (no
    ``sendrecv`` / ``core_barrier``: it would deadlock); it sidesteps a race in the
    interpreter's matching of the programs' ``shared_hbm`` allocations, which can hand the two
    programs different output tensors when they allocate at the same time.
    """
    eng = _pick_engine(engine, check_only)
    kern = resolve_kernel(kernel, eng) if isinstance(kernel, str) else kernel
    nl_mod = _nl_module(eng)
    np_args = [_convert_arg(a, nl_mod, to_numpy, eng) for a in args]
    np_kwargs = {k: _convert_arg(v, nl_mod, to_numpy, eng) for k, v in (kwargs or {}).items()}
    if eng is SimEngine.REAL:
        nki = importlib.import_module("nki")
        launch = kern[lnc] if lnc != 1 else kern
        out = nki.simulate(launch)(*np_args, **np_kwargs)
        return SimResult([to_torch(o) for o in _as_list(out)], None, eng)
    from mxcli import nkisim

    if serialize_programs and lnc > 1:
        kern = _serialized(kern)
    out, report = nkisim.run_kernel(
        kern,
        np_args,
        np_kwargs,
        lnc=lnc,
        target=target,
        check_only=check_only,
        uninit=uninit,
        check_capacity=check_capacity,
    )
    return SimResult([to_torch(o) for o in _as_list(out)], report, eng)


def _serialized(kern: Any) -> Callable[..., Any]:
    """The kernel body made to run program by program (program p waits for p - 1 to finish)."""
    from mxcli.nkisim.nki import language

    fn = getattr(kern, "fn", kern)
    done = [threading.Event() for _ in range(8)]

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        pid = language.program_id(0)
        if pid > 0:
            done[pid - 1].wait()
        try:
            return fn(*args, **kwargs)
        finally:
            done[pid].set()

    return body


# -- neuron --------------------------------------------------------------------------------------

_op_cache: dict[Any, Callable[..., Any]] = {}
_op_lock = threading.Lock()


def _default_lnc() -> int:
    """``kernel[lnc]`` must match ``NEURON_LOGICAL_NC_CONFIG`` (default 2 on Trn2/Trn3)."""
    try:
        return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    except ValueError:
        return 2


def _native_op(
    kernel: str,
    lnc: int,
    positions: tuple[int, ...],
    statics: Any,
    call: Callable[..., Any],
) -> Callable[..., Any]:
    """A ``torch_neuronx.nki_op`` custom op taking the tensor arguments only (torch >= 2.10,
    nki_execution.md §7.1); non-tensor arguments are bound at registration (one op per
    distinct set of them)."""
    key = (kernel, lnc, positions, repr(statics))
    with _op_lock:
        if key in _op_cache:
            return _op_cache[key]
        from torch_neuronx import nki_op  # lazy: only on a Trainium host

        params = ", ".join(f"t{i}: torch.Tensor" for i in range(len(positions)))
        names = ", ".join(f"t{i}" for i in range(len(positions)))
        src = f"def _op({params}) -> list[torch.Tensor]:\n    return list(_call({names}))\n"
        ns: dict[str, Any] = {"torch": torch, "_call": call}
        exec(src, ns)  # custom ops infer their schema from a real, typed signature
        op_name = f"mxcli::{kernel.rpartition(':')[2]}_{len(_op_cache)}"
        op = nki_op(op_name, mutates_args={})(ns["_op"])
        _op_cache[key] = op
        return op


def run_neuron(
    kernel: str | Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    lnc: int | None = None,
) -> list[torch.Tensor]:
    """Run the NKI kernel ``"module:attr"`` on a Trainium device; outputs come back on CPU.

    Tensors move to the device as they are (bf16, fp8, and MX data as uint8 / uint32 — NKI's x4
    types have no torch equivalent, nki_execution.md §7.2). torch <= 2.9: the torch-xla device
    and ``kernel[lnc](...)``; torch >= 2.10: ``.to("neuron")`` and an ``nki_op`` custom op.
    Raises `BackendUnavailableError` listing what is missing when the SDK or device is absent.
    """
    require_neuron()
    n = int(lnc if lnc is not None else _default_lnc())
    kern = resolve_kernel(kernel, SimEngine.REAL) if isinstance(kernel, str) else kernel
    nl_mod = _nl_module(SimEngine.REAL)
    kernel = _kernel_name(kernel)
    launch = kern[n]
    all_args = list(args)
    kw = dict(kwargs or {})
    if _native_neuron_torch():
        # tensors by position (args then kwargs); everything else bound into the custom op
        flat: list[tuple[str | int, Any]] = list(enumerate(all_args)) + list(kw.items())
        positions = tuple(i for i, (_, v) in enumerate(flat) if isinstance(v, torch.Tensor))
        statics = [(k, _convert_arg(v, nl_mod, lambda t: t, SimEngine.REAL)) for k, v in flat]

        def call(*tensors: torch.Tensor) -> Any:
            vals = [v for _, v in statics]
            for pos, t in zip(positions, tensors, strict=True):
                vals[pos] = t
            pos_args = [v for (k, _), v in zip(flat, vals, strict=True) if isinstance(k, int)]
            kw_args = {k: v for (k, _), v in zip(flat, vals, strict=True) if isinstance(k, str)}
            return launch(*pos_args, **kw_args)

        op = _native_op(
            kernel,
            n,
            positions,
            [s for s in statics if not isinstance(s[1], torch.Tensor)],
            call,
        )
        dev_tensors = [flat[i][1].to("neuron") for i in positions]
        out = op(*dev_tensors)
    else:
        import torch_xla  # lazy: only on a Trainium host with torch <= 2.9

        dev = torch_xla.device() if hasattr(torch_xla, "device") else None
        if dev is None:
            import torch_xla.core.xla_model as xm

            dev = xm.xla_device()
        real = SimEngine.REAL
        dev_args = [_convert_arg(a, nl_mod, lambda t: t.to(dev), real) for a in all_args]
        dev_kw = {k: _convert_arg(v, nl_mod, lambda t: t.to(dev), real) for k, v in kw.items()}
        out = launch(*dev_args, **dev_kw)
    return [o.cpu() for o in _as_list(out)]
