"""Data movement: dma_copy, dma_compute, dma_transpose, sendrecv, core_barrier (api spec §6).

DMA instructions always move real data, also in check-only mode: the bytes they move are what
index math and dynamic control flow are computed from, and copying is cheap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mxcli.nkisim import machine
from mxcli.nkisim.dtypes import from_fp32, to_fp32
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki.isa._common import (
    HBM,
    SBUF,
    SBUF_HBM,
    NkiInstruction,
    check_engine,
    isa_op,
    operand,
)
from mxcli.nkisim.nki.isa.enums import as_enum, dge_mode, dma_engine, engine, oob_mode
from mxcli.nkisim.ops import add as _nl_add
from mxcli.nkisim.target import nc_version
from mxcli.nkisim.tensor import Access, MemoryRegion, NkiTensor

__all__ = ["dma_copy", "dma_compute", "dma_transpose", "sendrecv", "core_barrier"]


def _no_index_grid(op: str, *views: Any) -> None:
    """A [128, n] vector_offset grid is the gather-transpose form (api spec §6.3): dma_copy
    and dma_compute take one index per row, (P, 1) (api spec §4.5)."""
    for v in views:
        vec = getattr(v, "_vec", None)
        if vec is not None and vec.grid:
            raise NkiValidationError(
                f"{op}: vector_offset must be (P, 1), one index per row (got an index grid of "
                f"shape {tuple(vec.index.shape)}: only dma_transpose takes one)"
            )


def _indirect(t: Any) -> tuple[bool, bool]:
    """(has vector offset, has scalar/dynamic offsets) of a view."""
    if not isinstance(t, NkiTensor):
        return False, False
    return t._vec is not None, bool(t._dyn)


def _dma_operand(op: str, name: str, t: Any, skip: bool) -> Access:
    if isinstance(t, NkiTensor) and t.buffer is MemoryRegion.psum:
        raise NkiValidationError(
            f"{op}: {name} is in PSUM; DMA cannot access PSUM since NKI 0.3 (copy it to SBUF "
            "with nisa.tensor_copy first)"
        )
    return operand(op, name, t, SBUF_HBM, oob_skip=skip)


def _elem_valid(acc: Access) -> np.ndarray | None:
    """Per-element validity of a vector access ([P, rest...]) or None when all valid."""
    if acc.valid is None or acc.valid.all():
        return None
    return np.broadcast_to(acc.valid.reshape((-1,) + (1,) * (len(acc.shape) - 1)), acc.shape)


def _count(prog: machine.Program, src: Access, dst: Access, n_elems: int) -> None:
    c = prog.counters
    c.dma_bytes += n_elems * dst.dtype.itemsize
    if src.buffer in HBM:
        c.hbm_read_bytes += n_elems * src.dtype.itemsize
    if dst.buffer in HBM:
        c.hbm_write_bytes += n_elems * dst.dtype.itemsize


def _convert(src: Access, raw: np.ndarray, dst: Access, op: str) -> np.ndarray:
    """Same dtype: raw bytes (bit-exact); otherwise through fp32 with RNE (api spec §2.4)."""
    if src.dtype is dst.dtype:
        return raw
    for a in (src, dst):
        if a.dtype.kind == "x4":
            raise NkiValidationError(
                f"{op}: {a.name} dtype {a.dtype} cannot be cast (src {src.dtype}, dst "
                f"{dst.dtype}); reinterpret with .view() so both sides match"
            )
    return from_fp32(to_fp32(raw, src.dtype), dst.dtype)


@isa_op(
    removed={
        "dst_rmw_op": "removed in NKI 0.3: use nisa.dma_compute",
        "unique_indices": "removed from dma_copy in NKI 0.3: use nisa.dma_compute",
    }
)
def dma_copy(
    dst: NkiTensor,
    src: NkiTensor,
    priority: int | None = None,
    oob_mode: oob_mode = oob_mode.error,
    dge_mode: dge_mode = dge_mode.unknown,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = src`` element-wise in row-major pairing; casts via fp32; indirect gather/scatter
    through ``.ap(vector_offset=...)`` / ``scalar_offset``; OOB rows raise or are skipped."""
    op = "dma_copy"
    prog = machine.current()
    om = as_enum(oob_mode, _OOB, op, "oob_mode")
    dm = as_enum(dge_mode, _DGE, op, "dge_mode")
    eng = as_enum(engine, _ENG, op, "engine")
    prog.begin(op, "dma")
    skip = om is _OOB.skip
    vs, ds_ = _indirect(src)
    vd, dd = _indirect(dst)
    _no_index_grid(op, src, dst)
    if skip and not (vs or ds_ or vd or dd):
        raise NkiValidationError(f"{op}: oob_mode.skip needs indirect (dynamic) addressing")
    if vs and vd:
        raise NkiValidationError(f"{op}: src and dst cannot both use vector_offset")
    if (vs or vd) and dm not in (_DGE.unknown, _DGE.swdge):
        raise NkiValidationError(
            f"{op}: vector_offset needs dge_mode unknown or swdge (got dge_mode.{dm.name})"
        )
    if dm is _DGE.none and (vs or vd or ds_ or dd):
        raise NkiValidationError(f"{op}: dge_mode.none cannot use dynamic offsets")
    if dm is _DGE.hwdge and prog.target.version < nc_version.gen3:
        raise NkiValidationError(
            f"{op}: dge_mode.hwdge needs NeuronCore-v3+ (target {prog.target.name})"
        )
    if eng is not _ENG.unknown:
        if dm is not _DGE.hwdge:
            raise NkiValidationError(f"{op}: engine may only be given with dge_mode.hwdge")
        check_engine(op, eng, (_ENG.sync, _ENG.scalar))
    _check_priority(op, prog, priority)
    if vs or vd or dm is _DGE.swdge:  # software DGE: descriptors in SBUF (capacity sweep)
        prog.swdge_dma()
    s = _dma_operand(op, "src", src, skip)
    d = _dma_operand(op, "dst", dst, skip)
    if s.size != d.size:
        raise NkiValidationError(
            f"{op}: dst element count differs from src (got {d.size} {d.shape}, expected {s.size} {s.shape})"
        )
    if dm is _DGE.hwdge and s.dtype is not d.dtype:
        raise NkiValidationError(
            f"{op}: dge_mode.hwdge needs equal src/dst dtypes (got {s.dtype} -> {d.dtype}); use .view()"
        )
    if s.skip or d.skip:
        return NkiInstruction(op)
    raw = _convert(s, s.read(), d, op)
    ev = _elem_valid(s)
    if ev is None:
        d.write(raw.reshape(d.shape))
        n = d.size if d.valid is None else int(d.valid.sum()) * (d.size // max(d.parts, 1))
    else:
        d.write(raw.reshape(d.shape), mask=ev.reshape(d.shape))
        n = int(ev.sum())
    _count(prog, s, d, n)
    return NkiInstruction(op)


_OOB = oob_mode
_DGE = dge_mode
_ENG = engine


def _check_priority(op: str, prog: machine.Program, priority: Any) -> None:
    if priority is None:
        return
    if prog.target.version < nc_version.gen4:
        raise NkiValidationError(f"{op}: priority is supported on NeuronCore-v4 only")
    if not isinstance(priority, int) or not 0 <= priority <= 3:
        raise NkiValidationError(f"{op}: priority must be an int in 0..3, got {priority!r}")


@isa_op()
def dma_compute(
    dst: NkiTensor,
    srcs: Any,
    reduce_op: Any,
    scales: Any = None,
    unique_indices: bool = True,
    oob_mode: oob_mode = oob_mode.error,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = sum_i srcs[i]`` in fp32 (api spec §6.2); RMW scatter/gather-add through
    ``vector_offset`` views."""
    op = "dma_compute"
    prog = machine.current()
    om = as_enum(oob_mode, _OOB, op, "oob_mode")
    prog.begin(op, "dma")
    if reduce_op is not _nl_add:
        raise NkiValidationError(f"{op}: reduce_op must be nl.add, got {reduce_op!r}")
    srcs = list(srcs) if isinstance(srcs, (list, tuple)) else [srcs]
    if not 1 <= len(srcs) <= 16:
        raise NkiValidationError(f"{op}: srcs must hold 1..16 tensors, got {len(srcs)}")
    if scales is not None:
        if len(scales) != len(srcs) or any(float(x) != 1.0 for x in scales):
            raise NkiValidationError(f"{op}: scales must be None or all 1.0, got {list(scales)}")
    skip = om is _OOB.skip
    views = [dst, *srcs]
    _no_index_grid(op, *views)
    vec = [_indirect(v)[0] for v in views]
    if any(_indirect(v)[1] for v in views):
        raise NkiValidationError(f"{op}: operands must use static addresses or vector_offset")
    if skip and not any(vec):
        raise NkiValidationError(f"{op}: oob_mode.skip is only valid with vector_offset")
    rmw = any(vec)
    if rmw and (len(srcs) != 2 or not unique_indices):
        raise NkiValidationError(
            f"{op}: read-modify-write (vector_offset) needs exactly 2 srcs and unique_indices=True "
            f"(got {len(srcs)} srcs, unique_indices={unique_indices})"
        )
    if rmw:  # read-modify-write through vector_offset is swdge only (api spec §6.2)
        prog.swdge_dma()
    d = _dma_operand(op, "dst", dst, skip)
    accs = [_dma_operand(op, f"srcs[{i}]", s, skip) for i, s in enumerate(srcs)]
    for i, a in enumerate(accs):
        if a.size != d.size:
            raise NkiValidationError(
                f"{op}: srcs[{i}] element count differs from dst (got {a.size}, expected {d.size})"
            )
    if d.rows is not None and unique_indices:
        # duplicate indices inside one RMW scatter would race on hardware
        idx = d.rows[d.valid] if d.valid is not None else d.rows
        if np.unique(idx).size != idx.size:
            raise NkiValidationError(
                f"{op}: dst vector_offset has duplicate indices but unique_indices=True"
            )
    total = np.zeros(d.size, dtype=np.float32)
    valid = np.ones(d.size, dtype=bool)
    for a in accs:
        total += a.read_f32().reshape(-1)
        ev = _elem_valid(a)
        if ev is not None:
            valid &= ev.reshape(-1)
    dv = _elem_valid(d)
    if dv is not None:
        valid &= dv.reshape(-1)
    if d.dtype.kind == "x4":
        raise NkiValidationError(f"{op}: dst dtype {d.dtype} cannot receive computed values")
    out = from_fp32(total, d.dtype).reshape(d.shape)
    d.write(out, mask=None if valid.all() else valid.reshape(d.shape))
    n = int(valid.sum())
    for a in accs:
        _count(prog, a, d, n)
    prog.counters.dma_bytes -= n * d.dtype.itemsize * (len(accs) - 1)
    return NkiInstruction(op)


_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


@isa_op()
def dma_transpose(
    dst: NkiTensor,
    src: NkiTensor,
    axes: Any = None,
    priority: int | None = None,
    dge_mode: dge_mode = dge_mode.unknown,
    oob_mode: oob_mode = oob_mode.error,
    name: str | None = None,
) -> NkiInstruction:
    """DMA transpose by rank (api spec §6.3): 2-D (1,0), 3-D (2,1,0), 4-D (3,1,2,0); bit-exact."""
    op = "dma_transpose"
    prog = machine.current()
    om = as_enum(oob_mode, _OOB, op, "oob_mode")
    dm = as_enum(dge_mode, _DGE, op, "dge_mode")
    prog.begin(op, "dma")
    _check_priority(op, prog, priority)
    if not isinstance(src, NkiTensor) or not isinstance(dst, NkiTensor):
        raise NkiValidationError(f"{op}: dst and src must be NkiTensors")
    rank = src.ndim
    if rank not in _TRANSPOSE_AXES:
        raise NkiValidationError(f"{op}: src rank must be 2, 3 or 4, got {rank}")
    perm = _TRANSPOSE_AXES[rank]
    if axes is not None and tuple(axes) != perm:
        raise NkiValidationError(f"{op}: axes for a {rank}-D src must be {perm}, got {tuple(axes)}")
    expected = tuple(src.shape[a] for a in perm)
    if dst.shape != expected:
        raise NkiValidationError(
            f"{op}: dst shape must be the permuted src shape (got {dst.shape}, expected {expected})"
        )
    if dst.dtype is not src.dtype:
        raise NkiValidationError(
            f"{op}: dst dtype must equal src dtype (got {dst.dtype}, {src.dtype})"
        )
    vs, dyn = _indirect(src)
    skip = om is _OOB.skip
    if skip and not (vs or dyn):
        raise NkiValidationError(f"{op}: oob_mode.skip is only valid with an indirect src")
    if dm is _DGE.hwdge or vs:
        if prog.target.version < nc_version.gen3:
            raise NkiValidationError(f"{op}: hwdge / indirect transpose needs NeuronCore-v3+")
        if src.dtype.itemsize != 2:
            raise NkiValidationError(
                f"{op}: {'indirect' if vs else 'hwdge'} transpose needs a 2-byte dtype (got {src.dtype})"
            )
        if src.shape[-1] > 128:
            raise NkiValidationError(f"{op}: src.shape[-1] must be <= 128 (got {src.shape[-1]})")
    if dm is _DGE.hwdge:
        if vs:
            raise NkiValidationError(f"{op}: dge_mode.hwdge cannot use vector_offset")
        if rank == 2 and src.shape[0] != 16:
            raise NkiValidationError(
                f"{op}: hwdge 2-D transpose needs src.shape[0] == 16 (got {src.shape[0]})"
            )
        if rank > 2 and (
            src.shape[0] not in (1, 2, 4, 8, 16) or (src.shape[0] * src.shape[-2]) % 16
        ):
            raise NkiValidationError(
                f"{op}: hwdge {rank}-D transpose needs src.shape[0] in {{1,2,4,8,16}} and "
                f"src.shape[0]*src.shape[-2] % 16 == 0 (got {src.shape})"
            )
    if vs:
        if dm not in (_DGE.unknown, _DGE.swdge):
            raise NkiValidationError(f"{op}: indirect src needs dge_mode unknown or swdge")
        if src.shape[0] % 16:
            raise NkiValidationError(
                f"{op}: indirect src.shape[0] must be a multiple of 16 (got {src.shape[0]})"
            )
    if vs or dm is _DGE.swdge:  # software DGE: descriptors in SBUF (capacity sweep)
        prog.swdge_dma()
    s = _dma_operand(op, "src", src, skip)
    d = operand(op, "dst", dst, (SBUF,))
    if s.skip:
        return NkiInstruction(op)
    raw = s.read()
    out = np.transpose(raw, perm)
    ev = _elem_valid(s)
    d.write(out, mask=None if ev is None else np.transpose(ev, perm))
    _count(prog, s, d, d.size if ev is None else int(ev.sum()))
    return NkiInstruction(op)


@isa_op(removed={"use_gpsimd_dma": "removed in NKI 0.3: use dma_engine=dma_engine.gpsimd_dma"})
def sendrecv(
    src: NkiTensor,
    dst: NkiTensor,
    send_to_rank: int,
    recv_from_rank: int,
    pipe_id: int,
    dma_engine: dma_engine = dma_engine.dma,
    name: str | None = None,
) -> NkiInstruction:
    """Send `src` to core `send_to_rank` while receiving `recv_from_rank`'s src into `dst`."""
    op = "sendrecv"
    prog = machine.current()
    de = as_enum(dma_engine, _DMAE, op, "dma_engine")
    prog.begin(op, "dma")
    if prog.target.version < nc_version.gen3:
        raise NkiValidationError(f"{op}: needs NeuronCore-v3+ (target {prog.target.name})")
    if prog.config.lnc < 2:
        raise NkiValidationError(f"{op}: only allowed when LNC is enabled (launch with kernel[2])")
    for nm, r in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if r not in range(prog.config.lnc):
            raise NkiValidationError(f"{op}: {nm} must be in 0..{prog.config.lnc - 1}, got {r!r}")
    s = operand(op, "src", src, (SBUF,))
    d = operand(op, "dst", dst, (SBUF,))
    if s.dtype is not d.dtype or s.parts != d.parts or s.per_part != d.per_part:
        raise NkiValidationError(
            f"{op}: src and dst must have the same dtype, partitions and elements per partition "
            f"(got {s.dtype} {s.shape} -> {d.dtype} {d.shape})"
        )
    if de is _DMAE.gpsimd_dma:
        cap = {4: 1024, 2: 512, 1: 256}.get(s.dtype.itemsize, 0)
        if s.per_part * s.dtype.itemsize > cap:
            raise NkiValidationError(
                f"{op}: dma_engine.gpsimd_dma moves at most {cap} bytes per partition "
                f"(got {s.per_part * s.dtype.itemsize})"
            )
    payload = s.read()
    got = prog.sendrecv(payload, int(send_to_rank), int(recv_from_rank), int(pipe_id))
    d.write(got.reshape(d.shape))
    prog.counters.dma_bytes += d.nbytes
    return NkiInstruction(op)


_DMAE = dma_engine


@isa_op()
def core_barrier(
    data: NkiTensor, cores: Any, engine: engine = engine.gpsimd, name: str | None = None
) -> NkiInstruction:
    """Both LNC cores wait until both reach this barrier (api spec §6.5).

    api spec §12.20 decision: under LNC=1 this is a no-op (the real compiler rejects it; the
    MoE backward calls it unconditionally, so its LNC=1 runs need the no-op here).
    """
    op = "core_barrier"
    prog = machine.current()
    as_enum(engine, _ENG, op, "engine")
    prog.begin(op, "sync")
    if tuple(cores) != (0, 1):
        raise NkiValidationError(f"{op}: cores must be (0, 1), got {tuple(cores)!r}")
    if not isinstance(data, NkiTensor) or data.buffer is not MemoryRegion.shared_hbm:
        got = data.buffer.value if isinstance(data, NkiTensor) else type(data).__name__
        raise NkiValidationError(f"{op}: data must be a shared_hbm tensor (got {got})")
    if prog.target.version < nc_version.gen3:
        raise NkiValidationError(f"{op}: needs NeuronCore-v3+ (target {prog.target.name})")
    prog.core_barrier(data._st)
    return NkiInstruction(op)
