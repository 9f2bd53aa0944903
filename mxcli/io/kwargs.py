"""Scalar kwargs as they cross files, flags and JSON: typed parsers, the one enum coercer, and
dataclass <-> JSON (the bwd ``MXFP8MOEBwdConfig``).

Every enum value that arrives from outside (a flag, a metadata value, a JSON field, a Python
caller) goes through `coerce_enum`, so that every enum accepts the same spellings.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from mxcli.errors import InputError
from mxcli.io.jsonfile import loads

E = TypeVar("E", bound=enum.Enum)


def coerce_enum(
    cls: type[E],
    value: Any,
    name: str,
    *,
    aliases: Mapping[Any, E] | None = None,
    expected: str | None = None,
    error: type[Exception] = InputError,
    type_error: type[Exception] | None = None,
) -> E:
    """`value` as a member of `cls`: the one enum coercer of mxcli.

    Accepted: a member; an alias (`aliases`: hashable values, or lower-case strings matched
    against the value and its last dotted part); a member of another enum with a member of the
    same name (another project's copy of the enum, e.g. nkilib's); the member's value (not a
    bool); its name or string value in any case, also qualified (``"RouterActFnType.SOFTMAX"``).

    Otherwise `error` with ``"{name}: expected {expected}, got {value!r}"`` (``expected``
    defaults to ``one of`` the member names); with `type_error`, a value that is neither a
    string nor an enum member raises that instead (``"{name}": expected {cls}, got {type}``).
    """
    if isinstance(value, cls):
        return value
    if aliases:
        try:
            hit = aliases.get(value)
        except TypeError:  # unhashable
            hit = None
        if hit is None and isinstance(value, str):
            text = str.strip(value).lower()
            hit = aliases.get(text, aliases.get(text.split(".")[-1]))
        if hit is not None:
            return hit
    if isinstance(value, enum.Enum):
        member = _by_name(cls, str(value.name))
        if member is not None:
            return member  # type: ignore[no-any-return]
    if isinstance(value, str):
        key = str.strip(value).split(".")[-1]
        member = _by_name(cls, key)
        if member is not None:
            return member  # type: ignore[no-any-return]
        for m in cls:
            if key.lower() == str(m.value).lower():
                return m
    elif type_error is not None and not isinstance(value, enum.Enum):
        raise type_error(f"{name}: expected {cls.__name__}, got {type(value).__name__}")
    elif not isinstance(value, (bool, enum.Enum)):
        for m in cls:
            if not isinstance(m.value, bool) and m.value == value and type(m.value) is type(value):
                return m
    choices = expected or "one of " + ", ".join(cls.__members__)
    raise error(f"{name}: expected {choices}, got {value!r}")


def _by_name(cls: type[E], key: str) -> Any:
    upper = key.upper()
    for n, m in cls.__members__.items():
        if n.upper() == upper:
            return m
    return None


def enum_dump(v: Any) -> Any:
    """An enum as JSON: its string value for string enums, else its name."""
    if isinstance(v, enum.Enum):
        return v.value if isinstance(v, str) else v.name
    return v


def typed(
    kind: type, name: str, *, low: float | None = None, allow_none: bool = False
) -> Callable[[Any], Any]:
    """A kwarg parser for ``bool``, ``int`` or a finite ``float`` (optionally ``>= low``)."""

    def parse(v: Any) -> Any:
        if v is None and allow_none:
            return None
        try:
            if kind is bool:
                if isinstance(v, bool):
                    return v
                if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
                    return v.lower() in ("true", "1")
                if isinstance(v, int) and v in (0, 1):
                    return bool(v)
                raise ValueError
            if kind is int:
                if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                out: Any = int(v)
            else:
                out = float(v)
                if not math.isfinite(out):
                    raise ValueError
        except (TypeError, ValueError):
            raise InputError(f"{name}: expected {kind.__name__}, got {v!r}") from None
        if low is not None and out < low:
            raise InputError(f"{name}: expected a value >= {low}, got {v!r}")
        return out

    return parse


def json_or_raw(raw: str) -> Any:
    """A metadata string parsed as JSON, else the string itself."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply to be kwargs
        return raw


# --------------------------------------------------------------------------------------------
# dataclasses <-> JSON
# --------------------------------------------------------------------------------------------


def to_jsonable(v: Any) -> Any:
    """JSON-ready form of `v`: enums by name, dataclasses as dicts, torch dtypes by name."""
    if isinstance(v, enum.Enum):
        return v.name
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: to_jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def dataclass_from_dict(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """`cls` from a (possibly partial) JSON object of its fields, each coerced to its type hint
    (an `InputError` naming ``where.field`` when one cannot be); `cls`'s own errors propagate."""
    if not isinstance(data, Mapping):
        raise InputError(f"{where}: expected a JSON object, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise InputError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}"
        )
    kwargs = {n: coerce_hint(hints.get(n, Any), v, f"{where}.{n}") for n, v in data.items()}
    return cls(**kwargs)


def coerce_hint(hint: Any, value: Any, where: str) -> Any:
    """`value` (from JSON) as type `hint`: unions tried in order, enums, nested dataclasses,
    torch dtypes, bool/int/float; anything else as it is."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        last: Exception | None = None
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            try:
                return coerce_hint(arg, value, where)
            except (InputError, TypeError, ValueError) as exc:
                last = exc
        raise InputError(f"{where}: cannot use {value!r} ({last})")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return coerce_enum(hint, value, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return dataclass_from_dict(hint, value, where)
    if hint is torch.dtype:
        dt = getattr(torch, str(value).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise InputError(f"{where}: unknown dtype {value!r}")
        return dt
    if hint in (int, float, bool):
        return typed(hint, where)(value)
    return value


def json_object(v: Any, name: str, what: str) -> Mapping[str, Any]:
    """`v` as a JSON object (a mapping, or a string holding one); `what` names its fields."""
    if isinstance(v, str):
        v = loads(v, name)
    if not isinstance(v, Mapping):
        raise InputError(f"{name}: expected a JSON object of {what}, got {v!r}")
    return v


__all__ = [
    "coerce_enum",
    "coerce_hint",
    "dataclass_from_dict",
    "enum_dump",
    "json_object",
    "json_or_raw",
    "to_jsonable",
    "typed",
]
