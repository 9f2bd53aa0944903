"""Files of measured latencies (``mxcli profile --calibrate MEASURED.json``, issue 29 item 7):
parsed and checked, and each measured launch run once in check-only mode with recording
(`mxcli.kernels.profiling`), for `mxcli.kernels.calibrating.calibrate` to refit the figures.

A measurements file: a JSON list (or ``{"measurements": [...]}``) of objects

    {"kernel": "bwd", "shape": {"tokens": 4096, "hidden": 4096, "intermediate": 1536,
     "experts": 1, "top_k": 1, "block_size": 4096}, "lnc": 2, "us": 2190.0,
     "kwargs": {...}, "nki_kernel": "mxcli"}

``kernel``: a kernel's short name or name; ``shape``: every shape flag of its profile part
(``profile <kernel> --help``); ``lnc``: 1 or 2; ``us``: the measured latency
(microseconds, > 0); optional ``kwargs``: kernel keyword arguments over the shape's own (as
``make-inputs`` records them; an object such as the bwd ``config`` is merged field by field
into the shape's); optional ``nki_kernel``: which
implementation was timed (default ``mxcli``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mxcli.errors import InputError
from mxcli.kernels import profiling as prof
from mxcli.kernels.calibrating import Measurement, finite_number, input_error, read_json
from mxcli.kernels.spec import all_specs, get_spec

__all__ = ["read_measurements", "record"]


# The kernel-specific part is the kernel's profile part (issue 32): its shape flags (every one
# required here: a measurement names its whole launch) and the inputs of a shape.


def _shape_fields(spec: Any) -> list[str]:
    part = spec.profile()
    if part is None:
        raise InputError(f"kernel: {spec.name} has no profile shapes ({spec.package}.profile)")
    return [p.name for p in part.PARAMS]


def _shape_inputs(spec: Any, shape: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return prof.shape_inputs(spec.name, dict(shape))


def read_measurements(path: str | os.PathLike[str]) -> list[Measurement]:
    """Parse and check a measurements file (one `InputError` line naming the file, entry and
    key)."""
    doc = read_json(path)
    if isinstance(doc, dict) and "measurements" in doc:
        doc = doc["measurements"]
    if not isinstance(doc, list) or not doc:
        raise InputError(f"{path}: expected a non-empty list of measurements")
    out = []
    for i, e in enumerate(doc):
        where = f"{path}: measurement {i}"
        if not isinstance(e, dict):
            raise input_error(where, f"expected an object, got {type(e).__name__}")
        for key in ("kernel", "shape", "lnc", "us"):
            if key not in e:
                raise input_error(where, f"missing key {key!r}")
        extra = sorted(set(e) - {"kernel", "shape", "lnc", "us", "kwargs", "nki_kernel"})
        if extra:
            raise input_error(where, f"unknown key {extra[0]!r} (expected kernel, shape, lnc, us, "
                        "kwargs, nki_kernel)")  # fmt: skip
        try:
            spec = get_spec(str(e["kernel"]))
        except InputError:
            known = ", ".join(s.short for s in all_specs())
            raise input_error(where, f"kernel: unknown kernel {e['kernel']!r}; expected one of "
                              f"{known}") from None  # fmt: skip
        us = e["us"]
        if not finite_number(us) or us <= 0:
            raise input_error(where, f"us: expected a positive latency in microseconds, got {us!r}")
        if e["lnc"] not in (1, 2) or isinstance(e["lnc"], bool):
            raise input_error(where, f"lnc: expected 1 or 2, got {e['lnc']!r}")
        shape = e["shape"]
        names = _shape_fields(spec)
        if not isinstance(shape, dict):
            raise input_error(where, f"shape: expected an object with {', '.join(names)}")
        for n in names:
            if n not in shape:
                raise input_error(where, f"shape: missing key {n!r}")
        unknown = sorted(set(shape) - set(names))
        if unknown:
            raise input_error(
                where, f"shape: unknown key {unknown[0]!r} (expected {', '.join(names)})"
            )
        kw = e.get("kwargs", {})
        if not isinstance(kw, dict):
            raise input_error(where, "kwargs: expected an object")
        nk = e.get("nki_kernel", "mxcli")
        if not isinstance(nk, str):
            raise input_error(where, f"nki_kernel: expected a string, got {nk!r}")
        out.append(Measurement(spec.name, dict(shape), int(e["lnc"]), float(us), kw, nk, e))
    return out


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        out[k] = _merged(b, v) if isinstance(b, Mapping) and isinstance(v, Mapping) else v
    return out


def _inputs(m: Measurement, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = get_spec(m.kernel)
    try:
        tensors, kwargs = _shape_inputs(spec, m.shape)
        if m.kwargs:  # over the shape's own kwargs, objects (a bwd config) field by field
            kwargs = spec.resolve_kwargs(_merged(spec.dump_kwargs(kwargs), m.kwargs))
    except (InputError, TypeError) as exc:
        raise input_error(where, str(exc)) from None
    return tensors, kwargs


def record(m: Measurement, where: str = "measurement") -> Any:
    """Run the measured kernel once in check-only mode (recorded): its `KernelProfile`."""
    tensors, kwargs = _inputs(m, where)
    try:
        return prof.profile_kernel(m.kernel, tensors, kwargs, lnc=m.lnc, shape=m.shape,
                                   nki_kernel=m.nki_kernel)  # fmt: skip
    except InputError as exc:
        raise input_error(where, str(exc)) from None
