"""``--output-format nxdi``: the MoE weights in NxD Inference's key names and layouts, one file
per rank, in bf16 or in NxD's MX layout (MXFP8 codes).

Facts taken from aws-neuron/neuronx-distributed-inference (NxDI, commit 4bcdc54b) and
aws-neuron/neuronx-distributed (NxD, commit fbac349b); the tests hold them, with file:line, in
``tests/weightprep/nxdi_oracle.py``:

- experts: ``layers.{l}.mlp.expert_mlps.mlp_op.gate_up_proj.weight [E, H, 2I]``, gate half first
  (``[..., :I]`` = gate_proj.T, ``[..., I:]`` = up_proj.T) and
  ``layers.{l}.mlp.expert_mlps.mlp_op.down_proj.weight [E, I, H]`` (down_proj.T);
  router ``layers.{l}.mlp.router.linear_router.weight [E, H]`` (the HF gate weight, unchanged)
  (NxDI models/qwen3_moe/modeling_qwen3_moe.py);
- pre-sharded checkpoints are ``weights/tp{rank}_sharded_checkpoint.safetensors``
  (NxDI models/application_base.py), ``rank`` the world rank, each read as the rank's complete
  weights: mxcli writes that name only with ``--nxdi-base`` (NxDI's own sharded checkpoint of
  the model, whose MoE tensors are replaced and whose others are copied and checked byte for
  byte); without it, ``weights/tp{rank}_moe_only.safetensors``, which NxDI does not read;
- with a base, a rank's I is the base's: NxDI pads it to a multiple of 256 when it shards on I
  (zeros appended to the whole I before sharding; `SHARD_ON_I`);
- ranks: NxD builds the MoE groups from ``arange(world).reshape(PP, DP_exp, EP, TP)`` (TP
  contiguous; parallel_state.py, through moe_process_group.py), shards a rank's TP piece by
  ``rank % tp`` and its experts by its place in its EP group, contiguous ``E/ep`` each
  (trace.py, parallel_state.py get_experts_for_expert_parallel_rank): so world rank
  ``r = ep_rank * tp + tp_rank``.

bf16 (``--formats bf16``): gate_up is an expert column-parallel linear with stride 2 (NxD
modules/moe/experts.py; trace/trace.py create_local_weight), so a rank holds its gate slice of I,
then its up slice; down_proj is row-parallel on I. Each file holds, per MoE layer, the router
(replicated) and its EP range of experts with its contiguous TP slice of I: ``gate_up
[E/ep, H, 2*I/tp]`` and ``down [E/ep, I/tp, H]``, exactly the (dequantized) source.

MX (``--formats mxfp8``, or ``bf16,mxfp8``: the MX tensors, since both cannot share the keys): the
layout NxDI's MX path writes for gpt-oss (models/gpt_oss/mx_layout_transform.py) and NxD's
quantized expert layers allocate for an OCP-MX dtype (quantization/quantization_layers.py), with
``F8E4M3FN_X4`` (uint32, 4 E4M3FN codes) in place of gpt-oss's ``F4E2M1FN_X4``: NxD's layers,
its dequantizer and nkilib's blockwise MX kernel take both (``is_ocp_mx_quantized``). Per rank,
with ``T`` the I tile (512, or the per-rank I when at most 512) and ``n = I_tp / T``:

- ``gate_up_proj.weight`` U32 ``[E/ep, 128, 2, H/512, I_tp]``: word ``[e, p, g, t, c]`` packs the
  codes of H ``512t + 4p + j`` (byte j, little-endian) for gate (g=0) or up (g=1), and ``c`` is
  the I shuffle: within each I tile, position ``j*T/4 + k`` holds tile element ``4k + j``;
- ``gate_up_proj.scale`` U8 ``[E/ep, 16, 2, H/512, I_tp]``: the E8M0 byte of H block
  ``16t + b`` (32 consecutive H), same I order;
- ``down_proj.weight`` U32 ``[E/ep, T/4, n, H]``: word ``[e, k, t, h]`` packs I ``tT + 4k + j``;
- ``down_proj.scale`` U8 ``[E/ep, T/32, n, H]``: the byte of I block ``tT/32 + b``;
- the router in the MX path's H order (``shuffle_hidden_dim``: H viewed as [H/4, 4], transposed),
  because that path also shuffles o_proj's output (NxDI's own conversion of the other weights);
  down's output H stays in order (``is_full_model_shuffled`` defaults to False).

Value = E4M3FN(code) * 2^(byte - 127) (NxD transform_weights.py get_mxfp8_tensor_from_uint32),
whichever rule chose the byte: the scale rule and FP8 range are recorded in the sidecar. The
per-rank I must be a multiple of 512 above 512, else of 32, and H of 512; checked before any
byte is written. Only the MoE tensors are written: attention, embeddings and norms stay with
NxDI's own conversion of the HF checkpoint.

No NxDI model reads these MX experts yet (issue 30): at 4bcdc54 the MX layout transform serves
gpt-oss only (models/gpt_oss/modeling_gpt_oss.py, under ``feed_forward.moe.expert_mlps.*`` keys
with biases), and qwen3_moe has no MX path and no o_proj shuffle. The MX layout is a tested
building block; ``--nxdi-base`` refuses it.

Not written (refused with one line): families with shared experts, expert biases or a router
selection bias (their NxDI key names are not established here).

Caveat recorded in the sidecar: at NxD fbac349b the blockwise MX path (``BlockwiseMatmulMXNKIFunc``,
chosen through ``blockwise_matmul_config.blockwise_nki_autograd_cls``; nkilib's
bwmm_shard_on_block_mx) takes float8_e4m3fn_x4 weights, but the fused token-generation MX
wrapper (moe_fused_tkg_mx.py) reinterprets them as float4_e2m1fn_x4 only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from mxcli import __version__
from mxcli.errors import InputError, MxcliError
from mxcli.fsutil import default_mode
from mxcli.mx import quantize_mx
from mxcli.weightprep.checkpoint import Checkpoint, open_safetensors, torch_dtype
from mxcli.weightprep.export import NXDI
from mxcli.weightprep.export.base import tensor_row
from mxcli.weightprep.export.folder import export_folder, write_record
from mxcli.weightprep.export.verifying import (
    Report,
    compare_keys,
    headers,
    over_range,
    plan_for,
    refuse_hashes_only,
    sqnr,
)
from mxcli.weightprep.families import Fused
from mxcli.weightprep.fp8 import Fp8Semantics, clip_codes
from mxcli.weightprep.writer import StreamingWriter, TensorSpec

NAME = NXDI.name
WEIGHTS_DIR = "weights"
GATE_UP = "layers.{l}.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = "layers.{l}.mlp.expert_mlps.mlp_op.down_proj.weight"
# NxD's quantized layers register the scale as the parameter "scale" beside "weight"
# (quantization_layers.py), the names NxDI's MX conversion writes (mx_layout_transform.py)
GATE_UP_SCALE = "layers.{l}.mlp.expert_mlps.mlp_op.gate_up_proj.scale"
DOWN_SCALE = "layers.{l}.mlp.expert_mlps.mlp_op.down_proj.scale"
ROUTER = "layers.{l}.mlp.router.linear_router.weight"
MX_TILE = 512  # NxDI MX path: I tile, and H tile (pmax 128 x q_width 4)
MX_BLOCK = 32  # NxDI MX path: q_width 4 x q_height 8
MX_PACK = 4  # codes per F8E4M3FN_X4 word, consecutive along the contraction axis
RANK_MAPPING = "r = ep_rank * tp + tp_rank (NxD: TP contiguous in world ranks)"


# NxDI reads weights/tp{rank}_sharded_checkpoint.safetensors as a rank's complete weights
# (application_base.py:389-400, handed whole to nxd_model.initialize at :415): mxcli writes that
# name only for complete files (--nxdi-base), else a name NxDI does not read (issue 30).
COMPLETE_FILE = "tp{rank}_sharded_checkpoint.safetensors"
MOE_ONLY_FILE = "tp{rank}_moe_only.safetensors"
# NxDI's shard-on-I padding unit (models/config.py:40 SHARD_ON_INTERMEDIATE_DIMENSION_PER_TP):
# with blockwise_matmul_config.use_shard_on_intermediate_dynamic_while, a per-rank I that is not
# a multiple of 256 is padded up to one, the zeros appended to the end of the whole I before
# sharding (models/qwen3_moe/modeling_qwen3_moe.py:273-282, and :197-203 / :224-227 for
# gate_up [E, H, 2, I] and down [E, I, H]).
SHARD_ON_I = 256


def rank_file(rank: int, complete: bool = False) -> str:
    return f"{WEIGHTS_DIR}/{(COMPLETE_FILE if complete else MOE_ONLY_FILE).format(rank=rank)}"


def plan_rank_file(plan: Any, rank: int) -> str:
    """The file of world rank `rank`: complete (NxDI's name) with ``--nxdi-base``, else MoE-only."""
    return rank_file(rank, plan.options.nxdi_base is not None)


def base_file(base: Path | str, rank: int) -> Path:
    """World rank `rank`'s file in NxDI's sharded checkpoint `base` (its compiled path or the
    ``weights`` folder in it)."""
    b = Path(base)
    d = b / WEIGHTS_DIR if (b / WEIGHTS_DIR).is_dir() else b
    return d / COMPLETE_FILE.format(rank=rank)


def base_headers(plan: Any) -> dict[int, dict[str, tuple[str, tuple[int, ...]]]]:
    """Each world rank's tensors (name -> (dtype, shape)) in ``--nxdi-base``."""
    from mxcli.weightprep.checkpoint import read_safetensors_header

    o = plan.options
    world = o.tp * o.ep
    out: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for r in range(world):
        f = base_file(o.nxdi_base, r)
        if not f.is_file():
            raise InputError(
                f"--nxdi-base {o.nxdi_base}: no {f.name} for world rank {r} "
                f"(--tp {o.tp} x --ep {o.ep} = {world} ranks)"
            )
        header, _ = read_safetensors_header(f)
        out[r] = {n: (e["dtype"], tuple(int(d) for d in e["shape"]))
                  for n, e in header.items() if n != "__metadata__"}  # fmt: skip
    extra = base_file(o.nxdi_base, world)
    if extra.is_file():
        raise InputError(
            f"--nxdi-base {o.nxdi_base}: has {extra.name}, more ranks than --tp {o.tp} x "
            f"--ep {o.ep} = {world}"
        )
    return out


def i_per_rank(plan: Any) -> int:
    """A rank's I: ``I / tp``, or NxDI's padded one where ``--nxdi-base`` holds it."""
    m, o = plan.model, plan.options
    if o.nxdi_base is None:
        return int(m.I // o.tp)
    hdr = base_headers(plan)[0]
    shape = hdr.get(GATE_UP.format(l=plan.layers[0]), (None, (0, 0, 0)))[1]
    return int(shape[2] // 2) if len(shape) == 3 else 0


def rank_i_range(plan: Any, rk: Any, ip: int | None = None) -> tuple[int, int]:
    """A rank's ``[i0, i1)`` of the (padded) I; `ip` = `i_per_rank` when known."""
    ip = i_per_rank(plan) if ip is None else ip
    return rk.tp_rank * ip, (rk.tp_rank + 1) * ip


def rank_moe(
    gate_up: torch.Tensor, down: torch.Tensor, i0: int, i1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rank_slices` of the experts with NxDI's shard-on-I padding: zeros appended to the end
    of I (gate_up ``[c, H, 2, I]`` on its last dim, down ``[c, I, H]`` below) up to `i1`."""
    I = gate_up.shape[-1]  # noqa: E741
    if i1 > I:
        gate_up = torch.nn.functional.pad(gate_up, (0, i1 - I))
        down = torch.nn.functional.pad(down, (0, 0, 0, i1 - I))
    return rank_slices(gate_up, down, i0, i1)


def _moe_keys(plan: Any) -> set[str]:
    return {k.format(l=L) for L in plan.layers for k in (ROUTER, GATE_UP, DOWN)}


def check_base(plan: Any) -> None:
    """``--nxdi-base``: every rank file present, holding the MoE tensors mxcli replaces with
    the shapes and dtypes it writes (I per rank: I/tp, or NxDI's shard-on-I padding of it)."""
    m, o = plan.model, plan.options
    I_tp = m.I // o.tp
    padded = -(-I_tp // SHARD_ON_I) * SHARD_ON_I
    ip = i_per_rank(plan)
    if ip not in (I_tp, padded):
        raise InputError(
            f"--nxdi-base {o.nxdi_base}: {GATE_UP.format(l=plan.layers[0])} holds a per-rank I "
            f"of {ip}; expected {I_tp} (I {m.I} / --tp {o.tp}) or NxDI's shard-on-I padding "
            f"{padded}"
        )
    for r, hdr in base_headers(plan).items():
        c = m.E // o.ep
        for L in plan.layers:
            want = {
                ROUTER.format(l=L): (plan.router_dtype, (m.E, m.H)),
                GATE_UP.format(l=L): ("BF16", (c, m.H, 2 * ip)),
                DOWN.format(l=L): ("BF16", (c, ip, m.H)),
            }
            for n, (dt, sh) in want.items():
                got = hdr.get(n)
                if got != (dt, sh):
                    raise InputError(
                        f"--nxdi-base {base_file(o.nxdi_base, r)}: {n}: expected {dt} "
                        f"{list(sh)}, got {'no such tensor' if got is None else f'{got[0]} {list(got[1])}'}"
                    )


def base_untouched(plan: Any, out: Path) -> list[str]:
    """The tensors other than the replaced MoE ones that differ from ``--nxdi-base`` (name,
    dtype, shape or bytes), per rank file of `out`; empty when all are untouched."""
    from mxcli.weightprep.checkpoint import open_safetensors

    bad: list[str] = []
    moe = _moe_keys(plan)
    for r, hdr in base_headers(plan).items():
        path = out / plan_rank_file(plan, r)
        with (
            open_safetensors(base_file(plan.options.nxdi_base, r)) as fb,
            open_safetensors(path) as fo,
        ):
            names = set(fo.keys())
            for n in hdr:
                if n in moe:
                    continue
                if n not in names:
                    bad.append(f"{plan_rank_file(plan, r)}: {n} missing")
                    continue
                a, b = fb.get_tensor(n), fo.get_tensor(n)
                if (
                    a.dtype != b.dtype
                    or a.shape != b.shape
                    or not torch.equal(
                        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                    )
                ):
                    bad.append(f"{plan_rank_file(plan, r)}: {n} differs from --nxdi-base")
            bad += [f"{plan_rank_file(plan, r)}: {n} not in --nxdi-base" for n in names - set(hdr)]
    return bad


def world_rank(ep_rank: int, tp_rank: int, tp: int) -> int:
    """NxD's world rank of MoE (ep_rank, tp_rank): its expert-region mesh is
    ``arange(world).reshape(PP, DP_exp, EP, TP)`` (parallel_state.py), TP the contiguous axis."""
    return ep_rank * tp + tp_rank


def shuffle_hidden(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """NxDI's MX-path H order: H viewed as ``[H/4, 4]``, the two axes swapped (new position
    ``j * H/4 + i`` holds old ``4 * i + j``)."""
    d = dim % t.dim()
    H = t.shape[d]
    if H % 4:
        raise InputError(f"shuffle: H ({H}) must be a multiple of 4")
    return t.unflatten(d, (H // 4, 4)).transpose(d, d + 1).flatten(d, d + 1).contiguous()


def mx_path_problems(H: int, I_tp: int) -> list[str]:
    """NxDI's MX-path divisibility rules (mx_layout_transform.py get_i/h_tiling_shard_i)."""
    out = []
    if I_tp > MX_TILE and I_tp % MX_TILE:
        out.append(f"per-rank I ({I_tp}) above {MX_TILE} a multiple of {MX_TILE}")
    if I_tp <= MX_TILE and I_tp % MX_BLOCK:
        out.append(f"per-rank I ({I_tp}) up to {MX_TILE} a multiple of {MX_BLOCK}")
    if H % MX_TILE:
        out.append(f"H ({H}) a multiple of {MX_TILE}")
    return out


def i_tiling(I_tp: int) -> tuple[int, int]:
    """(tiles, tile size) of a rank's I: 512-wide above 512, else one tile (get_i_tiling_shard_i)."""
    n = I_tp // MX_TILE if I_tp > MX_TILE else 1
    return n, I_tp // n


def _shuffle_i(t: torch.Tensor, dim: int, I_tp: int) -> torch.Tensor:
    """The MX path's I order: `shuffle_hidden` within each I tile of `dim`."""
    n, tile = i_tiling(I_tp)
    return shuffle_hidden(t.unflatten(dim, (n, tile)), dim + 1).flatten(dim, dim + 1)


def _unshuffle_i(t: torch.Tensor, dim: int, I_tp: int) -> torch.Tensor:
    n, tile = i_tiling(I_tp)
    u = t.unflatten(dim, (n, MX_PACK, tile // MX_PACK)).transpose(dim + 1, dim + 2)
    return u.flatten(dim, dim + 2).contiguous()


def mx_gate_up(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's gate_up codes ``[c, H, 2*I_tp]`` (gate slice, then up; uint8, MX groups of 32
    along H) and scales ``[c, H/32, 2*I_tp]`` -> NxD's ``weight`` U32 ``[c, 128, 2, H/512, I_tp]``
    and ``scale`` U8 ``[c, 16, 2, H/512, I_tp]`` (mx_layout_transform.py
    _tile_transpose_concat_gate_up_weight/_scale)."""
    from mxcli.mx.layouts import pack_x4

    c, H, I2 = codes.shape
    it, nh = I2 // 2, H // MX_TILE
    per_tile = MX_TILE // MX_PACK  # 128 word rows per H tile
    w = codes.reshape(c, nh, per_tile, MX_PACK, 2, it).permute(0, 2, 4, 1, 5, 3)
    w = pack_x4(_shuffle_i(w, 4, it), axis=-1).squeeze(-1)
    s = scales.reshape(c, nh, MX_TILE // MX_BLOCK, 2, it).permute(0, 2, 3, 1, 4)
    return w.contiguous(), _shuffle_i(s, 4, it)


def mx_gate_up_codes(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `mx_gate_up`: codes ``[c, H, 2*I_tp]`` and scales ``[c, H/32, 2*I_tp]``."""
    from mxcli.mx.layouts import unpack_x4

    c, rows, _, nh, it = weight.shape
    b = _unshuffle_i(unpack_x4(weight.unsqueeze(-1), axis=-1), 4, it)  # [c, 128, 2, nh, it, 4]
    codes = b.permute(0, 3, 1, 5, 2, 4).reshape(c, nh * rows * MX_PACK, 2 * it)
    s = _unshuffle_i(scale, 4, it).permute(0, 3, 1, 2, 4)
    return codes.contiguous(), s.reshape(c, -1, 2 * it).contiguous()


def mx_down(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's down codes ``[c, I_tp, H]`` (MX groups of 32 along I) and scales
    ``[c, I_tp/32, H]`` -> ``weight`` U32 ``[c, T/4, I_tp/T, H]`` and ``scale`` U8
    ``[c, T/32, I_tp/T, H]``, T the I tile (tile_transpose_down_proj_for_mxfp4_kernel)."""
    from mxcli.mx.layouts import pack_x4

    c, it, H = codes.shape
    n, tile = i_tiling(it)
    w = codes.reshape(c, n, tile // MX_PACK, MX_PACK, H).permute(0, 2, 1, 4, 3)
    w = pack_x4(w, axis=-1).squeeze(-1)
    s = scales.reshape(c, n, tile // MX_BLOCK, H).permute(0, 2, 1, 3)
    return w.contiguous(), s.contiguous()


def mx_down_codes(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `mx_down`: codes ``[c, I_tp, H]`` and scales ``[c, I_tp/32, H]``."""
    from mxcli.mx.layouts import unpack_x4

    c, words, n, H = weight.shape
    b = unpack_x4(weight.unsqueeze(-1), axis=-1)  # [c, T/4, n, H, 4]
    codes = b.permute(0, 2, 1, 4, 3).reshape(c, n * words * MX_PACK, H)
    return codes.contiguous(), scale.permute(0, 2, 1, 3).reshape(c, -1, H).contiguous()


def quantize_rank(
    gate_up: torch.Tensor, down: torch.Tensor, fp8: Fp8Semantics
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """MX-quantize one rank's ``[c, H, 2*I_tp]`` and ``[c, I_tp, H]`` along their contraction
    axis (H, I: dim 1) in plain groups of 32, `fp8`'s scale rule and range. Returns gate_up
    codes and scales, down codes and scales (uint8, unlaid) and the codes clipped to the range."""
    out: list[torch.Tensor] = []
    clipped = 0
    for x in (gate_up, down):
        codes, scales = quantize_mx(x, axis=1, rule=fp8.rule_bytes, scheme="1x32")
        clipped += clip_codes(codes, fp8.fp8_range)
        out += [codes, scales]
    return out[0], out[1], out[2], out[3], clipped


def check_plan(plan: Any) -> None:
    """Everything refused before any byte is written."""
    fam, m, o = plan.model.family, plan.model, plan.options
    if fam.shared is not None and m.shared_I:
        raise InputError(f"--output-format nxdi: {fam.name} has shared experts (not written)")
    if isinstance(fam.experts, Fused) and (fam.experts.gate_up_bias or fam.experts.down_bias):
        raise InputError(f"--output-format nxdi: {fam.name} has expert biases (not written)")
    if fam.router_bias:
        raise InputError(
            f"--output-format nxdi: {fam.name}'s router has a bias ({fam.router_bias}; not written)"
        )
    if o.nxdi_base is not None:
        check_base(plan)
    if "mxfp8" in o.formats:
        probs = mx_path_problems(m.H, m.I // o.tp)
        if probs:
            raise InputError(
                f"--output-format nxdi --formats mxfp8 --tp {o.tp}: NxDI's MX path needs "
                + "; ".join(probs)
                + " (use --formats bf16)"
            )


def is_mx(plan: Any) -> bool:
    return "mxfp8" in plan.options.formats


def world_ranks(plan: Any) -> dict[int, Any]:
    """NxD world rank -> the plan's `Rank` (its expert range and I slice)."""
    tp = plan.options.tp
    return {world_rank(rk.ep_rank, rk.tp_rank, tp): rk for rk in plan.ranks}


def expected_tensors(plan: Any) -> dict[int, dict[str, tuple[str, tuple[int, ...]]]]:
    """Per NxD world rank: tensor name -> (safetensors dtype, shape)."""
    m = plan.model
    mx = is_mx(plan)
    if plan.options.nxdi_base is not None:  # complete files: exactly the base's tensors
        return {r: dict(h) for r, h in sorted(base_headers(plan).items())}
    out: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for r, rk in sorted(world_ranks(plan).items()):
        e0, e1 = rk.expert_range
        i0, i1 = rk.i_range
        c, it = e1 - e0, i1 - i0
        t: dict[str, tuple[str, tuple[int, ...]]] = {}
        for L in plan.layers:
            t[ROUTER.format(l=L)] = (plan.router_dtype, (m.E, m.H))
            if mx:
                nh, (n, tile) = m.H // MX_TILE, i_tiling(it)
                rows = MX_TILE // MX_PACK
                t[GATE_UP.format(l=L)] = ("U32", (c, rows, 2, nh, it))
                t[GATE_UP_SCALE.format(l=L)] = ("U8", (c, MX_TILE // MX_BLOCK, 2, nh, it))
                t[DOWN.format(l=L)] = ("U32", (c, tile // MX_PACK, n, m.H))
                t[DOWN_SCALE.format(l=L)] = ("U8", (c, tile // MX_BLOCK, n, m.H))
            else:
                t[GATE_UP.format(l=L)] = ("BF16", (c, m.H, 2 * it))
                t[DOWN.format(l=L)] = ("BF16", (c, it, m.H))
        out[r] = t
    return out


def rank_slices(
    gate_up: torch.Tensor, down: torch.Tensor, i0: int, i1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [c, H, 2, I]`` / ``down [c, I, H]`` -> one rank's ``[c, H, 2*(i1-i0)]`` (its gate
    slice, then its up slice) and ``[c, i1-i0, H]``."""
    c, H = gate_up.shape[0], gate_up.shape[1]
    gu = gate_up[..., i0:i1].reshape(c, H, 2 * (i1 - i0)).contiguous()
    return gu, down[:, i0:i1, :].contiguous()


def router_tensor(plan: Any, router: torch.Tensor) -> torch.Tensor:
    """The router as written: the source's ``[E, H]`` in the router dtype, its H shuffled on the
    MX path (mx_layout_transform.py: the router follows the shuffled o_proj output)."""
    r = router.to(torch_dtype(plan.router_dtype))
    return shuffle_hidden(r, dim=-1) if is_mx(plan) else r


def nxdi_facts(plan: Any) -> dict[str, Any]:
    """What the sidecar records about the layout and its sources."""
    facts: dict[str, Any] = {
        "nxdi_commit": "4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e",
        "nxd_commit": "fbac349b61a3adbb123c2983835af692840ff62f",
        "rank_mapping": RANK_MAPPING,
        "rank_mapping_source": "NxD parallel_layers/parallel_state.py initialize_model_parallel "
        "(cluster_ranks_exp), trace/trace.py (rank % tp; EP-group index), "
        "get_experts_for_expert_parallel_rank (contiguous E/ep); no custom expert_distribution",
    }
    if is_mx(plan):
        facts["mx"] = {
            "weight_dtype": "F8E4M3FN_X4 (uint32: 4 E4M3FN codes, byte j = element j)",
            "scale_dtype": "F8E8M0 (uint8), value 2^(byte - 127)",
            "scale_rule_note": "NxD decodes any byte as 2^(byte - 127) and records no rule "
            "(transform_weights.py, dequantize.py); its own MXFP8 quantizer uses OCP's "
            "(mx_torch.py quantize_mxfp8); this export's rule is in result.fp8",
            "groups": "32 consecutive elements along the contraction axis (H for gate_up, I "
            "for down)",
            "router_h_order": "shuffled (shuffle_hidden_dim)",
            "down_output_h_order": "natural (is_full_model_shuffled=False)",
            "intermediate_dim_shuffled": True,
            "source": "NxDI models/gpt_oss/mx_layout_transform.py (the MXFP4 layout, with "
            "F8E4M3FN_X4 words); NxD quantization/quantization_layers.py",
            "consumer": "none yet: at NxDI 4bcdc54 only gpt-oss reads the MX layout "
            "(feed_forward.moe.expert_mlps.* keys); qwen3_moe and the other MoE models have no "
            "MX path",
            "caveat": "NxD's fused token-generation MX wrapper (moe_fused_tkg_mx.py) "
            "reinterprets expert weights as float4_e2m1fn_x4 only; the blockwise MX kernel "
            "(bwmm_shard_on_block_mx) takes float8_e4m3fn_x4",
        }
    return facts


def export_nxdi(
    plan: Any, out: Path | str, force: bool, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out)
    check_plan(plan)
    m = plan.model
    fam = m.family
    ckpt = Checkpoint(plan.source)
    expected = expected_tensors(plan)
    mx = is_mx(plan)
    md = {"format": "pt", "producer": f"mxcli {__version__} prep-weights --output-format nxdi"}
    if mx:
        md.update(plan.options.fp8().metadata())
    with export_folder(out, ckpt.root, force) as tmp:
        (tmp / WEIGHTS_DIR).mkdir()
        with ExitStack() as stack, ckpt.reader() as rd:
            writers: dict[int, StreamingWriter] = {}
            for r, tensors in expected.items():
                fd = os.open(tmp / plan_rank_file(plan, r), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             default_mode())  # fmt: skip
                stack.callback(os.close, fd)
                specs = [TensorSpec(n, dt, sh) for n, (dt, sh) in tensors.items()]
                writers[r] = StreamingWriter(fd, specs, {**md, "rank": str(r)})
                stack.callback(os.ftruncate, fd, writers[r].total_bytes)
            step = plan.chunk_experts()
            ip = i_per_rank(plan)
            fp8 = plan.options.fp8()
            clipped = 0
            if plan.options.nxdi_base is not None:  # everything but the MoE tensors, as is
                moe = _moe_keys(plan)
                for r, tensors in expected.items():
                    with open_safetensors(base_file(plan.options.nxdi_base, r)) as fb:
                        for name in tensors:
                            if name not in moe:
                                writers[r].write(name, fb.get_tensor(name))
            for L in plan.layers:
                p = plan.layer_prefix(L)
                router = router_tensor(plan, rd.get(p + fam.router_weight))
                for w in writers.values():
                    w.write(ROUTER.format(l=L), router)
                for r, rk in world_ranks(plan).items():
                    e_lo, e_hi = rk.expert_range
                    i0, i1 = rank_i_range(plan, rk, ip)
                    for e0 in range(e_lo, e_hi, step):
                        e1 = min(e_hi, e0 + step)
                        gu, dn = fam.experts.load(rd, p, e0, e1, m.H, m.I, m.fp8_block)
                        gu_r, dn_r = rank_moe(gu, dn, i0, i1)
                        if mx:
                            gc, gs, dc, ds, n = quantize_rank(gu_r, dn_r, fp8)
                            clipped += n
                            for key, (wt, sc) in (
                                ((GATE_UP, GATE_UP_SCALE), mx_gate_up(gc, gs)),
                                ((DOWN, DOWN_SCALE), mx_down(dc, ds)),
                            ):
                                writers[r].write(key[0].format(l=L), wt)
                                writers[r].write(key[1].format(l=L), sc)
                        else:
                            writers[r].write(GATE_UP.format(l=L), gu_r)
                            writers[r].write(DOWN.format(l=L), dn_r)
                        if progress:
                            progress((e1 - e0) * 3 * m.H * (i1 - i0) * 2)
            for w in writers.values():
                w.finish()
        base = plan.options.nxdi_base
        if base is not None:
            bad = base_untouched(plan, tmp)
            if bad:
                raise MxcliError(f"internal: --nxdi-base tensors changed: {bad[0]}")
        per_rank = 4 if mx else 2
        result = {
            "output": str(out),
            "output_format": NAME,
            "family": fam.name,
            "source_format": plan.source_format,
            "experts_format": "mxfp8" if mx else "bf16",
            "expert_tensors": per_rank * len(plan.layers) * len(plan.ranks),
            "ranks": len(plan.ranks),
            "files": [plan_rank_file(plan, r) for r in expected],
            "complete": base is not None,
            "nxdi_base": base,
            "i_per_rank": ip,
            "layers": plan.layers,
            "fp8": fp8.to_dict() if mx else None,
            "fp8_clipped": clipped,
            "nxdi": nxdi_facts(plan),
            "notes": [
                (
                    f"complete rank files: --nxdi-base's tensors with the MoE ones replaced "
                    f"(the others checked byte for byte); per-rank I {ip}"
                    if base is not None
                    else "MoE tensors only, under a name NxDI does not read "
                    f"({MOE_ONLY_FILE}); pass --nxdi-base (NxDI's own sharded checkpoint) for "
                    "complete rank files"
                ),
                f"world rank {RANK_MAPPING}, tp {plan.options.tp}",
            ]
            + (
                [
                    "MX layout of NxDI's MX path with F8E4M3FN_X4 words; router H shuffled: "
                    "NxDI must shuffle o_proj likewise (its MX path does)",
                    "NxD's fused TKG MX wrapper reads float4_e2m1fn_x4 only (see nxdi.mx.caveat)",
                ]
                if mx
                else []
            ),
        }
        write_record(tmp, plan, NAME, result)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def verify(out: Path, against: Path, hashes_only: bool = False) -> dict[str, Any]:
    """An nxdi export: keys and shapes per rank file; bf16 experts and the router bit-exact; MX
    experts decoded from NxD's layout, their SQNR against the source, and their codes and scales
    equal to mxcli's MXFP8 of the source under the recorded scale rule and range."""
    from mxcli.weightprep.checkpoint import st_dtype
    from mxcli.weightprep.export.folder import read_record
    from mxcli.weightprep.manifest import ExportRecord

    refuse_hashes_only(out, NAME, hashes_only)
    report = Report(NAME, out, against)
    side = read_record(out) or ExportRecord()
    s = side.settings
    layers = side.model.moe_layers
    plan = plan_for(
        against, report, tp=int(s.get("tp", 1)), ep=int(s.get("ep", 1)),
        formats=tuple(s.get("formats", ("bf16",))), scale_rule=s.get("scale_rule", "neuron"),
        fp8_range=int(s.get("fp8_range", 448)), output_format=NAME,
        layers=",".join(map(str, layers)) if layers else None, nxdi_base=s.get("nxdi_base"),
    )  # fmt: skip
    if plan is None:
        return dict(report.finish())

    def rank_file(r: int) -> str:
        return str(plan_rank_file(plan, r))

    for L in plan.model.moe_layers():
        if L not in plan.layers:
            report.fail("missing", f"layer {L}: a MoE layer of the source with no output")
    m, fam = plan.model, plan.model.family
    mx = is_mx(plan)
    fp8 = plan.options.fp8()
    ranks = world_ranks(plan)
    ok: dict[int, set[str]] = {}
    for r, exp in expected_tensors(plan).items():
        path = out / rank_file(r)
        if not path.is_file():
            rk = ranks[r]
            report.fail("missing", f"{rank_file(r)} (experts {rk.expert_range[0]}-"
                                   f"{rk.expert_range[1] - 1}, I {rk.i_range[0]}-{rk.i_range[1] - 1})")  # fmt: skip
            continue
        ok[r] = set(compare_keys(report, exp, headers(path), f"{rank_file(r)}: "))
    if plan.options.nxdi_base is not None and len(ok) == len(ranks):
        for item in base_untouched(plan, out):  # complete files: the rest is the base's
            report.fail("wrong", item)
    ckpt = Checkpoint(against)
    with ckpt.reader() as rd:
        for r, good in ok.items():
            rk = ranks[r]
            where = f"{rank_file(r)}: "
            with open_safetensors(out / rank_file(r)) as f:
                for L in plan.layers:
                    p = plan.layer_prefix(L)
                    e0, e1 = rk.expert_range
                    gu, dn = fam.experts.load(rd, p, e0, e1, m.H, m.I, m.fp8_block)
                    gu_r, dn_r = rank_moe(gu, dn, *rank_i_range(plan, rk))
                    exact = {ROUTER.format(l=L): router_tensor(plan, rd.get(p + fam.router_weight))}
                    if not mx:
                        exact.update({GATE_UP.format(l=L): gu_r, DOWN.format(l=L): dn_r})
                    for name, ref in exact.items():
                        if name not in good:
                            continue
                        got = f.get_tensor(name)
                        same = st_dtype(got.dtype) == st_dtype(ref.dtype) and torch.equal(
                            got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
                        )
                        report.numeric(where + name, same, None, True)
                    if mx:
                        _verify_nxdi_mx(report, f, where, L, gu_r, dn_r, fp8, good)
    return dict(report.finish(family=fam.name, layers=plan.layers, ranks=len(plan.ranks)))


def _verify_nxdi_mx(
    report: Report, f: Any, where: str, L: int, gu_r: torch.Tensor, dn_r: torch.Tensor,
    fp8: Any, good: set[str],
) -> None:  # fmt: skip
    """One layer's MX experts of one rank file, decoded from NxD's layout."""
    from mxcli.mx import dequantize_mx

    gc, gs, dc, ds, _ = quantize_rank(gu_r, dn_r, fp8)
    for key, skey, unlay, src, want in (
        (GATE_UP, GATE_UP_SCALE, mx_gate_up_codes, gu_r, (gc, gs)),
        (DOWN, DOWN_SCALE, mx_down_codes, dn_r, (dc, ds)),
    ):
        name, sname = key.format(l=L), skey.format(l=L)
        if name not in good or sname not in good:
            continue  # a missing or misshapen key is already reported
        codes, scales = unlay(f.get_tensor(name), f.get_tensor(sname))
        over = over_range(codes, fp8.max)
        if over:
            report.fail(
                "wrong", f"{where}{name}: {over} FP8 codes beyond the declared +-{fp8.max:g}"
            )
        if not (torch.equal(codes, want[0]) and torch.equal(scales, want[1])):
            # the quantizer is deterministic: other bytes mean another rule, range or layout
            report.fail(
                "wrong",
                f"{where}{name}: codes or scales differ from MXFP8 of the source "
                f"(scale rule {fp8.scale_rule}, +-{fp8.max:g})",
            )
        got = dequantize_mx(codes, scales, axis=1)
        exact, db = sqnr(got.to(torch.bfloat16), src)
        report.numeric(where + name, exact, db, False)


def dry_run_view(plan: Any) -> dict[str, Any]:
    """``--dry-run``'s view (`mxcli.weightprep.export.base.Exporter`): the first layer's tensors
    in the first rank file, and the bytes written per layer and in all."""
    L = plan.layers[0]
    per_rank = expected_tensors(plan)
    mark = f"layers.{L}."
    r0 = min(per_rank)
    rows = [tensor_row(n, d, s) for n, (d, s) in per_rank[r0].items() if n.startswith(mark)]
    total = sum(TensorSpec(n, d, s).nbytes for t in per_rank.values() for n, (d, s) in t.items())
    what = "complete" if plan.options.nxdi_base else "MoE tensors only"
    note = f"{len(per_rank)} rank file(s) {plan_rank_file(plan, r0)}, ...; {what}"
    return {"outputs_per_layer": {f"rank {r0}": rows},
            "write_per_layer": total // len(plan.layers), "write_total": total, "note": note}  # fmt: skip


def check_options(opts: Any) -> None:
    """The options this format refuses whatever the model (`PrepOptions`)."""
    if opts.nxdi_base is not None and "mxfp8" in opts.formats:
        # issue 30: NxDI's MX path serves gpt-oss only (models/gpt_oss/); no other model
        # reads MX experts, so a complete rank checkpoint with them would not load
        raise InputError(
            "--nxdi-base with --formats mxfp8: no NxD Inference model reads MXFP8 experts "
            "for these families (NxDI 4bcdc54: gpt-oss only); use --formats bf16"
        )
