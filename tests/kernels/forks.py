"""Third-party kernels for the ``--kernel MODULE:FUNCTION`` tests (issue 20 item 7), written at
test time under ``tmp_path``: no upstream code enters the repository.

`write_prefill_fork` writes a package whose ``rmsnorm_mx_prefill`` has the API reference's
signature (api/rmsnorm_mx_prefill.txt: tensors by name, its own ``RouterActFnType`` enum, an
``nki`` dtype for ``qmx_output_dtype``) and runs mxcli's NKI kernel under that module path: a
"fork" as a kernel engineer would keep one. The launch plan mxcli's launcher computes on the host
is computed here in NKI Python, inside the traced entry. A mutation adds one deliberate bug after
the kernel ran:

- ``scale``: one scale byte off by one (token 3, MX group 0: byte H of its row);
- ``swap``: the first two expert indices of token 5 swapped.
"""

from __future__ import annotations

from pathlib import Path

SCALE_TOKEN = 3  # the row whose first scale byte the "scale" mutation bumps
SWAP_TOKEN = 5  # the token whose first two expert indices the "swap" mutation swaps

_FORK = '''"""A fork of rmsnorm_mx_prefill with the API reference's signature (written by mxcli's tests)."""

from enum import Enum

import nki
import nki.isa as nisa
import nki.language as nl

from mxcli.kernels.rmsnorm_mx_prefill import nki_kernel as _mx
from mxcli.kernels.rmsnorm_mx_prefill.kernel_types import RouterMode


class RouterActFnType(Enum):
    SIGMOID = 0
    SOFTMAX = 1
    NOAUX_TC = 2


def _mode(act):
    if act == RouterActFnType.NOAUX_TC:
        return RouterMode.NOAUX_TC
    if act == RouterActFnType.SOFTMAX:
        return RouterMode.SOFTMAX
    return RouterMode.SIGMOID


def _bump_byte(t, row, col):
    """t[row, col] += 1 (one byte of an HBM uint8 tensor)."""
    tile = nl.ndarray((1, 1), dtype=t.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=t[row : row + 1, col : col + 1])
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.add, operand0=1.0)
    nisa.dma_copy(dst=t[row : row + 1, col : col + 1], src=tile)


def _swap_first_two(t, row):
    """Swap t[row, 0] and t[row, 1] (an HBM int32 tensor)."""
    a = nl.ndarray((1, 1), dtype=t.dtype, buffer=nl.sbuf)
    b = nl.ndarray((1, 1), dtype=t.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=t[row : row + 1, 0:1])
    nisa.dma_copy(dst=b, src=t[row : row + 1, 1:2])
    nisa.dma_copy(dst=t[row : row + 1, 0:1], src=b)
    nisa.dma_copy(dst=t[row : row + 1, 1:2], src=a)


@nki.jit
def rmsnorm_mx_prefill(
    hidden_states,
    gamma,
    router_weights=None,
    router_bias=None,
    eps=1e-6,
    top_k=1,
    router_act_fn=RouterActFnType.SIGMOID,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    qmx_output_dtype=nl.float8_e4m3fn_x4,
    pack_scales=True,
    pack_affinities=False,
    unpadded_hidden_size=None,
    residual=None,
    emit_norm_bf16=False,
):
    B, S, H = hidden_states.shape
    T = B * S
    NB = H // 512
    n_packs = (NB + 3) // 4 if pack_scales else NB
    affin_off = H + n_packs * 128
    has_router = router_weights != None
    E = router_weights.shape[1] if has_router else 0
    mode = _mode(router_act_fn)
    aff_width = 4 if mode == RouterMode.NOAUX_TC else 2
    packed_aff = pack_affinities and has_router
    row = affin_off
    if packed_aff:
        row = 4 * ((affin_off + E * aff_width + 3) // 4)
    cfg = _mx.PrefillKernelConfig(
        T=T,
        H=H,
        NB=NB,
        N=H if unpadded_hidden_size == None else unpadded_hidden_size,
        eps=eps,
        E=E,
        K=top_k,
        router_mode=mode,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        compute_dtype=router_weights.dtype if has_router else hidden_states.dtype,
        qmx_dtype=qmx_output_dtype,
        pack_scales=pack_scales,
        n_packs=n_packs,
        pack_affinities=packed_aff,
        aff_width=aff_width,
        affin_off=affin_off,
        row=row,
        emit_norm_bf16=emit_norm_bf16,
        hidden_interleaved=False,
    )
    outs = _mx.rmsnorm_mx_prefill_nki(hidden_states, gamma, cfg, router_weights, router_bias, residual)
    MUTATION
    return outs
'''

