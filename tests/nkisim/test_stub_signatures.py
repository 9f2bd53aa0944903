"""Every ``nisa`` / ``nl`` function the interpreter offers has the Neuron SDK 2.32 (NKI 0.6) stub's
parameter names, order and defaults (issue 11 item 2).

The tables below are facts we wrote down from the stubs ``nki/api/nki/isa/__init__.py`` and
``nki/api/nki/language/__init__.py`` at tag v2.32.0, in the stubs' own spelling of defaults
(``buffer=sbuf``, ``engine=engine.unknown``). High-level operator calls (``nl.add(x, y)``) are
included: the stub declares them as functions.
"""

from __future__ import annotations

import enum
import inspect

import pytest

from mxcli.nkisim.dtypes import DType
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from mxcli.nkisim.ops import OpToken
from mxcli.nkisim.tensor import MemoryRegion

# operator constants the stub does not declare as callable functions
NOT_FUNCTIONS_IN_STUB = {"bypass", "prelu"}

STUB_ISA = {
    "activate2": "dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None",
    "activation": "dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None",
    "activation_reduce": "dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None",
    "core_barrier": "data, cores, engine=engine.gpsimd, name=None",
    "dma_compute": "dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error, name=None",
    "dma_copy": "dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown, name=None",
    "dma_transpose": "dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None",
    "exponential": "dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle, reduce_init=0.0, name=None",
    "get_nc_sub_version": "",
    "get_nc_version": "",
    "iota": "dst, pattern, offset=0, channel_multiplier=0, name=None",
    "max8": "dst, src, name=None",
    "memset": "dst, value, engine=engine.unknown, name=None",
    "nc_find_index8": "dst, data, vals, name=None",
    "nc_matmul": "dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False, accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None",
    "nc_matmul_mx": "dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None, accumulate=None, name=None",
    "nc_stream_shuffle": "dst, src, shuffle_mask, name=None",
    "nc_transpose": "dst, data, engine=engine.unknown, name=None",
    "quantize_mx": "dst, src, dst_scale, name=None",
    "reciprocal": "dst, data, name=None",
    "register_alloc": "x=None",
    "register_load": "dst, src",
    "register_move": "dst, src",
    "register_store": "dst, src",
    "scalar_tensor_tensor": "dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None",
    "sendrecv": "src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None",
    "tensor_copy": "dst, src, engine=engine.unknown, name=None",
    "tensor_reduce": "dst, op, data, axis, negate=False, keepdims=False, name=None",
    "tensor_scalar": "dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=engine.unknown, name=None",
    "tensor_scalar_reduce": "dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False, reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None",
    "tensor_tensor": "dst, data1, data2, op, engine=engine.unknown, name=None",
    "topk": "val_dst, idx_dst, src, n, name=None",
}
STUB_NL = {
    "abs": "x, dtype=None",
    "abs_max": "x, y, dtype=None",
    "abs_min": "x, y, dtype=None",
    "add": "x, y, dtype=None",
    "affine_range": "start, stop=None, step=1",
    "arctan": "x, dtype=None",
    "bitwise_and": "x, y, dtype=None",
    "bitwise_or": "x, y, dtype=None",
    "bitwise_xor": "x, y, dtype=None",
    "copy": "x, dtype=None",
    "device_print": "print_prefix, tensor",
    "divide": "x, y, dtype=None",
    "ds": "start, size",
    "dynamic_range": "start, stop=None, step=1",
    "empty_like": "x, dtype=None, buffer=None, name=''",
    "equal": "x, y, dtype=None",
    "erf": "x, dtype=None",
    "erf_dx": "x, dtype=None",
    "exp": "x, dtype=None",
    "fori_loop": "lower, upper, body_fun, step=1",
    "full": "shape, fill_value, dtype, buffer=sbuf, name=''",
    "gelu": "x, dtype=None",
    "gelu_apprx_sigmoid": "x, dtype=None",
    "gelu_apprx_sigmoid_dx": "x, dtype=None",
    "gelu_apprx_tanh": "x, dtype=None",
    "gelu_dx": "x, dtype=None",
    "greater": "x, y, dtype=None",
    "greater_equal": "x, y, dtype=None",
    "invert": "x, dtype=None",
    "is_hbm": "buffer",
    "is_on_chip": "buffer",
    "is_psum": "buffer",
    "is_sbuf": "buffer",
    "left_shift": "x, y, dtype=None",
    "less": "x, y, dtype=None",
    "less_equal": "x, y, dtype=None",
    "load": "src, dtype=None",
    "log": "x, dtype=None",
    "logical_and": "x, y, dtype=None",
    "logical_or": "x, y, dtype=None",
    "logical_xor": "x, y, dtype=None",
    "maximum": "x, y, dtype=None",
    "minimum": "x, y, dtype=None",
    "mish": "x, dtype=None",
    "multiply": "x, y, dtype=None",
    "ndarray": "shape, dtype, buffer=sbuf, name='', address=None",
    "no_reorder": "",
    "not_equal": "x, y, dtype=None",
    "num_programs": "axes=0",
    "ones": "shape, dtype, buffer=sbuf, name=''",
    "power": "x, y, dtype=None",
    "program_id": "axis=0",
    "program_ndim": "",
    "reciprocal": "x, dtype=None",
    "relu": "x, dtype=None",
    "right_shift": "x, y, dtype=None",
    "rsqrt": "x, dtype=None",
    "sequential_range": "start, stop=None, step=1",
    "shared_constant": "constant",
    "shared_identity_matrix": "n, dtype=uint8, dst=None",
    "sigmoid": "x, dtype=None",
    "sign": "x, dtype=None",
    "silu": "x, dtype=None",
    "silu_dx": "x, dtype=None",
    "sin": "x, dtype=None",
    "softplus": "x, dtype=None",
    "sqrt": "x, dtype=None",
    "square": "x, dtype=None",
    "static_range": "start, stop=None, step=1",
    "store": "dst, value",
    "subtract": "x, y, dtype=None",
    "tanh": "x, dtype=None",
    "while_loop": "init, body_fun",
    "zeros": "shape, dtype, buffer=sbuf, name=''",
    "zeros_like": "x, dtype=None, buffer=None, name=''",
}


