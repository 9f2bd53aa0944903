"""Which NKI kernel runs: mxcli's own, AWS's NKI Library (``nkilib``) or any ``MODULE:FUNCTION``
with the API reference's signature (issue 20).

A user picks the kernel with ``--kernel mxcli|nkilib|MODULE:FUNCTION`` (``kernel=`` in the Python
API); the ``sim`` and ``neuron`` backends run it. `parse_kernel` checks the form only; `load`
imports the module (after installing mxcli's interpreter as ``nki`` when the Neuron SDK is absent,
`mxcli.nkisim.activate`, so that the module's ``import nki`` works unchanged); `describe` names
what ran (module file, its sha256, the nkilib version or git commit when known) for output
metadata and the verify report.

Third-party kernels are launched with the API reference's argument names (``api/*.txt``):
tensors by name, ``router_act_fn`` as the module's own enum, ``qmx_output_dtype`` as an ``nki``
dtype, the bwd ``config`` rebuilt as the module's own ``MXFP8MOEBwdConfig`` (`module_config`). An
mxcli argument the module lacks is an error naming it and the entry point (unless it is None or
has its default value), never dropped: the kernel would run on its own default instead. An entry
without ``config`` that takes the config's knobs as keyword arguments (an older nkilib entry)
gets each field as its keyword (`_config_keywords`); one it cannot take is refused. A
combination a kernel refuses is a `KernelUnsupportedError`: known refusals are reported before
the launch (`refusal`), a ``kernel_assert`` raised by the kernel itself is reported the same way.

On mxcli's interpreter, a third-party kernel runs as the real simulator would: a read of
never-written memory is a warning that names its kernel sites and is counted
(`SimResult.report.uninit_reads`); mxcli's own kernels stay under ``uninit="error"``.

The implementations are those of each kernel's `mxcli.kernels.spec.KernelSpec` (``mxcli``,
``nkilib``; ``MODULE:FUNCTION`` ad hoc); this module loads and launches the non-mxcli ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxcli.errors import InputError

__all__ = [
    "BWD",
    "NKILIB_TARGETS",
    "KernelChoice",
    "KernelLoadError",
    "KernelUnsupportedError",
    "MXCLI",
    "MODULE",
    "NKILIB",
    "PREFILL",
    "describe",
    "install_hint",
    "is_kernel_refusal",
    "load",
    "module_config",
    "parse_kernel",
    "refusal",
]

PREFILL = "rmsnorm_mx_prefill"
BWD = "blockwise_mm_bwd_mxfp8"

MXCLI = "mxcli"
NKILIB = "nkilib"
MODULE = "module"


# The documented import paths (api/rmsnorm_mx_prefill.txt, api/blockwise_mm_bwd_mxfp8.txt), as
# registered in each kernel's spec (`mxcli.kernels.spec.Implementation`, name "nkilib"). The API
# reference names the function by its package path, which is either the function re-exported by
# the package or a submodule holding it: both forms are tried (`_candidates`).
NKILIB_TARGETS = {
    PREFILL: "nkilib.core.rmsnorm:rmsnorm_mx_prefill",
    BWD: "nkilib.experimental.moe_mxfp8.bwd:blockwise_mm_bwd_mxfp8",
}
# where the newest NKI Library versions define them (submodules of the documented packages)
_NKILIB_FILES = {
    PREFILL: "nkilib.core.rmsnorm.rmsnorm_mx_prefill",
    BWD: "nkilib.experimental.moe_mxfp8.bwd.blockwise_mm_backward_mxfp8",
}


def nkilib_probe(kernel: str) -> str | None:
    """None when AWS's NKI Library is importable here (found on the path), else why not."""
    try:
        found = importlib.util.find_spec("nkilib") is not None
    except Exception as exc:  # detection never raises
        return f"nkilib cannot be looked up ({type(exc).__name__}: {exc})"
    return None if found else "nkilib (AWS's NKI Library) is not installed"


def _spec_target(kind: str, kernel: str) -> str | None:
    """The ``module:function`` the kernel's spec registers for implementation `kind`."""
    from mxcli.kernels.spec import find_spec

    spec = find_spec(kernel)
    impl = None if spec is None else spec.implementations.get(kind)
    target = None if impl is None else impl.kernel
    return target if isinstance(target, str) else None


