"""AWS's version of ``blockwise_mm_bwd_mxfp8`` (nkilib ``experimental/moe_mxfp8/bwd``): its import
path, and how any third-party entry point with the API reference's signature is called: mxcli's
`MXFP8MOEBwdConfig` rebuilt as the entry's own config class (`module_config`), or mapped onto
its keywords (`config_keywords`), and pre-quantized weights typed as x4 data on mxcli's
interpreter (`interpreter_arguments`). Registered on the kernel's spec (`spec.SPEC`); the generic
loader and adaptation are `mxcli.kernels.selection`'s.

The config is rebuilt field by field (torch dtypes as ``nki`` dtypes, enums by member name into
the module's own enum, nested dataclasses recursively). A field the module lacks is an error
naming it, unless it holds mxcli's default: the kernel would run on its own value instead.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import sys
from collections.abc import Mapping
from typing import Any

from mxcli.kernels import nkilib
from mxcli.kernels.selection import Entry, KernelUnsupportedError, enum_member, same
from mxcli.kernels.spec import ThirdParty
from mxcli.mx import ElemFormat

# The documented import path (api/blockwise_mm_bwd_mxfp8.txt), or the submodule where the newest
# nkilib versions define it.
NKILIB_KERNEL = nkilib.implementation(
    "nkilib.experimental.moe_mxfp8.bwd:blockwise_mm_bwd_mxfp8",
    modules=("nkilib.experimental.moe_mxfp8.bwd.blockwise_mm_backward_mxfp8",),
)

# MX element formats: mxcli names them by enum, AWS's configs hold nki dtypes or their names
_ELEM_DTYPES = {"E4M3FN": "float8_e4m3fn", "E5M2": "float8_e5m2"}


def convert(entry: Entry, name: str, value: Any) -> dict[str, Any] | None:
    """The `ThirdParty.convert` hook: ``config`` as the entry takes it (its own class, or its
    keywords when it has no ``config`` parameter); None for every other argument."""
    if name != "config":
        return None
    params = entry.signature.parameters
    if "config" in params:
        return {"config": module_config(entry, value)}
    if value is None:
        return {}
    return config_keywords(entry, value, params)


def interpreter_arguments(args: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Pre-quantized weights (uint32 x4 words, their scales given) declared as the
    interpreter's x4 dtype: AWS's kernel tells x4 MX data by its nki dtype (``'x4' in
    str(dtype)``, common_dataclasses.TensorDescriptor); as plain uint32 it reads them as
    unpacked fp8 and its matmuls cover a quarter of the columns (NaN outputs)."""
    import torch

    from mxcli.nkisim.kernel import TypedArg

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


# Any third-party entry point: the API reference's arguments (`nki_backend.api_arguments`).
THIRD_PARTY = ThirdParty(
    arguments="mxcli.kernels.blockwise_moe.nki_backend:api_arguments",
    signature_keys=("hidden_states", "expert_affinities_masked", "token_position_to_id"),
    convert=convert,
    interpreter_arguments=interpreter_arguments,
)


# -- the config as the entry's own class ------------------------------------------------------


def config_keywords(
    entry: Entry, config: Any, params: Mapping[str, inspect.Parameter]
) -> dict[str, Any]:
    """mxcli's config for an entry point without a ``config`` parameter that takes the config's
    knobs as its own keyword arguments (an older nkilib entry: ``phase1_config=``,
    ``shard_option=``, ``skip_dma=``...): each field the entry takes, converted as in
    `module_config` (its enum by member name, a nested dataclass as the class of the same name
    in the entry's module). A field it does not take is refused naming it and the entry, unless
    it holds mxcli's default; an entry that takes none of them is refused outright."""
    if not dataclasses.is_dataclass(config):
        raise KernelUnsupportedError(
            f"kernel: {entry.name}: config is set but the entry point {entry.qualname} has no "
            "parameter config"
        )
    fields = dataclasses.fields(config)
    if not any(f.name in params for f in fields):
        raise KernelUnsupportedError(
            f"kernel: {entry.name}: config is set but the entry point {entry.qualname} has no "
            "parameter config nor any of its fields as a keyword"
        )
    try:
        built_default: Any = type(config)()  # type: ignore[misc]
    except Exception:
        built_default = None
    out: dict[str, Any] = {}
    for f in fields:
        v = getattr(config, f.name)
        if f.name not in params:
            if built_default is not None and same(v, getattr(built_default, f.name)):
                continue
            raise KernelUnsupportedError(
                f"kernel: {entry.name}: config.{f.name}={v!r} has no keyword in the entry point "
                f"{entry.qualname} (it takes no config; only mxcli's default can be dropped)"
            )
        out[f.name] = _keyword_value(params[f.name], v, entry.globals, f"config.{f.name}")
    return out


