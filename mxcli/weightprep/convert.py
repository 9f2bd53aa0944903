"""Converting one layer: source tensors -> every rank's output file, streamed by expert chunk.

The prefill tensors (gamma, arranged router weight, router bias) are small and written first.
The experts are then read `Plan.chunk_experts` at a time, mapped to the kernel layouts
``[c, H, 2, I]`` / ``[c, I, H]`` by the family's layout, sliced per TP rank, and written as bf16
and/or pre-quantized MXFP8 straight into their place in each rank's file; a chunk is dropped
before the next is read. The router arrangement and the MXFP8 pre-quantization are the kernels'
own functions (`arrange_router_weights`, `prequantize_weights`), so the outputs are exactly what
the kernels expect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from mxcli import __version__
from mxcli.errors import InputError
from mxcli.kernels.blockwise_moe import prequantize_weights
from mxcli.kernels.rmsnorm_mx_prefill import arrange_router_weights
from mxcli.weightprep.checkpoint import CheckpointReader, torch_dtype
from mxcli.weightprep.families import Fused, Scratch, fold_gamma, t2
from mxcli.weightprep.finite import all_finite
from mxcli.weightprep.fp8 import clip_codes
from mxcli.weightprep.plan import Plan, Rank, layer_file, tensor_name
from mxcli.weightprep.writer import StreamingWriter, TensorSpec, WriteQueue, streaming_file

ProgressFn = Callable[[int], None]


def prefill_kwargs(plan: Plan) -> dict[str, Any]:
    """The prefill kernel's router keyword arguments for this model (spec §2.1)."""
    r = plan.model.router
    return {
        "router_act_fn": r.act_fn,
        "top_k": r.top_k,
        "n_group": r.n_group,
        "topk_group": r.topk_group,
        "routed_scaling_factor": r.routed_scaling_factor,
        "unpadded_hidden_size": plan.H,
        "eps": float(plan.model.values["eps"]),
    }


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of `x` to `rows`."""
    if x.shape[0] == rows:
        return x.contiguous()
    out = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype)
    out[: x.shape[0]] = x
    return out


def read_prefill(rd: CheckpointReader, plan: Plan, layer: int) -> dict[str, torch.Tensor]:
    """Source gamma ``[H]``, router weight in natural order ``[H, E]`` and bias ``[E]``."""
    fam = plan.model.family
    p = plan.layer_prefix(layer)
    out = {
        "gamma": fold_gamma(rd.get(p + fam.gamma), fam.norm),  # (1 + w) folded, fp32
        "router_natural": t2(rd.get(p + fam.router_weight)).to(
            torch_dtype(plan.router_dtype)
        ),  # [E, H] -> [H, E]
    }
    if fam.router_bias:
        out["router_bias"] = rd.get(p + fam.router_bias)
    return out


def check_finite(plan: Plan, name: str, t: torch.Tensor, where: str = "") -> None:
    """A source tensor holding NaN/Inf is an error unless ``--allow-nonfinite``: the kernels
    would turn it into NaN gradients (and an MX group holding it into NaN codes).

    ``where`` names the first bad element's position (`expert_position`)."""
    if plan.options.allow_nonfinite or all_finite(t):  # an integer test on the bits, one read
        return
    bad = ~torch.isfinite(t)  # found one: the exact count and position for the message
    if bool(bad.any()):
        nan = int(torch.isnan(t).sum())
        first = tuple(int(v) for v in bad.nonzero()[0])
        at = expert_position(where, first) if where else f"at {list(first)}"
        raise InputError(
            f"{name}: expected finite values, got {nan} NaN and {int(bad.sum()) - nan} Inf, "
            f"first {at} (pass --allow-nonfinite to convert anyway)"
        )


def expert_position(kind: str, index: tuple[int, ...]) -> str:
    """The source coordinates of an element of a chunk ``gate_up [c, H, 2, I]`` (``kind`` =
    ``"gate_up:e0"``) or ``down [c, I, H]`` (``"down:e0"``): expert, projection, ``(i, h)``."""
    what, e0 = kind.split(":")
    if what == "gate_up":
        c, h, j, i = index
        return f"in expert {int(e0) + c} {('gate', 'up')[j]}_proj at (i={i}, h={h})"
    c, i, h = index
    return f"in expert {int(e0) + c} down_proj at (h={h}, i={i})"


def prefill_outputs(src: dict[str, torch.Tensor], plan: Plan) -> dict[str, torch.Tensor]:
    """Kernel-ready prefill tensors: H zero-padded to a multiple of 512, router arranged."""
    Hp = plan.H_padded
    out = {
        "gamma": pad_rows(src["gamma"], Hp),  # [Hp]
        # prefill spec §6.1: swizzle (+ the NOAUX_TC partition transpose)
        "router_weights": arrange_router_weights(
            pad_rows(src["router_natural"], Hp), plan.model.router.act_fn
        ),
    }
    if "router_bias" in src:
        out["router_bias"] = src["router_bias"].contiguous()
    return out


