"""The safetensors I/O contract of the run commands (``run-prefill``, ``run-bwd``, ``verify``).

Input files
-----------
- Tensors are named exactly as the kernel arguments: ``hidden_states``, ``gamma``,
  ``router_weights``, ``router_bias``, ``residual`` for ``rmsnorm_mx_prefill``;
  ``hidden_states``, ``expert_affinities_masked``, ``gate_up_proj_weight``, ``down_proj_weight``,
  ``token_position_to_id``, ``block_to_expert``, ``output_hidden_states_grad``,
  ``gate_up_proj_act_checkpoint_T``, ``gate_up_weight_scales``, ... for
  ``blockwise_mm_bwd_mxfp8``. A name that is not a tensor argument of the kernel is an error, and
  so is a missing required one.
- Scalar kwargs (``top_k``, ``router_act_fn``, ``block_size``, the bwd ``config``, ...) come from
  the file's ``__metadata__``: the key ``kwargs`` holds a JSON object of them. A metadata key named
  exactly like a kwarg is accepted too (its value parsed as JSON, else taken as a string); the
  ``kwargs`` object wins over such keys, and command-line flags win over both. Enums are written
  by name (``"SOFTMAX"``), the bwd config as a JSON object of its fields.
- ``mxcli make-inputs`` also records ``kernel``, ``format`` (``mxcli.inputs/1``), the
  ``generator`` (seed, shapes, source) and ``mxcli_version``.

Output files
------------
- Tensors are named as the API references name the returns: ``norm_quant_packed``,
  ``expert_index``, ``expert_affinities``, ``output_residual``, ``norm_bf16`` (prefill, only those
  the kwargs ask for, see :func:`prefill_output_names`); ``hidden_states_grad``,
  ``expert_affinities_masked_grad``, ``gate_up_proj_weight_grad``, ``down_proj_weight_grad`` and,
  with ``config.bias``, ``gate_and_up_proj_bias_grad``, ``down_proj_bias_grad`` (bwd).
- ``__metadata__`` (every value a string, JSON where structured): ``format``
  (``mxcli.outputs/1``), ``kernel``, ``kwargs`` (every scalar kwarg the kernel ran with, defaults
  included), ``backend`` and ``device`` that ran, ``mxcli_version``, ``input_file`` and
  ``input_sha256`` (a JSON object: tensor name -> sha256 of its stored bytes), ``elapsed_s``.

Storage of MX data (all little-endian)
--------------------------------------
- fp8 bytes are stored as ``F8_E4M3`` (``torch.float8_e4m3fn``): the packed prefill rows
  ``norm_quant_packed [T, row]`` keep the kernel's byte layout (codes, then the scale region,
  then the optional affinity tail); read them back with ``.view(torch.uint8)``. ``uint8`` is
  accepted on input wherever fp8 bytes are expected.
- x4 data (four fp8 codes in one 32-bit word, byte ``j`` = element ``j``), such as pre-quantized
  weights ``gate_up_proj_weight [E, 2I/4, H]``, is stored as ``U32`` (``torch.uint32``).
- E8M0 scales are stored as ``U8`` bytes (``value = 2 ** (byte - 127)``); ``F8_E8M0`` is not used
  because older readers lack it.
- Everything else keeps its dtype (bf16 activations, int32 indices and block plans, fp32
  NOAUX affinities).

Every file is written atomically (temporary file + rename); an existing output needs ``force``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxcli import __version__
from mxcli.errors import InputError, MxcliError
from mxcli.fsutil import atomic_output

INPUTS_FORMAT = "mxcli.inputs/1"
OUTPUTS_FORMAT = "mxcli.outputs/1"

PREFILL = "rmsnorm_mx_prefill"
BWD = "blockwise_mm_bwd_mxfp8"

FLOAT16 = (torch.bfloat16, torch.float16)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INTS = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Kernel contracts: which tensors and scalars a kernel takes, and what it returns
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of a kernel, as it appears in an input file."""

    name: str
    shape: str  # legend, e.g. "[B, S, H]"
    dtypes: tuple[torch.dtype, ...]
    required: bool = False


@dataclass(frozen=True)
class ScalarArg:
    """A scalar kwarg: its default, its flag, and how a JSON/flag value becomes a kernel value."""

    name: str
    default: Any
    help: str
    # JSON/flag value -> kernel value (raises ValueError with a readable message)
    parse: Callable[[Any], Any] = lambda v: v
    # kernel value -> JSON value
    dump: Callable[[Any], Any] = lambda v: v


