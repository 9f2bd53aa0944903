"""Probes of constructs AWS's MXFP8 backward (nkilib ``experimental/moe_mxfp8/bwd``) uses that
the interpreter used to reject (issue 29): each is the construct alone, in a kernel of its own,
with the value the spec gives it."""

from __future__ import annotations

import numpy as np
import pytest

from mxcli.nkisim import isa as nisa
from mxcli.nkisim import language as nl
from tests.nkisim.conftest import run


class Dims(nl.NKIObject):
    """Annotated fields, no ``@dataclass``, a method deriving more: as AWS's ``DimensionSizes``
    (core/moe/moe_cte/bwmm_shard_on_I.py), built with keyword arguments."""

    B: int
    H: int
    scale: float = 2.0

    def derive(self):
        self.TILES = self.B // 128


def _dims_kernel(x):
    d = Dims(B=256, H=x.shape[1])
    d.derive()
    p = Dims(128, 4, 0.5)
    out = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
    values = (float(d.TILES), float(d.H), d.scale, p.scale)
    for i in range(4):
        nisa.memset(dst=t[0:1, i : i + 1], value=values[i])
    nisa.dma_copy(dst=out, src=t)
    return out


def test_nki_object_without_dataclass_is_built_with_keywords() -> None:
    """python subset spec, "Classes": ``@dataclass`` is optional and compiled the same way."""
    out = run(_dims_kernel, np.zeros((1, 3), np.float32))
    assert np.asarray(out).tolist() == [[2.0, 3.0, 2.0, 0.5]]


def test_nki_object_constructor_refuses_what_a_dataclass_would() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'C'"):
        Dims(B=1, H=2, C=3)
    with pytest.raises(TypeError, match="missing required argument.*H"):
        Dims(B=1)
    with pytest.raises(TypeError, match="takes 3 positional"):
        Dims(1, 2, 3, 4)