class KernelLoadError(InputError):
    """The chosen kernel cannot be imported or is not a kernel (one line, exit code 2)."""


class KernelUnsupportedError(InputError):
    """The chosen kernel refuses this combination of arguments (known, or its kernel_assert)."""


@dataclass(frozen=True)
class KernelChoice:
    """A parsed ``--kernel`` value for one kernel.

    ``spec``: as given (``mxcli``, ``nkilib``, ``pkg.mod:fn``); ``kind``: `MXCLI`, `NKILIB` or
    `MODULE`; ``kernel``: `PREFILL` or `BWD`; ``path``: the ``--kernel-path`` folder put in
    front of ``sys.path`` before importing, if any.
    """

    spec: str
    kind: str
    kernel: str
    module: str = ""
    function: str = ""
    path: str | None = None

    @property
    def is_own(self) -> bool:
        """mxcli's own kernel (run under ``uninit="error"``)."""
        return self.kind == MXCLI

    @property
    def label(self) -> str:
        return self.spec


@dataclass
class _Loaded:
    kernel: Any
    module: types.ModuleType
    function: str
    info: dict[str, Any] = field(default_factory=dict)


_lock = threading.Lock()
_cache: dict[KernelChoice, _Loaded] = {}


def parse_kernel(
    spec: str | KernelChoice | None, kernel: str, kernel_path: str | os.PathLike[str] | None = None
) -> KernelChoice:
    """``mxcli`` (default), ``nkilib`` or ``MODULE:FUNCTION`` for `kernel`; checks the form only."""
    if isinstance(spec, KernelChoice):
        if spec.kernel != kernel:
            return parse_kernel(
                spec.spec, kernel, spec.path if kernel_path is None else kernel_path
            )
        return spec
    text = (spec or MXCLI).strip()
    path = None if kernel_path is None else str(Path(kernel_path).expanduser())
    if path is not None and not Path(path).is_dir():
        raise InputError(f"kernel-path: {kernel_path} is not a folder")
    if kernel not in (PREFILL, BWD):
        from mxcli.kernels.spec import get_spec

        kernel = get_spec(kernel).name  # a short name (prefill, bwd)
    if text == MXCLI:  # its own kernel: --kernel-path does not apply
        return KernelChoice(MXCLI, MXCLI, kernel)
    if text == NKILIB:
        target = _spec_target(NKILIB, kernel) or NKILIB_TARGETS[kernel]
        mod, _, fn = target.partition(":")
        return KernelChoice(NKILIB, NKILIB, kernel, mod, fn, path)
    module, sep, function = text.partition(":")
    ident = all(p.isidentifier() for p in module.split(".")) and function.isidentifier()
    if not sep or not ident:
        raise InputError(
            f"kernel: expected mxcli, nkilib or MODULE:FUNCTION (a dotted module and a function "
            f"name), got {text!r}"
        )
    return KernelChoice(text, MODULE, kernel, module, function, path)


def install_hint(choice: KernelChoice) -> str:
    """How to make the chosen module importable."""
    if choice.kind == NKILIB:
        return (
            "install AWS's NKI Library (git clone https://github.com/aws-neuron/nki-library && "
            "pip install -e nki-library) or pass --kernel-path DIR (the folder holding nkilib/)"
        )
    return "put its package on PYTHONPATH or pass --kernel-path DIR"


def _missing(exc: ModuleNotFoundError, module: str) -> bool:
    name = exc.name or ""
    return bool(name) and (module == name or module.startswith(name + "."))


