"""The profile shapes of ``blockwise_mm_bwd_mxfp8`` (its `ProfilePart`: ``profile bwd``'s shape
flags, the inputs of a shape, the block plan's padding), and the profile of a large shape
extrapolated from short runs (`profile_bwd_scaled`, ``scripts/bench_nki.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels.blockwise_moe.config import MXFP8MOEBwdConfig
from mxcli.kernels.blockwise_moe.plan import build_block_plan
from mxcli.kernels.blockwise_moe.spec import SPEC, bwd_input_bytes
from mxcli.kernels.profiling import PlanPadding, extrapolate, positive, profile_kernel
from mxcli.kernels.spec import InputParam
from mxcli.memory import check_input_memory
from mxcli.nkisim import measured

PARAMS: tuple[InputParam, ...] = (
    InputParam("tokens", "T, tokens.", int, None),
    InputParam("hidden", "H, hidden size.", int, None),
    InputParam("intermediate", "I, expert FFN size.", int, None),
    InputParam("experts", "E, (local) experts.", int, None),
    InputParam("top_k", "K, experts per token.", int, 8),
    InputParam("block_size", "B, tokens per block.", int, 512),
)


@dataclass(frozen=True)
class BwdShape:
    """Backward launch shape: T tokens, hidden H, intermediate I, E experts, top-K, block B."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    block_size: int