@dataclass(frozen=True)
class KernelIO:
    kernel: str
    tensors: tuple[TensorArg, ...]
    scalars: tuple[ScalarArg, ...]
    outputs: tuple[str, ...]  # every possible output, in API order

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]


def _typed(kind: type, name: str, *, low: float | None = None, allow_none: bool = False):
    def parse(v: Any) -> Any:
        if v is None and allow_none:
            return None
        try:
            if kind is bool:
                if isinstance(v, bool):
                    return v
                if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
                    return v.lower() in ("true", "1")
                if isinstance(v, int) and v in (0, 1):
                    return bool(v)
                raise ValueError
            if kind is int:
                if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                out: Any = int(v)
            else:
                out = float(v)
                if not math.isfinite(out):
                    raise ValueError
        except (TypeError, ValueError):
            raise InputError(f"{name}: expected {kind.__name__}, got {v!r}") from None
        if low is not None and out < low:
            raise InputError(f"{name}: expected a value >= {low}, got {v!r}")
        return out

    return parse


def _router_act(v: Any) -> Any:
    from mxcli.kernels import RouterActFnType

    return RouterActFnType.coerce(v)


def _qmx_dtype(v: Any) -> Any:
    from mxcli.kernels.rmsnorm_mx_prefill.contract import QmxOutputDtype

    return QmxOutputDtype.coerce(v)