def _import(choice: KernelChoice) -> tuple[types.ModuleType, Any, str]:
    """Import the chosen module (interpreter as ``nki`` unless the SDK is there) and find the
    function; raises `KernelLoadError` with one line."""
    from mxcli import nkisim

    if choice.path is not None and choice.path not in sys.path:
        sys.path.insert(0, choice.path)
    importlib.invalidate_caches()
    nkisim.activate()  # no-op when a real nki is importable: the SDK is never shadowed
    candidates: list[tuple[str, str]] = [(choice.module, choice.function)]
    if choice.kind == NKILIB:
        candidates.append((_NKILIB_FILES[choice.kernel], choice.function))
    last: str = ""
    for module_name, function in candidates:
        try:
            mod = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if _missing(exc, module_name):
                root = module_name.split(".")[0]
                if exc.name == root or choice.kind != NKILIB:
                    raise KernelLoadError(
                        f"kernel: {choice.spec}: module {exc.name!r} is not importable; "
                        f"{install_hint(choice)}"
                    ) from None
                last = f"no module {module_name}"
                continue
            raise KernelLoadError(
                f"kernel: {choice.spec}: importing {module_name} failed: {exc}"
            ) from None
        except Exception as exc:  # a broken third-party module: one line, not a traceback
            raise KernelLoadError(
                f"kernel: {choice.spec}: importing {module_name} failed "
                f"({type(exc).__name__}: {exc})"
            ) from None
        obj = getattr(mod, function, None)
        if isinstance(obj, types.ModuleType):  # the package path names the submodule
            mod, obj = obj, getattr(obj, function, None)
        if obj is None:
            last = f"{module_name} has no {function}"
            continue
        if not callable(obj):
            raise KernelLoadError(
                f"kernel: {choice.spec}: {module_name}.{function} is not callable"
            )
        return mod, obj, function
    raise KernelLoadError(
        f"kernel: {choice.spec}: no {choice.kernel} kernel found ({last}); {install_hint(choice)}"
    )


def load(choice: KernelChoice) -> Any:
    """The chosen kernel object (an ``nki.jit`` kernel or a plain traced function); mxcli's own
    is None (its backends load it privately)."""
    if choice.is_own:
        return None
    with _lock:
        hit = _cache.get(choice)
        if hit is None:
            mod, obj, fn = _import(choice)
            hit = _cache[choice] = _Loaded(obj, mod, fn)
    return hit.kernel


