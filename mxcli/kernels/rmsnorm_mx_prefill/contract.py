"""Contract of ``rmsnorm_mx_prefill``: enums, the public signature, validation, row geometry.

The public function `rmsnorm_mx_prefill` is the only place holding the kernel's signature (the
API reference's, prefill spec §2.1). `validate` binds arguments to it and checks them once into a
frozen `PrefillCall`; every backend (the torch reference, the NKI simulator, a Trainium device)
takes that call object and produces rows with the geometry of `row_geometry` (§2.3, §2.4).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.io.kwargs import coerce_enum
from mxcli.kernels import backends
from mxcli.kernels.spec import bind_arguments
from mxcli.mx import ElemFormat, prefill_scale_region_size
from mxcli.mx.formats import as_elem_format

# prefill spec §2.3: hardware limits checked by the kernel itself.
MAX_EXPERTS = 512
MAX_TOP_K = 8  # max8 / nc_find_index8 return 8 candidates
MAX_GROUPS = 8  # NOAUX_TC group selection also runs on max8
HIDDEN_MULTIPLE = 512  # one H512 tile = 128 partitions x 4 lanes

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class PrefillValidationError(InputError):
    """An argument of `rmsnorm_mx_prefill` violates the kernel contract (prefill spec §2.3).

    The one-line message names the argument, the expected and the actual value.
    """


class RouterActFnType(enum.IntEnum):
    """Router activation / selection function (prefill spec §5).

    - ``SIGMOID`` (0): ``affinity_k = sigmoid(logit_k)`` on each of the top-K logits, no
      renormalisation (§5.2).
    - ``SOFTMAX`` (1): softmax over the K selected logits only:
      ``exp(l_k - l_0) * (1 / sum_j exp(l_j - l_0))`` (§5.2).
    - ``NOAUX_TC`` (2): DeepSeek-V3 group-limited routing: ``s = sigmoid(logit)``, selection on
      ``s + bias`` (groups scored by the sum of their two best), affinities
      ``s * routed_scaling_factor / (sum of selected s + 1e-20)`` in fp32 (§5.3).

    The value of ``NOAUX_TC`` upstream is unconfirmed (spec §9.8); 2 is the natural guess.
    """

    SIGMOID = 0
    SOFTMAX = 1
    NOAUX_TC = 2

    @classmethod
    def coerce(cls, value: Any, name: str = "router_act_fn") -> RouterActFnType:
        """Accept the enum, its int value, its name (any case, e.g. ``"noaux_tc"``) or another
        project's RouterActFnType (e.g. nkilib's) with the same member names (`coerce_enum`)."""
        return coerce_enum(cls, value, name, error=PrefillValidationError)


class QmxOutputDtype(str, enum.Enum):
    """Element format of the packed MX output (``qmx_output_dtype``).

    - ``FLOAT8_E4M3FN_X4`` (default): E4M3FN codes, NEURON scale ``byte = E(amax) - 7``.
    - ``FLOAT8_E5M2_X4``: E5M2 codes, ``byte = E(amax) - 14`` (prefill spec §9.9, untested
      upstream). The returned tensor is still labelled ``float8_e4m3fn``; only the bytes differ.
    """

    FLOAT8_E4M3FN_X4 = "float8_e4m3fn_x4"
    FLOAT8_E5M2_X4 = "float8_e5m2_x4"

    @property
    def elem(self) -> ElemFormat:
        return ElemFormat.E4M3FN if self is QmxOutputDtype.FLOAT8_E4M3FN_X4 else ElemFormat.E5M2

    @classmethod
    def coerce(cls, value: Any) -> QmxOutputDtype:
        """Accept the enum or any name of its element format: ``"float8_e4m3fn_x4"``,
        ``"e4m3fn"``, `ElemFormat`, the torch fp8 dtypes, the e5m2 names (`as_elem_format`)."""
        if isinstance(value, cls):
            return value
        elem = as_elem_format(
            value,
            "qmx_output_dtype",
            error=PrefillValidationError,
            expected="'float8_e4m3fn_x4' or 'float8_e5m2_x4'",
        )
        return cls.FLOAT8_E4M3FN_X4 if elem is ElemFormat.E4M3FN else cls.FLOAT8_E5M2_X4


@dataclass(frozen=True)
class RowGeometry:
    """Byte geometry of one packed output row (prefill spec §2.4).

    ``[0, H)`` fp8 codes in natural order · ``[H, affin_off)`` scale region ·
    ``[affin_off, affin_off + E*aff_bytes)`` affinity tail (only with ``pack_affinities``) ·
    pad up to ``row_region`` (a multiple of 4).
    """

    hidden_size: int
    pack_scales: bool
    num_h512: int
    scale_region: int
    affin_off: int
    num_experts: int  # 0 without a router
    aff_bytes: int  # 2 (bf16) or 4 (fp32, NOAUX_TC); 0 when affinities are not packed
    row_region: int

    @property
    def pack_affinities(self) -> bool:
        return self.aff_bytes > 0

    @property
    def affinity_dtype(self) -> torch.dtype | None:
        return {0: None, 2: torch.bfloat16, 4: torch.float32}[self.aff_bytes]

    @property
    def affinity_col(self) -> int:
        """Column of expert 0 in the row viewed as the affinity dtype (``affin_off / aff_bytes``)."""
        if not self.aff_bytes:
            raise ValueError("affinity_col: this row has no packed affinities")
        return self.affin_off // self.aff_bytes


def row_geometry(
    hidden_size: int,
    *,
    pack_scales: bool = True,
    num_experts: int | None = None,
    router_act_fn: RouterActFnType | str | int = RouterActFnType.SIGMOID,
    pack_affinities: bool = False,
) -> RowGeometry:
    """Row geometry for `hidden_size` (prefill spec §2.4).

    ``pack_affinities`` only takes effect with ``num_experts`` (a router); affinities are bf16
    (2 bytes) for SIGMOID/SOFTMAX and fp32 (4 bytes) for NOAUX_TC.
    """
    H = int(hidden_size)
    if H <= 0 or H % HIDDEN_MULTIPLE:
        raise PrefillValidationError(f"H: expected a positive multiple of 512, got {H}")
    scale_region = prefill_scale_region_size(H, bool(pack_scales))
    affin_off = H + scale_region
    E = int(num_experts or 0)
    aff_bytes = 0
    row = affin_off
    if pack_affinities and E > 0:
        act = RouterActFnType.coerce(router_act_fn)
        aff_bytes = 4 if act is RouterActFnType.NOAUX_TC else 2
        row = 4 * math.ceil((affin_off + E * aff_bytes) / 4)
    return RowGeometry(
        hidden_size=H,
        pack_scales=bool(pack_scales),
        num_h512=H // HIDDEN_MULTIPLE,
        scale_region=scale_region,
        affin_off=affin_off,
        num_experts=E,
        aff_bytes=aff_bytes,
        row_region=row,
    )


@dataclass(frozen=True, eq=False)
class PrefillCall:
    """One validated call of `rmsnorm_mx_prefill`: its tensors and its normalized arguments
    (what every backend takes; built by `validate`, once per call)."""

    hidden_states: torch.Tensor
    gamma: torch.Tensor
    router_weights: torch.Tensor | None
    router_bias: torch.Tensor | None
    residual: torch.Tensor | None
    B: int
    S: int
    H: int
    unpadded_hidden_size: int
    eps: float
    has_router: bool
    num_experts: int  # 0 without a router
    top_k: int
    act: RouterActFnType
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    qmx: QmxOutputDtype
    pack_scales: bool
    pack_affinities: bool  # effective: False without a router
    has_residual: bool
    emit_norm_bf16: bool
    hidden_interleaved: bool
    compute_dtype: torch.dtype  # cd: router dtype with a router, else hidden dtype (§1)
    geometry: RowGeometry

    @property
    def T(self) -> int:
        return self.B * self.S

    @property
    def returns_index(self) -> bool:
        return self.has_router and self.act is not RouterActFnType.NOAUX_TC

    @property
    def returns_affinities(self) -> bool:
        return self.has_router and not self.pack_affinities

    @property
    def output_names(self) -> tuple[str, ...]:
        """Names of this call's returns, in API order (prefill spec §2.2)."""
        return output_names(
            has_router=self.has_router,
            act=self.act,
            pack_affinities=self.pack_affinities,
            has_residual=self.has_residual,
            emit_norm_bf16=self.emit_norm_bf16,
        )