def prequantize(gate_up: torch.Tensor, down: torch.Tensor, plan: Plan) -> dict[str, torch.Tensor]:
    """bwd spec §5.5 x4 data + E8M0 scales of ``gate_up [c, H, 2, I]`` and ``down [c, I, H]``."""
    o = plan.options
    pq = prequantize_weights(
        gate_up,
        down,
        scale_layout=o.scale_layout,
        rule=o.scale_rule,
        scheme="wrapx",
        tile_k=512,
        fast_dma_transpose=False,
    )
    out = {
        "gate_up_proj_weight_mxfp8": pq.gate_up_proj_weight,
        "gate_up_weight_scales": pq.gate_up_weight_scales,
        "down_proj_weight_mxfp8": pq.down_proj_weight,
        "down_weight_scales": pq.down_weight_scales,
    }
    return {k: v for k, v in out.items() if v is not None}


class _Out:
    """Where one layer's tensors go: a rank's file, through the background write queue."""

    def __init__(self, queue: WriteQueue, writer: StreamingWriter, plan: Plan, layer: int) -> None:
        self.queue, self.writer, self.plan, self.layer = queue, writer, plan, layer
        self.clipped = 0  # FP8 codes saturated for a +-240 target (`fp8.clip_codes`)

    def write(self, key: str, t: torch.Tensor) -> None:
        self.queue.write(self.writer, tensor_name(self.layer, key), t)

    def mlp(self, prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """bf16 and/or MXFP8 forms of one rank's ``gate_up [c, H, 2, I_TP]``, ``down [c, I_TP, H]``."""
        if "bf16" in self.plan.options.formats:
            self.write(prefix + "gate_up_proj_weight", gate_up)
            self.write(prefix + "down_proj_weight", down)
        if "mxfp8" in self.plan.options.formats:
            for key, t in prequantize(gate_up, down, self.plan).items():
                if key.endswith("_mxfp8"):
                    self.clipped += clip_codes(t, self.plan.options.fp8_range)
                self.write(prefix + key, t)


def _tp_slice(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    i0: int,
    i1: int,
    scratch: Scratch | None = None,
    key: str = "tp_",
    h_pad: int | None = None,
    i_pad: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One TP rank's ``[..., i0:i1]`` of ``gate_up [c, H, 2, I]`` and ``down [c, I, H]``,
    contiguous, zero-padded to ``[c, h_pad, 2, i_pad]`` / ``[c, i_pad, h_pad]`` (`Padding`)."""
    c, H = gate_up.shape[0], gate_up.shape[1]
    Hb, Ip = h_pad or H, i_pad or (i1 - i0)
    if i0 == 0 and i1 == gate_up.shape[-1] and (Hb, Ip) == (H, i1 - i0):
        return gate_up, down
    sc = scratch or Scratch()
    gu = sc.get(key + "gate_up", (c, Hb, 2, Ip), gate_up.dtype)
    dn = sc.get(key + "down", (c, Ip, Hb), down.dtype)
    # scratch buffers are reused with other chunk sizes: clear the pad regions every time
    gu[:, H:].zero_()
    gu[..., i1 - i0 :].zero_()
    dn[:, i1 - i0 :].zero_()
    dn[..., H:].zero_()
    gu[:, :H, :, : i1 - i0].copy_(gate_up[..., i0:i1])
    dn[:, : i1 - i0, :H].copy_(down[:, i0:i1, :])
    return gu, dn


def rank_biases(
    gub: torch.Tensor | None, db: torch.Tensor | None, i0: int, i1: int, h_pad: int, i_pad: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One rank's ``gate_up_bias [c, 2, I_TP]`` (sliced, zero-padded to `i_pad`) and
    ``down_bias [c, H]`` (zero-padded to `h_pad`)."""
    from mxcli.weightprep.padding import pad_dims

    g = None if gub is None else pad_dims(gub[..., i0:i1].contiguous(), {2: i_pad})
    d = None if db is None else pad_dims(db.contiguous(), {1: h_pad})
    return g, d


def convert_layer(
    plan: Plan, rd: CheckpointReader, layer: int, out_root: Path, progress: ProgressFn | None = None
) -> dict[str, Any]:
    """Write `layer` for every rank; return its manifest entry (see `mxcli.weightprep.manifest`)."""
    t_start = time.perf_counter()
    fam = plan.model.family
    m = plan.model
    p = plan.layer_prefix(layer)
    H, I = m.H, m.I  # noqa: E741
    metadata = {
        "format": "pt",
        "producer": f"mxcli {__version__} prep-weights",
        "layer": str(layer),
        "family": fam.name,
        "router_act_fn": m.router.act_fn,
        "scale_layout": plan.options.scale_layout,
        **plan.options.fp8().metadata(),
    }
    writers: dict[int, StreamingWriter] = {}
    with ExitStack() as stack:
        for rank, outs in zip(plan.ranks, plan.outputs, strict=True):
            path = out_root / rank.dir / layer_file(layer)
            path.parent.mkdir(parents=True, exist_ok=True)
            specs = [TensorSpec(tensor_name(layer, o.key), o.dtype, o.shape) for o in outs]
            md = {
                **metadata,
                "rank": str(rank.rank),
                "tp_rank": str(rank.tp_rank),
                "ep_rank": str(rank.ep_rank),
            }
            writers[rank.rank] = stack.enter_context(streaming_file(path, specs, md))
        queue = WriteQueue()
        stack.callback(queue.close)  # unwinds before the files close
        outs_by_rank = {r: _Out(queue, w, plan, layer) for r, w in writers.items()}

        src = read_prefill(rd, plan, layer)
        for key, t in src.items():
            check_finite(plan, f"layer {layer} {key}", t)
        for key, t in prefill_outputs(src, plan).items():
            for dst in outs_by_rank.values():
                dst.write(key, t)

        pad = plan.padding
        Hb, Ip, Isp = pad.backward_hidden_size, pad.padded_intermediate_size, None
        if fam.shared and m.shared_I:
            Isp = pad.padded_shared_intermediate_size
            sc = Scratch()  # never reused: its writes need no fence
            gu, dn = fam.shared.mlp.load(
                rd, p, 0, 1, H, m.shared_I, m.fp8_block, sc
            )  # [1, H, 2, Is], [1, Is, H]
            check_finite(plan, f"layer {layer} shared expert weights", gu, "gate_up:0")
            check_finite(plan, f"layer {layer} shared expert weights", dn, "down:0")
            for rank in plan.ranks:
                assert rank.shared_i_range is not None
                outs_by_rank[rank.rank].mlp(
                    "shared_expert.",
                    *_tp_slice(gu, dn, *rank.shared_i_range, sc, f"tp{rank.rank}_", Hb, Isp),
                )
            if fam.shared.gate_weight:
                g = rd.get(p + fam.shared.gate_weight)
                for dst in outs_by_rank.values():
                    dst.write("shared_expert_gate_weight", g)
            if progress:
                progress(3 * H * m.shared_I * 2)

        # Expert chunks alternate between two sets of buffers: chunk k is read and converted
        # while chunk k-1 is written; chunk k waits for chunk k-2's writes before reusing its set.
        scratches = (Scratch(), Scratch())
        fences: list[Any] = [None, None]
        by_ep: dict[int, list[Rank]] = {}
        for rank in plan.ranks:
            by_ep.setdefault(rank.ep_rank, []).append(rank)
        step = plan.chunk_experts()
        k = 0
        for ranks in by_ep.values():
            e_lo, e_hi = ranks[0].expert_range
            for e0 in range(e_lo, e_hi, step):
                e1 = min(e_hi, e0 + step)
                sc = scratches[k % 2]
                if fences[k % 2] is not None:
                    fences[k % 2].result()
                gu, dn = fam.experts.load(
                    rd, p, e0, e1, H, I, m.fp8_block, sc
                )  # [c, H, 2, I], [c, I, H]
                check_finite(plan, f"layer {layer} expert weights", gu, f"gate_up:{e0}")
                check_finite(plan, f"layer {layer} expert weights", dn, f"down:{e0}")
                biases = (
                    fam.experts.load_biases(rd, p, e0, e1, I)
                    if isinstance(fam.experts, Fused)
                    else (None, None)
                )
                for rank in ranks:
                    i0, i1 = rank.i_range
                    dst = outs_by_rank[rank.rank]
                    dst.mlp("", *_tp_slice(gu, dn, i0, i1, sc, f"tp{rank.rank}_", Hb, Ip))
                    gub, db = rank_biases(*biases, i0, i1, Hb, Ip)
                    if gub is not None:
                        dst.write("gate_up_proj_bias", gub)  # [c, 2, Ip]
                    if db is not None:
                        dst.write("down_proj_bias", db)  # [c, Hb]
                fences[k % 2] = queue.fence()
                k += 1
                if progress:
                    progress((e1 - e0) * 3 * H * I * 2)
        queue.wait()
        hashes = {r: w.finish() for r, w in writers.items()}
    # every rank's file is complete and renamed into place

    files: dict[str, Any] = {}
    for rank, outs in zip(plan.ranks, plan.outputs, strict=True):
        tensors = {}
        for o in outs:
            name = tensor_name(layer, o.key)
            tensors[o.key] = {
                "name": name,
                "dtype": o.dtype,
                "shape": list(o.shape),
                "sha256": hashes[rank.rank][name],
                "kernel_arg": o.kernel_arg,
                "layout": o.layout,
            }
        path = out_root / rank.dir / layer_file(layer)
        files[str(rank.rank)] = {
            "file": f"{rank.dir}/{layer_file(layer)}",
            "bytes": path.stat().st_size,
            "tensors": tensors,
        }
    return {
        "layer": layer,
        "prefill_kwargs": prefill_kwargs(plan),
        "router_exact": m.router.exact,
        "backward_exact": m.router.backward_exact,
        "notes": list(m.router.notes) + list(m.router.bwd_notes),
        "source_tensors": plan.source_tensors[layer],
        "source_bytes": plan.source_bytes[layer],
        "seconds": round(time.perf_counter() - t_start, 3),
        "fp8_clipped": sum(o.clipped for o in outs_by_rank.values()),
        "ranks": files,
    }