def inputs(shape: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Zero inputs and a round-robin routing at the shape flags' values."""
    return bwd_inputs(BwdShape(**shape))


def bwd_inputs(s: BwdShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inputs of the backward kernel at shape `s`: zeros, and a round-robin routing with
    `top_k` distinct experts per token (even expert loads: the padding is the plan's own)."""
    for k in ("tokens", "hidden", "intermediate", "experts", "top_k", "block_size"):
        positive(k, getattr(s, k))
    if s.top_k > s.experts:
        raise InputError(f"top_k: expected at most experts={s.experts}, got {s.top_k}")
    T, H, I, E, K, B = s.tokens, s.hidden, s.intermediate, s.experts, s.top_k, s.block_size  # noqa: E741
    check_input_memory(
        f"{T} tokens (hidden {H}, intermediate {I}, experts {E}, top-k {K})",
        bwd_input_bytes(T, H, I, E, K, drawn=False),
    )
    tok = torch.arange(T).unsqueeze(1)
    choices = (tok + torch.arange(K).unsqueeze(0) * max(1, E // K)) % E  # [T, K] distinct
    tpi, b2e = build_block_plan(choices, E, B)
    N = b2e.shape[0]
    bf = torch.bfloat16
    tensors = {
        "hidden_states": torch.zeros(T, H, dtype=bf),
        "expert_affinities_masked": torch.zeros(T * E, 1, dtype=bf),
        "gate_up_proj_weight": torch.zeros(E, H, 2, I, dtype=bf),
        "down_proj_weight": torch.zeros(E, I, H, dtype=bf),
        "token_position_to_id": tpi,
        "block_to_expert": b2e,
        "output_hidden_states_grad": torch.zeros(T, H, dtype=bf),
        "gate_up_proj_act_checkpoint_T": torch.zeros(N, 2, I, B, dtype=bf),
    }
    kwargs = {"block_size": B, "config": MXFP8MOEBwdConfig.routed(top_k=K)}
    return tensors, kwargs


def plan_padding(tensors: dict[str, Any], kwargs: dict[str, Any]) -> PlanPadding:
    tpi = torch.as_tensor(tensors["token_position_to_id"]).reshape(-1)
    b2e = torch.as_tensor(tensors["block_to_expert"]).reshape(-1)
    B = int(SPEC.value(kwargs, "block_size"))
    valid = tpi.reshape(-1, B) >= 0 if tpi.numel() % B == 0 else None
    pairs = int((tpi >= 0).sum())
    needed = int(valid.any(dim=1).sum()) if valid is not None else int(b2e.numel())
    return PlanPadding(pairs, int(b2e.numel()), B, needed)


def sample_inputs(
    s: BwdShape, n_blocks: int, n_experts: int, one_expert: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plan of `n_blocks` full blocks (block b: expert b mod `n_experts`, or expert 0 for all
    with `one_expert`; tokens b*B.. mod T) at the shape's T, H, I and B with `n_experts`
    experts and the shape's top-K config."""
    T, H, I, E, B = s.tokens, s.hidden, s.intermediate, n_experts, s.block_size  # noqa: E741
    bf = torch.bfloat16
    tpi = (torch.arange(n_blocks * B, dtype=torch.int64) % T).to(torch.int32)
    b2e = (torch.arange(n_blocks, dtype=torch.int32) % E).reshape(n_blocks, 1)
    if one_expert:
        b2e = torch.zeros(n_blocks, 1, dtype=torch.int32)
    tensors = {
        "hidden_states": torch.zeros(T, H, dtype=bf),
        "expert_affinities_masked": torch.zeros(T * E, 1, dtype=bf),
        "gate_up_proj_weight": torch.zeros(E, H, 2, I, dtype=bf),
        "down_proj_weight": torch.zeros(E, I, H, dtype=bf),
        "token_position_to_id": tpi,
        "block_to_expert": b2e,
        "output_hidden_states_grad": torch.zeros(T, H, dtype=bf),
        "gate_up_proj_act_checkpoint_T": torch.zeros(n_blocks, 2, I, B, dtype=bf),
    }
    return tensors, {"block_size": B, "config": MXFP8MOEBwdConfig.routed(top_k=s.top_k)}


def _aws_shape() -> BwdShape:
    m = measured.BWD_MXFP8
    return BwdShape(m.tokens, m.hidden, m.intermediate, m.experts, 1, m.block_size)


AWS_SHAPE = _aws_shape()  # the shape of AWS's measured backward (`measured.BWD_MXFP8`)


def aws_tuned_config(top_k: int = 1, *, dma_transposes: bool = False) -> MXFP8MOEBwdConfig:
    """AWS's tuned per-phase blocking for `AWS_SHAPE` (`measured.BWD_TUNED_BLOCKING`), with its
    phase-3/4 transposes on the PE (AWS's 2.190 ms run) or on the DMA (its 2.342 ms run)."""
    from mxcli.kernels.blockwise_moe.config import MatmulMxfp8KernelConfig, TransposeMode

    phases = [MatmulMxfp8KernelConfig(**b.__dict__) for b in measured.BWD_TUNED_BLOCKING]
    mode = TransposeMode.DMA if dma_transposes else TransposeMode.NC
    return MXFP8MOEBwdConfig.routed(
        top_k=top_k, phase1_config=phases[0], phase2_config=phases[1], phase3_config=phases[2],
        phase4_config=phases[3], phase3_transpose_mode=mode, phase4_transpose_mode=mode,
    )  # fmt: skip


def _top_k(kwargs: dict[str, Any]) -> int:
    """1, or 2 for any top-K > 1 (what `MXFP8MOEBwdConfig.routed` keeps of it)."""
    cfg = kwargs.get("config")
    return 2 if getattr(cfg, "accumulate_hidden_states_grad", False) else 1


def _at_aws_shape(tensors: dict[str, Any], kwargs: dict[str, Any]) -> bool:
    """The launch is `AWS_SHAPE` (T, H, I, E, B) with the default config (no config of its own)."""
    s = AWS_SHAPE
    try:
        T, H = tuple(tensors["hidden_states"].shape)
        E, I, H2 = tuple(tensors["down_proj_weight"].shape)  # noqa: E741
        B = int(SPEC.value(kwargs, "block_size"))
    except (KeyError, ValueError, TypeError):
        return False
    cfg = kwargs.get("config")
    default = cfg is None or cfg == MXFP8MOEBwdConfig.routed(top_k=_top_k(kwargs))
    same = (T, H, I, E, B) == (s.tokens, s.hidden, s.intermediate, s.experts, s.block_size)
    return same and H2 == H and default


def launch_kwargs(
    implementation: str, tensors: dict[str, Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The kwargs a profile launches `implementation` with (`ProfilePart.launch_kwargs`): AWS's
    kernel (``nkilib``) at the shape AWS tuned and measured gets AWS's tuned blocking (its
    phase-1..4 defaults are one tile per block), the launch AWS's 2.190 ms was timed on."""
    if implementation == "nkilib" and _at_aws_shape(tensors, kwargs):
        return {**kwargs, "config": aws_tuned_config(_top_k(kwargs))}
    return kwargs


def profile_bwd_scaled(
    s: BwdShape,
    *,
    lnc: int = 2,
    target: str = "trn3",
    blocks: tuple[int, int] = (1, 2),
    calibration: Any = None,
    nki_kernel: Any = None,
) -> dict[str, Any]:
    """The backward kernel's profile at shape `s`, extrapolated from four short runs.

    Scaling argument: the kernel processes the plan block by block with the same instruction
    stream per block (only the expert's weight offset and the token ids differ), and its other
    work is per launch: per token (zeroing the hidden-state gradient, exact here: the samples
    use the real T) and per expert (zeroing each expert's weight gradients). A block's DMAs
    differ in one way: the weight-gradient read of a read-modify-write is skipped where the
    block is its expert's first (the rows still hold zeros). So every engine's busy time, the
    DMA bytes, the PE FLOPs and, past the pipeline fill, the list schedule are
    ``m(N, E) = m0 + U * first + (N - U) * later + E * per_expert`` with U the plan's distinct
    experts (blocks that are their expert's first); four runs — (n1, e1), (n2, e1), (n2, e1)
    with all blocks on one expert, and (n1, e2) blocks and experts — give the slopes. The sampled blocks are full of real tokens;
    padding positions of the real plan are skipped by the DMAs (oob skip) but computed like
    real ones, so the estimate is an upper bound for padded blocks. The plan's padding comes
    from the real plan (`bwd_inputs`). Small E also keeps the runs' memory small (the weights of
    all E experts are inputs).
    """
    n1, n2 = blocks
    if n1 != 1 or n2 <= n1:
        raise InputError(f"blocks: expected (1, n) with n > 1, got {blocks}")
    e1, e2 = n2, 2 * n2
    runs = []
    for nb, ne, one in ((n1, e1, False), (n2, e1, False), (n2, e1, True), (n1, e2, False)):
        tensors, kwargs = sample_inputs(s, nb, ne, one)
        runs.append(
            profile_kernel(
                SPEC.name,
                tensors,
                kwargs,
                lnc=lnc,
                target=target,
                nki_kernel=nki_kernel,
                calibration=calibration,
            )  # fmt: skip
        )
    plan = bwd_inputs(s)
    pad = plan_padding(*plan)
    firsts = int(plan[0]["block_to_expert"].unique().numel())
    base, pb, pl, pe = (r.summary(10, ranges=False) for r in runs)
    # all sampled blocks are their expert's first, but the one-expert run's last n2 - n1
    steps = [
        (pb, (firsts - n1) / (n2 - n1)),
        (pl, (pad.blocks - firsts) / (n2 - n1)),
        (pe, (s.experts - e1) / (e2 - e1)),
    ]
    keys = ("busy_us", "dma_queue_us", "schedule_us", "pe_flops", "dma", "instructions")
    out: dict[str, Any] = {
        "kernel": SPEC.name,
        "shape": dict(s.__dict__),
        "target": target,
        "lnc": lnc,
    }
    for k in keys:
        out[k] = extrapolate(base[k], [(x[k], w) for x, w in steps])
    busy = out["busy_us"]
    out["bottleneck"] = max(busy, key=lambda k: busy[k])
    out["lower_bound_us"] = max(busy.values())
    hw = runs[1].profile.hw
    mx_peak, bf_peak = hw["pe_mx_tflops"] * 1e6 * lnc, hw["pe_bf16_tflops"] * 1e6 * lnc  # FLOP/us

    def util(t_us: float) -> dict[str, float]:
        mx = out["pe_flops"]["mx"] / (t_us * mx_peak)
        bf = out["pe_flops"]["bf16"] / (t_us * bf_peak)
        return {"mx": mx, "bf16": bf, "total": mx + bf}

    out["pe_utilization"] = util(out["schedule_us"])
    out["pe_utilization_at_lower_bound"] = util(out["lower_bound_us"])
    out["plan_padding"] = {
        "pairs": pad.pairs, "blocks": pad.blocks, "block_size": pad.block_size,
        "positions": pad.positions, "blocks_needed": pad.blocks_needed,
        "efficiency": pad.efficiency,
    }  # fmt: skip
    out["top_lines"] = pb["top_lines"]
    out["sampled"] = {"blocks_experts": [[n1, e1], [n2, e1], [n2, 1], [n1, e2]]}
    out["check_only_run_s"] = round(sum(r.run_seconds for r in runs), 3)
    from mxcli.kernels import calibrating  # the range: the extrapolation per figure setting

    out["range"] = calibrating.extrapolated_ranges(
        runs[0], [(r, w) for r, (_, w) in zip(runs[1:], steps, strict=True)], calibration
    )
    if runs[0].nki_kernel is not None:
        out["nki_kernel"] = runs[0].nki_kernel
    return out


__all__ = [
    "AWS_SHAPE",
    "PARAMS",
    "BwdShape",
    "aws_tuned_config",
    "bwd_inputs",
    "inputs",
    "launch_kwargs",
    "plan_padding",
    "profile_bwd_scaled",
]
