"""Probes of constructs AWS's MXFP8 backward (nkilib ``experimental/moe_mxfp8/bwd``) uses that
the interpreter used to reject (issue 29): each is the construct alone, in a kernel of its own,
with the value the spec gives it."""

from __future__ import annotations

import numpy as np
import pytest

from mxcli import nkisim
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
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
    # a field given no value stays unset until a method sets it (DimensionSizes.derive_all_dims)
    d = Dims(B=256)
    assert not hasattr(d, "H") and d.scale == 2.0
    with pytest.raises(TypeError, match="takes 3 positional"):
        Dims(1, 2, 3, 4)


# A package with AWS's module-global state pattern (mxfp_utils/mxfp8_utils/common_utils.py:
# ``_state = {"sbm": None}``, set once per kernel, asserting none is active), written at test
# time: the kernel's own package, as a third-party kernel's would be.
_STATE_PKG = {
    "__init__.py": "",
    "state.py": """_state = {"active": None}


def set_active(value):
    assert _state["active"] == None, "already set. Only one kernel should be active at a time."
    _state["active"] = value


def get_active():
    return _state["active"]


def clear_active():
    _state["active"] = None
""",
    "kern.py": """from enum import Enum

import nki
import nki.isa as nisa
import nki.language as nl

from .state import clear_active, get_active, set_active


class Mode(Enum):
    A = 0
    B = 1


class Cfg(nl.NKIObject):
    mode: Mode = Mode.A
    scale: float = 1.0


@nki.jit
def kernel(x, cfg):
    set_active(10.0 * (nl.program_id(0) + 1))
    out = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t[0:1, 0:1], value=get_active())
    nisa.memset(dst=t[0:1, 1:2], value=cfg.scale if cfg.mode == Mode.B else -1.0)
    pid = nl.program_id(0)
    nisa.dma_copy(dst=out[pid : pid + 1, 0:2], src=t)
    nisa.core_barrier(data=out, cores=(0, 1))  # both cores have set it before either clears it
    clear_active()
    return out
""",
}


def test_each_logical_core_has_its_own_module_state(tmp_path, monkeypatch) -> None:
    """Two LNC programs each set a module-global state once (AWS's SBUF manager pattern): on
    the device each core's program has its own; the interpreter's two threads used to share one
    (the second core's assert failed). An argument object is rebuilt for each core as its own
    class (python subset spec, "Classes"), so its enum compares equal there."""
    import importlib

    from mxcli import nkisim

    pkg = tmp_path / "mxprobe_state"
    pkg.mkdir()
    for name, text in _STATE_PKG.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    nkisim.activate()
    kern = importlib.import_module("mxprobe_state.kern")
    cfg = kern.Cfg(mode=kern.Mode.B, scale=0.5)
    out = nkisim.simulate(kern.kernel[2])(np.zeros((1, 1), np.float32), cfg)
    assert np.asarray(out).tolist() == [[10.0, 0.5], [20.0, 0.5]]
    # program 0 ran the caller's own modules: their state is cleared again
    assert importlib.import_module("mxprobe_state.state")._state == {"active": None}


def _sync(pid):
    """A sendrecv handshake: orders the two programs in time; it is no barrier on any tensor."""
    token = nl.ndarray((1, 1), nl.float32)
    nisa.memset(token, 1.0)
    got = nl.ndarray((1, 1), nl.float32)
    nisa.sendrecv(src=token, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)


def _both_gather(x, mode):
    """Both cores stage the same block of x into one shared buffer and read it back, with no
    core_barrier on it (AWS's bwmm_bwd_dropless_mxfp8.py gathers a block per core this way).
    Core 0 stores first, then core 1; ``differ``: core 1 stores other bytes; ``read_first``:
    core 1 reads the buffer before storing it itself (a hand-over from core 0)."""
    pid = nl.program_id(0)
    stage = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 4), nl.float32)
    nisa.dma_copy(dst=t, src=x)
    if mode == "differ" and pid == 1:
        nisa.memset(t, 7.0)
    back = nl.ndarray((4, 4), nl.float32)
    if pid == 0:
        nisa.dma_copy(dst=stage, src=t)
    _sync(pid)
    if pid == 1:
        if mode == "read_first":
            nisa.dma_copy(dst=back, src=stage)
        nisa.dma_copy(dst=stage, src=t)
    _sync(pid)
    nisa.dma_copy(dst=back, src=stage)
    out = nl.ndarray((2, 4, 4), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid], src=back)
    return out


def test_both_cores_storing_identical_bytes_then_reading_them_is_no_race() -> None:
    """Issue 29: every order of the two stores of one value gives each reader that value (it
    reads its own product, no hand-over); races.py's docstring gives the reasoning."""
    from mxcli.nkisim import NkiRuleError
    from mxcli.nkisim.kernel import jit

    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    out = nkisim.simulate(jit(_both_gather)[2])(x, "same")
    np.testing.assert_array_equal(np.asarray(out), np.stack([x, x]))
    # other bytes: which store lands last decides what core 0 reads, a race
    with pytest.raises(NkiRuleError, match=r"core 0 reads bytes the other core wrote.*lnc-race"):
        nkisim.simulate(jit(_both_gather)[2])(x, "differ")
    # core 1 reading core 0's store before storing it itself is a hand-over, a race
    with pytest.raises(NkiRuleError, match=r"core 1 reads bytes the other core wrote.*lnc-race"):
        nkisim.simulate(jit(_both_gather)[2])(x, "read_first")


def _gather_transpose(table, idx):
    """AWS's DGT loader (load_apis.py load_tile_dgt, legacy path): a gather-transpose of 512
    rows whose indices are a [128, 4] grid, read column-major."""
    it = nl.ndarray((128, 4), nl.uint32)
    nisa.dma_copy(dst=it, src=idx)
    rows = table.reshape((table.shape[0], 1, 1, 16))
    src = rows.ap(pattern=[[16, 512], [1, 1], [1, 1], [1, 16]], vector_offset=it)
    d = nl.ndarray((16, 1, 1, 512), nl.bfloat16)
    nisa.dma_transpose(dst=d, src=src, axes=(3, 1, 2, 0))
    out = nl.ndarray((16, 512), nl.bfloat16, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=d.reshape((16, 512)))
    return out


def _grid_in_dma_copy(table, idx):
    it = nl.ndarray((128, 4), nl.uint32)
    nisa.dma_copy(dst=it, src=idx)
    t = nl.ndarray((128, 16), nl.bfloat16)
    nisa.dma_copy(dst=t, src=table.ap(pattern=[[16, 128], [1, 16]], vector_offset=it))
    return t


def test_gather_transpose_takes_a_column_major_index_grid() -> None:
    """api spec §6.3: indices [128, n] (n > 1), flat = indices.T.flatten()[:rows]; the
    interpreter used to demand one index per row, (512, 1). dma_copy still takes (P, 1)."""
    import torch

    from mxcli.nkisim import NkiValidationError

    gen = torch.Generator().manual_seed(5)
    table = torch.randn((600, 16), generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 600, (128, 4), generator=gen, dtype=torch.int64).to(torch.uint32)
    out = run(_gather_transpose, table, idx)
    flat = idx.to(torch.int64).T.reshape(-1)[:512]
    assert torch.equal(out, table[flat].T)
    with pytest.raises(NkiValidationError, match=r"vector_offset must be \(P, 1\).*dma_transpose"):
        run(_grid_in_dma_copy, table, idx)
