"""Tensor engine: nc_matmul, nc_matmul_mx, nc_transpose; and quantize_mx (api spec §7).

MX numerics come from `mxcli.mx` (ScaleRule.NEURON): this module only maps the hardware
layout (8 partitions x 4 x4-lanes per group, scales in quadrant rows ``32q + g``, x4 packing
byte k = element k) onto mxcli.mx's contiguous 32-element groups.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
import torch

from mxcli import mx
from mxcli.nkisim import machine
from mxcli.nkisim.dtypes import DType, bfloat16, float32, to_fp32
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki.isa._common import (
    PSUM,
    SBUF,
    NkiInstruction,
    check_engine,
    check_parts,
    isa_op,
    operand,
    require_v4,
    skip_arithmetic,
    store_f32,
)
from mxcli.nkisim.nki.isa.enums import as_enum, engine, matmul_perf_mode
from mxcli.nkisim.rules import Rule, rule_error
from mxcli.nkisim.target import nc_version
from mxcli.nkisim.tensor import Access, NkiTensor

__all__ = ["nc_matmul", "nc_matmul_mx", "nc_transpose", "quantize_mx"]

_PE_IN_V2 = {"float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}
_FP32ISH = {"float32", "tfloat32"}
_FP8 = {"float8_e4m3", "float8_e5m2", "float8_e4m3fn"}
# api spec §7.2: a scale view starts at a quadrant offset of 0, 4, 8 or 12 ("scale packing")
_SCALE_STARTS = (0, 4, 8, 12)


def _accumulate_write(op: str, dst: Access, res: np.ndarray, accumulate: Any) -> None:
    """PSUM accumulation (api spec §7.1, §12.5): False overwrites; True adds to the current
    content; None adds where the element was written since allocation (any instruction's
    write counts), overwrites elsewhere — tracked per element."""
    res = res.reshape(dst.shape).astype(np.float32)
    if accumulate is False:
        store_f32(dst, res)
        return
    if accumulate is True:
        old = dst.read_f32()  # raises / warns on never-written PSUM (uninitialized read)
        store_f32(dst, old + res)
        return
    if accumulate is not None:
        raise NkiValidationError(
            f"{op}: accumulate must be None, True or False, got {accumulate!r}"
        )
    written = dst.written_mask()
    if not written.any():
        store_f32(dst, res)
        return
    old = to_fp32(dst.read(check_init=False), dst.dtype)
    store_f32(dst, np.where(written, old + res, res))


def _check_bank(op: str, prog: machine.Program, dst: Access) -> None:
    """v2/v3: a matmul writes inside one 2 KiB PSUM bank per partition (api spec §7.1)."""
    if prog.target.version >= nc_version.gen4:
        return
    s = dst.dtype.itemsize
    in_row = (dst.offset * s) % dst.st.row_bytes
    ext = sum((sz - 1) * st for sz, st in zip(dst.shape[1:], dst.strides[1:], strict=True))
    end = in_row + (ext + 1) * s
    bank = prog.target.psum_bank_fmax_bytes
    if in_row // bank != (end - 1) // bank:
        raise NkiValidationError(
            f"{op}: dst crosses a PSUM bank boundary (bytes {in_row}..{end} of the partition; "
            f"banks are {bank} bytes on {prog.target.name})"
        )


def _check_tiling(op: str, tile_position: Any, tile_size: Any, k: int, m: int, mx_: bool) -> None:
    pos = tuple(tile_position) if tile_position is not None else ()
    size = tuple(tile_size) if tile_size is not None else ()
    if bool(pos) != bool(size):
        raise NkiValidationError(f"{op}: tile_position and tile_size must be given together")
    if not pos:
        return
    if len(pos) != 2 or len(size) != 2:
        raise NkiValidationError(f"{op}: tile_position/tile_size must be (row, col) pairs")
    prog = machine.current()
    allowed = {64, 128} if prog.target.version < nc_version.gen3 else {32, 64, 128}
    if mx_:
        if size[1] != 128 or pos[1] != 0:
            raise NkiValidationError(
                f"{op}: only row tiling: tile_size=(rows, 128), tile_position=(row, 0) "
                f"(got size {size}, position {pos})"
            )
    for i, what in ((0, "row"), (1, "column")):
        if size[i] not in allowed:
            raise NkiValidationError(
                f"{op}: tile_size {what} must be in {sorted(allowed)}, got {size[i]}"
            )
        if pos[i] % size[i] or not 0 <= pos[i] < 128:
            raise NkiValidationError(
                f"{op}: tile_position {what} must be a multiple of {size[i]} below 128, got {pos[i]}"
            )
    if k > size[0]:
        raise NkiValidationError(f"{op}: contraction size {k} exceeds the tile rows {size[0]}")
    if m > size[1]:
        raise NkiValidationError(
            f"{op}: stationary free size {m} exceeds the tile columns {size[1]}"
        )


def _moving_limit(prog: machine.Program, dst_dtype: DType) -> int:
    if prog.target.version >= nc_version.gen4:
        return 8192 if dst_dtype is bfloat16 else 4096
    return prog.target.gemm_moving_fmax


@isa_op(
    removed={
        "is_moving_zero": "removed: use is_moving_onezero",
        "psumAccumulateFlag": "removed: use accumulate=",
    }
)
def nc_matmul(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    is_stationary_onezero: bool = False,
    is_moving_onezero: bool = False,
    is_transpose: bool = False,
    accumulate: bool | None = None,
    tile_position: Any = (),
    tile_size: Any = (),
    perf_mode: matmul_perf_mode = matmul_perf_mode.none,
    name: str | None = None,
) -> NkiInstruction:
    """``dst (=|+=) stationary.T @ moving`` contracting over partitions, fp32 (api spec §7.1)."""
    op = "nc_matmul"
    prog = machine.current()
    pm = as_enum(perf_mode, matmul_perf_mode, op, "perf_mode")
    prog.begin(op, "tensor")
    t = prog.target
    s = operand(op, "stationary", stationary, (SBUF,))
    m = operand(op, "moving", moving, (SBUF,))
    d = operand(op, "dst", dst, (PSUM,))
    for a in (s, m):
        check_parts(op, a)
    if s.parts != m.parts:
        raise NkiValidationError(
            f"{op}: moving partition count differs from stationary (got {m.parts}, expected {s.parts})"
        )
    ok_in = set(_PE_IN_V2) | ({"float8_e4m3fn"} if t.version >= nc_version.gen4 else set())
    for a in (s, m):
        if a.dtype.name not in ok_in:
            raise NkiValidationError(
                f"{op}: {a.name} dtype {a.dtype} is not a tensor-engine input on {t.name} "
                f"(expected one of {sorted(ok_in)}; x4 data needs nc_matmul_mx)"
            )
    if (s.dtype.name in _FP32ISH) != (m.dtype.name in _FP32ISH):
        raise NkiValidationError(
            f"{op}: fp32/tf32 operands cannot be mixed with other dtypes (got {s.dtype}, {m.dtype})"
        )
    if {s.dtype.name, m.dtype.name} == {"float8_e4m3", "float8_e4m3fn"}:
        raise NkiValidationError(f"{op}: float8_e4m3 and float8_e4m3fn cannot be mixed")
    K, M, N = s.parts, s.per_part, m.per_part
    if is_transpose:
        if d.dtype is not s.dtype:
            raise NkiValidationError(
                f"{op}: is_transpose needs dst dtype == stationary dtype (got {d.dtype}, {s.dtype})"
            )
        if pm is matmul_perf_mode.double_row and t.version < nc_version.gen4:
            raise NkiValidationError(
                f"{op}: double_row cannot be combined with transpose on {t.name}"
            )
    else:
        ok_dst = (float32, bfloat16) if t.version >= nc_version.gen4 else (float32,)
        if d.dtype not in ok_dst:
            raise NkiValidationError(
                f"{op}: dst dtype must be {'/'.join(x.name for x in ok_dst)} on {t.name} (got {d.dtype})"
            )
    if pm is matmul_perf_mode.double_row:
        if t.version < nc_version.gen3:
            raise NkiValidationError(f"{op}: perf_mode double_row needs NeuronCore-v3+")
        for a in (s, m):
            if a.dtype.name not in _FP8:
                raise NkiValidationError(
                    f"{op}: double_row needs fp8 inputs ({a.name} is {a.dtype})"
                )
            if len(a.shape) < 3 or a.shape[1] != 2:
                raise NkiValidationError(
                    f"{op}: double_row needs {a.name} laid out (K, 2, F) (got {a.shape})"
                )
        if tile_position and tuple(tile_position)[1:] not in ((), (0,)):
            raise NkiValidationError(f"{op}: double_row cannot be combined with column tiling")
        M, N, K = M // 2, N // 2, 2 * K
    if M > t.gemm_stationary_fmax:
        raise NkiValidationError(f"{op}: stationary free size {M} exceeds {t.gemm_stationary_fmax}")
    lim = _moving_limit(prog, d.dtype)
    if N > lim:
        raise NkiValidationError(
            f"{op}: moving free size {N} exceeds {lim} on {t.name} (dst {d.dtype})"
        )
    check_parts(op, d)
    if d.parts != M or d.per_part != N:
        raise NkiValidationError(
            f"{op}: dst must have {M} partitions x {N} elements (got {d.shape})"
        )
    _check_tiling(op, tile_position, tile_size, s.parts, M, False)
    _check_bank(op, prog, d)
    if is_transpose:
        # PE transpose: moving must be an identity matrix; bit-exact; always overwrites.
        mv = m.read_f32().reshape(K, N)
        if K != N or not np.array_equal(mv, np.eye(K, dtype=np.float32)):
            raise NkiValidationError(f"{op}: is_transpose needs an identity moving operand")
        d.write(s.read().reshape(K, M).T.reshape(d.shape))
        prog.counters.transpose_elements += K * M
        return NkiInstruction(op)
    prog.counters.matmul_flops += 2 * K * M * N
    if skip_arithmetic(prog, d, s, m):
        return NkiInstruction(op)
    if pm is matmul_perf_mode.double_row:
        # contraction over (partition, the size-2 dim): [K, 2, M] -> [2K, M]
        sv = s.read_f32().reshape(s.parts, 2, M).reshape(K, M)
        mvv = m.read_f32().reshape(m.parts, 2, N).reshape(K, N)
    else:
        sv = s.read_f32().reshape(K, M)
        mvv = m.read_f32().reshape(K, N)
    # IEEE fp32 products and sums (api spec §7.1 "Products and accumulation in fp32"; the
    # onezero flags are hints with "No semantic effect"): a NaN or Inf operand meets the zeros
    # of the other, so a matmul against the identity spreads NaN * 0 = NaN over its row. Use a
    # transpose (below, and `is_transpose=True` above) to move data bit-exactly.
    res = sv.T @ mvv  # [M, N], fp32
    _accumulate_write(op, d, res, accumulate)
    return NkiInstruction(op)


# -- MX ---------------------------------------------------------------------------------------


def _scale_indices(op: str, sc: Access, k: int, ncols: int) -> np.ndarray:
    """Flat byte indices [K/8, ncols] of the scales of an MX operand with `k` partitions.

    api spec §7.2 / §12.6: group G = p // 8 of quadrant q = G // 4 uses scale row
    ``start + 32 q + G % 4`` of the scale *storage*, where start is the scale view's first
    partition; the view's declared partition count is not used.
    """
    if sc.dtype.name not in ("uint8", "float8_e8m0fnu"):
        raise NkiValidationError(
            f"{op}: {sc.name} dtype must be float8_e8m0fnu or uint8 (got {sc.dtype})"
        )
    if sc.buffer is not SBUF:
        raise NkiValidationError(f"{op}: {sc.name} must be in sbuf (got {sc.buffer.value})")
    row = sc.st.row_bytes
    start = sc.start_partition
    if start % 32 not in _SCALE_STARTS:
        raise NkiValidationError(
            f"{op}: {sc.name} starts at partition {start}; scale views must start at a quadrant "
            f"offset of 0, 4, 8 or 12 (got {start % 32})"
        )
    groups = np.arange(k // 8)
    rows = start + 32 * (groups // 4) + groups % 4
    if rows.max() >= sc.st.partitions:
        raise NkiValidationError(
            f"{op}: {sc.name} needs scale rows up to {int(rows.max())} but its storage has "
            f"{sc.st.partitions} partitions"
        )
    if sc.per_part < ncols:
        raise NkiValidationError(
            f"{op}: {sc.name} has {sc.per_part} elements per partition, fewer than the operand's "
            f"{ncols} columns"
        )
    # free positions of the view (in-row element offsets), first `ncols` in row-major order
    pos = np.zeros((), dtype=np.int64)
    for sz, st in zip(sc.shape[1:], sc.strides[1:], strict=True):
        pos = pos[..., None] + np.arange(sz, dtype=np.int64) * st
    cols = (sc.offset % row) + pos.reshape(-1)[:ncols]
    return rows[:, None] * row + cols[None, :]


def _physical_partition(a: Access) -> int:
    """First SBUF partition of a view: its storage's placement (``address=``) plus its start."""
    base = a.st.address[0] if a.st.address is not None else 0
    return base + a.start_partition


