"""``--output-format nxdi``: the MoE weights in NxD Inference's key names and layouts, one file
per rank.

Facts taken from aws-neuron/neuronx-distributed-inference (commit 4bcdc54b; the tests hold them,
with file:line, in ``tests/weightprep/nxdi_oracle.py``):

- experts: ``layers.{l}.mlp.expert_mlps.mlp_op.gate_up_proj.weight [E, H, 2I]``, gate half first
  (``[..., :I]`` = gate_proj.T, ``[..., I:]`` = up_proj.T) and
  ``layers.{l}.mlp.expert_mlps.mlp_op.down_proj.weight [E, I, H]`` (down_proj.T);
  router ``layers.{l}.mlp.router.linear_router.weight [E, H]`` (the HF gate weight, unchanged)
  (models/qwen3_moe/modeling_qwen3_moe.py);
- pre-sharded checkpoints are ``weights/tp{rank}_sharded_checkpoint.safetensors``
  (models/application_base.py);
- its MX path (gpt-oss, models/gpt_oss/mx_layout_transform.py) needs the per-rank I a multiple of
  512 when above 512, else of 32, and H a multiple of 512 (512-wide H tiles of 128 rows), and
  permutes the router's H dimension (``shuffle_hidden_dim``: H viewed as [H/4, 4], transposed).

The TP slices follow aws-neuron/neuronx-distributed (commit fbac349b): gate_up_proj is an expert
column-parallel linear with stride 2 (modules/moe/experts.py), so a rank holds the pieces r and
r + tp of 2I (trace/trace.py create_local_weight): its gate slice, then its up slice; down_proj
is row-parallel on I. Per rank ``r = ep_rank * tp + tp_rank`` (mxcli's rank order; NxD's
moe_tp x moe_ep = tp_degree, mx_layout_transform.py; the mapping of world ranks to (tp, ep) is
mxcli's assumption, not read from NxD), each file holds, per MoE layer, the router (replicated), and its EP range
of experts with its contiguous TP slice of I: ``gate_up [E/ep, H, 2*I/tp]`` (the rank's gate
slice, then its up slice) and ``down [E/ep, I/tp, H]``. Experts are bf16, exactly the (dequantized)
source. Only the MoE tensors are written: attention, embeddings and norms stay with NxDI's own
conversion of the HF checkpoint.

Not written (refused with one line): the MX weight layout itself (NxDI's MXFP4-compute tiling for
gpt-oss), families with shared experts, expert biases or a router selection bias (their NxDI key
names are not established here). ``--formats`` with mxfp8 checks the MX path's divisibility rules
before anything is written, then refuses.
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
from mxcli.errors import InputError
from mxcli.fsutil import default_mode
from mxcli.weightprep.checkpoint import Checkpoint, torch_dtype
from mxcli.weightprep.export.folder import SIDECAR, export_folder, sidecar, write_json
from mxcli.weightprep.families import Fused
from mxcli.weightprep.writer import StreamingWriter, TensorSpec

WEIGHTS_DIR = "weights"
GATE_UP = "layers.{l}.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = "layers.{l}.mlp.expert_mlps.mlp_op.down_proj.weight"
ROUTER = "layers.{l}.mlp.router.linear_router.weight"
MX_TILE = 512  # NxDI MX path: I tile, and H tile (pmax 128 x q_width 4)
MX_BLOCK = 32  # NxDI MX path: q_width 4 x q_height 8


def rank_file(rank: int) -> str:
    return f"{WEIGHTS_DIR}/tp{rank}_sharded_checkpoint.safetensors"


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
    if "mxfp8" in o.formats:
        probs = mx_path_problems(m.H, m.I // o.tp)
        if probs:
            raise InputError(
                f"--output-format nxdi --formats mxfp8 --tp {o.tp}: NxDI's MX path needs "
                + "; ".join(probs)
                + " (use --formats bf16)"
            )
        raise InputError(
            "--output-format nxdi --formats mxfp8: NxDI's MX weight layout is not written by "
            "this version (divisibility checked: fine); use --formats bf16"
        )


def expected_tensors(plan: Any) -> dict[int, dict[str, tuple[str, tuple[int, ...]]]]:
    """Per rank: tensor name -> (safetensors dtype, shape)."""
    m = plan.model
    out: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for rk in plan.ranks:
        e0, e1 = rk.expert_range
        i0, i1 = rk.i_range
        t: dict[str, tuple[str, tuple[int, ...]]] = {}
        for L in plan.layers:
            t[ROUTER.format(l=L)] = (plan.router_dtype, (m.E, m.H))
            t[GATE_UP.format(l=L)] = ("BF16", (e1 - e0, m.H, 2 * (i1 - i0)))
            t[DOWN.format(l=L)] = ("BF16", (e1 - e0, i1 - i0, m.H))
        out[rk.rank] = t
    return out


def rank_slices(
    gate_up: torch.Tensor, down: torch.Tensor, i0: int, i1: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [c, H, 2, I]`` / ``down [c, I, H]`` -> one rank's ``[c, H, 2*(i1-i0)]`` (its gate
    slice, then its up slice) and ``[c, i1-i0, H]``."""
    c, H = gate_up.shape[0], gate_up.shape[1]
    gu = gate_up[..., i0:i1].reshape(c, H, 2 * (i1 - i0)).contiguous()
    return gu, down[:, i0:i1, :].contiguous()


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
    md = {"format": "pt", "producer": f"mxcli {__version__} prep-weights --output-format nxdi"}
    with export_folder(out, ckpt.root, force) as tmp:
        (tmp / WEIGHTS_DIR).mkdir()
        with ExitStack() as stack, ckpt.reader() as rd:
            writers: dict[int, StreamingWriter] = {}
            for r, tensors in expected.items():
                fd = os.open(tmp / rank_file(r), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             default_mode())  # fmt: skip
                stack.callback(os.close, fd)
                specs = [TensorSpec(n, dt, sh) for n, (dt, sh) in tensors.items()]
                writers[r] = StreamingWriter(fd, specs, {**md, "rank": str(r)})
                stack.callback(os.ftruncate, fd, writers[r].total_bytes)
            step = plan.chunk_experts()
            for L in plan.layers:
                p = plan.layer_prefix(L)
                router = rd.get(p + fam.router_weight).to(torch_dtype(plan.router_dtype))
                for w in writers.values():
                    w.write(ROUTER.format(l=L), router)
                for rk in plan.ranks:
                    e_lo, e_hi = rk.expert_range
                    i0, i1 = rk.i_range
                    for e0 in range(e_lo, e_hi, step):
                        e1 = min(e_hi, e0 + step)
                        gu, dn = fam.experts.load(rd, p, e0, e1, m.H, m.I, m.fp8_block)
                        gu_r, dn_r = rank_slices(gu, dn, i0, i1)
                        writers[rk.rank].write(GATE_UP.format(l=L), gu_r)
                        writers[rk.rank].write(DOWN.format(l=L), dn_r)
                        if progress:
                            progress((e1 - e0) * 3 * m.H * (i1 - i0) * 2)
            for w in writers.values():
                w.finish()
        result = {
            "output": str(out),
            "output_format": "nxdi",
            "family": fam.name,
            "source_format": plan.source_format,
            "experts_format": "bf16",
            "expert_tensors": 2 * len(plan.layers) * len(plan.ranks),
            "ranks": len(plan.ranks),
            "files": [rank_file(r) for r in expected],
            "layers": plan.layers,
            "fp8": None,
            "notes": [
                "MoE tensors only; NxDI converts attention, embeddings and norms itself",
                f"rank r = ep_rank * {plan.options.tp} + tp_rank",
            ],
        }
        write_json(tmp / SIDECAR, sidecar(plan, "nxdi", {"result": result}))
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result
