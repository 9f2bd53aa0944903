"""Kernel-side types of ``rmsnorm_mx_prefill``, importable by the NKI kernel and the host alike.

The NKI 0.6 front end parses everything the kernel reaches (nki_python_subset: "Reachability"):
this module therefore holds only a basic `Enum` (no methods, no torch), compared with ``==``.
The public `contract.RouterActFnType` (an ``IntEnum`` with host-side coercion) maps onto it in
the launcher (`nki_backend`), by member name.
"""

from __future__ import annotations

import enum


class RouterMode(enum.Enum):
    """Router activation / selection of one launch (prefill spec §5.2, §5.3); same members and
    values as `contract.RouterActFnType`."""

    SIGMOID = 0
    SOFTMAX = 1
    NOAUX_TC = 2