def _check_scale_quadrant(op: str, data: Access, sc: Access, k: int) -> None:
    """MXFP matmul guide: "scale values must be placed in the same quadrant as their corresponding
    scaling group" (SBUF <-> VectorE connectivity). Group G spans data partitions
    ``d0 + 8G .. d0 + 8G + 7``; its scale sits in row ``s0 + 32 (G // 4) + G % 4``."""
    d0, s0 = _physical_partition(data), _physical_partition(sc)
    for g in range(k // 8):
        data_q = {(d0 + 8 * g) // 32, (d0 + 8 * g + 7) // 32}
        row = s0 + 32 * (g // 4) + g % 4
        if data_q != {row // 32}:
            raise rule_error(
                Rule.MX_SCALE_QUADRANT,
                f"{op}: {sc.name} scale row {row} (quadrant {row // 32}) of scaling group {g} is "
                f"not in the quadrant of its data {data.name} partitions {d0 + 8 * g}.."
                f"{d0 + 8 * g + 7} (quadrant {'/'.join(str(q) for q in sorted(data_q))})",
            )


def _check_scale_init(op: str, sc: Access, idx: np.ndarray) -> None:
    prog = machine.current()
    if sc.st.init is None or not prog.checks_init:
        return
    if not (sc.st.init[idx] == 0xFF).all():
        msg = f"{op}: {sc.name} reads scale bytes never written since allocation"
        prog.uninit_read(f"uninit:{op}:{sc.name}", msg)


_FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def _decode_x4(raw: np.ndarray, dt: DType) -> np.ndarray:
    """x4 elements [K, F] -> values [K, F, 4] (lane k = byte k / nibble k), fp32."""
    k, f = raw.shape
    if dt.fp8_elem == "e2m1fn":
        b = np.ascontiguousarray(raw).view(np.uint8).reshape(k, f, 2)
        nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(k, f, 4)
        return _FP4_VALUES[nib]
    codes = np.ascontiguousarray(raw).view(np.uint8).reshape(k, f, 4)
    return _lut(dt.fp8_elem or "e4m3fn")[codes]


@functools.cache
def _lut(elem: str) -> np.ndarray:
    """Value of each of the 256 codes, decoded once by mxcli.mx (fp8 formats; "e8m0" scales)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if elem == "e8m0":
        return mx.e8m0_decode(codes).numpy()
    return mx.fp8_decode(codes, elem).numpy()


@isa_op()
def nc_matmul_mx(
    dst: NkiTensor,
    stationary: NkiTensor,
    moving: NkiTensor,
    stationary_scale: NkiTensor,
    moving_scale: NkiTensor,
    tile_position: Any = None,
    tile_size: Any = None,
    accumulate: bool | None = None,
    name: str | None = None,
) -> NkiInstruction:
    """MX matmul with dequantization (api spec §7.2), NeuronCore-v4 only."""
    op = "nc_matmul_mx"
    prog = machine.current()
    prog.begin(op, "tensor")
    require_v4(op)
    s = operand(op, "stationary", stationary, (SBUF,))
    m = operand(op, "moving", moving, (SBUF,))
    ss = operand(op, "stationary_scale", stationary_scale, (SBUF,))
    ms = operand(op, "moving_scale", moving_scale, (SBUF,))
    d = operand(op, "dst", dst, (PSUM,))
    for a in (s, m, d):
        check_parts(op, a)
    for a in (s, m):
        if a.dtype.kind != "x4":
            raise NkiValidationError(
                f"{op}: {a.name} dtype must be float8_e4m3fn_x4, float8_e5m2_x4 or "
                f"float4_e2m1fn_x4 (got {a.dtype})"
            )
    if d.dtype not in (float32, bfloat16):
        raise NkiValidationError(f"{op}: dst dtype must be float32 or bfloat16 (got {d.dtype})")
    K = s.parts
    if m.parts != K:
        raise NkiValidationError(
            f"{op}: moving partition count differs from stationary (got {m.parts}, expected {K})"
        )
    if K % 32 or K > 128:
        raise NkiValidationError(
            f"{op}: partition count (K) must be a multiple of 32 and <= 128 (got {K})"
        )
    M, N = s.per_part, m.per_part
    if M % 2 or M > 128:
        raise NkiValidationError(f"{op}: stationary free size must be even and <= 128 (got {M})")
    lim = _moving_limit(prog, d.dtype)
    if N > lim:
        raise NkiValidationError(f"{op}: moving free size {N} exceeds {lim} (dst {d.dtype})")
    if d.parts != M or d.per_part != N:
        raise NkiValidationError(
            f"{op}: dst must have {M} partitions x {N} elements (got {d.shape})"
        )
    _check_tiling(op, tile_position, tile_size, K, M, True)
    sidx = _scale_indices(op, ss, K, M)
    midx = _scale_indices(op, ms, K, N)
    _check_scale_quadrant(op, s, ss, K)
    _check_scale_quadrant(op, m, ms, K)
    _check_scale_init(op, ss, sidx)
    _check_scale_init(op, ms, midx)
    prog.counters.mx_matmul_flops += 2 * 4 * K * M * N
    if skip_arithmetic(prog, d, s, m):
        return NkiInstruction(op)
    # scale of partition p is the scale of its group G = p // 8  -> [K, F]
    sS = _lut("e8m0")[ss.st.buf[sidx]].repeat(8, axis=0)
    sM = _lut("e8m0")[ms.st.buf[midx]].repeat(8, axis=0)
    vS = _decode_x4(s.read().reshape(K, M), s.dtype) * sS[:, :, None]  # [K, M, 4]
    vM = _decode_x4(m.read().reshape(K, N), m.dtype) * sM[:, :, None]  # [K, N, 4]
    a = vS.transpose(0, 2, 1).reshape(4 * K, M)
    b = vM.transpose(0, 2, 1).reshape(4 * K, N)
    res = a.T.astype(np.float32) @ b.astype(np.float32)  # [M, N], fp32 products and sums
    _accumulate_write(op, d, res, accumulate)
    return NkiInstruction(op)


@isa_op()
def quantize_mx(
    dst: NkiTensor, src: NkiTensor, dst_scale: NkiTensor, name: str | None = None
) -> NkiInstruction:
    """MX-quantize bf16/fp16 SBUF data into x4 data + e8m0 scales (api spec §7.3).

    Groups are 8 partitions x 4 free elements; the per-group math is
    ``mxcli.mx.quantize_mx(..., rule=ScaleRule.NEURON)`` (bit-identical by construction).
    """
    op = "quantize_mx"
    prog = machine.current()
    prog.begin(op, "vector")
    require_v4(op)
    x = operand(op, "src", src, (SBUF,))
    d = operand(op, "dst", dst, (SBUF,))
    sc = operand(op, "dst_scale", dst_scale, (SBUF,))
    for a in (x, d):
        check_parts(op, a)
    if x.dtype.name not in ("bfloat16", "float16"):
        raise NkiValidationError(f"{op}: src dtype must be bfloat16 or float16 (got {x.dtype})")
    if d.dtype.name not in ("float8_e4m3fn_x4", "float8_e5m2_x4"):
        raise NkiValidationError(
            f"{op}: dst dtype must be float8_e4m3fn_x4 or float8_e5m2_x4 (got {d.dtype})"
        )
    P, n = x.parts, x.per_part
    if P % 32:
        raise NkiValidationError(f"{op}: src partition count must be a multiple of 32 (got {P})")
    if n % 4:
        raise NkiValidationError(f"{op}: src free size must be a multiple of 4 (got {n})")
    if d.parts != P:
        raise NkiValidationError(
            f"{op}: dst partition count differs from src (got {d.parts}, expected {P})"
        )
    if d.per_part != n // 4:
        raise NkiValidationError(
            f"{op}: dst elements per partition must be src's / 4 (got {d.per_part}, expected {n // 4})"
        )
    if sc.per_part != n // 4:
        raise NkiValidationError(
            f"{op}: dst_scale elements per partition must equal dst's (got {sc.per_part}, expected {n // 4})"
        )
    idx = _scale_indices(op, sc, P, n // 4)  # [P/8, n/4]
    _check_scale_quadrant(op, x, sc, P)
    if skip_arithmetic(prog, d, x):
        _write_scale_bytes(sc, idx, np.zeros(idx.shape, dtype=np.uint8))
        return NkiInstruction(op)
    raw = x.read().reshape(P, n)
    xt = (
        torch.from_numpy(np.ascontiguousarray(raw).view(np.int16)).view(torch.bfloat16)
        if x.dtype.name == "bfloat16"
        else torch.from_numpy(np.ascontiguousarray(raw))
    )
    # [P, n] -> [P/8, 8, n/4, 4] -> [P/8, n/4, 8, 4] -> groups of 32 along the last axis
    g = xt.reshape(P // 8, 8, n // 4, 4).permute(0, 2, 1, 3).reshape(P // 8, n // 4, 32)
    elem = d.dtype.fp8_elem or "e4m3fn"
    codes, scales = mx.quantize_mx(g, axis=-1, elem=elem, rule=mx.ScaleRule.NEURON)
    # back to [P, n] codes, then x4 packing: byte k of word j = code of column 4j + k
    c = codes.reshape(P // 8, n // 4, 8, 4).permute(0, 2, 1, 3).reshape(P, n).contiguous().numpy()
    words = c.view("<u4").reshape(P, n // 4).astype(np.uint32)
    d.write(words.reshape(d.shape))
    _write_scale_bytes(sc, idx, scales.reshape(P // 8, n // 4).numpy())
    return NkiInstruction(op)


def _write_scale_bytes(sc: Access, idx: np.ndarray, values: np.ndarray) -> None:
    sc.st.buf[idx] = values.astype(np.uint8)
    if sc.st.init is not None:
        sc.st.init[idx] = 0xFF


def nc_transpose(
    dst: NkiTensor, data: NkiTensor, engine: engine = engine.unknown, name: str | None = None
) -> NkiInstruction:
    """Partition <-> free transpose, bit-exact (api spec §7.4). PE (tensor engine): SBUF -> PSUM
    up to 128x128; Vector: up to 32x32, SBUF/PSUM either side; unknown: PE iff dst is PSUM."""
    op = "nc_transpose"
    prog = machine.current()
    e = check_engine(op, engine, (_E.unknown, _E.tensor, _E.vector))
    if e is _E.unknown:
        e = _E.tensor if isinstance(dst, NkiTensor) and dst.buffer is PSUM else _E.vector
    prog.begin(op, e.name)
    if e is _E.tensor:
        x = operand(op, "data", data, (SBUF,))
        d = operand(op, "dst", dst, (PSUM,))
        limit = 128
    else:
        x = operand(op, "data", data)
        d = operand(op, "dst", dst)
        limit = 32
    for a in (x, d):
        check_parts(op, a)
    if d.dtype is not x.dtype:
        raise NkiValidationError(
            f"{op}: dst dtype must equal data dtype (got {d.dtype}, {x.dtype})"
        )
    if e is _E.tensor and x.dtype.kind == "x4":
        raise NkiValidationError(
            f"{op}: x4 data cannot be PE-transposed (view it as float32 first)"
        )
    P, F = x.parts, x.per_part
    if P > limit or F > limit:
        raise NkiValidationError(
            f"{op}: engine.{e.name} transposes at most {limit}x{limit} (got {P}x{F})"
        )
    if d.parts != F or d.per_part != P:
        raise NkiValidationError(
            f"{op}: dst must have {F} partitions x {P} elements (got {d.shape})"
        )
    # a data move, not a matmul against the identity: api spec §7.4 "Bit-exact copy of elements
    # (dst.dtype == data.dtype required); on v2 the PE path is not NaN/Inf-safe (irrelevant for
    # v3/v4)", and §2.4: a same-dtype "PE transpose on v3+ ... is bit-exact: copy raw bytes,
    # never go through float math". So NaN/Inf (and every NaN payload) stay where they were.
    d.write(x.read().reshape(P, F).T.reshape(d.shape))
    prog.counters.transpose_elements += P * F
    return NkiInstruction(op)


_E = engine
_ = ml_dtypes  # bf16 arrays are handled through their raw bits above
