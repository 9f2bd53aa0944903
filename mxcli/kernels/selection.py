"""Which NKI implementation runs a kernel: the one mechanism behind ``--kernel`` (issue 20, 32).

A user picks the implementation with ``--kernel mxcli|nkilib|MODULE:FUNCTION`` (``kernel=`` in
the Python API); the ``sim`` and ``neuron`` backends run it (`mxcli.kernels.launcher`). The
candidates are the implementations each kernel's `mxcli.kernels.spec.KernelSpec` registers
(`mxcli.kernels.spec.Implementation`: mxcli's own, AWS's nkilib from the kernel's adapter module)
and any ``MODULE:FUNCTION`` with the API reference's signature. This module knows no kernel: what
is kernel-specific (import targets, refusals, the argument conversion) is on the spec.

`parse_implementation` checks the form only. `load` imports the entry point: the implementation's
probe first (its one-line reason, e.g. nkilib not installed, is the error), then the module, with
mxcli's interpreter installed as ``nki`` when the Neuron SDK is absent (`mxcli.nkisim.activate`,
so that the module's ``import nki`` works unchanged). `describe` names what ran (module file, its
sha256, the version or git commit when known) for output metadata and the verify report.
`resolve_for` tells, per kernel of a suite, whether the choice runs it (`NotRunnable` otherwise).

Third-party entry points are launched with the API reference's argument names (``api/*.txt``):
the kernel's `mxcli.kernels.spec.ThirdParty` gives them (and converts what needs the entry's own
classes, e.g. the backward's config); here, only the entry's parameters are passed, enums as the
entry's own (by member name). An mxcli argument the entry lacks is an error naming it and the
entry point (unless it is None or mxcli's default of an mxcli-only argument), never dropped: the
kernel would run on its own default instead. A combination an implementation refuses is a
`KernelUnsupportedError`: known refusals (`Implementation.refusal`) before the launch, a
``kernel_assert`` raised by the kernel itself the same way (`is_kernel_refusal`).
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import sys
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxcli.errors import InputError
from mxcli.kernels.spec import Implementation, KernelSpec, ThirdParty, get_spec, load_target

__all__ = [
    "MXCLI",
    "MODULE",
    "Entry",
    "ImplementationChoice",
    "KernelLoadError",
    "KernelUnsupportedError",
    "Launch",
    "NotRunnable",
    "api_arguments",
    "backend_kwargs",
    "describe",
    "describe_line",
    "describe_name",
    "entry",
    "is_kernel_refusal",
    "load",
    "module_probe",
    "parse_implementation",
    "record",
    "recording",
    "refusal",
    "resolve_for",
]

MXCLI = "mxcli"  # the default: mxcli's own kernel
MODULE = "module"  # the kind of an ad-hoc MODULE:FUNCTION choice


def module_probe(root: str) -> str | None:
    """None when the top-level package `root` is found on the path, else why not (never raises):
    the probe of an optional third-party implementation."""
    try:
        found = importlib.util.find_spec(root) is not None
    except Exception as exc:  # detection never raises
        return f"module {root!r} cannot be looked up ({type(exc).__name__}: {exc})"
    return None if found else f"module {root!r} is not importable"


class KernelLoadError(InputError):
    """The chosen implementation cannot be imported or is not a kernel (one line, exit code 2)."""


class KernelUnsupportedError(InputError):
    """The chosen implementation refuses this combination of arguments (known, or its
    kernel_assert)."""


@dataclass(frozen=True)
class ImplementationChoice:
    """A parsed ``--kernel`` value for one kernel.

    ``label``: as given (``mxcli``, ``nkilib``, ``pkg.mod:fn``); ``kernel``: the kernel's name
    (its public function's); ``implementation``: the spec's registered one, or an ad-hoc one for
    ``MODULE:FUNCTION``; ``path``: the ``--kernel-path`` folder put in front of ``sys.path``
    before importing, if any.
    """

    label: str
    kernel: str
    implementation: Implementation
    path: str | None = None

    @property
    def is_own(self) -> bool:
        """mxcli's own kernel (run under ``uninit="error"``)."""
        return self.implementation.own

    @property
    def kind(self) -> str:
        """The registered implementation's name (``mxcli``, ``nkilib``), else `MODULE`."""
        name = self.implementation.name
        return name if name == self.label and ":" not in name else MODULE

    @property
    def module(self) -> str:
        return self.implementation.module

    @property
    def function(self) -> str:
        return self.implementation.function


@dataclass(frozen=True)
class NotRunnable:
    """Why a choice cannot run a kernel's cases here (`resolve_for`): they are skipped with it."""

    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass
class _Loaded:
    kernel: Any
    module: types.ModuleType
    function: str
    info: dict[str, Any] = field(default_factory=dict)


_lock = threading.Lock()
_cache: dict[ImplementationChoice, _Loaded] = {}


def parse_implementation(
    text: str | ImplementationChoice | None,
    kernel: str | KernelSpec,
    kernel_path: str | os.PathLike[str] | None = None,
) -> ImplementationChoice:
    """The ``--kernel`` value `text` (default: mxcli's own kernel) for `kernel` (a name, short
    name or spec): one of the spec's implementations or ``MODULE:FUNCTION``; the form only."""
    spec = get_spec(kernel)
    if isinstance(text, ImplementationChoice):
        if text.kernel != spec.name:
            return parse_implementation(
                text.label, spec, text.path if kernel_path is None else kernel_path
            )
        return text
    own = spec.own_implementation
    label = (text or (own.name if own is not None else MXCLI)).strip()
    path = None if kernel_path is None else str(Path(kernel_path).expanduser())
    if path is not None and not Path(path).is_dir():
        raise InputError(f"kernel-path: {kernel_path} is not a folder")
    impl = spec.implementations.get(label)
    if impl is not None:  # mxcli's own kernel: --kernel-path does not apply
        return ImplementationChoice(label, spec.name, impl, None if impl.own else path)
    if label == MXCLI and own is None:
        # a kernel with no NKI implementation of mxcli's (a torch reference only): the default
        # choice names none; a backend that runs NKI kernels says so when it is asked to load it
        none = Implementation(MXCLI, f"{spec.name} has no NKI kernel of mxcli's", own=True)
        return ImplementationChoice(label, spec.name, none, None)
    module, sep, function = label.partition(":")
    ident = all(p.isidentifier() for p in module.split(".")) and function.isidentifier()
    if not sep or not ident:
        names = ", ".join(spec.implementations)
        raise InputError(
            f"kernel: expected {names} or MODULE:FUNCTION (a dotted module and a function "
            f"name), got {label!r}"
        )
    return ImplementationChoice(label, spec.name, spec.implementation(label), path)


def _missing(exc: ModuleNotFoundError, module: str) -> bool:
    name = exc.name or ""
    return bool(name) and (module == name or module.startswith(name + "."))


def _import(choice: ImplementationChoice) -> tuple[types.ModuleType, Any, str]:
    """Probe and import the chosen module (interpreter as ``nki`` unless the SDK is there) and
    find the function; raises `KernelLoadError` with one line."""
    from mxcli import nkisim

    impl = choice.implementation
    if choice.path is not None and choice.path not in sys.path:
        sys.path.insert(0, choice.path)
    importlib.invalidate_caches()
    reason = impl.unavailable_reason()
    if reason is not None:
        raise KernelLoadError(f"kernel: {choice.label}: {reason}; {impl.install_hint}")
    nkisim.activate()  # no-op when a real nki is importable: the SDK is never shadowed
    candidates = [choice.module, *impl.modules]
    last: str = ""
    for module_name in candidates:
        try:
            mod = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if _missing(exc, module_name):
                root = module_name.split(".")[0]
                if exc.name == root or not impl.modules:
                    raise KernelLoadError(
                        f"kernel: {choice.label}: module {exc.name!r} is not importable; "
                        f"{impl.install_hint}"
                    ) from None
                last = f"no module {module_name}"
                continue
            raise KernelLoadError(
                f"kernel: {choice.label}: importing {module_name} failed: {exc}"
            ) from None
        except Exception as exc:  # a broken third-party module: one line, not a traceback
            raise KernelLoadError(
                f"kernel: {choice.label}: importing {module_name} failed "
                f"({type(exc).__name__}: {exc})"
            ) from None
        obj = getattr(mod, choice.function, None)
        if isinstance(obj, types.ModuleType):  # the package path names the submodule
            mod, obj = obj, getattr(obj, choice.function, None)
        if obj is None:
            last = f"{module_name} has no {choice.function}"
            continue
        if not callable(obj):
            raise KernelLoadError(
                f"kernel: {choice.label}: {module_name}.{choice.function} is not callable"
            )
        return mod, obj, choice.function
    raise KernelLoadError(
        f"kernel: {choice.label}: no {choice.kernel} kernel found ({last}); {impl.install_hint}"
    )


def load(choice: ImplementationChoice) -> Any:
    """The chosen kernel object (an ``nki.jit`` kernel or a plain traced function); mxcli's own
    is None (the launcher loads it privately, `mxcli.kernels.nki_runtime.load_kernel_module`)."""
    if choice.is_own:
        return None
    with _lock:
        hit = _cache.get(choice)
        if hit is None:
            mod, obj, fn = _import(choice)
            hit = _cache[choice] = _Loaded(obj, mod, fn)
    return hit.kernel


def _file_sha256(path: str | None) -> str | None:
    """sha256 of a kernel's source: a file's bytes, or for a package folder every ``.py`` file
    below it in sorted order, each as its relative path, a NUL and its bytes (so the hash
    identifies the whole kernel, not its ``__init__.py``)."""
    if not path:
        return None
    try:
        folder = Path(path)
        if not folder.is_dir():
            return hashlib.sha256(folder.read_bytes()).hexdigest()
        h = hashlib.sha256()
        for f in sorted(folder.rglob("*.py")):
            h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes())
        return h.hexdigest()
    except OSError:
        return None