def _file_sha256(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _git_commit(path: str | None) -> str | None:
    """The commit checked out in the git repository holding `path` (read from ``.git``, no
    subprocess); None when there is none or it cannot be read."""
    if not path:
        return None
    here = Path(path).resolve().parent
    for folder in (here, *here.parents):
        git = folder / ".git"
        try:
            if git.is_file():  # a worktree or submodule: "gitdir: <path>"
                text = git.read_text(encoding="utf-8").strip()
                if not text.startswith("gitdir:"):
                    return None
                git = (folder / text.split(":", 1)[1].strip()).resolve()
            if not git.is_dir():
                continue
            head = (git / "HEAD").read_text(encoding="utf-8").strip()
            if not head.startswith("ref:"):
                return head or None
            ref = head.split(":", 1)[1].strip()
            bases = [git]
            if (git / "commondir").is_file():
                bases.append(
                    (git / (git / "commondir").read_text(encoding="utf-8").strip()).resolve()
                )
            for base in bases:
                if (base / ref).is_file():
                    return (base / ref).read_text(encoding="utf-8").strip() or None
                packed = base / "packed-refs"
                if packed.is_file():
                    for line in packed.read_text(encoding="utf-8").splitlines():
                        if line.endswith(" " + ref):
                            return line.split()[0]
        except OSError:
            return None
        return None
    return None


def _version(mod: types.ModuleType, choice: KernelChoice) -> str | None:
    root = mod.__name__.split(".")[0]
    for name in (f"{root}.version", root):
        try:
            v = getattr(importlib.import_module(name), "__version__", None)
        except Exception:
            v = None
        if isinstance(v, str):
            return v
    for dist in ("nki-library", "nkilib") if choice.kind == NKILIB else (root,):
        try:
            return importlib.metadata.version(dist)
        except Exception:
            continue
    return None


def describe(choice: KernelChoice) -> dict[str, Any]:
    """What ran, for output metadata and reports: ``kernel`` (the ``--kernel`` value), ``name``,
    ``module``, ``file``, ``sha256`` and, when known, ``version`` / ``commit``."""
    if choice.is_own:
        from mxcli import __version__
        from mxcli.kernels.spec import get_spec

        # the module of the kernel's own implementation (none: a kernel with no NKI kernel)
        impl = get_spec(choice.kernel).implementations.get(MXCLI)
        target = impl.kernel if impl is not None else None
        module = (
            target.partition(":")[0]
            if isinstance(target, str)
            else getattr(target, "__module__", None)
        )
        spec = importlib.util.find_spec(module) if module else None
        path = spec.origin if spec is not None else None
        return {
            "kernel": MXCLI,
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
            "kernel": choice.spec,
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
    """One line naming a kernel: ``nkilib rmsnorm_mx_prefill (file, sha256 1a2b3c4d, 0.1.0)``."""
    extra = [str(info.get("file") or "?")]
    if info.get("sha256"):
        extra.append(f"sha256 {str(info['sha256'])[:12]}")
    for key in ("version", "commit"):
        if info.get(key):
            extra.append(f"{key} {str(info[key])[:12]}")
    return f"{info.get('kernel')} {info.get('name')} ({', '.join(extra)})"


# -- adapting the launch to the chosen kernel ---------------------------------------------------


def _entry(kern: Any) -> Any:
    return getattr(kern, "fn", kern)


def signature(choice: KernelChoice) -> inspect.Signature:
    """The chosen kernel's signature (its jit function's)."""
    fn = _entry(load(choice))
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        raise KernelLoadError(f"kernel: {choice.spec}: its signature cannot be read") from None


# Combinations a kernel is known to refuse, checked before launching: (kind, kernel) -> checks
# of the mxcli-named arguments, each (predicate, message).
def _nkilib_prefill_refusal(args: Mapping[str, Any]) -> str | None:
    act = args.get("router_act_fn")
    name = getattr(act, "name", str(act))
    if (
        args.get("router_weights") is not None
        and name == "NOAUX_TC"
        and args.get("pack_affinities")
    ):
        # nkilib rmsnorm_mx_prefill: kernel_assert(not pack_affinities, "NOAUX_TC emits fp32
        # affinities; pack_affinities (bf16 row tail) is unsupported"); mxcli's kernel packs them
        return "NOAUX_TC with pack_affinities (its NOAUX_TC affinities are fp32, the packed tail is bf16)"
    return None


_REFUSALS = {(NKILIB, PREFILL): _nkilib_prefill_refusal}


def refusal(choice: KernelChoice, args: Mapping[str, Any]) -> str | None:
    """Why the chosen kernel refuses these (API-named) arguments, or None: the known refusals
    of the implementation (`_REFUSALS`), and mxcli-only arguments the kernel has no parameter for."""
    if choice.is_own:
        return None
    check = _REFUSALS.get((choice.kind, choice.kernel))
    if check is not None:
        why = check(args)
        if why is not None:
            return why
    params = signature(choice).parameters
    defaults = _MXCLI_DEFAULTS.get(choice.kernel, {})
    for name, value in args.items():
        if name in params or name not in defaults:
            continue
        if not _same(value, defaults[name]):
            return f"{name}={value!r} (the kernel has no {name} parameter)"
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


# mxcli-only arguments of the public functions and their defaults (not in the API reference)
_MXCLI_DEFAULTS: dict[str, dict[str, Any]] = {PREFILL: {"hidden_interleaved": False}, BWD: {}}


def is_kernel_refusal(exc: BaseException) -> bool:
    """An ``AssertionError`` raised by the kernel's own checks (``kernel_assert``), not one of
    the interpreter's hardware rules (`mxcli.nkisim.NkiValidationError`)."""
    from mxcli.nkisim import NkiValidationError

    return isinstance(exc, AssertionError) and not isinstance(exc, NkiValidationError)


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


def api_arguments(choice: KernelChoice, args: Mapping[str, Any]) -> dict[str, Any]:
    """The kernel's keyword arguments from mxcli's (API-named) ones: only its parameters, enums
    as its own, dtype names as `DTypeName`, the bwd config as its own config class."""
    from mxcli.kernels.nki_runtime import DTypeName

    why = refusal(choice, args)
    if why is not None:
        raise KernelUnsupportedError(f"kernel: {describe_name(choice)} does not support {why}")
    params = signature(choice).parameters
    out: dict[str, Any] = {}
    for name, value in args.items():
        if name not in params:
            if name == "config" and value is not None:
                out.update(_config_keywords(choice, value, params))
            elif value is not None and name not in _MXCLI_DEFAULTS.get(choice.kernel, {}):
                # nothing to pass is fine (None); a value the kernel cannot take is refused,
                # never dropped: it would run on its own default instead (issue 29)
                raise KernelUnsupportedError(
                    f"kernel: {describe_name(choice)}: {name} is set but the entry point "
                    f"{_entry_name(choice)} has no parameter {name}"
                )
            continue
        p = params[name]
        if name == "qmx_output_dtype":
            value = DTypeName(str(getattr(value, "value", value)))
        elif name == "config":
            value = module_config(choice, value)
        elif isinstance(value, enum.Enum) or isinstance(p.default, enum.Enum):
            value = _enum_for(p, value)
        out[name] = value
    return out


def _entry_name(choice: KernelChoice) -> str:
    fn = _entry(load(choice))
    return (
        f"{getattr(fn, '__module__', choice.module)}.{getattr(fn, '__qualname__', choice.function)}"
    )


def _config_keywords(
    choice: KernelChoice, config: Any, params: Mapping[str, inspect.Parameter]
) -> dict[str, Any]:
    """mxcli's config for an entry point without a ``config`` parameter that takes the config's
    knobs as its own keyword arguments (an older nkilib entry: ``phase1_config=``,
    ``shard_option=``, ``skip_dma=``...): each field the entry takes, converted as in
    `module_config` (its enum by member name, a nested dataclass as the class of the same name
    in the entry's module). A field it does not take is refused naming it and the entry, unless
    it holds mxcli's default; an entry that takes none of them is refused outright."""
    if not dataclasses.is_dataclass(config):
        raise KernelUnsupportedError(
            f"kernel: {describe_name(choice)}: config is set but the entry point "
            f"{_entry_name(choice)} has no parameter config"
        )
    fields = dataclasses.fields(config)
    if not any(f.name in params for f in fields):
        raise KernelUnsupportedError(
            f"kernel: {describe_name(choice)}: config is set but the entry point "
            f"{_entry_name(choice)} has no parameter config nor any of its fields as a keyword"
        )
    try:
        built_default: Any = type(config)()  # type: ignore[misc]
    except Exception:
        built_default = None
    glb = getattr(_entry(load(choice)), "__globals__", {})
    out: dict[str, Any] = {}
    for f in fields:
        v = getattr(config, f.name)
        if f.name not in params:
            if built_default is not None and _same(v, getattr(built_default, f.name)):
                continue
            raise KernelUnsupportedError(
                f"kernel: {describe_name(choice)}: config.{f.name}={v!r} has no keyword in the "
                f"entry point {_entry_name(choice)} (it takes no config; only mxcli's default "
                f"can be dropped)"
            )
        out[f.name] = _keyword_value(params[f.name], v, glb, f"config.{f.name}")
    return out


def _keyword_value(p: inspect.Parameter, v: Any, glb: Mapping[str, Any], where: str) -> Any:
    """A config field's value as the keyword argument `p` of an entry point takes it."""
    if v is None:
        return None
    if isinstance(v, enum.Enum) and type(v).__name__ == "ElemFormat":
        if isinstance(p.default, str):
            return {"E4M3FN": "float8_e4m3fn", "E5M2": "float8_e5m2"}.get(v.name, v.name.lower())
        nl = importlib.import_module("nki.language")
        text = {"E4M3FN": "float8_e4m3fn", "E5M2": "float8_e5m2"}.get(v.name, v.name.lower())
        name = text + "_x4" if "x4" in str(p.default) or p.default is None else text
        if not hasattr(nl, name):
            raise KernelUnsupportedError(f"{where}: nki has no dtype {name}")
        return getattr(nl, name)
    if isinstance(v, enum.Enum):
        target = type(p.default) if isinstance(p.default, enum.Enum) else glb.get(type(v).__name__)
        if isinstance(target, type) and issubclass(target, enum.Enum):
            return _enum_member(target, v, where)
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        cls = glb.get(type(v).__name__)  # the entry module's class of the same name
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise KernelUnsupportedError(
                f"{where}: the entry point's module has no class {type(v).__name__} to build it as"
            )
        return _rebuild(v, cls, where)
    return _nki_dtype(v)


def describe_name(choice: KernelChoice) -> str:
    return f"{choice.spec}'s {choice.kernel}" if not choice.is_own else f"mxcli's {choice.kernel}"


# -- the bwd config -----------------------------------------------------------------------------


def _config_class(choice: KernelChoice) -> type | None:
    """The module's own ``MXFP8MOEBwdConfig``: the ``config`` parameter's annotation when it is a
    class, else the name in the kernel's module (or its package)."""
    fn = _entry(load(choice))
    p = signature(choice).parameters.get("config")
    ann = None if p is None else p.annotation
    glb = getattr(fn, "__globals__", {})
    if isinstance(ann, str):  # postponed annotations: the name in the kernel's module
        ann = glb.get(ann.rsplit(".", 1)[-1])
    if (
        isinstance(ann, type)
        and ann is not inspect.Parameter.empty
        and dataclasses.is_dataclass(ann)
    ):
        return ann
    cls = glb.get("MXFP8MOEBwdConfig")
    if isinstance(cls, type):
        return cls
    mod = _cache[choice].module
    cls = getattr(mod, "MXFP8MOEBwdConfig", None)
    return cls if isinstance(cls, type) else None


def module_config(choice: KernelChoice, config: Any) -> Any:
    """mxcli's `MXFP8MOEBwdConfig` rebuilt as the chosen module's own config class, field by field
    (torch dtypes as ``nki`` dtypes, enums by member name, nested dataclasses recursively). A field
    the module lacks is an error naming it, unless it holds mxcli's default."""
    if config is None:
        return None
    cls = _config_class(choice)
    if cls is None:
        raise KernelUnsupportedError(
            f"config: {describe_name(choice)} has no MXFP8MOEBwdConfig class to build the config as"
        )
    return _rebuild(config, cls, "config")


def _nki_dtype(value: Any) -> Any:
    import torch

    if isinstance(value, torch.dtype):
        import importlib as _il

        nl = _il.import_module("nki.language")
        name = str(value).removeprefix("torch.")
        if not hasattr(nl, name):
            raise KernelUnsupportedError(f"config: nki has no dtype {name}")
        return getattr(nl, name)
    return value


def _field_type(cls: type, f: dataclasses.Field[Any]) -> Any:
    """A target field's class, from its default (an instance) or default_factory."""
    if f.default is not dataclasses.MISSING and f.default is not None:
        return type(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        try:
            return type(f.default_factory())  # type: ignore[misc]
        except Exception:
            return None
    return None


def _rebuild(value: Any, cls: type, where: str) -> Any:
    if not dataclasses.is_dataclass(value):
        return value
    targets = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    try:  # defaults as mxcli's own validation fills them in (__post_init__)
        built_default: Any = type(value)()  # type: ignore[misc]
    except Exception:
        built_default = None
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if f.name not in targets:
            if built_default is not None:
                try:
                    if v == getattr(built_default, f.name):
                        continue
                except Exception:
                    pass
            elif _is_default(f, v):
                continue
            raise KernelUnsupportedError(
                f"{where}.{f.name}: {cls.__module__}.{cls.__qualname__} has no field {f.name} "
                f"(set to {v!r}; only its default can be dropped)"
            )
        kwargs[f.name] = _convert_field(v, targets[f.name], cls, f"{where}.{f.name}")
    for name, tf in targets.items():
        # a field of the module's class without a default that mxcli's config has no value
        # for (AWS's MatmulMxfp8KernelConfig M/K/N, which its entry point fills from the
        # shapes before use): None, never a guessed value
        if (
            name not in kwargs
            and tf.init
            and tf.default is dataclasses.MISSING
            and tf.default_factory is dataclasses.MISSING  # type: ignore[misc]
        ):
            kwargs[name] = None
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise KernelUnsupportedError(
            f"{where}: {cls.__qualname__}(...) refused mxcli's values ({type(exc).__name__}: {exc})"
        ) from None


def _is_default(f: dataclasses.Field[Any], v: Any) -> bool:
    """`v` is the field's own default (a field without one is never dropped)."""
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
    else:
        return False
    try:
        return bool(v == default)
    except Exception:
        return False


def _convert_field(v: Any, f: dataclasses.Field[Any], owner: type, where: str) -> Any:
    if v is None:
        return None
    target = _field_type(owner, f)
    default = f.default if f.default is not dataclasses.MISSING else None
    if isinstance(v, enum.Enum) and type(v).__name__ == "ElemFormat" and default is not None:
        # mxcli names MX element formats by enum; AWS's configs hold nki dtypes or their names
        text = {"E4M3FN": "float8_e4m3fn", "E5M2": "float8_e5m2"}.get(v.name, v.name.lower())
        if isinstance(default, str) and type(default) is str:
            return text
        import importlib as _il

        nl = _il.import_module("nki.language")
        x4 = text + "_x4"
        name = x4 if "x4" in str(default) else text
        if not hasattr(nl, name):
            raise KernelUnsupportedError(f"{where}: nki has no dtype {name}")
        return getattr(nl, name)
    if isinstance(v, enum.Enum):
        # the module's own enum of the same name, when its field holds one (AWS's phase
        # config types quant_scheme as Union[str, QuantScheme] with a str default, and its
        # kernel config requires the enum)
        twin = getattr(sys.modules.get(owner.__module__), type(v).__name__, None)
        if isinstance(twin, type) and issubclass(twin, enum.Enum) and v.name in twin.__members__:
            return twin[v.name]
        if isinstance(target, type) and not issubclass(target, enum.Enum):
            raw = v.value if isinstance(v.value, str) else v.name
            return raw if target is str else v
        if isinstance(target, type) and issubclass(target, enum.Enum):
            return _enum_member(target, v, where)
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        if target is None or not dataclasses.is_dataclass(target):
            raise KernelUnsupportedError(f"{where}: cannot tell which class the kernel expects")
        return _rebuild(v, target, where)  # type: ignore[arg-type]
    return _nki_dtype(v)


# -- launching ----------------------------------------------------------------------------------


@dataclass
class Launch:
    """One launch of a chosen kernel, as recorded by `recording`: what ran and, on mxcli's
    interpreter, its reads of never-written memory (`mxcli.nkisim.UninitRead`)."""

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


def record(choice: KernelChoice, engine: str, report: Any) -> None:
    """Note a launch in the active `recording` (if any)."""
    launches = getattr(_tls, "launches", None)
    if launches is None:
        return
    reads = tuple(getattr(report, "uninit_reads", ()) or ())
    launches.append(Launch(describe(choice), engine, reads))


def _as_nki_tensor(name: str, value: Any) -> Any:
    """int64 index tensors as int32 (NKI has no 64-bit types), Python ints of tensor arguments
    (``num_valid_tokens``) as a ``[1]`` int32 tensor."""
    import torch

    if isinstance(value, torch.Tensor) and value.dtype == torch.int64:
        return value.to(torch.int32)
    if name == "num_valid_tokens" and isinstance(value, int) and not isinstance(value, bool):
        return torch.tensor([value], dtype=torch.int32)
    return value


def _x4_weights(choice: KernelChoice, args: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Pre-quantized bwd weights (uint32 x4 words, their scales given) declared as the
    interpreter's x4 dtype: AWS's kernel tells x4 MX data by its nki dtype (``'x4' in
    str(dtype)``, common_dataclasses.TensorDescriptor); as plain uint32 it reads them as
    unpacked fp8 and its matmuls cover a quarter of the columns (NaN outputs)."""
    import torch

    from mxcli.nkisim.kernel import TypedArg

    if choice.kernel != BWD:
        return
    fmt = getattr(getattr(args.get("config"), "fp8_x4_dtype", None), "name", "E4M3FN")
    nl = importlib.import_module("nki.language")
    x4 = getattr(nl, {"E5M2": "float8_e5m2_x4"}.get(str(fmt), "float8_e4m3fn_x4"))
    for weight, scales in (
        ("gate_up_proj_weight", "gate_up_weight_scales"),
        ("down_proj_weight", "down_weight_scales"),
    ):
        w = kw.get(weight)
        if kw.get(scales) is not None and isinstance(w, torch.Tensor) and w.dtype == torch.uint32:
            kw[weight] = TypedArg(w, x4)


def _jit(kern: Any) -> Any:
    """A plain traced function (AWS's bwd entry is one) wrapped as the active nki's jit kernel."""
    if hasattr(kern, "__getitem__"):
        return kern
    return importlib.import_module("nki").jit(kern)


def launch_sim(
    choice: KernelChoice,
    args: Mapping[str, Any],
    *,
    lnc: int = 1,
    check_only: bool = False,
    check_capacity: bool = True,
) -> Any:
    """Run the chosen third-party kernel on a simulator with API-named `args`; a `SimResult`.

    It runs on the ``nki`` it was imported with: the Neuron SDK's ``nki.simulate`` when that is
    installed, else mxcli's interpreter with ``uninit="warn"`` (never-written reads are warned
    about, named and counted, as the real simulator tolerates them).
    """
    from mxcli import nkisim
    from mxcli.kernels import nki_runtime
    from mxcli.kernels.nki_runtime import SimEngine

    kw = {k: _as_nki_tensor(k, v) for k, v in api_arguments(choice, args).items()}
    kern = _jit(load(choice))
    real = nkisim.real_nki_available()
    if not real:
        _x4_weights(choice, args, kw)
    if real and check_only:
        raise InputError(
            f"kernel: {choice.spec} was imported with the Neuron SDK's nki; check-only mode needs "
            "mxcli's interpreter"
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
        if not is_kernel_refusal(exc):
            raise
        raise KernelUnsupportedError(
            f"kernel: {describe_name(choice)} refused this launch: {_short(str(exc))}"
        ) from None
    record(choice, engine.value, res.report)
    return res


def launch_neuron(choice: KernelChoice, args: Mapping[str, Any], *, lnc: int | None = None) -> Any:
    """Run the chosen third-party kernel on a Trainium device (the same launch path as mxcli's
    kernels, `mxcli.kernels.nki_runtime.run_neuron`); the output tensors on the CPU."""
    from mxcli.kernels import nki_runtime

    nki_runtime.require_neuron(describe_name(choice))
    kw = {k: _as_nki_tensor(k, v) for k, v in api_arguments(choice, args).items()}
    with contextlib.redirect_stdout(sys.stderr):
        outs = nki_runtime.run_neuron(_jit(load(choice)), (), kw, lnc=lnc)
    record(choice, "neuron", None)
    return outs


def _short(message: str) -> str:
    """A kernel_assert message without its boilerplate (``[INTERNAL_ERROR] [NCC_...] ...``)."""
    text = " ".join(message.split())
    marker = "Kernel validation exception:"
    if marker in text:
        text = text.split(marker, 1)[1]
        text = text.split(" - Please check", 1)[0]
    return text.strip()[:300]


_NKI_BACKENDS = ("sim", "neuron")


def backend_kwargs(kernel: Any, backend: str, which: str) -> dict[str, Any]:
    """``{"kernel": ...}`` for a backend that runs an NKI kernel, ``{}`` for mxcli's default; an
    error when a non-default kernel meets a backend that runs no NKI kernel (the reference)."""
    if kernel is None:
        return {}
    choice = parse_kernel(kernel, which)
    if choice.is_own:
        return {}
    if backend not in _NKI_BACKENDS:
        raise InputError(
            f"kernel: --kernel {choice.spec} picks the NKI kernel of the sim and neuron "
            f"backends; backend {backend!r} runs mxcli's torch reference"
        )
    return {"kernel": choice}


# parameters that tell the two kernels' API signatures apart
_SIGNATURE_KEYS = {
    PREFILL: ("hidden_states", "gamma"),
    BWD: ("hidden_states", "expert_affinities_masked", "token_position_to_id"),
}


def resolve_for(spec: Any, kernels: list[str], kernel_path: Any = None) -> dict[str, Any]:
    """For each kernel name: its loaded `KernelChoice`, or a one-line reason it cannot run here
    (not in this module / not importable). Raises the first load error when none can run, so a
    missing module is a user error before any work."""
    out: dict[str, Any] = {}
    errors: list[KernelLoadError] = []
    for kernel in kernels:
        choice = parse_kernel(spec, kernel, kernel_path)
        if choice.is_own:
            out[kernel] = choice
            continue
        try:
            params = signature(choice).parameters
        except KernelLoadError as exc:
            errors.append(exc)
            out[kernel] = f"not available: {exc}"
            continue
        missing = [p for p in _SIGNATURE_KEYS[kernel] if p not in params]
        if missing:
            out[kernel] = (
                f"not this kernel: {choice.spec} has no parameter {', '.join(missing)} of the "
                f"{kernel} API"
            )
            continue
        out[kernel] = choice
    if errors and not any(isinstance(v, KernelChoice) for v in out.values()):
        raise errors[0]
    if not any(isinstance(v, KernelChoice) for v in out.values()):
        raise KernelLoadError(f"kernel: {spec}: {next(iter(out.values()))}")
    return out


def _enum_member(target: type[enum.Enum], v: enum.Enum, where: str) -> enum.Enum:
    """The member of the kernel module's own enum `target` named as mxcli's `v`."""
    try:
        return target[v.name]
    except KeyError:
        raise KernelUnsupportedError(
            f"{where}: {target.__qualname__} has no member {v.name}"
        ) from None
