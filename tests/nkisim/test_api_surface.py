"""The API surface (names, parameter names, defaults) matches the spec's signatures (api spec
§3-§8), and a real ``nki`` whenever one is importable."""

from __future__ import annotations

import enum
import importlib
import inspect

import pytest

import mxcli.nkisim as nkisim
from mxcli.nkisim import nki as nki_module
from mxcli.nkisim.dtypes import DType
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from mxcli.nkisim.ops import OpToken

# Pinned from the spec's signatures (nki_api_subset.md), parameter order and defaults.
ISA = {
    "dma_copy": "dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown, name=None",
    "dma_compute": "dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None",
    "dma_transpose": "dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None",
    "sendrecv": "src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None",
    "core_barrier": "data, cores, engine=engine.gpsimd, name=None",
    "nc_matmul": "dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None",
    "nc_matmul_mx": "dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None, accumulate=None, name=None",
    "quantize_mx": "dst, src, dst_scale, name=None",
    "nc_transpose": "dst, data, engine=engine.unknown, name=None",
    "tensor_copy": "dst, src, engine=engine.unknown, name=None",
    "memset": "dst, value, engine=engine.unknown, name=None",
    "iota": "dst, pattern, offset=0, channel_multiplier=0, name=None",
    "tensor_tensor": "dst, data1, data2, op, engine=engine.unknown, name=None",
    "tensor_scalar": "dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=engine.unknown, name=None",
    "scalar_tensor_tensor": "dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None",
    "tensor_reduce": "dst, op, data, axis, negate=False, keepdims=False, name=None",
    "activation": "dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None",
    "activation_reduce": "dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None",
    "activate2": "dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None",
    "reciprocal": "dst, data, name=None",
    "exponential": "dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None",
    "max8": "dst, src, name=None",
    "nc_find_index8": "dst, data, vals, name=None",
    "topk": "val_dst, idx_dst, src, n, name=None",
    "nc_stream_shuffle": "dst, src, shuffle_mask, name=None",
    "register_alloc": "x=None",
    "register_move": "dst, src",
    "register_load": "dst, src",
    "register_store": "dst, src",
    "get_nc_version": "",
    "get_nc_sub_version": "",
}
NL = {
    "ndarray": "shape, dtype, buffer=nl.sbuf, name='', address=None",
    "zeros": "shape, dtype, buffer=nl.sbuf, name=''",
    "ones": "shape, dtype, buffer=nl.sbuf, name=''",
    "full": "shape, fill_value, dtype, buffer=nl.sbuf, name=''",
    "zeros_like": "x, dtype=None, buffer=None, name=''",
    "empty_like": "x, dtype=None, buffer=None, name=''",
    "shared_identity_matrix": "n, dtype=nl.uint8, dst=None",
    "shared_constant": "constant",
    "ds": "start, size",
    "affine_range": "start, stop=None, step=1",
    "sequential_range": "start, stop=None, step=1",
    "static_range": "start, stop=None, step=1",
    "dynamic_range": "start, stop=None, step=1",
    "fori_loop": "lower, upper, body_fun, step=1",
    "while_loop": "init, body_fun",
    "program_id": "axis=0",
    "num_programs": "axes=0",
    "program_ndim": "",
    "device_print": "print_prefix, tensor",
    "no_reorder": "",
    "load": "src, dtype=None",
    "store": "dst, value",
}
TENSOR = {
    "ap": "self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None",
    "view": "self, dtype",
    "slice": "self, dim, start, end, step=1",
    "select": "self, dim, index",
    "vector_select": "self, dim, vector_offset",
    "permute": "self, dims",
    "broadcast": "self, dim, size",
    "reshape_dim": "self, dim, shape",
    "flatten_dims": "self, start_dim, end_dim",
}
ENUMS = {
    "engine": {
        "tensor": 1,
        "vector": 5,
        "scalar": 2,
        "gpsimd": 3,
        "dma": 4,
        "sync": 6,
        "unknown": 0,
    },
    "reduce_cmd": {"idle": 0, "reset": 1, "reduce": 2, "reset_reduce": 3, "load_reduce": 4},
    "dge_mode": {"unknown": 0, "swdge": 1, "hwdge": 2, "none": 3},
    "oob_mode": {"error": 0, "skip": 1},
    "matmul_perf_mode": {"none": "none", "double_row": "double_row"},
    "nc_version": {"gen2": 2, "gen3": 3, "gen4": 4},
    "dma_engine": {"dma": 1, "gpsimd_dma": 2},
}
OP_TOKENS = (
    "add subtract multiply maximum minimum equal not_equal greater greater_equal less less_equal "
    "logical_and logical_or logical_xor power abs_max abs_min abs square relu rsqrt reciprocal "
    "bitwise_and bitwise_or bitwise_xor invert left_shift right_shift bypass copy sigmoid exp log "
    "tanh silu silu_dx gelu gelu_dx gelu_apprx_tanh gelu_apprx_sigmoid gelu_apprx_sigmoid_dx "
    "softplus mish erf erf_dx sqrt sign sin arctan"
).split()
DTYPES = (
    "bool_ int8 int16 int32 uint8 uint16 uint32 float16 float32 bfloat16 tfloat32 float8_e4m3 "
    "float8_e4m3fn float8_e5m2 float8_e8m0fnu float8_e4m3fn_x4 float8_e5m2_x4 float4_e2m1fn_x4"
).split()