def _keyword_value(p: inspect.Parameter, v: Any, glb: Mapping[str, Any], where: str) -> Any:
    """A config field's value as the keyword argument `p` of an entry point takes it."""
    if v is None:
        return None
    if isinstance(v, ElemFormat):
        text = _ELEM_DTYPES.get(v.name, v.name.lower())
        if isinstance(p.default, str):
            return text
        nl = importlib.import_module("nki.language")
        name = text + "_x4" if "x4" in str(p.default) or p.default is None else text
        if not hasattr(nl, name):
            raise KernelUnsupportedError(f"{where}: nki has no dtype {name}")
        return getattr(nl, name)
    if isinstance(v, enum.Enum):
        target = type(p.default) if isinstance(p.default, enum.Enum) else glb.get(type(v).__name__)
        if isinstance(target, type) and issubclass(target, enum.Enum):
            return enum_member(target, v, where)
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        cls = glb.get(type(v).__name__)  # the entry module's class of the same name
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise KernelUnsupportedError(
                f"{where}: the entry point's module has no class {type(v).__name__} to build it as"
            )
        return rebuild(v, cls, where)
    return _nki_dtype(v)


def _config_class(entry: Entry) -> type | None:
    """The module's own ``MXFP8MOEBwdConfig``: the ``config`` parameter's annotation when it is a
    class, else the name in the kernel's module (or its package)."""
    p = entry.signature.parameters.get("config")
    ann = None if p is None else p.annotation
    glb = entry.globals
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
    cls = getattr(entry.module, "MXFP8MOEBwdConfig", None)
    return cls if isinstance(cls, type) else None


def module_config(entry: Entry, config: Any) -> Any:
    """mxcli's `MXFP8MOEBwdConfig` rebuilt as the chosen module's own config class, field by field
    (torch dtypes as ``nki`` dtypes, enums by member name, nested dataclasses recursively). A field
    the module lacks is an error naming it, unless it holds mxcli's default."""
    if config is None:
        return None
    cls = _config_class(entry)
    if cls is None:
        raise KernelUnsupportedError(
            f"config: {entry.name} has no MXFP8MOEBwdConfig class to build the config as"
        )
    return rebuild(config, cls, "config")


def _nki_dtype(value: Any) -> Any:
    import torch

    if isinstance(value, torch.dtype):
        nl = importlib.import_module("nki.language")
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


def rebuild(value: Any, cls: type, where: str) -> Any:
    """Dataclass `value` (mxcli's config or one of its parts) as an instance of `cls`, field by
    field by name (see the module's docstring)."""
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
    if isinstance(v, ElemFormat) and default is not None:
        text = _ELEM_DTYPES.get(v.name, v.name.lower())
        if isinstance(default, str) and type(default) is str:
            return text
        nl = importlib.import_module("nki.language")
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
            return enum_member(target, v, where)
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        if target is None or not dataclasses.is_dataclass(target):
            raise KernelUnsupportedError(f"{where}: cannot tell which class the kernel expects")
        return rebuild(v, target, where)  # type: ignore[arg-type]
    return _nki_dtype(v)


__all__ = [
    "NKILIB_KERNEL",
    "THIRD_PARTY",
    "config_keywords",
    "convert",
    "interpreter_arguments",
    "module_config",
    "rebuild",
]