def _enum_dump(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value if isinstance(v, str) else v.name
    return v


def _enum_parser(name: str, load: Callable[[], type[enum.Enum]]):
    def parse(v: Any) -> Any:
        cls = load()
        if isinstance(v, cls):
            return v
        key = str(v).strip().split(".")[-1]  # accept "RouterActFnType.SOFTMAX"
        for member in cls:
            if key.upper() == member.name.upper() or key == str(member.value):
                return member
        names = ", ".join(m.name.lower() for m in cls)
        raise InputError(f"{name}: unknown value {v!r}; expected one of {names}")

    return parse


def _parse_bwd_config(v: Any) -> Any:
    from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig

    if v is None or isinstance(v, MXFP8MOEBwdConfig):
        return v
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as exc:
            raise InputError(f"config: not valid JSON ({exc})") from None
    if not isinstance(v, Mapping):
        raise InputError(f"config: expected a JSON object of MXFP8MOEBwdConfig fields, got {v!r}")
    return config_from_dict(dict(v))


def _dump_bwd_config(v: Any) -> Any:
    return None if v is None else config_to_dict(v)


PREFILL_IO = KernelIO(
    kernel=PREFILL,
    tensors=(
        TensorArg("hidden_states", "[B, S, H]", FLOAT16, required=True),
        TensorArg("gamma", "[1, H] or [H]", FLOATS, required=True),
        TensorArg("router_weights", "[H, E] (arranged)", FLOAT16),
        TensorArg("router_bias", "[1, E] or [E]", FLOATS),
        TensorArg("residual", "[B, S, H]", FLOAT16),
    ),
    scalars=(
        ScalarArg("eps", 1e-6, "RMSNorm epsilon.", _typed(float, "eps", low=0.0)),
        ScalarArg("top_k", 1, "Experts per token (<= 8).", _typed(int, "top_k", low=1)),
        ScalarArg(
            "router_act_fn",
            "SIGMOID",
            "Router activation: sigmoid, softmax or noaux_tc.",
            _router_act,
            _enum_dump,
        ),
        ScalarArg("n_group", 1, "NOAUX_TC expert groups.", _typed(int, "n_group", low=1)),
        ScalarArg("topk_group", 1, "NOAUX_TC groups kept.", _typed(int, "topk_group", low=1)),
        ScalarArg(
            "routed_scaling_factor",
            1.0,
            "NOAUX_TC multiplier on the normalised affinities.",
            _typed(float, "routed_scaling_factor"),
        ),
        ScalarArg(
            "qmx_output_dtype",
            "float8_e4m3fn_x4",
            "Packed MX element dtype: float8_e4m3fn_x4 or float8_e5m2_x4.",
            _qmx_dtype,
            _enum_dump,
        ),
        ScalarArg(
            "pack_scales",
            True,
            "Fold 4 H512 tiles of scales into 128 bytes.",
            _typed(bool, "pack_scales"),
        ),
        ScalarArg(
            "pack_affinities",
            False,
            "Append the affinities to each packed row.",
            _typed(bool, "pack_affinities"),
        ),
        ScalarArg(
            "unpadded_hidden_size",
            None,
            "Real hidden size for the RMS mean when H is zero-padded.",
            _typed(int, "unpadded_hidden_size", low=1, allow_none=True),
        ),
        ScalarArg(
            "emit_norm_bf16",
            False,
            "Also return the bf16 RMSNorm output.",
            _typed(bool, "emit_norm_bf16"),
        ),
        ScalarArg(
            "hidden_interleaved",
            False,
            "hidden_states/residual stored 4-way interleaved (a documented extra).",
            _typed(bool, "hidden_interleaved"),
        ),
    ),
    outputs=(
        "norm_quant_packed",
        "expert_index",
        "expert_affinities",
        "output_residual",
        "norm_bf16",
    ),
)

BWD_IO = KernelIO(
    kernel=BWD,
    tensors=(
        TensorArg("hidden_states", "[T, H]", FLOAT16, required=True),
        TensorArg("expert_affinities_masked", "[T * E, 1]", FLOATS, required=True),
        TensorArg(
            "gate_up_proj_weight",
            "[E, H, 2, I] bf16 or [E, 2I/4, H] x4 (uint32)",
            (*FLOAT16, torch.uint32),
            required=True,
        ),
        TensorArg(
            "down_proj_weight",
            "[E, I, H] bf16 or [E, H/4, I] x4 (uint32)",
            (*FLOAT16, torch.uint32),
            required=True,
        ),
        TensorArg("token_position_to_id", "[N * B]", INTS, required=True),
        TensorArg("block_to_expert", "[N, 1]", INTS, required=True),
        TensorArg("output_hidden_states_grad", "[T, H]", FLOAT16, required=True),
        TensorArg("gate_up_proj_act_checkpoint_T", "[N, 2, I, B]", FLOAT16),
        TensorArg("gate_act_checkpoint_T", "[N, I, B]", FLOAT16),
        TensorArg("intermediate_checkpoint_T", "[N, I, B]", FLOAT16),
        TensorArg("scaled_intermediate_checkpoint_T", "[N, I, B]", FLOAT16),
        TensorArg("down_proj_act_checkpoint", "[N, B, H]", FLOAT16),
        TensorArg("gate_up_weight_scales", "e8m0 bytes (uint8)", (torch.uint8,)),
        TensorArg("down_weight_scales", "e8m0 bytes (uint8)", (torch.uint8,)),
        TensorArg("num_valid_tokens", "[1] int32", INTS),
    ),
    scalars=(
        ScalarArg(
            "block_size", 4096, "Tokens per block (128 ... 4096).", _typed(int, "block_size", low=1)
        ),
        ScalarArg(
            "config",
            None,
            "MXFP8MOEBwdConfig as a JSON object of its fields.",
            _parse_bwd_config,
            _dump_bwd_config,
        ),
    ),
    outputs=(
        "hidden_states_grad",
        "expert_affinities_masked_grad",
        "gate_up_proj_weight_grad",
        "down_proj_weight_grad",
        "gate_and_up_proj_bias_grad",
        "down_proj_bias_grad",
    ),
)

KERNEL_IO: dict[str, KernelIO] = {PREFILL: PREFILL_IO, BWD: BWD_IO}


def kernel_io(kernel: str) -> KernelIO:
    try:
        return KERNEL_IO[kernel]
    except KeyError:
        raise InputError(
            f"kernel: unknown kernel {kernel!r}; expected one of {', '.join(KERNEL_IO)}"
        ) from None


# --------------------------------------------------------------------------------------------
# MXFP8MOEBwdConfig <-> JSON
# --------------------------------------------------------------------------------------------


def _to_jsonable(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.name
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _to_jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_to_jsonable(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def config_to_dict(config: Any) -> dict[str, Any]:
    """JSON-ready dict of an ``MXFP8MOEBwdConfig`` (enums by name, nested configs as dicts)."""
    return _to_jsonable(config)


def config_from_dict(data: Mapping[str, Any]) -> Any:
    """``MXFP8MOEBwdConfig`` from a (possibly partial) JSON object of its fields."""
    from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig

    try:
        return _dataclass_from_dict(MXFP8MOEBwdConfig, data, "config")
    except MxcliError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise InputError(f"config: {exc}") from None


def _dataclass_from_dict(cls: type, data: Mapping[str, Any], where: str) -> Any:
    import typing

    if not isinstance(data, Mapping):
        raise InputError(f"{where}: expected a JSON object, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise InputError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints.get(name, Any), value, f"{where}.{name}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    import types
    import typing

    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        last: Exception | None = None
        for arg in typing.get_args(hint):
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except (InputError, TypeError, ValueError) as exc:
                last = exc
        raise InputError(f"{where}: cannot use {value!r} ({last})")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_parser(where, lambda: hint)(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass_from_dict(hint, value, where)
    if hint is torch.dtype:
        dt = getattr(torch, str(value).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise InputError(f"{where}: unknown dtype {value!r}")
        return dt
    if hint in (int, float, bool):
        return _typed(hint, where)(value)
    return value


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _json_or_raw(raw: str) -> Any:
    """A metadata string parsed as JSON, else the string itself."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


@dataclass
class TensorFile:
    """A safetensors file read whole: tensors in file order, plus its ``__metadata__``."""

    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    def meta_json(self, key: str, default: Any = None) -> Any:
        """A metadata value parsed as JSON (falls back to the raw string)."""
        raw = self.metadata.get(key)
        return default if raw is None else _json_or_raw(raw)

    @property
    def kernel(self) -> str | None:
        return self.metadata.get("kernel")

    @property
    def kwargs(self) -> dict[str, Any]:
        value = self.meta_json("kwargs", {})
        return dict(value) if isinstance(value, Mapping) else {}


def read_file(path: str | os.PathLike[str]) -> TensorFile:
    """Read every tensor and the metadata of a safetensors file.

    A missing, empty, truncated or otherwise corrupt file raises ``InputError`` naming the file.
    """
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p}: is a folder, expected a .safetensors file")
    if p.stat().st_size < 8:
        raise InputError(f"{p}: not a safetensors file (only {p.stat().st_size} bytes)")
    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as exc:
        raise InputError(f"{p}: corrupt or truncated safetensors file ({exc})") from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise InputError(f"{p}: cannot read safetensors file ({exc})") from None
    io = KERNEL_IO.get(metadata.get("kernel", ""))
    if io is not None:  # safetensors sorts names: restore the kernel's argument / return order
        rank = {n: i for i, n in enumerate([*io.tensor_names, *io.outputs])}
        tensors = dict(sorted(tensors.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    return TensorFile(p, tensors, metadata)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's stored bytes (row-major, little-endian), as hex."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor; (0, 0) for integer and byte tensors."""
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return 0, 0
    f = t.detach().float()
    return int(torch.isnan(f).sum()), int(torch.isinf(f).sum())


def check_tensors(
    io: KernelIO,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    *,
    allow_nonfinite: bool = False,
) -> None:
    """Names, dtypes and finiteness of the input tensors of ``io.kernel``.

    Shapes are the kernel's to validate (its messages give the expected and actual shapes).
    """
    known = io.tensor_names
    extra = [n for n in tensors if n not in known]
    if extra:
        raise InputError(
            f"{source}: unexpected tensor(s) {', '.join(extra)} for {io.kernel}; "
            f"expected names: {', '.join(known)}"
        )
    missing = [f"{t.name} {t.shape}" for t in io.tensors if t.required and t.name not in tensors]
    if missing:
        raise InputError(f"{source}: missing tensor(s) {', '.join(missing)} for {io.kernel}")
    hs = tensors.get("hidden_states")
    if hs is not None and hs.dim() >= 2 and 0 in hs.shape[:-1]:
        # the kernel API takes it (empty outputs), but the NKI kernel cannot allocate [0, ...]
        # tiles, and a run of no token is never what a file meant
        raise InputError(f"hidden_states: expected at least one token, got shape {tuple(hs.shape)}")
    for arg in io.tensors:
        t = tensors.get(arg.name)
        if t is None:
            continue
        if t.dtype not in arg.dtypes:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in arg.dtypes)
            raise InputError(
                f"{arg.name}: expected dtype {allowed}, got {str(t.dtype).removeprefix('torch.')}"
            )
        if not allow_nonfinite:
            from mxcli.verification.finite import input_nonfinite  # x4 words: NaN codes too

            nan, inf = input_nonfinite(arg.name, t)
            if nan or inf:
                raise InputError(
                    f"{arg.name}: contains {nan} NaN and {inf} Inf value(s) "
                    "(pass --allow-nonfinite to run anyway)"
                )


def metadata_kwargs(io: KernelIO, metadata: Mapping[str, str]) -> dict[str, Any]:
    """Raw (JSON) scalar kwargs recorded in a file's metadata: per-key entries, then ``kwargs``."""
    names = [s.name for s in io.scalars]
    out: dict[str, Any] = {n: _json_or_raw(metadata[n]) for n in names if n in metadata}
    raw_kwargs = metadata.get("kwargs")
    if raw_kwargs is not None:
        try:
            obj = json.loads(raw_kwargs)
        except json.JSONDecodeError as exc:
            raise InputError(f"__metadata__['kwargs']: not valid JSON ({exc})") from None
        if not isinstance(obj, Mapping):
            raise InputError("__metadata__['kwargs']: expected a JSON object")
        unknown = sorted(k for k in obj if k not in names)
        if unknown:
            raise InputError(
                f"__metadata__['kwargs']: unknown kwarg(s) {', '.join(unknown)} for {io.kernel}"
            )
        out.update(obj)
    return out


def resolve_kwargs(io: KernelIO, *layers: Mapping[str, Any]) -> dict[str, Any]:
    """Every scalar kwarg as a kernel value: defaults, overridden by each layer in turn.

    ``None`` in a layer means "not given" (so an unset flag keeps the file's value), except for
    kwargs whose default is None.
    """
    raw: dict[str, Any] = {s.name: s.default for s in io.scalars}
    for layer in layers:
        for name, value in layer.items():
            if name not in raw:
                raise InputError(f"{name}: not a kwarg of {io.kernel}")
            if value is not None:
                raw[name] = value
    return {s.name: s.parse(raw[s.name]) for s in io.scalars}


def dump_kwargs(io: KernelIO, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-ready kwargs (enums by name, the bwd config as a dict)."""
    return {s.name: s.dump(kwargs[s.name]) for s in io.scalars if s.name in kwargs}


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def prefill_output_names(
    kwargs: Mapping[str, Any], *, has_router: bool, has_residual: bool
) -> list[str]:
    """Names of the prefill returns, in API order, for these kwargs (prefill spec §2.2)."""
    act = kwargs.get("router_act_fn")
    act_name = getattr(act, "name", str(act)).upper()
    noaux = act_name == "NOAUX_TC"
    names = ["norm_quant_packed"]
    if has_router:
        if not noaux:
            names.append("expert_index")
        if not kwargs.get("pack_affinities", False):
            names.append("expert_affinities")
    if has_residual:
        names.append("output_residual")
    if kwargs.get("emit_norm_bf16", False):
        names.append("norm_bf16")
    return names


def bwd_output_names(n_returned: int) -> list[str]:
    """Names of the bwd returns: four gradients, plus the two bias grads with ``config.bias``."""
    if n_returned not in (4, 6):
        raise MxcliError(f"{BWD} returned {n_returned} tensors, expected 4 or 6")
    return list(BWD_IO.outputs[:n_returned])


def required_output_names(
    kernel: str, kwargs: Mapping[str, Any], input_names: Any = None
) -> list[str]:
    """The outputs a run of `kernel` with `kwargs` must have written (what `verify` requires).

    prefill: :func:`prefill_output_names`, the router and residual read from `input_names`
    (the names of the run's input tensors; when unknown, only those the kwargs alone decide);
    bwd: the four gradients, and the two bias gradients with ``config.bias``.
    """
    if kernel == PREFILL:
        names = set(input_names or ())
        return prefill_output_names(
            kwargs, has_router="router_weights" in names, has_residual="residual" in names
        )
    config = kwargs.get("config")
    return bwd_output_names(6 if getattr(config, "bias", False) else 4)


def name_outputs(
    kernel: str,
    result: Any,
    kwargs: Mapping[str, Any],
    inputs: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Map a kernel's return value (tuple/list, dict or named tuple) to the contract's names."""
    if isinstance(result, Mapping):
        named = dict(result)
    elif hasattr(result, "_asdict"):
        named = dict(result._asdict())
    else:
        values = list(result) if isinstance(result, (list, tuple)) else [result]
        if kernel == PREFILL:
            names = prefill_output_names(
                kwargs,
                has_router=inputs.get("router_weights") is not None,
                has_residual=inputs.get("residual") is not None,
            )
        else:
            names = bwd_output_names(len(values))
        if len(names) != len(values):
            raise MxcliError(
                f"{kernel} returned {len(values)} tensors, expected {len(names)} ({', '.join(names)})"
            )
        named = dict(zip(names, values, strict=True))
    return {k: v for k, v in named.items() if v is not None}


def storage_form(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor as it is stored on disk (see the module docstring), on the CPU, contiguous."""
    t = t.detach().cpu().contiguous()
    if name == "norm_quant_packed" and t.dtype != torch.float8_e4m3fn:
        # fp8 bytes: the packed row may come back as uint8 or as a bf16/fp32 view of the bytes
        from mxcli.kernels.rmsnorm_mx_prefill import packed_bytes

        t = packed_bytes(t).view(torch.float8_e4m3fn)
    return t


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    *,
    force: bool = False,
) -> Path:
    """Write tensors atomically with ``__metadata__`` (non-string values are JSON-encoded).

    A write that fails (a full disk) raises `MxcliError` naming the file and leaves nothing.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    meta = {
        k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()
    }
    data = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    final = Path(path)
    with atomic_output(final, force=force) as tmp:
        try:
            save_file(data, str(tmp), metadata=meta)
        except SafetensorError as exc:
            raise MxcliError(f"{final}: cannot write ({exc}); nothing written") from None
    return final


def inputs_metadata(
    kernel: str, kwargs: Mapping[str, Any], generator: Mapping[str, Any]
) -> dict[str, Any]:
    """``__metadata__`` of an input file written by ``make-inputs``."""
    return {
        "format": INPUTS_FORMAT,
        "kernel": kernel,
        "kwargs": dump_kwargs(kernel_io(kernel), kwargs),
        "generator": dict(generator),
        "mxcli_version": __version__,
    }


def outputs_metadata(
    kernel: str,
    kwargs: Mapping[str, Any],
    *,
    backend: str,
    device: str,
    inputs: Mapping[str, torch.Tensor],
    input_file: str | None = None,
    elapsed_s: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``__metadata__`` of an output file: kernel, every kwarg, backend, device, version, hashes."""
    meta: dict[str, Any] = {
        "format": OUTPUTS_FORMAT,
        "kernel": kernel,
        "kwargs": dump_kwargs(kernel_io(kernel), kwargs),
        "backend": backend,
        "device": device,
        "mxcli_version": __version__,
        "input_sha256": {name: tensor_sha256(t) for name, t in inputs.items()},
    }
    if input_file is not None:
        meta["input_file"] = input_file
    if elapsed_s is not None:
        meta["elapsed_s"] = f"{elapsed_s:.6f}"
    if extra:
        meta.update(extra)
    return meta


def geometry_metadata(kernel: str, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Sizes a reader of the outputs needs besides the kwargs (prefill: H and E of the rows)."""
    if kernel != PREFILL or "hidden_states" not in inputs:
        return {}
    w = inputs.get("router_weights")
    return {
        "geometry": {
            "hidden_size": int(inputs["hidden_states"].shape[-1]),
            "num_experts": int(w.shape[1]) if w is not None else None,
        }
    }


def describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """JSON-ready shape, dtype and sha256 of each tensor (the summaries of the commands)."""
    return {
        name: {"shape": list(t.shape), "dtype": describe_dtype(t.dtype), "sha256": tensor_sha256(t)}
        for name, t in tensors.items()
    }


# --------------------------------------------------------------------------------------------
# Running a kernel on contract-named tensors
# --------------------------------------------------------------------------------------------


def kernel_api(kernel: str) -> Callable[..., Any]:
    """The public kernel function (importing it registers its backends)."""
    import mxcli.kernels

    kernel_io(kernel)
    return getattr(mxcli.kernels, kernel)  # type: ignore[no-any-return]


def available_backends(kernel: str) -> list[str]:
    """Backends registered for ``kernel`` (``auto`` not included)."""
    from mxcli.kernels import backends

    kernel_api(kernel)
    return backends.backend_names(kernel)


def resolve_backend(kernel: str, backend: str) -> str:
    """The concrete backend ``backend`` (``auto`` allowed) names for ``kernel``; a user error
    if it cannot run here."""
    from mxcli.kernels import backends

    kernel_api(kernel)
    name = backends.resolve_name(kernel, backend)
    reason = backends.unavailable_reason(kernel, name)
    if reason is not None:
        raise backends.BackendUnavailableError(
            f"backend: {name!r} cannot run {kernel} here: {reason}"
        )
    return name


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA must be available."""
    text = str(device).strip().lower()
    if not (text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise InputError(f"device: expected cpu or cuda (cuda:N), got {device!r}")
    dev = torch.device(text)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device: cuda requested but no CUDA device is available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"device: {text} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return dev


@dataclass
class RunOutcome:
    """Named outputs (stored form, on the CPU) and where and how fast they were computed."""

    outputs: dict[str, torch.Tensor]
    backend: str
    device: str
    seconds: float


def run_kernel(
    kernel: str,
    tensors: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    *,
    backend: str = "auto",
    device: str = "cpu",
) -> RunOutcome:
    """Call ``kernel`` on ``backend`` with contract-named tensors and parsed kwargs.

    ``device`` places the tensors for the reference backend (CPU or CUDA); other backends get
    CPU tensors and run where they run (``neuron`` on the Trainium device).
    """
    import time

    api = kernel_api(kernel)
    name = resolve_backend(kernel, backend)
    dev = resolve_device(device)
    if name != "reference" and dev.type != "cpu":
        raise InputError(
            f"device: --device {device} applies to the reference backend only, not {name!r}"
        )
    moved = {k: v.to(dev) for k, v in tensors.items()}
    t0 = time.perf_counter()
    result = api(**moved, **kwargs, backend=name)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    named = name_outputs(kernel, result, kwargs, moved)
    outputs = {k: storage_form(k, v) for k, v in named.items()}
    label = "neuron" if name == "neuron" else str(dev)
    return RunOutcome(outputs=outputs, backend=name, device=label, seconds=seconds)


def _merge_config(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bwd ``config`` of later layers updates (field by field) that of earlier ones."""
    merged: dict[str, Any] | None = None
    out = []
    for layer in layers:
        layer = dict(layer)
        cfg = layer.get("config")
        if isinstance(cfg, str):
            try:
                cfg = json.loads(cfg)
            except json.JSONDecodeError as exc:
                raise InputError(f"config: not valid JSON ({exc})") from None
        if isinstance(cfg, Mapping):
            merged = _deep_merge(merged or {}, cfg)
            layer["config"] = merged
        out.append(layer)
    return out


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def run_file(
    kernel: str,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    overrides: Mapping[str, Any] | None = None,
    backend: str = "auto",
    device: str = "cpu",
    weights: str | os.PathLike[str] | None = None,
    layer: int | None = None,
    allow_nonfinite: bool = False,
    force: bool = False,
    step: Callable[[str], Any] | None = None,
    verify_hashes: bool = True,
) -> dict[str, Any]:
    """``run-prefill`` / ``run-bwd``: read, check, run, write; returns a JSON-ready summary.

    The ``--weights`` layer is checked against its manifest (shapes, zero padding and, unless
    not `verify_hashes`, sha256: `mxcli.weightprep.manifest`).

    Kwargs: kernel defaults < the ``--weights`` manifest < the input file's metadata <
    ``overrides`` (the flags). Every check runs before the kernel, and the output is written
    atomically, so a failed run leaves no output file.
    """
    import contextlib
    import time

    from mxcli.fsutil import check_output_path, refuse_inputs

    step = step or (lambda _d: contextlib.nullcontext())
    io = kernel_io(kernel)
    out = check_output_path(output_path, force)
    refuse_inputs(out, [("input", input_path)], [("--weights folder", weights)])
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with step(f"Reading {input_path}"):
        f = read_file(input_path)
        if f.kernel not in (None, kernel):
            raise InputError(f"{f.path}: input file is for {f.kernel}, not {kernel}")
        tensors = dict(f.tensors)
        layers: list[dict[str, Any]] = []
        pad = _recorded_padding(kernel, f, weights)
        if weights is not None:
            from mxcli.inputs import layer_run_inputs

            if layer is None:
                raise InputError("layer: --weights needs --layer L")
            w_tensors, w_kwargs = layer_run_inputs(
                kernel, weights, layer, verify_hashes=verify_hashes
            )
            both = sorted(set(w_tensors) & set(tensors))
            if both:
                raise InputError(
                    f"{f.path}: tensor(s) {', '.join(both)} given both in the file and by --weights"
                )
            tensors.update(w_tensors)
            layers.append(w_kwargs)
        elif layer is not None:
            raise InputError("layer: --layer needs --weights DIR")
        layers.append(metadata_kwargs(io, f.metadata))
        layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
        if pad is not None:  # prepared weights are zero-padded: pad the activations to match
            from mxcli.weightprep.padding import pad_run_inputs

            tensors = pad_run_inputs(kernel, tensors, pad)
        check_tensors(io, tensors, str(f.path), allow_nonfinite=allow_nonfinite)
        kwargs = resolve_kwargs(io, *_merge_config(layers))
    timings["read"] = time.perf_counter() - t0
    with step(f"Running {kernel} on {backend}"):
        outcome = run_kernel(kernel, tensors, kwargs, backend=backend, device=device)
    timings["run"] = outcome.seconds
    from mxcli.verification.finite import unexplained_nonfinite

    # checked at the kernel's (padded) sizes, where inputs and outputs line up
    nonfinite = unexplained_nonfinite(kernel, tensors, outcome.outputs, kwargs)
    outputs, extra = outcome.outputs, geometry_metadata(kernel, tensors)
    if pad is not None:  # bwd gradients are cut back to the model's sizes
        from mxcli.weightprep.padding import unpad_run_outputs

        outputs, extra["padding"] = unpad_run_outputs(kernel, outputs, tensors, pad)
    t1 = time.perf_counter()
    with step(f"Writing {out}"):
        meta = outputs_metadata(
            kernel,
            kwargs,
            backend=outcome.backend,
            device=outcome.device,
            inputs=tensors,
            input_file=str(f.path.name),
            elapsed_s=outcome.seconds,
            extra=extra,
        )
        write_file(out, outputs, meta, force=force)
    timings["write"] = time.perf_counter() - t1
    return {
        "kernel": kernel,
        "input": str(f.path),
        "output": str(out),
        "backend": outcome.backend,
        "device": outcome.device,
        "kwargs": dump_kwargs(io, kwargs),
        "outputs": describe_tensors(outputs),
        "nonfinite": nonfinite,  # output -> NaN/Inf count the inputs do not explain
        "timing_s": {k: round(v, 6) for k, v in timings.items()},
        **({"padding": extra["padding"]} if "padding" in extra else {}),
    }


def _recorded_padding(kernel: str, f: TensorFile, weights: str | os.PathLike[str] | None) -> Any:
    """The zero padding of prepared weights (`mxcli.weightprep.padding.Padding`): from the
    ``--weights`` manifest, else as recorded by ``make-inputs --weights``; None when nothing is
    padded. The hidden states must have the true or the padded H it gives (outputs are cut to
    the true sizes: a padding that does not describe the file would cut real values)."""
    from mxcli.weightprep.padding import Padding

    pad = None
    if weights is not None:
        from mxcli.weightprep.manifest import load_manifest

        pad = load_manifest(Path(weights)).padding()
    else:
        gen = f.meta_json("generator")
        if isinstance(gen, Mapping) and isinstance(gen.get("padding"), Mapping):
            try:
                pad = Padding.from_dict(gen["padding"])
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{f.path}: __metadata__ generator.padding is malformed") from None
    if pad is None or not pad.any:
        return None
    from mxcli.weightprep.manifest import padding_problem

    where = f"the --weights manifest {weights}" if weights else f"{f.path}'s generator.padding"
    problem = padding_problem(pad, "padding")
    if problem is not None:
        raise InputError(f"{f.path}: {problem}, in {where}")
    hs = f.tensors.get("hidden_states")
    H = pad.hidden_size
    padded = pad.prefill_hidden_size if kernel == PREFILL else pad.backward_hidden_size
    if hs is not None and hs.dim():
        if int(hs.shape[-1]) not in (H, padded):
            raise InputError(
                f"hidden_states: expected H {H} (padded {padded}) as {where} says, "
                f"got {int(hs.shape[-1])}"
            )
        if int(hs.shape[-1]) > H and bool(hs[..., H:].any()):
            raise InputError(
                f"hidden_states: not zero past column {H}, where {where} says it is padding"
            )
    return pad
