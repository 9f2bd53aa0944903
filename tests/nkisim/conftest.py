"""Shared helpers for the interpreter's tests: run a kernel body on the interpreter."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mxcli import nkisim


def run(fn: Callable[..., Any], *args: Any, **opts: Any) -> Any:
    """Run `fn` as a kernel on the interpreter; returns its outputs."""
    return nkisim.simulate(fn, **opts)(*args)


def run_report(fn: Callable[..., Any], *args: Any, **opts: Any) -> tuple[Any, nkisim.RunReport]:
    sk = nkisim.simulate(fn, **opts)
    out = sk(*args)
    assert sk.report is not None
    return out, sk.report


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# A dummy HBM argument for kernels that need no inputs (kernels must take arguments).
DUMMY = np.zeros((1, 1), dtype=np.float32)


@pytest.fixture(scope="module")
def matmul_kernels() -> Iterator[Any]:
    """tests/nkisim/matmul_kernels.py, bound to the interpreter (its ``import nki``)."""
    if nkisim.real_nki_available():
        pytest.skip("a real nki is installed: the kernel would bind to it")
    with nkisim.installed():
        yield importlib.import_module("tests.nkisim.matmul_kernels")