def _git_commit(path: str | None) -> str | None:
    """The commit checked out in the git repository holding `path` (``git rev-parse HEAD``);
    None when there is none, git is absent or it fails."""
    if not path:
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(
            ["git", "-C", str(Path(path).resolve().parent), "rev-parse", "--verify", "-q", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=env,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


def _version(mod: types.ModuleType, choice: ImplementationChoice) -> str | None:
    root = mod.__name__.split(".")[0]
    for name in (f"{root}.version", root):
        try:
            v = getattr(importlib.import_module(name), "__version__", None)
        except Exception:
            v = None
        if isinstance(v, str):
            return v
    for dist in choice.implementation.distributions or (root,):
        try:
            return importlib.metadata.version(dist)
        except Exception:
            continue
    return None


def describe(choice: ImplementationChoice) -> dict[str, Any]:
    """What ran, for output metadata and reports: ``kernel`` (the ``--kernel`` value), ``name``,
    ``module``, ``file``, ``sha256`` and, when known, ``version`` / ``commit``."""
    if choice.is_own:
        from mxcli import __version__

        module = choice.module
        spec = importlib.util.find_spec(module)
        path = spec.origin if spec is not None else None
        if spec is not None and spec.submodule_search_locations and path:
            path = str(Path(path).parent)  # a kernel package: the folder is the kernel
        return {
            "kernel": choice.label,
            "name": choice.kernel,
            "module": module,
            "file": path,
            "sha256": _file_sha256(path),
            "version": __version__,
        }
    load(choice)
    hit = _cache[choice]
    if not hit.info:
        fn = getattr(hit.kernel, "fn", hit.kernel)
        path = inspect.getsourcefile(fn) if callable(fn) else None
        path = path or getattr(hit.module, "__file__", None)
        info: dict[str, Any] = {
            "kernel": choice.label,
            "name": getattr(fn, "__name__", hit.function),
            "module": getattr(fn, "__module__", hit.module.__name__),
            "file": path,
            "sha256": _file_sha256(path),
        }
        version = _version(hit.module, choice)
        commit = _git_commit(path)
        if version:
            info["version"] = version
        if commit:
            info["commit"] = commit
        hit.info = info
    return dict(hit.info)


def describe_line(info: Mapping[str, Any]) -> str:
    """One line naming what ran: ``nkilib <kernel> (file, sha256 1a2b3c4d, version 0.1.0)``."""
    extra = [str(info.get("file") or "?")]
    if info.get("sha256"):
        extra.append(f"sha256 {str(info['sha256'])[:12]}")
    for key in ("version", "commit"):
        if info.get(key):
            extra.append(f"{key} {str(info[key])[:12]}")
    return f"{info.get('kernel')} {info.get('name')} ({', '.join(extra)})"


def describe_name(choice: ImplementationChoice) -> str:
    return f"{choice.label}'s {choice.kernel}" if not choice.is_own else f"mxcli's {choice.kernel}"


# -- the loaded entry point ------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A loaded third-party entry point, as the kernels' adaptation hooks see it
    (`mxcli.kernels.spec.ThirdParty.convert`)."""

    choice: ImplementationChoice
    function: Any  # the entry's Python function (a jit kernel's ``fn``)
    module: types.ModuleType
    signature: inspect.Signature

    @property
    def name(self) -> str:
        """``nkilib's <kernel>``: the choice and the kernel it stands for."""
        return describe_name(self.choice)

    @property
    def qualname(self) -> str:
        """The entry point's dotted name (``module.function``)."""
        fn = self.function
        return (
            f"{getattr(fn, '__module__', self.choice.module)}."
            f"{getattr(fn, '__qualname__', self.choice.function)}"
        )

    @property
    def globals(self) -> Mapping[str, Any]:
        return getattr(self.function, "__globals__", {})  # type: ignore[no-any-return]


def entry(choice: ImplementationChoice) -> Entry:
    """The chosen (third-party) entry point, loaded, with its signature."""
    kern = load(choice)
    fn = getattr(kern, "fn", kern)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise KernelLoadError(f"kernel: {choice.label}: its signature cannot be read") from None
    return Entry(choice, fn, _cache[choice].module, sig)


def resolve_for(
    text: str | ImplementationChoice | None,
    kernels: list[str],
    kernel_path: str | os.PathLike[str] | None = None,
) -> dict[str, ImplementationChoice | NotRunnable]:
    """For each kernel name: the loaded choice, or why it cannot run that kernel's cases here
    (not in this module / not importable). Raises the first load error when none can run, so a
    missing module is a user error before any work."""
    out: dict[str, ImplementationChoice | NotRunnable] = {}
    errors: list[KernelLoadError] = []
    for kernel in kernels:
        choice = parse_implementation(text, kernel, kernel_path)
        if choice.is_own:
            out[kernel] = choice
            continue
        try:
            params = entry(choice).signature.parameters
        except KernelLoadError as exc:
            errors.append(exc)
            out[kernel] = NotRunnable(f"not available: {exc}")
            continue
        third = _third_party(choice)
        missing = [p for p in third.signature_keys if p not in params]
        if missing:
            out[kernel] = NotRunnable(
                f"not this kernel: {choice.label} has no parameter {', '.join(missing)} of the "
                f"{kernel} API"
            )
            continue
        out[kernel] = choice
    runnable = [v for v in out.values() if isinstance(v, ImplementationChoice)]
    if errors and not runnable:
        raise errors[0]
    if not runnable:
        raise KernelLoadError(f"kernel: {text}: {next(iter(out.values()))}")
    return out


# -- adapting the arguments to a third-party entry point ------------------------------------------


def _third_party(choice: ImplementationChoice) -> ThirdParty:
    spec = get_spec(choice.kernel)
    third = None if spec.nki is None else spec.nki.third_party
    if third is None:
        raise KernelUnsupportedError(
            f"kernel: {choice.label}: {spec.name} runs only mxcli's own NKI kernel"
        )
    return third


def refusal(choice: ImplementationChoice, args: Mapping[str, Any]) -> str | None:
    """Why the chosen implementation refuses these (API-named) arguments, or None: its known
    refusals (`Implementation.refusal`), and mxcli-only arguments away from their defaults that
    the entry has no parameter for."""
    if choice.is_own:
        return None
    check = choice.implementation.refusal
    if check is not None:
        why = check(args)
        if why is not None:
            return why
    params = entry(choice).signature.parameters
    defaults = dict(_third_party(choice).mxcli_only)
    for name, value in args.items():
        if name in params or name not in defaults:
            continue
        if not same(value, defaults[name]):
            return f"{name}={value!r} (the kernel has no {name} parameter)"
    return None


def same(a: Any, b: Any) -> bool:
    """Equal values of the same type (a default compared without raising)."""
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def is_kernel_refusal(exc: BaseException) -> bool:
    """An ``AssertionError`` raised by the kernel's own checks (``kernel_assert``), not one of
    the interpreter's hardware rules (`mxcli.nkisim.NkiValidationError`)."""
    from mxcli.nkisim import NkiValidationError

    return isinstance(exc, AssertionError) and not isinstance(exc, NkiValidationError)


def enum_member(target: type[enum.Enum], v: enum.Enum, where: str) -> enum.Enum:
    """The member of the kernel module's own enum `target` named as mxcli's `v`."""
    try:
        return target[v.name]
    except KeyError:
        raise KernelUnsupportedError(
            f"{where}: {target.__qualname__} has no member {v.name}"
        ) from None


def _enum_for(param: inspect.Parameter | None, value: Any) -> Any:
    """`value` (an mxcli enum or its name) as the kernel's own enum, read from the parameter's
    default; unchanged when the default is not an enum."""
    default = None if param is None else param.default
    if isinstance(default, enum.Enum) and not isinstance(value, type(default)):
        name = getattr(value, "name", value)
        try:
            return type(default)[str(name)]
        except KeyError:
            raise KernelUnsupportedError(
                f"{param.name if param else 'argument'}: the kernel's {type(default).__name__} has "
                f"no member {name}"
            ) from None
    return value


def api_arguments(choice: ImplementationChoice, args: Mapping[str, Any]) -> dict[str, Any]:
    """The entry's keyword arguments from the kernel's API-named ones (`ThirdParty.arguments`):
    only its parameters, enums as its own, what the kernel's `ThirdParty.convert` takes as it
    converts it."""
    why = refusal(choice, args)
    if why is not None:
        raise KernelUnsupportedError(f"kernel: {describe_name(choice)} does not support {why}")
    third = _third_party(choice)
    found = entry(choice)
    params = found.signature.parameters
    convert = None if third.convert is None else load_target(third.convert, "convert")
    mxcli_only = dict(third.mxcli_only)
    out: dict[str, Any] = {}
    for name, value in args.items():
        converted = None if convert is None else convert(found, name, value)
        if converted is not None:
            out.update(converted)
            continue
        if name not in params:
            if value is not None and name not in mxcli_only:
                # nothing to pass is fine (None); a value the kernel cannot take is refused,
                # never dropped: it would run on its own default instead (issue 29)
                raise KernelUnsupportedError(
                    f"kernel: {describe_name(choice)}: {name} is set but the entry point "
                    f"{found.qualname} has no parameter {name}"
                )
            continue
        p = params[name]
        if isinstance(value, enum.Enum) or isinstance(p.default, enum.Enum):
            value = _enum_for(p, value)
        out[name] = value
    return out


# -- recording what ran -------------------------------------------------------------------------


@dataclass
class Launch:
    """One launch of a chosen implementation, as recorded by `recording`: what ran and, on
    mxcli's interpreter, its reads of never-written memory (`mxcli.nkisim.UninitRead`)."""

    kernel: dict[str, Any]
    engine: str
    uninit_reads: tuple[Any, ...] = ()


_tls = threading.local()


class recording:
    """``with recording() as launches:`` collects the `Launch` of every kernel launched in the
    block (this thread), for reports and output metadata."""

    def __enter__(self) -> list[Launch]:
        self.saved = getattr(_tls, "launches", None)
        self.launches: list[Launch] = []
        _tls.launches = self.launches
        return self.launches

    def __exit__(self, *exc: object) -> None:
        _tls.launches = self.saved


def record(choice: ImplementationChoice, engine: str, report: Any) -> None:
    """Note a launch in the active `recording` (if any)."""
    launches = getattr(_tls, "launches", None)
    if launches is None:
        return
    reads = tuple(getattr(report, "uninit_reads", ()) or ())
    launches.append(Launch(describe(choice), engine, reads))


_NKI_BACKENDS = ("sim", "neuron")


def backend_kwargs(
    implementation: Any, backend: str, kernel: str | KernelSpec
) -> dict[str, ImplementationChoice]:
    """``{"implementation": ...}`` for a backend that runs an NKI kernel, ``{}`` for mxcli's
    default; an error when a non-default implementation meets a backend that runs no NKI kernel
    (the reference)."""
    if implementation is None:
        return {}
    choice = parse_implementation(implementation, kernel)
    if choice.is_own:
        return {}
    if backend not in _NKI_BACKENDS:
        raise InputError(
            f"kernel: --kernel {choice.label} picks the NKI kernel of the sim and neuron "
            f"backends; backend {backend!r} runs mxcli's torch reference"
        )
    return {"implementation": choice}