_MUTATIONS = {
    None: "",
    "scale": f"_bump_byte(outs[0], {SCALE_TOKEN}, H)  # bug: one scale byte off",
    "swap": (
        f"if has_router and mode != RouterMode.NOAUX_TC and top_k >= 2:\n"
        f"        _swap_first_two(outs[1], {SWAP_TOKEN})  # bug: two expert indices swapped"
    ),
}


def write_prefill_fork(root: Path, package: str, mutation: str | None = None) -> str:
    """Write package `package` under `root`; returns its ``MODULE:FUNCTION`` kernel spec."""
    pkg = root / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""A fork of mxcli\'s NKI kernels (test data)."""\n')
    (pkg / "prefill.py").write_text(_FORK.replace("MUTATION", _MUTATIONS[mutation]))
    return f"{package}.prefill:rmsnorm_mx_prefill"


_BWD = '''"""A third-party blockwise_mm_bwd_mxfp8 with the API reference's signature and its own config
class (written by mxcli's tests). It checks the config it receives and returns zero gradients of
the API's shapes, with the block size and the number of valid tokens written into the first
element of the affinity gradient, so a test can see what arrived."""

from dataclasses import dataclass
from enum import Enum

import nki
import nki.isa as nisa
import nki.language as nl


class ShardOption(Enum):
    SHARD_ON_FREE = 0
    SHARD_ON_HIDDEN = 1


@dataclass
class MXFP8MOEBwdConfig(nl.NKIObject):
    compute_dtype: str = nl.bfloat16
    shard_option: ShardOption = ShardOption.SHARD_ON_FREE
    accumulate_hidden_states_grad: bool = True
    single_expert_dense: bool = False
    skip_grad_initialization: bool = False


def _zeros(t):
    rows, cols = t.shape[0], t.shape[1]
    z = nl.ndarray((128, cols), dtype=t.dtype, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0)
    for r0 in range(0, rows, 128):
        n = min(128, rows - r0)
        nisa.dma_copy(dst=t[r0 : r0 + n, 0:cols], src=z[0:n, 0:cols])


@nki.jit
def blockwise_mm_bwd_mxfp8(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    output_hidden_states_grad,
    block_size=4096,
    gate_up_proj_act_checkpoint_T=None,
    gate_act_checkpoint_T=None,
    intermediate_checkpoint_T=None,
    scaled_intermediate_checkpoint_T=None,
    down_proj_act_checkpoint=None,
    config=None,
    gate_up_weight_scales=None,
    down_weight_scales=None,
    num_valid_tokens=None,
):
    assert config != None, "config is required"
    assert config.shard_option == ShardOption.SHARD_ON_FREE, "only SHARD_ON_FREE"
    assert config.compute_dtype == nl.bfloat16, "only bf16"
    assert not config.skip_grad_initialization, "no skipped init"
    T, H = hidden_states.shape
    E = down_proj_weight.shape[0]
    I = gate_up_proj_act_checkpoint_T.shape[2]
    dx = nl.ndarray((T, H), dtype=hidden_states.dtype, buffer=nl.shared_hbm)
    da = nl.ndarray((T * E, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    dgu = nl.ndarray((E, H, 2, I), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    dd = nl.ndarray((E, I, H), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    _zeros(dx)
    _zeros(da)
    _zeros(dgu.reshape((E * H, 2 * I)))
    _zeros(dd.reshape((E * I, H)))
    mark = nl.ndarray((1, 3), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=mark, value=float(block_size))
    if num_valid_tokens != None:
        nisa.dma_copy(dst=mark[0:1, 1:2], src=num_valid_tokens.reshape((1, 1)))
    # AWS's kernel tells pre-quantized x4 weights by their dtype ('x4' in str(dtype))
    x4 = gate_up_weight_scales != None and "x4" in str(gate_up_proj_weight.dtype)
    nisa.memset(dst=mark[0:1, 2:3], value=1.0 if x4 else 0.0)
    nisa.dma_copy(dst=da.reshape((1, T * E))[0:1, 0:3], src=mark)
    return dx, da, dgu, dd
'''


