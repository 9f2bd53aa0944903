"""Kernels using the constructs AWS's shipped MXFP8 kernels use, which the front-end check was
calibrated to accept (issue 20 item 4; mxcli/nkisim/README.md lists the upstream file:line of
each). Own code, written for these tests: no upstream code is copied here.

``# violates: <rule>`` marks the lines a violation must be reported at.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum

import mxcli.nkisim.nki.language as nl
from mxcli.nkisim.nki import isa as nisa

_state = {"owner": None}


def _releasing(func):
    """A transparent wrapper (functools.wraps) whose own body is outside the subset: the front end
    ignores decorators, so only `func` is checked."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        finally:
            _state["owner"] = None

    return wrapper


def _touch(x):
    t = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)


@_releasing
def _decorated_helper(n):
    return n + 1


@_releasing
def _decorated_bad_helper(n):
    s = {n}  # violates: set
    return len(s)


def decorated_helper_kernel(x):
    assert _decorated_helper(1) == 2
    _touch(x)


def decorated_bad_helper_kernel(x):
    assert _decorated_bad_helper(1) == 1
    _touch(x)


class Engine(Enum):
    PE = "pe"
    DMA = "dma"


@dataclass
class PhaseConfig(nl.NKIObject):
    tiles: int = 1


def _default_phase():
    return PhaseConfig(tiles=1)


@dataclass
class BwdLikeConfig(nl.NKIObject):
    """Validated in __post_init__ with getattr / setattr / raise, as AWS's config does."""

    first: PhaseConfig = field(default_factory=_default_phase)
    second: PhaseConfig = None
    engine: Engine = Engine.PE

    def __post_init__(self):
        for name in ("first", "second"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, _default_phase())
            if not isinstance(getattr(self, name), PhaseConfig):
                raise TypeError(f"{name} must be a PhaseConfig")
        if not isinstance(self.engine, Engine):
            raise TypeError("engine must be an Engine")

    @property
    def total_tiles(self):
        return self.first.tiles + self.second.tiles


@dataclass
class CheckedConfig(nl.NKIObject):
    """Every method of an argument's class is traced code: a raise there is still rejected."""

    tiles: int = 1

    def check(self):
        if self.tiles < 0:
            raise ValueError("negative")  # violates: raise
        return True


def config_argument_kernel(x, config):
    """The config is built by the caller (host) and passed in."""
    assert config.total_tiles == 2
    _touch(x)


def config_built_in_kernel(x):
    """The config is built while tracing: its __post_init__ is traced (and accepted)."""
    config = BwdLikeConfig()
    names = ("first", "second")
    for name, phase in zip(names, (config.first, config.second)):  # noqa: B905 - as upstream
        assert phase.tiles == 1, name
    _touch(x)


def config_method_raise_kernel(x, config):
    assert config.check()
    _touch(x)


@dataclass
class HostOnly(nl.NKIObject):
    """Construction code outside the subset: fine while it runs on the host only."""

    n: int = 1

    def __post_init__(self):
        try:
            self.n = int(self.n)
        except ValueError:
            self.n = 1


def host_only_argument_kernel(x, obj):
    assert obj.n == 1
    _touch(x)


def host_only_built_in_kernel(x):
    obj = HostOnly(2)
    assert obj.n == 2
    _touch(x)
