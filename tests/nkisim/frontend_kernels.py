"""Kernels for the front-end check: ``bad_<rule>`` breaks one rule, ``good_<rule>`` is the same
kernel fixed. Each offending line carries a ``# violates: <rule>`` marker; the tests check that
the violation is reported at exactly that file:line.
"""

# ruff: noqa: B018, E731, F841, SIM

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np

from mxcli.nkisim.kernel import jit
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from tests.nkisim import frontend_helpers as helpers

P = 8
_SIZES = (1, 2, 4)
_RANGE = range(4)


def _touch(x):
    """One real instruction, so that good kernels also run on the interpreter."""
    t = nl.ndarray((1, 1), nl.float32)
    nisa.dma_copy(dst=t, src=x)
    return t


# -- syntax ------------------------------------------------------------------------------------


def bad_try(x):
    try:  # violates: try
        _touch(x)
    except ValueError:
        pass


def good_try(x):
    _touch(x)


def bad_raise(x, n=1):
    if n < 0:
        raise ValueError("n must be >= 0")  # violates: raise
    _touch(x)


def good_raise(x, n=1):
    assert n >= 0, "n must be >= 0"
    _touch(x)


def bad_with(x):
    with nl.no_reorder():  # violates: with
        _touch(x)


def good_with(x):
    _touch(x)


def bad_lambda(x):
    f = lambda v: v + 1  # violates: lambda
    assert f(1) == 2
    _touch(x)


def _plus_one(v):
    return v + 1


def good_lambda(x):
    assert _plus_one(1) == 2
    _touch(x)


def bad_set(x):
    seen = {1, 2}  # violates: set
    assert len(seen) == 2
    _touch(x)


def good_set(x):
    seen = (1, 2)
    assert len(seen) == 2
    _touch(x)


def bad_generator(x):
    m = max(s * 2 for s in _SIZES)  # violates: generator
    assert m == 8
    _touch(x)


def good_generator(x):
    m = 0
    for s in _SIZES:
        m = max(m, s * 2)
    assert m == 8
    _touch(x)


def bad_comprehension(x):
    tiles = [nl.ndarray((P, 4), nl.float32) for _ in range(2)]  # violates: comprehension
    assert len(tiles) == 2
    _touch(x)


def good_comprehension(x):
    tiles = []
    for _ in range(2):
        tiles.append(nl.ndarray((P, 4), nl.float32))
    assert len(tiles) == 2
    _touch(x)


_COUNT = 0


def bad_global(x):
    global _COUNT  # violates: global
    _COUNT = 1
    _touch(x)


def good_global(x):
    count = 1
    assert count == 1
    _touch(x)


def _gen_sizes():
    yield 1  # violates: yield


def bad_yield(x):
    for s in _gen_sizes():
        assert s == 1
    _touch(x)


def _sizes():
    return (1,)


def good_yield(x):
    for s in _sizes():
        assert s == 1
    _touch(x)


def bad_del(x):
    t = _touch(x)
    del t  # violates: del


def good_del(x):
    _touch(x)


def bad_walrus(x, n=2):
    if (m := n * 2) > 2:  # violates: walrus
        _touch(x)


def good_walrus(x, n=2):
    m = n * 2
    if m > 2:
        _touch(x)


def bad_syntax(x, n=1):
    match n:  # violates: syntax
        case 1:
            _touch(x)


def good_syntax(x, n=1):
    if n == 1:
        _touch(x)


def bad_import(x):
    import math as m  # violates: import

    assert m.ceil(1.5) == 2
    _touch(x)


def good_import(x):
    assert math.ceil(1.5) == 2  # math is allowed (upstream kernels use it)
    _touch(x)


# -- values, classes, names --------------------------------------------------------------------


class Mode(enum.Enum):
    A = 1
    B = 2


class StrMode(str, enum.Enum):  # violates: class-base
    A = "a"


def bad_is(x, mode=Mode.A, skip=None):
    if mode is Mode.A and skip is None:  # violates: is
        _touch(x)


