"""MX block quantization: scale rules, grouping schemes, quantize / dequantize.

One E8M0 scale byte is shared by a group of 32 elements that runs along one axis (the
contraction axis of the matmul that consumes the operand). Which 32 elements form a group is
the *scheme*; how the scale byte follows from the group's largest magnitude is the *rule*.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, overload

import torch

from mxcli import memory
from mxcli.errors import InputError
from mxcli.io.kwargs import coerce_enum
from mxcli.mx.formats import ElemFormat, as_elem_format, as_tensor

GROUP_SIZE = 32
# Work on row blocks of about this many elements so that intermediates stay in cache.
_BLOCK_ELEMS = 1 << 20

Chunks = Sequence[tuple[int, int]]


class ScaleRule(enum.Enum):
    """How a group's E8M0 scale byte follows from its largest magnitude ``amax``.

    With ``E`` = the biased fp32 exponent field of ``amax`` (``floor(log2 amax) + 127`` for a
    normal ``amax``; 0 for an all-zero group) and ``Emax`` = 8 (E4M3FN) or 15 (E5M2):

    - ``NEURON`` (default; Trn3 ``quantize_mx``, prefill spec §3.4, bwd spec §5.2):
      ``byte = clamp(E - (Emax - 1), 0, 255)``, i.e. ``E - 7`` for E4M3FN and ``E - 14`` for
      E5M2. The block scale ``X = 2^(byte - 127)`` is twice the OCP one, so the group maximum
      lands in [128, 256) (E4M3FN) and can round up without saturating.
    - ``OCP`` (alias ``FLOOR``; the OCP MX v1.0 sample algorithm, torchao's
      ``ScaleCalculationMode.FLOOR``): ``byte = clamp(E - Emax, 0, 255)``, i.e. ``E - 8`` /
      ``E - 15``, the floor of ``log2(amax)`` minus the format's Emax; the group maximum lands
      in [256, 512) and values above 448 saturate.

    - ``RCEIL`` (torchao's ``ScaleCalculationMode.RCEIL``, the default of its MoE training
      recipes; the cuBLAS "round the scale up" rule of NVIDIA's MXFP8 recipe, Mishra et al. 2025,
      arXiv 2506.08027): ``d = fp32(amax * fp32(1 / max_finite))``, ``byte = Ed + (Md != 0)``
      with ``Ed``/``Md`` the exponent/mantissa fields of ``d`` (a subnormal ``d`` rounds up only
      when ``Md > 0x400000``, as byte 0 is 2^-127); 255 (E8M0 NaN) for a non-finite group
      (torchao ``mx_tensor._f32_to_e8m0_rceil`` and ``_to_mx_rceil``, pytorch/ao 36027d8). For a
      bf16 ``amax`` this is ``OCP`` plus one when the significand of ``amax`` exceeds 1.75
      (that of 448 and 57344), else ``OCP``: the group maximum lands in (224, 448] and never
      saturates.

    The members are named after where each rule comes from; by the rule itself, ``NEURON`` is
    ``FLOOR`` plus one (a scale twice as large: the maximum never saturates), which is none of
    torchao's modes (FLOOR, CEIL, RCEIL, EVEN).

    An all-zero group gets byte 0 (``X = 2^-127``) under both rules; so does any group with
    ``E < Emax - 1`` (|amax| < 2^-120 for E4M3FN/NEURON), a clamp the hardware behaviour of which
    is unconfirmed (prefill spec errata 3). A group holding Inf or NaN has ``E = 255``: byte 248
    (NEURON/E4M3FN); Inf then saturates to ±max and NaN stays NaN.
    """

    NEURON = "neuron"
    OCP = "ocp"
    FLOOR = "ocp"  # the same rule, by its name in torchao
    # Rounding rules: the byte is OCP's or one more, by the group maximum's mantissa.
    # RCEIL: see the docstring (torchao's ScaleCalculationMode.RCEIL, pytorch/ao@36027d82
    # torchao/prototype/mx_formats/mx_tensor.py:185 and :111-127).
    RCEIL = "rceil"
    # CT (compressed-tensors' MX rule, what llm-compressor writes: compressed_tensors 0.20.1
    # quantization/utils/mxfp_utils.py, generate_mx_scales and round_to_power_2): ``amax`` is
    # rounded to one mantissa bit first, so byte = OCP's + 1 exactly when amax's mantissa is
    # 1.75 or more (the group max then lands in [224, 256) instead of saturating at 448).
    # The library's own arithmetic overflows for amax >= 1.75 * 2^127; the formula does not.
    CT = "ct"

    def exponent_offset(self, elem: ElemFormat | str) -> int:
        """What is subtracted from amax's exponent field; RCEIL and CT may add one on top
        (`scale_bytes` gives the bytes of every rule)."""
        fmt = as_elem_format(elem)
        return fmt.emax - 1 if self is ScaleRule.NEURON else fmt.emax

    def scale_bytes(self, amax: torch.Tensor, elem: ElemFormat | str) -> torch.Tensor:
        """The E8M0 bytes (int32) of groups whose largest magnitudes are `amax` (float32)."""
        fmt = as_elem_format(elem)
        a = amax.to(torch.float32)
        if self is ScaleRule.RCEIL:
            inv_max = torch.tensor(1.0 / fmt.max_finite, dtype=torch.float32)  # fl32(1 / max)
            d = (a * inv_max).view(torch.int32)
            e, m = (d >> 23) & 0xFF, d & 0x7FFFFF
            up = torch.where(e == 0, m > 0x400000, m != 0)
            return torch.where(torch.isfinite(a), e + up.to(torch.int32), 255)
        bits = a.view(torch.int32)
        byte = ((bits >> 23) & 0xFF) - self.exponent_offset(fmt)
        if self is ScaleRule.CT:
            byte = byte + ((bits & 0x7FFFFF) >= 0x600000).to(torch.int32)
        return byte.clamp_(0, 255)

    @property
    def rounds(self) -> bool:
        """Whether the byte depends on amax's mantissa (RCEIL, CT), not only its exponent."""
        return self in (ScaleRule.RCEIL, ScaleRule.CT)