# An entry point without ``config`` that takes the config's knobs as its own keyword arguments,
# as an older nkilib entry does (blockwise_mm_backward_mxfp8.py: phase1_config=..., shard_option=,
# compute_dtype=, skip_dma=, skip_grad_initialization=, ...) and without num_valid_tokens. What
# arrived is written into the affinity gradient: [block_size, skip_token, accumulating,
# phase1 tile_k, shard_option value, compute dtype is bf16, single_expert_dense, output-grad
# swizzle (DGT 0, PE 1)].
_BWD_KWARGS = '''"""A third-party blockwise_mm_bwd_mxfp8 whose entry point takes no config: its knobs are
keyword arguments (written by mxcli's tests)."""

from dataclasses import dataclass
from enum import Enum

import nki
import nki.isa as nisa
import nki.language as nl


class ShardOption(Enum):
    SHARD_ON_FREE = 0
    SHARD_ON_HIDDEN = 1


class SwizzleMode(Enum):
    DGT = 0
    PE = 1


@dataclass
class SkipMode(nl.NKIObject):
    skip_token: bool = False
    skip_weight: bool = False


@dataclass
class MatmulMxfp8KernelConfig(nl.NKIObject):
    tile_m: int = None
    tile_k: int = None
    tile_n: int = None
    TILES_IN_BLOCK_M: int = None
    TILES_IN_BLOCK_N: int = None
    TILES_IN_BLOCK_K: int = None
    TILES_IN_LOAD_M: int = None
    TILES_IN_LOAD_N: int = None
    TILES_IN_LOAD_K: int = None
    block_loop_order: object = None
    tile_loop_order: object = None
    float8_dtype: object = None
    enable_scale_packing: bool = False
    spill_reload: bool = False
    enable_psum_copy_in: bool = False
    quant_scheme: object = None
    output_dtype: object = None


def _zeros(t):
    rows, cols = t.shape[0], t.shape[1]
    z = nl.ndarray((128, cols), dtype=t.dtype, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0)
    for r0 in range(0, rows, 128):
        n = min(128, rows - r0)
        nisa.dma_copy(dst=t[r0 : r0 + n, 0:cols], src=z[0:n, 0:cols])


@nki.jit
def blockwise_mm_bwd_mxfp8(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    output_hidden_states_grad,
    block_size,
    gate_up_proj_act_checkpoint_T=None,
    gate_act_checkpoint_T=None,
    intermediate_checkpoint_T=None,
    scaled_intermediate_checkpoint_T=None,
    down_proj_act_checkpoint=None,
    gate_up_weight_scales=None,
    down_weight_scales=None,
    phase1_config=None,
    phase2_config=None,
    phase3_config=None,
    phase4_config=None,
    shard_option=ShardOption.SHARD_ON_FREE,
    compute_dtype=nl.float32,
    skip_dma=None,
    skip_grad_initialization=False,
    accumulate_hidden_states_grad=True,
    single_expert_dense=False,
    output_grad_swizzle_mode=SwizzleMode.DGT,
    down_weight_swizzle_mode=SwizzleMode.DGT,
    d_gate_up_swizzle_mode=SwizzleMode.DGT,
    gate_up_weight_swizzle_mode=SwizzleMode.DGT,
    d_gate_up_t_swizzle_mode=SwizzleMode.DGT,
    hidden_states_t_swizzle_mode=SwizzleMode.DGT,
    output_grad_t_swizzle_mode=SwizzleMode.DGT,
    scaled_intermediate_t_swizzle_mode=SwizzleMode.DGT,
):
    T, H = hidden_states.shape
    E, _, _, I = gate_up_proj_weight.shape
    dx = nl.ndarray((T, H), dtype=hidden_states.dtype, buffer=nl.shared_hbm)
    da = nl.ndarray((T * E, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    dgu = nl.ndarray((E, H, 2, I), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    dd = nl.ndarray((E, I, H), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    _zeros(dx)
    _zeros(da)
    _zeros(dgu.reshape((E * H, 2 * I)))
    _zeros(dd.reshape((E * I, H)))
    seen = [
        float(block_size),
        1.0 if skip_dma != None and skip_dma.skip_token else 0.0,
        1.0 if accumulate_hidden_states_grad else 0.0,
        -1.0 if phase1_config == None or phase1_config.tile_k == None else float(phase1_config.tile_k),
        float(shard_option.value),
        1.0 if compute_dtype == nl.bfloat16 else 0.0,
        1.0 if single_expert_dense else 0.0,
        float(output_grad_swizzle_mode.value),
    ]
    mark = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
    for i in range(8):
        nisa.memset(dst=mark[0:1, i : i + 1], value=seen[i])
    nisa.dma_copy(dst=da.reshape((1, T * E))[0:1, 0:8], src=mark)
    return dx, da, dgu, dd
'''

# An entry point with neither ``config`` nor any of its knobs: a config can only be refused.
_BWD_BARE = _BWD_KWARGS.split("    phase1_config=None,")[0] + (
    "):\n    assert False, 'never launched'\n"
)


def write_bwd_kernel(root: Path, package: str, style: str = "config") -> str:
    """Write a third-party bwd kernel package under `root`; returns its kernel spec. `style`:
    ``config`` (takes the API's ``config``), ``kwargs`` (no ``config``: its knobs as keyword
    arguments) or ``bare`` (no ``config`` and none of its knobs)."""
    pkg = root / package
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""A third-party MXFP8 MoE backward (test data)."""\n')
    text = {"config": _BWD, "kwargs": _BWD_KWARGS, "bare": _BWD_BARE}[style]
    (pkg / "bwd.py").write_text(text)
    return f"{package}.bwd:blockwise_mm_bwd_mxfp8"