def _fmt_default(v: object) -> str:
    if isinstance(v, (DType, nl.MemoryRegion, OpToken)):
        return repr(v)  # nl.<name>
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    return repr(v)


def _sig(fn: object) -> str:
    parts = []
    for p in inspect.signature(fn).parameters.values():  # type: ignore[arg-type]
        parts.append(
            p.name
            if p.default is inspect.Parameter.empty
            else f"{p.name}={_fmt_default(p.default)}"
        )
    return ", ".join(parts)


@pytest.mark.parametrize("name", sorted(ISA))
def test_isa_signatures(name: str) -> None:
    assert _sig(getattr(nisa, name)) == ISA[name]


@pytest.mark.parametrize("name", sorted(NL))
def test_language_signatures(name: str) -> None:
    assert _sig(getattr(nl, name)) == NL[name]


@pytest.mark.parametrize("name", sorted(TENSOR))
def test_tensor_method_signatures(name: str) -> None:
    assert _sig(getattr(nl.NkiTensor, name)) == TENSOR[name]


def test_enums_tokens_dtypes_and_aliases() -> None:
    for name, members in ENUMS.items():
        cls = getattr(nisa, name)
        assert {m.name: m.value for m in cls} == members
        assert getattr(nisa.constants, name) is cls
    for tok in OP_TOKENS:
        assert isinstance(getattr(nl, tok), OpToken), tok
    for dt in DTYPES:
        assert str(getattr(nl, dt)) == dt
    assert nisa.scalar_engine is nisa.engine.scalar and nisa.gpsimd_engine is nisa.engine.gpsimd
    assert nisa.vector_engine is nisa.engine.vector and nisa.tensor_engine is nisa.engine.tensor
    assert nl.hbm is nl.private_hbm and nl.range is range
    assert issubclass(nisa.NkiValidationError, AssertionError)
    assert _sig(nki_module.simulate) == "kernel" and _sig(nki_module.jit) == "fn=None, kwargs"
    tile = nl.tile_size
    assert (tile.pmax, tile.psum_bank_fmax, tile.gemm_stationary_fmax, tile.gemm_moving_fmax) == (
        128,
        512,
        128,
        512,
    )


def _real() -> tuple[object, object, object]:
    if not nkisim.real_nki_available():
        pytest.skip("no real nki importable")
    return (
        importlib.import_module("nki"),
        importlib.import_module("nki.isa"),
        importlib.import_module("nki.language"),
    )


@pytest.mark.parametrize("name", sorted(ISA))
def test_matches_real_nki_isa(name: str) -> None:
    _, real_isa, _ = _real()
    real_fn = getattr(real_isa, name, None)
    if real_fn is None:
        pytest.fail(f"real nki.isa has no {name}")
    ours = list(inspect.signature(getattr(nisa, name)).parameters)
    assert ours == list(inspect.signature(real_fn).parameters)


@pytest.mark.parametrize("name", sorted(NL))
def test_matches_real_nki_language(name: str) -> None:
    _, _, real_nl = _real()
    ours = list(inspect.signature(getattr(nl, name)).parameters)
    assert ours == list(inspect.signature(getattr(real_nl, name)).parameters)