def good_is(x, mode=Mode.A, skip=None):
    if mode == Mode.A and skip is None:
        _touch(x)


class PlainTiles:  # violates: class-base
    def __init__(self, n):
        self.n = n


@dataclasses.dataclass
class NkiTiles(nl.NKIObject):
    n: int = 2

    def doubled(self):
        return self.n * 2

    @staticmethod
    def unit():
        return 1


def bad_class_base(x):
    assert PlainTiles(2).n == 2
    assert StrMode.A == "a"
    _touch(x)


def good_class_base(x):
    assert NkiTiles(2).doubled() == 4 and NkiTiles.unit() == 1
    assert Mode.B != Mode.A
    _touch(x)


class ClassmethodTiles(nl.NKIObject):
    def __init__(self, n):
        self.n = n

    @classmethod  # violates: decorator
    def unit(cls):
        return cls(1)


def bad_decorator(x):
    assert ClassmethodTiles.unit().n == 1
    _touch(x)


class PropertyTiles(nl.NKIObject):
    """@property is allowed: AWS's MatmulMxfp8KernelConfig uses it (issue 20)."""

    def __init__(self, n):
        self.n = n

    @property
    def doubled(self):
        return self.n * 2


def good_property(x):
    assert PropertyTiles(2).doubled == 4
    _touch(x)


class MethodTiles(nl.NKIObject):
    def __init__(self, n):
        self.n = n

    def doubled(self):
        return self.n * 2


def good_decorator(x):
    assert MethodTiles(2).doubled() == 4
    _touch(x)


def bad_signature(x, *, n=1):  # violates: signature
    _touch(x)


def good_signature(x, n=1):
    _touch(x)


def _variadic(*sizes):  # violates: signature
    return len(sizes)


def bad_helper_signature(x):
    assert _variadic(1, 2) == 2
    _touch(x)


def list_argument(x, sizes):
    assert len(sizes) == 2
    _touch(x)


def bad_value(x):
    assert len(_RANGE) == 4  # violates: value
    _touch(x)


def good_value(x):
    assert len(_SIZES) == 3
    _touch(x)


def bad_torch_numpy(x):
    scale = float(np.float32(0.5))  # violates: torch-numpy
    assert scale == 0.5
    _touch(x)


def good_torch_numpy(x):
    scale = 0.5
    assert scale == 0.5
    _touch(x)


def dtype_argument(x, dtype):
    t = nl.ndarray((1, 1), dtype)
    nisa.dma_copy(dst=t, src=x)


def bad_builtin(x):
    total = 0
    for i, s in enumerate(_SIZES):  # violates: builtin
        total += i * s
    assert total == 10
    _touch(x)


def good_builtin(x):
    total = 0
    for i in range(len(_SIZES)):
        total += i * _SIZES[i]
    assert total == 10
    _touch(x)


@jit
def _jit_helper(x):
    _touch(x)


def calls_jit_helper(x):
    _jit_helper(x)


_MAX_FINITE = {nl.float8_e4m3fn: 448.0, nl.float8_e5m2: 57344.0}


def dtype_keyed_table(x):
    assert _MAX_FINITE[nl.float8_e4m3fn] == 448.0
    _touch(x)


# -- reachability: helpers in other modules, methods of argument objects -----------------------


def bad_imported_helper(x):
    assert helpers.checked_size(4) == 4
    _touch(x)


def good_imported_helper(x):
    assert helpers.asserted_size(4) == 4
    _touch(x)


def config_argument(x, cfg):
    assert cfg.size() == 2
    _touch(x)


def bad_memset_x4(x):
    t = nl.ndarray((4, 4), nl.float8_e4m3fn_x4)
    nisa.memset(t, 1)  # violates: memset-x4


def good_memset_x4(x):
    t = nl.ndarray((4, 4), nl.float8_e4m3fn_x4)
    nisa.memset(t, 0)
    _touch(x)
