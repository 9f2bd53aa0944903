"""Cost-model profiles of the two NKI kernels (``mxcli profile``, ``scripts/bench_nki.py``).

Each kernel runs once in the interpreter's check-only mode (every hardware rule and the
SBUF/PSUM capacity checked, float arithmetic skipped) with instruction recording on; the recorded
stream is costed and scheduled by `mxcli.nkisim.cost` / `mxcli.nkisim.schedule`. Inputs come from
a ``make-inputs`` file or are synthesized (zeros; routing round-robin) from shapes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels.blockwise_moe import SPEC as BWD
from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig, build_block_plan
from mxcli.kernels.blockwise_moe.spec import bwd_input_bytes
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL  # noqa: F401 (bench_nki: prof.PREFILL)
from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType
from mxcli.kernels.rmsnorm_mx_prefill.spec import prefill_input_bytes
from mxcli.kernels.spec import get_spec, read_kernel_file
from mxcli.memory import check_input_memory
from mxcli.nkisim import cost, measured, schedule, trace

__all__ = [
    "PrefillShape",
    "BwdShape",
    "PlanPadding",
    "KernelProfile",
    "prefill_inputs",
    "bwd_inputs",
    "file_inputs",
    "profile_kernel",
    "AWS_SHAPE",
    "aws_tuned_config",
]

TARGETS = ("trn3", "trn2")


@dataclass(frozen=True)
class PrefillShape:
    """Prefill launch shape: T tokens, hidden H, E experts, top-K, router activation. No
    defaults: the kernel API's are in its signature (``profile prefill`` shows them), and a
    benchmark names its router (DeepSeek-V3's: top-K 8, noaux_tc, 8 groups, 4 kept)."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    router_act: str
    n_group: int
    topk_group: int
    pack_affinities: bool  # nkilib's kernel refuses it with NOAUX_TC


@dataclass(frozen=True)
class BwdShape:
    """Backward launch shape: T tokens, hidden H, intermediate I, E experts, top-K, block B."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    block_size: int


@dataclass(frozen=True)
class PlanPadding:
    """The block plan's padding (kept apart from kernel efficiency)."""

    pairs: int  # routed (token, expert) pairs
    blocks: int  # N, the plan's static block count
    block_size: int
    blocks_needed: int  # sum over experts of ceil(c_e / B)

    @property
    def positions(self) -> int:
        return self.blocks * self.block_size

    @property
    def efficiency(self) -> float:
        """Routed pairs / positions the kernel processes (1.0 = no padding)."""
        return self.pairs / self.positions if self.positions else 0.0


@dataclass
class KernelProfile:
    """A kernel's profile plus what it ran on."""

    kernel: str
    profile: Any  # mxcli.nkisim.schedule.Profile
    shape: dict[str, Any]
    padding: PlanPadding | None
    run_seconds: float
    # which NKI kernel ran (`mxcli.kernels.selection.describe`) and its never-written reads
    nki_kernel: dict[str, Any] | None = None
    uninit_reads: tuple[str, ...] = ()
    # the recorded instruction streams (one per core): re-costed under other figures for the
    # estimate's range and for calibration (`mxcli.kernels.calibrating`), with no second run
    recorders: list[Any] = field(default_factory=list, repr=False)
    calibration: Any = None  # `mxcli.kernels.calibrating.Calibration` the figures came from
    _range: dict[str, Any] | None = field(default=None, repr=False)

    def ranges(self) -> dict[str, Any]:
        """The estimates' ranges over the free figures (`calibrating.profile_ranges`; the
        recorded stream re-scheduled, computed once)."""
        from mxcli.kernels import calibrating

        if self._range is None:
            self._range = calibrating.profile_ranges(self, self.calibration)
        return self._range

    def summary(self, top: int = 10, ranges: bool = True) -> dict[str, Any]:
        """JSON-ready report; with `ranges` (and a recorded stream) each estimate's range
        under ``"range"`` (issue 29 item 5)."""
        out: dict[str, Any] = {"kernel": self.kernel, "shape": self.shape}
        if self.nki_kernel is not None:
            out["nki_kernel"] = self.nki_kernel
        if self.uninit_reads:
            out["uninit_reads"] = list(self.uninit_reads)
        out.update(self.profile.summary(top))
        if self.padding is not None:
            p = self.padding
            out["plan_padding"] = {
                "pairs": p.pairs, "blocks": p.blocks, "block_size": p.block_size,
                "positions": p.positions, "blocks_needed": p.blocks_needed,
                "efficiency": p.efficiency,
            }  # fmt: skip
        out["check_only_run_s"] = round(self.run_seconds, 3)
        if ranges and self.recorders:
            out["range"] = self.ranges()
        return out


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
        B = int(BWD.value(kwargs, "block_size"))
    except (KeyError, ValueError, TypeError):
        return False
    cfg = kwargs.get("config")
    default = cfg is None or cfg == MXFP8MOEBwdConfig.routed(top_k=_top_k(kwargs))
    same = (T, H, I, E, B) == (s.tokens, s.hidden, s.intermediate, s.experts, s.block_size)
    return same and H2 == H and default


def _positive(name: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InputError(f"{name}: expected a positive integer, got {v!r}")


def prefill_inputs(s: PrefillShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """Zero inputs of the prefill kernel at shape `s` (values do not matter in check-only)."""
    for k in ("tokens", "hidden", "experts", "top_k", "n_group", "topk_group"):
        _positive(k, getattr(s, k))
    acts = {a.name.lower(): a for a in RouterActFnType}
    if s.router_act.lower() not in acts:
        raise InputError(
            f"router_act: expected one of {', '.join(sorted(acts))}, got {s.router_act!r}"
        )
    act = acts[s.router_act.lower()]
    # refuse what cannot fit before anything is allocated (make-inputs' estimate, one place)
    check_input_memory(
        f"{s.tokens} tokens x hidden {s.hidden}", prefill_input_bytes(s.tokens, s.hidden, False)
    )
    bf = torch.bfloat16
    tensors = {
        "hidden_states": torch.zeros(1, s.tokens, s.hidden, dtype=bf),
        "gamma": torch.ones(s.hidden, dtype=bf),
        "router_weights": torch.zeros(s.hidden, s.experts, dtype=bf),
        "router_bias": torch.zeros(s.experts, dtype=torch.float32),
    }
    kwargs: dict[str, Any] = {
        "top_k": s.top_k,
        "router_act_fn": act,
        "pack_affinities": bool(s.pack_affinities),
    }
    if act is RouterActFnType.NOAUX_TC:
        kwargs.update(n_group=s.n_group, topk_group=s.topk_group, routed_scaling_factor=2.5)
    return tensors, kwargs


def bwd_inputs(s: BwdShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inputs of the backward kernel at shape `s`: zeros, and a round-robin routing with
    `top_k` distinct experts per token (even expert loads: the padding is the plan's own)."""
    for k in ("tokens", "hidden", "intermediate", "experts", "top_k", "block_size"):
        _positive(k, getattr(s, k))
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


def file_inputs(kernel: str, path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors and kwargs of a ``make-inputs`` file (``.safetensors``) for `kernel`."""
    spec = get_spec(kernel)
    f = read_kernel_file(path)
    if f.kernel not in (None, spec.name):
        raise InputError(f"{f.path}: input file is for {f.kernel}, not {spec.name}")
    tensors = dict(f.tensors)
    spec.check_tensors(tensors, str(f.path))
    kwargs = spec.resolve_kwargs(spec.metadata_kwargs(f.metadata))
    return tensors, kwargs


def _padding(tensors: dict[str, Any], kwargs: dict[str, Any]) -> PlanPadding:
    tpi = torch.as_tensor(tensors["token_position_to_id"]).reshape(-1)
    b2e = torch.as_tensor(tensors["block_to_expert"]).reshape(-1)
    B = int(BWD.value(kwargs, "block_size"))
    valid = tpi.reshape(-1, B) >= 0 if tpi.numel() % B == 0 else None
    pairs = int((tpi >= 0).sum())
    needed = int(valid.any(dim=1).sum()) if valid is not None else int(b2e.numel())
    return PlanPadding(pairs, int(b2e.numel()), B, needed)


def profile_kernel(
    kernel: str,
    tensors: dict[str, Any],
    kwargs: dict[str, Any],
    *,
    lnc: int = 2,
    target: str = "trn3",
    shape: dict[str, Any] | None = None,
    nki_kernel: Any = None,
    calibration: Any = None,
    check_capacity: bool = True,
) -> KernelProfile:
    """Run `kernel` in check-only mode with recording and return its cost-model profile.

    `nki_kernel`: the NKI implementation to profile (``mxcli`` default, ``nkilib``,
    ``MODULE:FUNCTION`` or a `mxcli.kernels.selection.ImplementationChoice`). `check_capacity`:
    False skips the SBUF/PSUM capacity check. `calibration`: a
    `mxcli.kernels.calibrating.Calibration` whose fitted figures replace the table's."""
    import warnings

    from mxcli.kernels import launcher, selection

    if target not in TARGETS:
        raise InputError(f"target: expected trn3 or trn2, got {target!r}")
    if target != "trn3":
        raise InputError(
            "target: both kernels use MX instructions (quantize_mx, nc_matmul_mx), which exist "
            f"on NeuronCore-v4 (trn3) only; got {target}"
        )
    if lnc not in (1, 2):
        raise InputError(f"lnc: expected 1 or 2, got {lnc}")
    spec = get_spec(kernel)
    choice = selection.parse_implementation(nki_kernel, spec)
    if spec is BWD and choice.kind == "nkilib" and _at_aws_shape(tensors, kwargs):
        # AWS's kernel at the shape AWS tuned and measured: with AWS's tuned blocking (its
        # phase-1..4 defaults are one tile per block), the launch AWS's 2.190 ms was timed on
        kwargs = {**kwargs, "config": aws_tuned_config(_top_k(kwargs))}
    t0 = time.perf_counter()
    with trace.recording() as recorders, selection.recording() as launches:
        with warnings.catch_warnings():  # counted per site below instead
            warnings.filterwarnings("ignore", message=".*reads memory never written")
            launcher.launch_sim(
                spec, **tensors, **kwargs, lnc=lnc, check_only=True, implementation=choice,
                check_capacity=check_capacity,
            )  # fmt: skip
    secs = time.perf_counter() - t0
    hw = calibration.hardware(target) if calibration is not None else cost.hardware(target)
    prof = schedule.build_profile(recorders, target, hw, lnc)
    padding = _padding(tensors, kwargs) if spec is BWD else None  # the block plan's padding
    if shape is None:
        shape = {k: list(v.shape) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    info = launches[-1].kernel if launches else selection.describe(choice)
    reads = tuple(str(r) for launch in launches for r in launch.uninit_reads)
    return KernelProfile(
        spec.name, prof, shape, padding, secs, info, reads, list(recorders), calibration
    )


def _sample_bwd_inputs(
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


def _extrapolate(base: Any, steps: list[tuple[Any, float]]) -> Any:
    """``base + sum(w * (sample - base))`` over `steps` ``(sample, w)``, on matching numbers."""
    if isinstance(base, dict):
        return {
            k: _extrapolate(base[k], [(x[k], w) for x, w in steps])
            for k in base
            if all(k in x for x, _ in steps)
        }
    if isinstance(base, (int, float)) and not isinstance(base, bool):
        v = base + sum(w * (x - base) for x, w in steps)
        return int(round(v)) if isinstance(base, int) else float(v)
    return base


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
        tensors, kwargs = _sample_bwd_inputs(s, nb, ne, one)
        runs.append(
            profile_kernel(
                BWD.name,
                tensors,
                kwargs,
                lnc=lnc,
                target=target,
                nki_kernel=nki_kernel,
                calibration=calibration,
            )  # fmt: skip
        )
    plan = bwd_inputs(s)
    pad = _padding(*plan)
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
        "kernel": BWD.name,
        "shape": dict(s.__dict__),
        "target": target,
        "lnc": lnc,
    }
    for k in keys:
        out[k] = _extrapolate(base[k], [(x[k], w) for x, w in steps])
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