def _stub_default(v: object) -> str:
    if isinstance(v, (DType, MemoryRegion, OpToken)):
        return repr(v).removeprefix("nl.")
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    return repr(v)


def _stub_style(fn: object) -> str:
    parts = []
    for p in inspect.signature(fn).parameters.values():  # type: ignore[arg-type]
        star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        has_default = p.default is not inspect.Parameter.empty
        parts.append(f"{star}{p.name}" + (f"={_stub_default(p.default)}" if has_default else ""))
    return ", ".join(parts)


def _offered(mod: object) -> set[str]:
    names = getattr(mod, "__all__", [])
    return {
        n
        for n in names
        if inspect.isfunction(getattr(mod, n, None)) or isinstance(getattr(mod, n, None), OpToken)
    }


def test_every_offered_function_is_in_the_table() -> None:
    assert _offered(nisa) == set(STUB_ISA)
    assert _offered(nl) - NOT_FUNCTIONS_IN_STUB == set(STUB_NL)


@pytest.mark.parametrize("name", sorted(STUB_ISA))
def test_isa_matches_the_232_stub(name: str) -> None:
    assert _stub_style(getattr(nisa, name)) == STUB_ISA[name]


@pytest.mark.parametrize("name", sorted(STUB_NL))
def test_language_matches_the_232_stub(name: str) -> None:
    assert _stub_style(getattr(nl, name)) == STUB_NL[name]


def test_high_level_calls_bind_the_stub_parameter_names() -> None:
    import numpy as np

    from tests.nkisim.conftest import run

    def k(x):
        t = nl.load(x)
        s = nl.add(x=t, y=t, dtype=nl.float32)
        e = nl.exp(x=s)
        out = nl.ndarray(e.shape, e.dtype, buffer=nl.shared_hbm)
        nl.store(out, e)
        return out

    x = np.full((2, 2), 0.5, np.float32)
    np.testing.assert_allclose(run(k, x), np.exp(x + x), rtol=1e-6)
    with pytest.raises(TypeError, match="nl.add"):
        nl.add(1)