class QuantScheme(str, enum.Enum):
    """Which 32 elements along the quantized axis share one scale.

    - ``MX1X32``: contiguous runs ``[32g, 32g + 32)`` (prefill spec §3.4; bwd ``_1x32``).
    - ``WRAPX`` (bwd spec §5.3): the axis is cut into chunks (``tile_k``-sized chunks while they
      fit, then one 256-chunk, then one 128-chunk). A chunk of size ``c`` at ``k0`` is laid out
      as ``c/4`` physical rows of 4 interleaved lanes, row ``pp`` holding ``k0 + j*c/4 + pp`` for
      lanes ``j = 0..3``; a group is 8 consecutive physical rows x 4 lanes:
      ``{k0 + j*c/4 + 8g + i : j in 0..3, i in 0..7}``.
    """

    MX1X32 = "1x32"
    WRAPX = "wrapx"


# the bwd spec's spelling of the contiguous scheme (``_1x32``, §5.3)
SCHEME_ALIASES = {"_1x32": QuantScheme.MX1X32}


def as_scheme(
    scheme: Any, name: str = "scheme", expected: str = "'1x32' or 'wrapx'", **options: Any
) -> QuantScheme:
    """The enum from itself, its value or name (any case), or ``_1x32`` (`coerce_enum`)."""
    return coerce_enum(
        QuantScheme, scheme, name, aliases=SCHEME_ALIASES, expected=expected, **options
    )


def as_rule(rule: Any) -> ScaleRule:
    """The enum from itself or its value or name (any case) (`coerce_enum`)."""
    return coerce_enum(ScaleRule, rule, "rule", expected="'neuron', 'ocp', 'rceil' or 'ct'")


def wrapx_chunks(K: int, tile_k: int = 512) -> list[tuple[int, int]]:
    """Chunk list ``[(k0, c), ...]`` of the wrapX scheme (bwd spec §5.3).

    ``tile_k``-sized chunks while they fit, then one 256-chunk if at least 256 remain, then one
    128-chunk if at least 128 remain. ``K`` must be a multiple of 128.
    """
    if tile_k not in (128, 256, 512):
        raise InputError(f"tile_k: expected 128, 256 or 512, got {tile_k}")
    if K <= 0 or K % 128:
        raise InputError(f"K: wrapX needs a positive multiple of 128, got {K}")
    chunks: list[tuple[int, int]] = []
    k = 0
    while K - k >= tile_k:
        chunks.append((k, tile_k))
        k += tile_k
    for c in (256, 128):
        if K - k >= c:
            chunks.append((k, c))
            k += c
    return chunks