def output_names(
    *,
    has_router: bool,
    act: RouterActFnType,
    pack_affinities: bool,
    has_residual: bool,
    emit_norm_bf16: bool,
) -> tuple[str, ...]:
    """The returns of a call, in API order (prefill spec §2.2): the packed rows; with a router
    the index (not for NOAUX_TC) and the affinities (unless packed into the rows); the residual
    sum with a residual; the bf16 norm when asked for."""
    names = ["norm_quant_packed"]
    if has_router and act is not RouterActFnType.NOAUX_TC:
        names.append("expert_index")
    if has_router and not pack_affinities:
        names.append("expert_affinities")
    if has_residual:
        names.append("output_residual")
    if emit_norm_bf16:
        names.append("norm_bf16")
    return tuple(names)


def as_call(*args: Any, **kwargs: Any) -> PrefillCall:
    """A `PrefillCall` given as the only argument, else `validate` of the arguments."""
    if len(args) == 1 and not kwargs and isinstance(args[0], PrefillCall):
        return args[0]
    return validate(*args, **kwargs)


def _fail(name: str, expected: str, actual: object) -> PrefillValidationError:
    return PrefillValidationError(f"{name}: expected {expected}, got {actual}")


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                return int(value)
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
        raise _fail(name, "an int", repr(value))
    return int(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _fail(name, "a finite float", repr(value))
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise _fail(name, "a finite float", repr(value)) from None
    if not math.isfinite(f):
        raise _fail(name, "a finite float", repr(value))
    return f


def _check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    return t


def validate(*args: Any, **kwargs: Any) -> PrefillCall:
    """Bind the arguments of `rmsnorm_mx_prefill` (positional or by name, defaults from its
    signature) and check every one against the contract; the frozen `PrefillCall`.

    Runs the kernel's own checks in the kernel's order (prefill spec §2.3, errata 2), then the
    checks the kernel leaves out although the result would be meaningless or undefined: gamma
    length, router rows == H, bias length == E, 16-bit router weights, ``1 <= top_k <= E``,
    ``1 <= topk_group <= n_group``, ``E >= 8`` for NOAUX_TC (its max8 expert selection reads 8
    columns), one device for all tensors. Raises `PrefillValidationError`.
    """
    a = bind_arguments(rmsnorm_mx_prefill, *args, **kwargs)
    unpadded_hidden_size, residual = a["unpadded_hidden_size"], a["residual"]
    router_weights, router_bias = a["router_weights"], a["router_bias"]
    hs = _check_tensor("hidden_states", a["hidden_states"])
    # --- the kernel's checks, in its order (§2.3) ---
    if hs.dim() != 3:
        raise _fail("hidden_states", "a [B, S, H] tensor (rank 3)", f"shape {_shape(hs)}")
    B, S, H = _shape(hs)
    if H <= 0 or H % HIDDEN_MULTIPLE:
        raise _fail("hidden_states", "H (last dim) a positive multiple of 512", f"H={H}")
    N = H if unpadded_hidden_size is None else _as_int("unpadded_hidden_size", unpadded_hidden_size)
    if not 0 < N <= H:
        raise _fail("unpadded_hidden_size", f"a value in (0, H={H}]", N)
    res = None
    if residual is not None:
        res = _check_tensor("residual", residual)
        if _shape(res) != _shape(hs):
            raise _fail("residual", f"shape {_shape(hs)} (same as hidden_states)", _shape(res))
    act = RouterActFnType.coerce(a["router_act_fn"])
    K = _as_int("top_k", a["top_k"])
    G = _as_int("n_group", a["n_group"])
    TG = _as_int("topk_group", a["topk_group"])
    E = 0
    w = None
    if router_weights is not None:
        w = _check_tensor("router_weights", router_weights)
        if w.dim() != 2:
            raise _fail("router_weights", "an [H, E] tensor (rank 2)", f"shape {_shape(w)}")
        E = int(w.shape[1])
        if not 0 < E <= MAX_EXPERTS:
            raise _fail("router_weights", f"E (dim 1) in [1, {MAX_EXPERTS}]", f"E={E}")
        if K > MAX_TOP_K:
            raise _fail("top_k", f"<= {MAX_TOP_K}", K)
        if act is RouterActFnType.NOAUX_TC:
            if router_bias is None:
                raise _fail(
                    "router_bias",
                    "a [1, E] or [E] tensor (NOAUX_TC requires the e_score_correction_bias)",
                    "None",
                )
            if TG > MAX_GROUPS:
                raise _fail("topk_group", f"<= {MAX_GROUPS}", TG)
            if G > MAX_GROUPS:
                raise _fail("n_group", f"<= {MAX_GROUPS} (max8-based group selection)", G)
            if G >= 1 and E % G:
                raise _fail("n_group", f"a divisor of E={E}", G)
    # --- checks the kernel leaves out (§2.3 "NOT validated") ---
    if hs.dtype not in _SIXTEEN_BIT:
        raise _fail("hidden_states", "dtype bfloat16 or float16", hs.dtype)
    g = _check_tensor("gamma", a["gamma"])
    if _shape(g) not in ((H,), (1, H)):
        raise _fail("gamma", f"shape ({H},) or (1, {H})", _shape(g))
    if not g.is_floating_point():
        raise _fail("gamma", "a floating-point dtype", g.dtype)
    if res is not None and not res.is_floating_point():
        raise _fail("residual", "a floating-point dtype", res.dtype)
    tensors: list[tuple[str, torch.Tensor]] = [("gamma", g)]
    if res is not None:
        tensors.append(("residual", res))
    if w is not None:
        tensors.append(("router_weights", w))
        if int(w.shape[0]) != H:
            raise _fail("router_weights", f"{H} rows (= H of hidden_states)", int(w.shape[0]))
        if w.dtype not in _SIXTEEN_BIT:
            raise _fail(
                "router_weights", "dtype bfloat16 or float16 (16-bit compute dtype)", w.dtype
            )
        if K < 1:
            raise _fail("top_k", ">= 1", K)
        if K > E:
            raise _fail("top_k", f"<= E={E}", K)
        if router_bias is not None:
            b = _check_tensor("router_bias", router_bias)
            if _shape(b) not in ((E,), (1, E)):
                raise _fail("router_bias", f"shape ({E},) or (1, {E})", _shape(b))
            if not b.is_floating_point():
                raise _fail("router_bias", "a floating-point dtype", b.dtype)
            tensors.append(("router_bias", b))
        if act is RouterActFnType.NOAUX_TC:
            if G < 1:
                raise _fail("n_group", ">= 1", G)
            if TG < 1:
                raise _fail("topk_group", ">= 1", TG)
            if TG > G:
                raise _fail("topk_group", f"<= n_group={G}", TG)
            if E < MAX_TOP_K:
                raise _fail(
                    "router_weights", "E >= 8 for NOAUX_TC (max8 expert selection)", f"E={E}"
                )
            # §5.3 "If K exceeds the number of experts in kept groups, masked (-30000-shifted)
            # experts get selected": the kernel would route outside the kept groups
            if K > TG * (E // G):
                raise _fail(
                    "top_k",
                    f"<= topk_group * E / n_group = {TG * (E // G)} (experts in the kept groups)",
                    K,
                )
    for name, t in tensors:
        if t.device != hs.device:
            raise _fail(name, f"device {hs.device} (same as hidden_states)", t.device)
    qmx = QmxOutputDtype.coerce(a["qmx_output_dtype"])
    eps_f = _as_float("eps", a["eps"])
    rsf = _as_float("routed_scaling_factor", a["routed_scaling_factor"])
    has_router = w is not None
    pack_aff = bool(a["pack_affinities"]) and has_router  # §2.1: silently off without a router
    pack_scales = bool(a["pack_scales"])
    geometry = row_geometry(
        H,
        pack_scales=pack_scales,
        num_experts=E if has_router else None,
        router_act_fn=act,
        pack_affinities=pack_aff,
    )
    return PrefillCall(
        hidden_states=hs,
        gamma=g,
        router_weights=w,
        router_bias=router_bias,
        residual=res,
        B=B,
        S=S,
        H=H,
        unpadded_hidden_size=N,
        eps=eps_f,
        has_router=has_router,
        num_experts=E,
        top_k=K,
        act=act,
        n_group=G,
        topk_group=TG,
        routed_scaling_factor=rsf,
        qmx=qmx,
        pack_scales=pack_scales,
        pack_affinities=pack_aff,
        has_residual=res is not None,
        emit_norm_bf16=bool(a["emit_norm_bf16"]),
        hidden_interleaved=bool(a["hidden_interleaved"]),
        compute_dtype=w.dtype if w is not None else hs.dtype,
        geometry=geometry,
    )


def rmsnorm_mx_prefill(
    hidden_states: torch.Tensor,
    gamma: torch.Tensor,
    router_weights: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    top_k: int = 1,
    router_act_fn: RouterActFnType = RouterActFnType.SIGMOID,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    qmx_output_dtype: Any = "float8_e4m3fn_x4",
    pack_scales: bool = True,
    pack_affinities: bool = False,
    unpadded_hidden_size: int | None = None,
    residual: torch.Tensor | None = None,
    emit_norm_bf16: bool = False,
    hidden_interleaved: bool = False,
    *,
    backend: str = "reference",
    kernel: Any = None,
) -> list[torch.Tensor]:
    """Fused RMSNorm [T, H] + MXFP8 quantization (+ optional router top-K) for prefill.

    Trn3 ``rmsnorm_mx_prefill`` semantics (prefill spec; the kernel wins over the upstream
    golden, §8). ``hidden_states`` [B, S, H] bf16/fp16 in natural H order (or 4-way interleaved
    with ``hidden_interleaved``, §3.1), ``gamma`` [H] or [1, H] natural order, ``router_weights``
    [H, E] bf16/fp16 *arranged* with `arrange_router_weights` (§6.1), ``router_bias`` [E] or
    [1, E]. Returns, in this order (§2.2, T = B*S):

    1. ``norm_quant_packed`` [T, row_region] ``torch.float8_e4m3fn`` (always fp8, errata 1;
       ``.view(torch.uint8)`` gives the raw bytes): codes ``[0, H)``, scale bytes, and with
       ``pack_affinities`` the affinity tail (see `row_geometry`, `decode_packed_rows`);
    2. ``expert_index`` [T, K] int32 — router with SIGMOID/SOFTMAX only;
    3. ``expert_affinities`` [T, E] bf16 (SIGMOID/SOFTMAX) or fp32 (NOAUX_TC) — router without
       ``pack_affinities`` only;
    4. ``output_residual`` [T, H] in ``residual.dtype`` — with ``residual`` only;
    5. ``norm_bf16`` [T, H] bf16 — with ``emit_norm_bf16`` only.

    ``backend`` picks the implementation (`mxcli.kernels.backends`): ``"reference"`` (torch,
    CPU or CUDA), or any other registered backend, or ``"auto"``. ``kernel`` picks the NKI
    kernel the ``sim`` / ``neuron`` backends run: ``"mxcli"`` (default), ``"nkilib"`` (AWS's NKI
    Library) or ``"MODULE:FUNCTION"`` (`mxcli.kernels.selection`). Invalid arguments raise
    `PrefillValidationError` (a ``ValueError``).
    """
    arguments = dict(locals())  # the parameters as given: this signature is the only one
    backend = arguments.pop("backend")
    arguments.pop("kernel")
    call = validate(**arguments)
    return backends.resolve(rmsnorm_mx_prefill.__name__, backend, kernel).run(call)  # type: ignore[no-any-return]