def _segments(
    K: int, scheme: QuantScheme | str, tile_k: int, chunks: Chunks | None
) -> list[tuple[int, int, bool]]:
    """Segments ``(k0, c, wrapped)`` covering ``[0, K)`` in order; groups never straddle one."""
    sch = as_scheme(scheme)
    if sch is QuantScheme.MX1X32:
        if K <= 0 or K % GROUP_SIZE:
            raise InputError(f"K: MX groups of 32 need a positive multiple of 32, got {K}")
        return [(0, K, False)]
    chunk_list = list(chunks) if chunks is not None else wrapx_chunks(K, tile_k)
    k = 0
    for k0, c in chunk_list:
        if k0 != k or c <= 0 or c % 128:
            raise InputError(
                f"chunks: expected contiguous multiples of 128 from 0, got {chunk_list}"
            )
        k += c
    if k != K:
        raise InputError(f"chunks: cover {k} elements, expected K={K}")
    return [(k0, c, True) for k0, c in chunk_list]


def group_order(
    K: int,
    scheme: QuantScheme | str = QuantScheme.MX1X32,
    tile_k: int = 512,
    chunks: Chunks | None = None,
) -> torch.Tensor:
    """Element indices along the axis in group order: group ``g`` is ``order[32g : 32g + 32]``."""
    parts = []
    for k0, c, wrapped in _segments(K, scheme, tile_k, chunks):
        idx = torch.arange(k0, k0 + c, dtype=torch.int64)
        if wrapped:
            # chunk as [lane j, physical row pp] -> enumerate row-major over (pp, j)
            idx = idx.view(4, c // 4).t().reshape(-1)
        parts.append(idx)
    return torch.cat(parts)


def to_group_order(
    x: Any,
    axis: int = -1,
    scheme: QuantScheme | str = QuantScheme.MX1X32,
    tile_k: int = 512,
    chunks: Chunks | None = None,
) -> torch.Tensor:
    """``x`` permuted along `axis` into group order: ``x.index_select(axis, group_order(...))``.

    Done as strided chunk transposes (wrapX: ``[4, c/4] -> [c/4, 4]`` per chunk), which is much
    faster than a gather; for wrapX this is the physical row/lane order of bwd spec §5.5, whose
    consecutive 4 elements become one x4 word.
    """
    t = as_tensor(x)
    ax = axis % t.dim()
    K = t.shape[ax]
    runs = _runs(_segments(K, scheme, tile_k, chunks))
    if len(runs) == 1 and not runs[0][3]:
        return t
    last = t.movedim(ax, -1)
    lead = last.shape[:-1]
    parts = []
    for k0, c, count, wrapped in runs:
        piece = last[..., k0 : k0 + c * count]
        if wrapped:
            piece = piece.unflatten(-1, (count, 4, c // 4)).transpose(-1, -2)
        parts.append(piece.reshape(*lead, c * count))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out.movedim(-1, ax)


def group_index(
    K: int,
    scheme: QuantScheme | str = QuantScheme.MX1X32,
    tile_k: int = 512,
    chunks: Chunks | None = None,
) -> torch.Tensor:
    """Group number of every element along the axis (inverse view of `group_order`)."""
    order = group_order(K, scheme, tile_k, chunks)
    gidx = torch.empty(K, dtype=torch.int64)
    gidx[order] = torch.arange(K, dtype=torch.int64) // GROUP_SIZE
    return gidx


def _prepare(x: Any, axis: int) -> tuple[torch.Tensor, int]:
    """Move `axis` last, make contiguous, widen dtypes that do not share fp32's exponent field."""
    t = as_tensor(x)
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InputError(f"x: expected a bf16, fp16 or fp32 tensor, got {t.dtype}")
    if t.dim() == 0:
        raise InputError("x: expected at least one dimension, got a scalar")
    ax = axis % t.dim()
    if t.dtype in (torch.float16, torch.float64):
        t = t.to(torch.float32)  # fp16 -> fp32 is exact; fp64 is rounded once to fp32
    return t.movedim(ax, -1).contiguous(), ax


def _runs(segments: list[tuple[int, int, bool]]) -> list[tuple[int, int, int, bool]]:
    """Merge consecutive equal wrapX chunks into runs ``(k0, c, count, wrapped)``.

    A run of ``count`` chunks of size ``c`` is one strided view ``[r, count, 4, c/32, 8]``,
    so a K of many ``tile_k`` chunks costs a handful of tensor ops, not a handful per chunk.
    """
    runs: list[tuple[int, int, int, bool]] = []
    for k0, c, wrapped in segments:
        if runs and wrapped and runs[-1][3] and runs[-1][1] == c:
            rk0, rc, n, _ = runs[-1]
            runs[-1] = (rk0, rc, n + 1, True)
        else:
            runs.append((k0, c, 1, wrapped))
    return runs


def _per_element(g: torch.Tensor, wrapped: bool, elems: tuple[int, ...]) -> torch.Tensor:
    """Broadcastable per-element view of per-group values ``g`` for an element view `elems`.

    wrapX: one value per physical row (8 rows per group), shared by the 4 lanes, so the result
    is ``[r, count, 1, v]`` with a contiguous row axis; 1x32: ``[r, ng, 1]``.
    """
    if wrapped:
        r, count, _, v = elems
        return g.unsqueeze(-1).expand(r, count, v // 8, 8).reshape(r, count, 1, v)
    return g.unsqueeze(-1)


def _quantize_block(
    xb: torch.Tensor,
    runs: list[tuple[int, int, int, bool]],
    offset: int,
    rule: ScaleRule,
    fmt: ElemFormat,
    saturate: bool,
    codes_out: torch.Tensor | None,
    scales_out: torch.Tensor,
    deq_out: torch.Tensor | None,
    work: dict[str, torch.Tensor],
) -> None:
    """Quantize one block of rows ``xb [r, K]`` (axis last) into the output slices given.

    `work` holds reusable buffers so that a block's intermediates stay in cache (the speed of
    this loop is what bench_mx.py measures).
    """
    r = xb.shape[0]
    m = fmt.max_finite
    g0 = 0
    for k0, c, count, wrapped in runs:
        ng = c // GROUP_SIZE
        width = c * count
        n = r * width
        # Work in fp32 (bf16 -> fp32 is exact): fp32 abs/max/mul vectorize far better on CPUs
        # than their bf16 or int16 forms, and the fp8 cast is no slower from fp32.
        xf = work["xf"][:n].view(r, width)
        xf.copy_(xb[:, k0 : k0 + width])
        mag = work["mag"][:n].view(r, width)
        torch.abs(xf, out=mag)
        # prefill spec §3.4 / bwd spec §5.2: scale from the exponent field of the group max
        # (|x| max; NaN propagates and, like Inf, has exponent field 255).
        if wrapped:
            # bwd spec §5.3: a chunk is [lane j, physical row pp] with v = c/4 rows; a group is
            # 8 rows x 4 lanes. Reduce the lanes first (contiguous rows of v), then runs of 8.
            v = c // 4
            lane_max = mag.view(r, count, 4, v).amax(dim=2)  # [r, count, v]
            amax = lane_max.view(r, count, ng, 8).amax(dim=3)  # [r, count, ng]
        else:
            amax = mag.view(r, ng, GROUP_SIZE).amax(dim=2)  # [r, ng]
        if rule.rounds:
            byte = rule.scale_bytes(amax, fmt)
        else:
            emax = (amax.view(torch.int32) >> 23) & 0xFF
            byte = (emax - offset).clamp_(0, 255)
        scales_out[:, g0 : g0 + count * ng] = byte.view(r, count * ng)
        elems = (r, count, 4, c // 4) if wrapped else (r, ng, GROUP_SIZE)
        # Multiplier 1/X = 2^(127 - byte): a normal power of two for every byte <= 253
        # (RCEIL's 255 marks a non-finite group, whose values stay non-finite).
        inv = ((254 - byte.clamp(max=254)) << 23).view(torch.float32)
        xe = xf.view(elems)
        torch.mul(xe, _per_element(inv, wrapped, elems), out=xe)  # exact: a power of two
        if saturate:
            xf.clamp_(-m, m)  # OCP rule, E5M2; NaN passes through
        if codes_out is not None:
            codes_out[:, k0 : k0 + width].view(fmt.torch_dtype).copy_(xf)
        if deq_out is not None:
            # X = 2^(byte - 127); byte 0 is the fp32 subnormal 2^-127 (bit 22 set).
            xbits = torch.where(byte == 0, torch.full_like(byte, 1 << 22), byte << 23)
            scale = _per_element(xbits.view(torch.float32), wrapped, elems)
            q = xf.to(fmt.torch_dtype).to(torch.float32).view(elems)
            deq_out[:, k0 : k0 + width] = (q * scale).view(r, width)
        g0 += count * ng


def _fused_kernels(t: torch.Tensor) -> Any:
    """The `mxcli.mx._fused` module when it applies to `t` (numba installed, CPU tensor, not
    turned off with ``MXCLI_FUSED=0``), else None: then the pure-torch path runs."""
    global _FUSED
    if t.device.type != "cpu" or t.dtype not in (torch.bfloat16, torch.float32):
        return None
    if _FUSED is None:
        try:
            from mxcli.mx import _fused

            _FUSED = _fused
        except Exception:  # numba missing or broken: the torch path gives the same bytes
            _FUSED = False
    if _FUSED is False or not _FUSED.enabled():
        return None
    return _FUSED


_FUSED: Any = None


def uses_fused_kernels(x: torch.Tensor) -> bool:
    """Whether quantizing `x` runs the fused numba kernels (`mxcli.mx._fused`)."""
    return _fused_kernels(x) is not None


@overload
def _restore(a: torch.Tensor, lead: torch.Size, ax: int) -> torch.Tensor: ...
@overload
def _restore(a: None, lead: torch.Size, ax: int) -> None: ...
def _restore(a: torch.Tensor | None, lead: torch.Size, ax: int) -> torch.Tensor | None:
    """``[R, n]`` rows back to the input's leading shape, the last axis moved back to `ax`."""
    if a is None:
        return None
    return a.reshape(*lead, a.shape[-1]).movedim(-1, ax).contiguous()


def _run(
    x: Any,
    axis: int,
    elem: ElemFormat | str,
    rule: ScaleRule | str,
    scheme: QuantScheme | str,
    tile_k: int,
    chunks: Chunks | None,
    want_codes: bool,
    want_deq: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, int]:
    fmt = as_elem_format(elem)
    rule = as_rule(rule)
    offset = rule.exponent_offset(fmt)
    t, ax = _prepare(x, axis)
    K = t.shape[-1]
    runs = _runs(_segments(K, scheme, tile_k, chunks))
    lead = t.shape[:-1]
    x2 = t.reshape(-1, K)
    R = x2.shape[0]
    # fresh outputs written in full: huge pages for large ones (`memory.empty`)
    codes = memory.empty((R, K), torch.uint8, t.device) if want_codes else None
    scales = memory.empty((R, K // GROUP_SIZE), torch.uint8, t.device)
    deq = memory.empty((R, K), torch.float32, t.device) if want_deq else None
    fused = _fused_kernels(t)
    if fused is not None and rule.rounds:
        got = _rounding_fused(fused, x2, rule, fmt, scheme, tile_k, chunks, want_codes, want_deq)
        if got is not None:
            c, s, d = got
            return _restore(c, lead, ax), _restore(s, lead, ax), _restore(d, lead, ax), ax
        fused = None  # a non-finite or tiny group maximum: the torch path below
    if fused is not None:
        segments = _segments(K, scheme, tile_k, chunks)
        fused.quantize_2d(x2, segments, offset, fmt.torch_dtype, fmt.max_finite, codes, scales, deq)
        return _restore(codes, lead, ax), _restore(scales, lead, ax), _restore(deq, lead, ax), ax
    rows = R if t.is_cuda else max(1, min(R, _BLOCK_ELEMS // K))
    work = {
        "xf": torch.empty(rows * K, dtype=torch.float32, device=t.device),
        "mag": torch.empty(rows * K, dtype=torch.float32, device=t.device),
    }
    # E4M3FN under NEURON keeps |x/X| < 256 for finite x; torch's cast saturates Inf
    # (tests/mx check it), so the clamp pass is needed only for the other combinations.
    saturate = not (fmt is ElemFormat.E4M3FN and rule is ScaleRule.NEURON)
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        _quantize_block(
            x2[r0:r1],
            runs,
            offset,
            rule,
            fmt,
            saturate,
            None if codes is None else codes[r0:r1],
            scales[r0:r1],
            None if deq is None else deq[r0:r1],
            work,
        )
    return _restore(codes, lead, ax), _restore(scales, lead, ax), _restore(deq, lead, ax), ax


def _rounding_fused(
    fused: Any,
    x2: torch.Tensor,
    rule: ScaleRule,
    fmt: ElemFormat,
    scheme: QuantScheme | str,
    tile_k: int,
    chunks: Chunks | None,
    want_codes: bool,
    want_deq: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
    """A rounding rule (RCEIL, CT) with the fused kernels, which take a fixed exponent offset:
    every finite group's byte is its OCP byte or one more, its NEURON byte (`ScaleRule`), so
    quantize under both and keep, per group, the one the rule's byte names. None when a group is
    neither (a non-finite or tiny maximum): the caller then runs the torch path."""
    R, K = x2.shape
    # fp32 first: bf16 abs/max are many times slower on CPUs (and bf16 -> fp32 is exact)
    mag = to_group_order(torch.abs(x2.to(torch.float32)), -1, scheme, tile_k, chunks)
    amax = mag.reshape(R, K // GROUP_SIZE, GROUP_SIZE).amax(-1)
    want = rule.scale_bytes(amax, fmt)
    segments = _segments(K, scheme, tile_k, chunks)
    outs = []
    for r in (ScaleRule.NEURON, ScaleRule.OCP):
        codes = memory.empty((R, K), torch.uint8, x2.device) if want_codes else None
        scales = memory.empty((R, K // GROUP_SIZE), torch.uint8, x2.device)
        deq = memory.empty((R, K), torch.float32, x2.device) if want_deq else None
        offset = r.exponent_offset(fmt)
        fused.quantize_2d(x2, segments, offset, fmt.torch_dtype, fmt.max_finite, codes, scales, deq)
        outs.append((codes, scales, deq))
    (cn, sn, dn), (co, so, do) = outs
    up = want == sn.to(torch.int32)
    if not bool((up | (want == so.to(torch.int32))).all()):
        return None
    per_elem = up.index_select(1, group_index(K, scheme, tile_k, chunks).to(x2.device))
    codes = None if cn is None or co is None else torch.where(per_elem, cn, co)
    deq = None if dn is None or do is None else torch.where(per_elem, dn, do)
    return codes, torch.where(up, sn, so), deq


def quantize_mx(
    x: Any,
    axis: int = -1,
    *,
    elem: ElemFormat | str = ElemFormat.E4M3FN,
    rule: ScaleRule | str = ScaleRule.NEURON,
    scheme: QuantScheme | str = QuantScheme.MX1X32,
    tile_k: int = 512,
    chunks: Chunks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize `x` along `axis`.

    Returns ``(codes, scales)``: ``codes`` is uint8 with the shape of `x`, each code at its
    element's position; ``scales`` is uint8 with the axis length divided by 32, entry ``g`` being
    the E8M0 byte of the g-th group in the scheme's order (`group_order`).

    Elements: ``code = fp8(x / X)`` with ``X = 2^(byte - 127)`` from `rule`, round to nearest
    even in one step (the division by a power of two is exact), saturating to ±max; NaN keeps
    its sign as 0x7F/0xFF. bf16, fp16 and fp32 inputs are exact; float64 is rounded to fp32.
    """
    codes, scales, _, _ = _run(x, axis, elem, rule, scheme, tile_k, chunks, True, False)
    assert codes is not None
    return codes, scales


def fake_quantize_mx(
    x: Any,
    axis: int = -1,
    *,
    elem: ElemFormat | str = ElemFormat.E4M3FN,
    rule: ScaleRule | str = ScaleRule.NEURON,
    scheme: QuantScheme | str = QuantScheme.MX1X32,
    tile_k: int = 512,
    chunks: Chunks | None = None,
) -> torch.Tensor:
    """``dequantize_mx(*quantize_mx(x, ...))`` in one pass: float32 values an MX matmul sees."""
    _, _, deq, _ = _run(x, axis, elem, rule, scheme, tile_k, chunks, False, True)
    assert deq is not None
    return deq


def dequantize_mx(
    codes: Any,
    scales: Any,
    axis: int = -1,
    *,
    elem: ElemFormat | str = ElemFormat.E4M3FN,
    scheme: QuantScheme | str = QuantScheme.MX1X32,
    tile_k: int = 512,
    chunks: Chunks | None = None,
) -> torch.Tensor:
    """Float32 values ``fp8_decode(code) * 2^(byte - 127)`` of MX data (exact)."""
    from mxcli.mx.formats import e8m0_decode, fp8_decode

    c = as_tensor(codes)
    s = as_tensor(scales)
    ax = axis % c.dim()
    K = c.shape[ax]
    expected = list(c.shape)
    expected[ax] = K // GROUP_SIZE
    if list(s.shape) != expected:
        raise InputError(f"scales: expected shape {tuple(expected)}, got {tuple(s.shape)}")
    gidx = group_index(K, scheme, tile_k, chunks).to(c.device)
    factor = e8m0_decode(s).index_select(ax, gidx)
    return fp8_decode(c, elem) * factor
