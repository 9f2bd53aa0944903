"""The NKI kernel of ``blockwise_mm_bwd_mxfp8`` on the interpreter (``sim`` backend) vs the
reference.

Contract (issue 8): the backward has no MX-code or index outputs; every output (hidden-state
grad, affinity grad, weight and bias grads, all bf16-rounded) must be within a relative L2 of
1e-3 of the reference. That is the fp32 accumulation-order tolerance: the kernel accumulates
MX matmuls tile by tile in PSUM and sums the affinity grad as a ones-matmul, the reference in
one torch matmul, so a bf16 rounding occasionally lands on the other side (observed ~1e-5).
It is far tighter than the MXFP8 error itself: a wrong quantization group moves results by
~1e-2 (checked below with a deliberately mismatched grouping).

Element by element, every output must also meet the strict tolerance `mxcli verify` applies to
the sim backend (`mxcli.verification.policy`): the outputs downstream of dG/dU (P1 matmul, bf16
rounding, MX quantization) under the tolerance model of `mxcli.verification.mxchain`.
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mxcli import mx
from mxcli.kernels import backends, launcher, nki_runtime
from mxcli.kernels.backends import BackendUnavailableError
from mxcli.kernels.blockwise_moe import SPEC as BWD_SPEC
from mxcli.kernels.blockwise_moe import (
    BwdValidationError,
    ClampLimits,
    MatmulMxfp8KernelConfig,
    MXFP8MOEBwdConfig,
    QuantScheme,
    ScaleLayout,
    SkipMode,
    blockwise_mm_bwd_mxfp8,
    build_block_plan,
    nki_backend,
    prequant,
    prequantize_weights,
)
from mxcli.kernels.blockwise_moe.config import AffinityOption
from mxcli.kernels.blockwise_moe.numerics import silu
from mxcli.kernels.blockwise_moe.upstream_cases import make_upstream_case
from mxcli.nkisim import trace
from mxcli.verification.compare import compare_tensors
from mxcli.verification.policy import tolerance_for
from tests.kernels._nki_helpers import kernel_source_usage, rel_l2

# the one launcher (`mxcli.kernels.launcher`) with this kernel's hooks
launch_sim = functools.partial(launcher.launch_sim, BWD_SPEC)
run_sim = functools.partial(launcher.run_sim, BWD_SPEC)
run_neuron = functools.partial(launcher.run_neuron, BWD_SPEC)

REL_L2 = 1e-3  # fp32 accumulation order (module docstring)
KERNEL_DIR = Path(__file__).parents[2] / "mxcli/kernels/blockwise_moe/nki_kernel"
KERNEL_MODULE = "mxcli.kernels.blockwise_moe.nki_kernel"


def _kernel_modules() -> list[Any]:
    """The interpreter's private copy of the kernel package and of its modules."""
    pkg = nki_runtime.load_kernel_module(KERNEL_MODULE, nki_runtime.SimEngine.INTERPRETER)
    return [m for k, m in sorted(sys.modules.items()) if k.startswith(pkg.__name__)]


def _kernel_attr(name: str) -> Any:
    """The kernel's (private copy's) constant or helper `name`."""
    for m in _kernel_modules():
        if name in vars(m):
            return vars(m)[name]
    raise AssertionError(f"no kernel module binds {name}")


def _patch(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """Rebind `name` in every kernel module that binds it (its own, and those importing it)."""
    hit = [m for m in _kernel_modules() if name in vars(m)]
    assert hit, name
    for m in hit:
        monkeypatch.setattr(m, name, value)


NAMES = ("hidden_states_grad", "affinity_grad", "gate_up_grad", "down_grad", "bias_gu", "bias_d")
OUTPUT_NAMES = BWD_SPEC.outputs


def compare(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float:
    """Shapes and dtypes equal, every output within REL_L2; returns the worst error."""
    assert len(out) == len(ref)
    worst = 0.0
    for name, a, r in zip(NAMES, out, ref, strict=False):
        assert a.shape == r.shape, name
        assert a.dtype == r.dtype, name
        assert torch.isfinite(a.float()).all(), name
        assert r.float().norm() > 0, f"{name}: degenerate case (all-zero reference)"
        err = rel_l2(a, r)
        assert err <= REL_L2, f"{name}: relative L2 {err:.2e} > {REL_L2}"
        out_name = OUTPUT_NAMES[NAMES.index(name)]
        rep = compare_tensors(out_name, a, r, tolerance_for(out_name, "strict"))
        assert rep.passed, f"{name}: {rep.message} ({rep.tolerance})"
        worst = max(worst, err)
    return worst


def case(
    T: int,
    H: int,
    E: int,
    B: int,
    K: int,
    I: int,  # noqa: E741
    **mk: Any,
) -> dict[str, Any]:
    return make_upstream_case(T, H, E, B, K, I, **mk).kwargs()


def both(args: dict[str, Any], cfg: MXFP8MOEBwdConfig, lnc: int) -> tuple[Any, Any]:
    ref = blockwise_mm_bwd_mxfp8(**args, config=cfg)
    out = run_sim(**args, config=cfg, lnc=lnc)
    return out, ref


# -- the simplest complete path and its discrimination --------------------------------------


def test_routed_lnc1_matches_reference() -> None:
    """Routed, on-the-fly quantization, gate/up checkpoint, AFFINITY_ON_I, LNC 1 (T=256,
    H=512, I=256, E=2, B=128, top-1: 3 blocks, the last one pure padding)."""
    args = case(256, 512, 2, 128, 1, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=1)
    out, ref = both(args, cfg, lnc=1)
    compare(out, ref)
    # affinity grad of non-routed (token, expert) pairs is exactly zero (bwd spec §4.3)
    routed = args["expert_affinities_masked"].float() != 0
    assert (out[1].float()[~routed] == 0).all()
    # REL_L2 separates the kernel from anything without the MXFP8 numerics: against the
    # unquantized fp32 reference every output misses by > 10x REL_L2, so a skipped or
    # mis-scaled quantization cannot pass. (A changed wrapX group membership alone moves
    # rel-L2 only by ~1e-4: e4m3 keeps 3 mantissa bits over 17 binades below the group
    # maximum, so grouping shows through subnormals only; see the next test.)
    exact = blockwise_mm_bwd_mxfp8(**args, config=cfg, emulate="exact")
    for name, a, r in zip(NAMES, out, exact, strict=False):
        assert rel_l2(a, r) > 10 * REL_L2, name


def test_wrong_tile_k_changes_results() -> None:
    """Grouping reaches the kernel: with values spread over 2^-20..1 (so subnormals occur),
    the kernel with phase-1 tile_k 256 (H=512 as two 256-chunks) matches the reference with
    the same config, and its affinity-grad bits differ from the default (512) grouping's."""
    args = case(256, 512, 2, 128, 1, 256)
    g = torch.Generator().manual_seed(1)
    spread = 2.0 ** (-20 * torch.rand(256, 512, generator=g))
    dy = args["output_hidden_states_grad"].float() * spread
    args["output_hidden_states_grad"] = dy.to(torch.bfloat16)
    cfg256 = MXFP8MOEBwdConfig.routed(top_k=1, phase1_config=MatmulMxfp8KernelConfig(tile_k=256))
    out256 = run_sim(**args, config=cfg256, lnc=1)
    compare(out256, blockwise_mm_bwd_mxfp8(**args, config=cfg256))
    ref512 = blockwise_mm_bwd_mxfp8(**args, config=MXFP8MOEBwdConfig.routed(top_k=1))
    routed = args["expert_affinities_masked"].float().reshape(-1) != 0
    differ = (ref512[1].reshape(-1) != out256[1].reshape(-1))[routed].float().mean()
    assert differ > 0.005


def test_public_api_dispatches_to_sim() -> None:
    """``blockwise_mm_bwd_mxfp8(..., backend="sim")`` runs this kernel (LNC 2 by default)."""
    assert backends.unavailable_reason("blockwise_mm_bwd_mxfp8", "sim") is None
    args = case(256, 512, 2, 128, 1, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=1)
    out = blockwise_mm_bwd_mxfp8(**args, config=cfg, backend="sim")
    compare(out, blockwise_mm_bwd_mxfp8(**args, config=cfg))


# -- the other configuration options --------------------------------------------------------


def test_lnc2_topk2_accumulate_bias_clamps() -> None:
    """LNC 2 (SHARD_ON_FREE), top-2 with hidden-grad read-add-write, bias grads, both clamp
    masks (the checkpoint is clamped, so many values sit exactly on a limit), B=256."""
    cl = ClampLimits(-1.0, 1.0, -0.5, 0.5)
    args = case(256, 512, 2, 256, 2, 256, bias=True, clamp_limits=cl)
    cfg = MXFP8MOEBwdConfig.routed(top_k=2, bias=True, clamp_limits=cl)
    out, ref = both(args, cfg, lnc=2)
    assert len(out) == 6
    compare(out, ref)
    ckpt = args["gate_up_proj_act_checkpoint_T"]
    assert (ckpt[:, 0] == 1.0).any() and (ckpt[:, 1] == 0.5).any()  # masks are exercised


@pytest.mark.parametrize("packed", [True, False])
def test_prequantized_weights(packed: bool) -> None:
    """Pre-quantized x4 weights with packed / unpacked scales (bwd spec §5.5); H=640 and
    I=384 give 512+128 and 512+256 wrapX remainders."""
    args = case(128, 640, 2, 128, 1, 384)
    pc = lambda: MatmulMxfp8KernelConfig(enable_scale_packing=packed)  # noqa: E731
    cfg = MXFP8MOEBwdConfig.routed(top_k=1, phase1_config=pc(), phase2_config=pc())
    pq = prequantize_weights(args["gate_up_proj_weight"], args["down_proj_weight"], config=cfg)
    args.update(pq.as_kwargs())
    assert args["gate_up_proj_weight"].dtype == torch.uint32
    out, ref = both(args, cfg, lnc=2 if packed else 1)
    compare(out, ref)


def test_packed_scales_off_512_boundary_move_to_data_quadrant() -> None:
    """Packed pre-quantized scales of chunks that do not start on a 512 boundary (H=384: a
    128-chunk at 256; phase-2 tile_k 256: chunks at 256 and 768 of 2I=1024) sit one to three
    quadrants below their data in HBM; the launcher plans copies into the data's quadrant and
    the results match the reference, LNC 2. (The placement itself is checked lane by lane
    against the layout in the next test.)"""
    args = case(128, 384, 2, 128, 1, 512)
    cfg = MXFP8MOEBwdConfig.routed(
        top_k=1,
        phase1_config=MatmulMxfp8KernelConfig(enable_scale_packing=True),
        phase2_config=MatmulMxfp8KernelConfig(tile_k=256, enable_scale_packing=True),
    )
    pq = prequantize_weights(args["gate_up_proj_weight"], args["down_proj_weight"], config=cfg)
    args.update(pq.as_kwargs())
    kw, _ = nki_backend.prepare(**args, config=cfg)
    fields = dict(kw["config"].fields)
    assert fields["d_place"] == ((0, 0, -1), (1, 0, 64))  # (slot, start, HBM row)
    assert sum(row >= 0 for _, _, row in fields["gu_place"]) == 2
    out, ref = both(args, cfg, lnc=2)
    compare(out, ref)


@pytest.mark.parametrize(
    "K, tile_k", [(384, 512), (896, 512), (1024, 256), (640, 128), (4096, 512)]
)
def test_packed_scale_placement_matches_layout(K: int, tile_k: int) -> None:
    """Independent oracle: for every chunk and lane, the HBM row the kernel reads (through the
    planned group slot or quadrant copy) is the packed row of that lane's MX group
    (`prequant.scale_row_index`), and the scale tile starts at partition 0/4/8/12 of the data's
    first quadrant, the MX matmul's rule."""
    chunks = tuple(mx.wrapx_chunks(K, tile_k))
    groups, place = nki_backend.packed_scale_placement(chunks)
    rows = prequant.scale_row_index(K, ScaleLayout.PACKED)
    for (k0, c), (slot, start, row) in zip(chunks, place, strict=True):
        assert start in (0, 4, 8, 12)
        for p in range(c // 4):
            part = start + 32 * (p // 32) + (p % 32) // 8
            hbm = groups[slot] * 128 + part if row < 0 else row + part - start
            assert hbm == int(rows[k0 // 32 + p // 8]), (k0, c, p)


def test_dma_runs() -> None:
    """Full 128-lane chunks with contiguous rows share one DMA; remainders stand alone."""
    assert nki_backend.dma_runs(((0, 512), (512, 512), (1024, 256), (1280, 128))) == (
        (0, 2),
        (2, 1),
        (3, 1),
    )
    assert nki_backend.dma_runs(((0, 384), (384, 512))) == ((0, 1), (1, 1))


def _weight_grad_rows_read(args: dict[str, Any], cfg: MXFP8MOEBwdConfig, lnc: int) -> int:
    """Rows the kernel's DMAs read from the two weight-gradient outputs (check-only run)."""
    from mxcli.nkisim import trace

    with trace.recording() as recorders:
        launch_sim(**args, config=cfg, lnc=lnc, check_only=True)
    names = ("gate_up_proj_weight_grad", "down_proj_weight_grad")
    rows = 0
    for rec in recorders:
        for ins in rec.instrs:
            if ins.op != "dma_copy":
                continue
            for o in ins.operands:
                if o.tensor in names and not o.write and o.name == "src":
                    rows += o.rows
    return rows


def test_expert_blocks_apart_and_an_expert_without_blocks() -> None:
    """The weight grads of a plan whose expert blocks are not consecutive ([e0, e1, e0, e1,
    e1 (padding)]) and a third expert without any block: each expert's first block writes
    without reading, later blocks read back what the earlier ones wrote, and the unused
    expert's grads are zeroed at the end. Against the reference, with the unused expert's
    grads exactly 0, and the read-modify-write reads counted: only the three later blocks
    read, 2H + I rows each (LNC 1: phase 3 reads H rows for each of the gate and up column
    groups, I = 256 wide, phase 4 I rows for the one 512-column group of H), nothing for the
    first blocks (block 0 issues no read, block 1's reads skip every row)."""
    T, H, I, B = 256, 512, 256, 128  # noqa: E741
    args = case(T, H, 2, B, 2, I)
    assert args["block_to_expert"].flatten().tolist() == [0, 0, 1, 1, 1]
    perm = torch.tensor([0, 2, 1, 4, 3])
    args["block_to_expert"] = args["block_to_expert"][perm].contiguous()
    tpi = args["token_position_to_id"].reshape(5, B)[perm].reshape(-1).contiguous()
    args["token_position_to_id"] = tpi
    ck = args["gate_up_proj_act_checkpoint_T"]
    args["gate_up_proj_act_checkpoint_T"] = ck[perm].contiguous()
    # a third expert with weights but no routed token
    for k in ("gate_up_proj_weight", "down_proj_weight"):
        w = args[k]
        args[k] = torch.cat([w, w[:1].flip(-1)]).contiguous()
    ea = args["expert_affinities_masked"].reshape(T, 2)
    zero_col = torch.zeros(T, 1, dtype=ea.dtype)
    args["expert_affinities_masked"] = torch.cat([ea, zero_col], 1).reshape(-1, 1)
    cfg = MXFP8MOEBwdConfig.routed(top_k=2)
    out, ref = both(args, cfg, lnc=2)
    compare(out, ref)
    assert (out[2][2] == 0).all() and (out[3][2] == 0).all()
    assert (out[2][0] != 0).any() and (out[3][1] != 0).any()
    assert _weight_grad_rows_read(args, cfg, lnc=1) == 3 * (2 * H + I)


def test_affinity_offsets_reach_last_expert_and_skip_padding() -> None:
    """E=3, top-2, B=128: affinity-grad entries ``t*E + e`` are computed on the device as an
    fp32 multiply then an int32 add (tensor_scalar operands are fp32); every routed entry of
    every expert (including the last, where padding gives ``-E + E-1 = -1``) matches the
    reference and every non-routed one stays exactly 0."""
    args = case(128, 256, 3, 128, 2, 128)
    cfg = MXFP8MOEBwdConfig.routed(top_k=2)
    out, ref = both(args, cfg, lnc=1)
    compare(out, ref)
    routed = args["expert_affinities_masked"].float().reshape(-1) != 0
    assert routed.reshape(128, 3)[:, 2].any()
    assert (out[1].float().reshape(-1)[~routed] == 0).all()


def test_dense_with_token_count() -> None:
    """single_expert_dense with num_valid_tokens: rows past the count are padding (zero grads,
    the reference's choice for the UNDEFINED rows), weight grads exclude them."""
    args = case(512, 512, 1, 256, 1, 256, dense=True)
    args["num_valid_tokens"] = torch.tensor([300], dtype=torch.int32)
    cfg = MXFP8MOEBwdConfig()
    out, ref = both(args, cfg, lnc=2)
    compare(out, ref)
    assert (out[0][300:] == 0).all() and (out[1][300:] == 0).all()


def test_dense_full() -> None:
    """single_expert_dense without a count: contiguous loads, weights quantized once, block 0
    writes the weight grads."""
    args = case(512, 512, 1, 256, 1, 256, dense=True)
    out, ref = both(args, MXFP8MOEBwdConfig(), lnc=1)
    compare(out, ref)


def test_optional_checkpoints_fp16_and_fp32_affinities() -> None:
    """gate_act / intermediate / scaled_intermediate checkpoints are used as given (the scaled
    one deliberately differs from Hm*alpha); fp16 activations and fp32 affinities keep their
    dtypes; B=256 > T=128."""
    args = case(128, 512, 1, 256, 1, 256)
    c = args["gate_up_proj_act_checkpoint_T"].float()
    hm = silu(c[:, 0]) * c[:, 1]
    args["gate_act_checkpoint_T"] = silu(c[:, 0]).to(torch.bfloat16)
    args["intermediate_checkpoint_T"] = hm.to(torch.bfloat16)
    args["scaled_intermediate_checkpoint_T"] = (hm * 0.5).to(torch.bfloat16)
    args["hidden_states"] = args["hidden_states"].half()
    args["output_hidden_states_grad"] = args["output_hidden_states_grad"].half()
    args["expert_affinities_masked"] = args["expert_affinities_masked"].float()
    out, ref = both(args, MXFP8MOEBwdConfig.routed(top_k=1), lnc=1)
    assert out[0].dtype == torch.float16 and out[1].dtype == torch.float32
    compare(out, ref)


def test_remainder_chunks_odd_tile_split() -> None:
    """H = I = 384 (wrapX 256+128 chunks), B=512, top-2, LNC 2 (odd tile counts: the two
    cores get 2 and 1 tiles of I and of H)."""
    args = case(256, 384, 2, 512, 2, 384)
    out, ref = both(args, MXFP8MOEBwdConfig.routed(top_k=2), lnc=2)
    compare(out, ref)


@pytest.mark.parametrize("prequantized", [False, True])
def test_streamed_weights(monkeypatch: pytest.MonkeyPatch, prequantized: bool) -> None:
    """With no SBUF budget for resident weights or phase-3/4 stationary operands, the quantized
    weights are spilled to the HBM scratch (or read from the pre-quantized inputs) and streamed
    per window, and X / S are loaded per output tile; same results."""
    _patch(monkeypatch, "RESIDENT_BUDGET", 0)
    _patch(monkeypatch, "STATIONARY_BUDGET", 0)
    args = case(256, 512, 2, 256, 2, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=2)
    if prequantized:
        pq = prequantize_weights(args["gate_up_proj_weight"], args["down_proj_weight"], config=cfg)
        args.update(pq.as_kwargs())
    out, ref = both(args, cfg, lnc=2)
    compare(out, ref)


def test_streamed_gate_up_quantized_per_column_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed (not resident) W_gu of a routed launch is quantized on chip per phase-2
    column group from its DMA transpose, with no HBM scratch in between: two 512-token windows
    and two column groups per core (H=2048, LNC 2), three experts' blocks; bit-exact to the
    reference, and the kernel allocates no quantized-W_gu scratch."""
    _patch(monkeypatch, "RESIDENT_BUDGET", 0)
    args = case(512, 2048, 3, 1024, 2, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=2)
    scratch: list[str] = []
    real = _kernel_attr("_scratch_operand")
    _patch(
        monkeypatch,
        "_scratch_operand",
        lambda *a: scratch.append(a[-1]) or real(*a),  # type: ignore[func-returns-value]
    )
    out, ref = both(args, cfg, lnc=2)
    compare(out, ref)
    assert "wdq" in scratch and "wguq" not in scratch


@pytest.mark.parametrize(
    "plan",
    ["late_x", "late_x_no_overlap", "rows_ahead_no_pipeline"],
)
def test_sbuf_saving_plans_change_no_output_byte(
    monkeypatch: pytest.MonkeyPatch, plan: str
) -> None:
    """The SBUF-saving plans AWS's shape takes (`SBUF_BUDGET`), at a small shape: phase 3's X
    rows of window w+1 gathered after window w's are last read instead of with its phase-2
    loads (with and without block overlap), and phase 1's dY rows gathered two windows ahead
    without the operands' one-window pipeline. Four 512-token windows, routed: outputs equal,
    byte for byte, to the default plan's (only buffer lifetimes and instruction order change),
    and the plan ran (later windows' phase-2 loads without X rows; phase 1's rows two ahead)."""
    args = case(2048, 512, 1, 2048, 1, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=1)
    if plan == "late_x_no_overlap":
        _patch(monkeypatch, "OVERLAP_BUDGET", 0)
        _patch(monkeypatch, "OVERLAP4_BUDGET", 0)
    default = run_sim(**args, config=cfg, lnc=2)
    with_x: list[tuple[int, bool]] = []
    depth: list[tuple[bool, int]] = []
    if plan == "rows_ahead_no_pipeline":
        _patch(monkeypatch, "_pipeline_depth", lambda *a: depth.append((False, 2)) or (False, 2))
    else:
        _patch(monkeypatch, "X_AHEAD_BUDGET", 0)
        real = _kernel_attr("_phase2_loads")
        _patch(
            monkeypatch,
            "_phase2_loads",
            lambda *a: with_x.append((a[5], a[6])) or real(*a),  # type: ignore[func-returns-value]
        )
    out = run_sim(**args, config=cfg, lnc=2)
    for name, a, d in zip(NAMES, out, default, strict=False):
        assert a.dtype == d.dtype and torch.equal(a, d), name
    compare(out, blockwise_mm_bwd_mxfp8(**args, config=cfg))
    if plan == "rows_ahead_no_pipeline":
        assert depth
    else:
        assert {w for w, x in with_x if not x} == {1, 2, 3}
        assert all(x for w, x in with_x if w == 0)


def _sbuf_budget() -> int:
    return int(_kernel_attr("SBUF_BUDGET"))


def test_kernel_package_loads_privately_module_by_module() -> None:
    """The interpreter's private copy of the kernel package holds every module of the package
    (its relative imports are loaded privately too), each importing the interpreter as
    ``nki``; the public package's modules stay unimported (they would need a real ``nki``)."""
    from mxcli import nkisim

    mods = {m.__name__.rpartition(".")[2]: m for m in _kernel_modules()}
    assert {p.stem for p in KERNEL_DIR.glob("*.py")} - {"__init__"} <= set(mods)
    shim = nkisim.shim_modules()
    for name, m in mods.items():
        assert m.__name__.startswith(f"{KERNEL_MODULE}.__nkisim__"), name
        if "nl" in vars(m):
            assert vars(m)["nl"] is shim["nki.language"], name
        if "nisa" in vars(m):
            assert vars(m)["nisa"] is shim["nki.isa"], name
    assert f"{KERNEL_MODULE}.plan" not in sys.modules


def test_sbuf_budget_is_aws_margin() -> None:
    """The kernel plans to AWS's margin (212472 B per partition, below Trn3's 245752)."""
    assert _sbuf_budget() == 212472


@pytest.mark.parametrize(
    "shape",
    [
        # AWS's tuned shape: H 4096, I 1536, one block of B = T = 4096 tokens, one expert
        pytest.param((4096, 4096, 1536, 1, 1, 4096, 1), id="aws"),
        # the README's shapes (scripts/bench_nki.py), as its profile samples them: 2 blocks
        pytest.param((4096, 2048, 768, 2, 8, 512, 2), id="qwen3-b512", marks=pytest.mark.slow),
        pytest.param((4096, 2048, 768, 2, 8, 1024, 2), id="qwen3-b1024", marks=pytest.mark.slow),
        pytest.param((4096, 7168, 2048, 2, 2, 512, 2), id="deepseek-b512", marks=pytest.mark.slow),
        pytest.param(
            (4096, 7168, 2048, 2, 2, 1024, 2), id="deepseek-b1024", marks=pytest.mark.slow
        ),
    ],
)
def test_peak_sbuf_within_aws_margin(shape: tuple[int, ...]) -> None:
    """Check-only at LNC 2: every program's SBUF peak stays within `SBUF_BUDGET`, AWS's own
    backward's margin (at AWS's shape the kernel used to peak at 240392 B)."""
    from mxcli.kernels.blockwise_moe import profile as prof

    T, H, I, E, K, B, nb = shape  # noqa: E741
    tensors, kwargs = prof.sample_inputs(prof.BwdShape(T, H, I, E, K, B), nb, E)
    res = launch_sim(**tensors, **kwargs, lnc=2, check_only=True)
    budget = _sbuf_budget()
    for prog in res.report.programs:
        assert 0 < prog.peak_sbuf_bytes <= budget


def _mx_matmuls(fns: tuple[str, ...], recorders: list[Any]) -> int:
    """MX matmuls recorded at the source lines of the kernel functions `fns`."""
    sites = set()
    for fn in fns:
        f = _kernel_attr(fn)
        lines, first = inspect.getsourcelines(f)
        name = Path(inspect.getsourcefile(f) or "?").name
        sites |= {f"{name}:{first + k}" for k in range(len(lines))}
    return sum(
        1 for r in recorders for i in r.instrs
        if i.op == "nc_matmul_mx" and i.source.rsplit("/", 1)[-1] in sites
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["routed", "dense"])
def test_phases34_row_by_row(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Without block overlap and with the moving operands on chip, phases 3/4 compute a whole
    output row tile before one read-modify-write (`_phase34_rows`): routed top-2 with several
    blocks per expert (the later ones read the old rows), and dense (block 0 writes, later
    blocks read back); bit-exact to the reference, and every phase-3/4 matmul of the tile-by-
    tile path ran in the row path instead."""
    if mode == "dense":
        args, cfg = case(512, 1024, 1, 256, 1, 256, dense=True), MXFP8MOEBwdConfig()
    else:
        args, cfg = case(512, 1024, 2, 256, 2, 384), MXFP8MOEBwdConfig.routed(top_k=2)
    with trace.recording() as tiles_rec:  # default budgets: blocks overlap, tile by tile
        run_sim(**args, config=cfg, lnc=2)
    _patch(monkeypatch, "OVERLAP_BUDGET", 0)
    _patch(monkeypatch, "OVERLAP4_BUDGET", 0)
    ref = blockwise_mm_bwd_mxfp8(**args, config=cfg)
    with trace.recording() as rows_rec:
        out = run_sim(**args, config=cfg, lnc=2)
    compare(out, ref)
    per_tile = _mx_matmuls(("_phase3", "_phase4"), tiles_rec)
    assert per_tile > 0 and _mx_matmuls(("_phase34_rows",), rows_rec) == per_tile
    assert _mx_matmuls(("_phase3", "_phase4"), rows_rec) == 0


# -- validation -------------------------------------------------------------------------------


def test_padding_without_skip_token_is_rejected() -> None:
    args = case(256, 512, 2, 128, 1, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=1, skip_dma=SkipMode(skip_token=False))
    with pytest.raises(BwdValidationError, match="skip_token"):
        run_sim(**args, config=cfg)


def test_bad_expert_id_and_shape_are_rejected() -> None:
    args = case(256, 512, 2, 128, 1, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=1)
    bad = dict(args, block_to_expert=torch.full_like(args["block_to_expert"], 2))
    with pytest.raises(BwdValidationError, match="block_to_expert"):
        run_sim(**bad, config=cfg)
    bad = dict(args, output_hidden_states_grad=args["output_hidden_states_grad"][:, :256])
    with pytest.raises(BwdValidationError, match="output_hidden_states_grad: expected shape"):
        run_sim(**bad, config=cfg)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"quant_scheme": QuantScheme.MX1X32}, "WRAPX"),
        ({"affinity_option": AffinityOption.AFFINITY_ON_H}, "AFFINITY_ON_I"),
    ],
)
def test_unimplemented_options_are_named(override: dict[str, Any], match: str) -> None:
    """Options the reference has but this kernel does not raise a one-line ValueError."""
    args = case(256, 512, 2, 128, 1, 256)
    cfg = MXFP8MOEBwdConfig.routed(top_k=1, **override)
    with pytest.raises(ValueError, match=match):
        run_sim(**args, config=cfg, lnc=1)


def test_missing_checkpoint_is_named() -> None:
    args = case(256, 512, 2, 128, 1, 256)
    args["gate_up_proj_act_checkpoint_T"] = None
    c = make_upstream_case(256, 512, 2, 128, 1, 256).gate_up_proj_act_checkpoint_T
    args["gate_act_checkpoint_T"] = c[:, 0]
    args["intermediate_checkpoint_T"] = c[:, 1]
    with pytest.raises(ValueError, match="gate_up_proj_act_checkpoint_T"):
        run_sim(**args, config=MXFP8MOEBwdConfig.routed(top_k=1), lnc=1)


def test_neuron_backend_lists_what_is_missing() -> None:
    if nki_runtime.neuron_unavailable_reason() is None:  # pragma: no cover - Trainium host
        pytest.skip("a Neuron device is present")
    args = case(256, 512, 2, 128, 1, 256)
    with pytest.raises(BackendUnavailableError, match="missing .*Neuron device"):
        run_neuron(**args, config=MXFP8MOEBwdConfig.routed(top_k=1))


def test_kernel_source_is_plain_nki() -> None:
    """The kernel imports the real NKI modules (never the interpreter) and calls only ISA ops
    of the api spec §10 checklist for the MoE backward."""
    imported: set[str] = set()
    used: set[str] = set()
    for path in sorted(KERNEL_DIR.glob("*.py")):
        got = kernel_source_usage(path)
        imported |= got[0]
        used |= got[1]
    assert {"nki", "nki.isa", "nki.language"} <= imported
    assert not any("nkisim" in m for m in imported)
    allowed = {
        "dma_copy", "nc_transpose", "tensor_copy", "tensor_tensor", "tensor_scalar",
        "scalar_tensor_tensor", "tensor_reduce", "activation", "memset", "iota",
        "core_barrier", "quantize_mx", "nc_matmul_mx", "nc_matmul", "oob_mode", "dma_transpose",
        "engine",  # the enum: PSUM evictions on ScalarE (tensor_copy engine=engine.scalar)
        "dge_mode",  # hardware-DGE loads / stores on the sync and scalar queues (§10 checklist)
    }  # fmt: skip
    assert used <= allowed, used - allowed
    assert {"quantize_mx", "nc_matmul_mx", "nc_transpose", "core_barrier"} <= used


# -- NKI 0.6 front end --------------------------------------------------------------------------


def _prequant(args: dict[str, Any], cfg: MXFP8MOEBwdConfig) -> dict[str, Any]:
    pq = prequantize_weights(args["gate_up_proj_weight"], args["down_proj_weight"], config=cfg)
    return dict(args, **pq.as_kwargs())


def _frontend_cases() -> dict[str, tuple[dict[str, Any], MXFP8MOEBwdConfig]]:
    """Every shape and configuration the tests of this module run the kernel at (the slow
    ones included, as check-only launches are cheap)."""
    r = MXFP8MOEBwdConfig.routed
    mk = MatmulMxfp8KernelConfig
    cl = ClampLimits(-1.0, 1.0, -0.5, 0.5)
    c = case(128, 512, 1, 256, 1, 256)
    ckpts = dict(
        c, gate_act_checkpoint_T=c["gate_up_proj_act_checkpoint_T"][:, 0],
        intermediate_checkpoint_T=c["gate_up_proj_act_checkpoint_T"][:, 1],
        scaled_intermediate_checkpoint_T=c["gate_up_proj_act_checkpoint_T"][:, 1],
    )  # fmt: skip
    pk = r(top_k=1, phase1_config=mk(enable_scale_packing=True), phase2_config=mk(tile_k=256, enable_scale_packing=True))  # fmt: skip
    unpk = r(top_k=1, phase1_config=mk(), phase2_config=mk())
    fast = r(top_k=2, fast_dma_transpose=True, phase2_config=mk(tile_k=256), phase3_config=mk(tile_k=128), phase4_config=mk(tile_k=256))  # fmt: skip
    nv = dict(case(512, 512, 1, 256, 1, 256, dense=True), num_valid_tokens=300)
    return {
        "routed": (case(256, 512, 2, 128, 1, 256), r(top_k=1)),
        "tile_k_256": (case(256, 512, 2, 128, 1, 256), r(top_k=1, phase1_config=mk(tile_k=256))),
        "top2_bias_clamp": (
            case(256, 512, 2, 256, 2, 256, bias=True, clamp_limits=cl),
            r(top_k=2, bias=True, clamp_limits=cl),
        ),
        "prequant_unpacked": (_prequant(case(128, 640, 2, 128, 1, 384), unpk), unpk),
        "prequant_packed_off_512": (_prequant(case(128, 384, 2, 128, 1, 512), pk), pk),
        "dense_token_count": (nv, MXFP8MOEBwdConfig()),
        "dense": (case(512, 512, 1, 256, 1, 256, dense=True), MXFP8MOEBwdConfig()),
        "optional_checkpoints": (ckpts, r(top_k=1)),
        "remainders": (case(256, 384, 2, 512, 2, 384), r(top_k=2)),
        "three_experts": (case(128, 256, 3, 128, 2, 128), r(top_k=2)),
        "fast_dma_tile_k_mix": (case(512, 896, 2, 1024, 2, 256), fast),
        "upstream_4experts": (case(1024, 1024, 4, 512, 4, 256), r(top_k=4)),
        "upstream_bias": (case(1024, 2048, 2, 256, 2, 128, bias=True), r(top_k=2, bias=True)),
        "upstream_1expert": (case(512, 1024, 1, 512, 1, 384), r(top_k=1)),
    }


FRONTEND_CASES = _frontend_cases()


def _as_kernel_arguments(kw: dict[str, Any]) -> dict[str, Any]:
    """The launcher's kernel kwargs as the interpreter receives them (NumPy arrays, the
    kernel's own `BwdKernelConfig` instance with interpreter dtypes)."""
    from mxcli.nkisim.nki import language

    out: dict[str, Any] = {}
    for k, v in kw.items():
        if isinstance(v, nki_runtime.KernelObject):
            cls = nki_runtime.resolve_kernel(v.cls, nki_runtime.SimEngine.INTERPRETER)
            fields = {
                f: getattr(language, x.name) if isinstance(x, nki_runtime.DTypeName) else x
                for f, x in v.fields
            }
            out[k] = cls(**fields)
        elif isinstance(v, torch.Tensor):
            out[k] = nki_runtime.to_numpy(v)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("name", sorted(FRONTEND_CASES))
def test_kernel_passes_nki_frontend(name: str, lnc: int) -> None:
    """Issue 11: at every tested shape and configuration, what the kernel reaches is inside
    the NKI 0.6 subset together with the launch's real arguments (`check_frontend`, no
    violation), and a check-only launch at that LNC passes every interpreter rule."""
    from mxcli import nkisim

    args, cfg = FRONTEND_CASES[name]
    kern = nki_runtime.resolve_kernel(
        "mxcli.kernels.blockwise_moe.nki_kernel:blockwise_mm_bwd_mxfp8_jit",
        nki_runtime.SimEngine.INTERPRETER,
    )
    kw, _ = nki_backend.prepare(**args, config=cfg)
    assert nkisim.check_frontend(kern, (), _as_kernel_arguments(kw)) == ()
    res = launch_sim(**args, config=cfg, lnc=lnc, check_only=True)
    assert res.report.counters.mx_matmul_flops > 0


def test_frontend_check_sees_the_public_config() -> None:
    """The check is not vacuous: the public config (torch dtypes, host-side methods) passed
    straight to the kernel is rejected, naming the torch/numpy rule."""
    from mxcli import nkisim

    args, cfg = FRONTEND_CASES["routed"]
    kern = nki_runtime.resolve_kernel(
        "mxcli.kernels.blockwise_moe.nki_kernel:blockwise_mm_bwd_mxfp8_jit",
        nki_runtime.SimEngine.INTERPRETER,
    )
    kw, _ = nki_backend.prepare(**args, config=cfg)
    kw = _as_kernel_arguments(kw)
    kw["config"] = cfg
    rules = {v.rule for v in nkisim.check_frontend(kern, (), kw)}
    assert nkisim.Rule.TORCH_NUMPY in rules


# -- check-only mode ---------------------------------------------------------------------------


def _zero_case(T: int, H: int, I: int, B: int, E: int, K: int) -> dict[str, Any]:  # noqa: E741
    """Shape-only inputs for check-only runs (values are not computed there)."""
    g = torch.Generator().manual_seed(0)
    choices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    tpi, b2e = build_block_plan(choices, E, B)
    N = b2e.shape[0]
    z = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
    return dict(
        hidden_states=z(T, H), expert_affinities_masked=z(T * E, 1),
        gate_up_proj_weight=z(E, H, 2, I), down_proj_weight=z(E, I, H),
        token_position_to_id=tpi, block_to_expert=b2e, output_hidden_states_grad=z(T, H),
        block_size=B, gate_up_proj_act_checkpoint_T=z(N, 2, I, B),
    )  # fmt: skip


def test_check_only_medium_shape_counts() -> None:
    """Check-only mode (every rule, SBUF/PSUM capacity) at H=1024, I=512, B=1024, E=4: the
    counters equal the kernel's compulsory MX work (2*B*H*I per phase and block, 4 phases)."""
    T, H, I, B, E, K = 512, 1024, 512, 1024, 4, 2  # noqa: E741
    args = _zero_case(T, H, I, B, E, K)
    res = launch_sim(**args, config=MXFP8MOEBwdConfig.routed(top_k=K), lnc=2, check_only=True)
    c = res.report.counters
    N = args["block_to_expert"].shape[0]
    # P1: B*H*I, P2: B*2I*H, P3: B*H*2I, P4: B*I*H multiply-adds per block
    assert c.mx_matmul_flops == N * 2 * 6 * B * H * I
    assert 0 < c.peak_sbuf_bytes <= 245752 and 0 < c.peak_psum_bytes <= 16384


@pytest.mark.slow
@pytest.mark.parametrize("lnc", [2, 1])
def test_check_only_production_shape(lnc: int) -> None:
    """Issue 8: check-only at the spec's largest backward shape, H=4096, I=1536, B=4096, E=16
    (T=4096, top-2: 17 blocks), within the Trn3 SBUF and PSUM budgets."""
    T, H, I, B, E, K = 4096, 4096, 1536, 4096, 16, 2  # noqa: E741
    args = _zero_case(T, H, I, B, E, K)
    res = launch_sim(**args, config=MXFP8MOEBwdConfig.routed(top_k=K), lnc=lnc, check_only=True)
    c = res.report.counters
    assert c.mx_matmul_flops == 17 * 2 * 6 * B * H * I
    for prog in res.report.programs:
        assert prog.peak_sbuf_bytes <= 245752 and prog.peak_psum_bytes <= 16384


@pytest.mark.slow
def test_check_only_deepseek_width_full_block() -> None:
    """Check-only at DeepSeek-V3's expert width with one full 4096-token block per expert (H=7168,
    I=2048, B=4096, E=2, top-1, LNC 2): a streamed W_gu and X too large to stay on chip beside
    it fit the Trn3 SBUF (this shape used to exceed it by 74 KB)."""
    T, H, I, B, E, K = 4096, 7168, 2048, 4096, 2, 1  # noqa: E741
    args = _zero_case(T, H, I, B, E, K)
    res = launch_sim(**args, config=MXFP8MOEBwdConfig.routed(top_k=K), lnc=2, check_only=True)
    N = args["block_to_expert"].shape[0]
    assert res.report.counters.mx_matmul_flops == N * 2 * 6 * B * H * I
    for prog in res.report.programs:
        assert prog.peak_sbuf_bytes <= 245752 and prog.peak_psum_bytes <= 16384


# -- wider numerics (slow) ---------------------------------------------------------------------


@pytest.mark.slow
def test_fast_dma_transpose_and_tile_k_mix() -> None:
    """Errata 1 (H=896: the last 384 rows of phase 1 are one 384-chunk) with per-phase tile_k
    256/128/256, B=1024 (two 512-token windows), top-2."""
    t = lambda k: MatmulMxfp8KernelConfig(tile_k=k)  # noqa: E731
    cfg = MXFP8MOEBwdConfig.routed(
        top_k=2, fast_dma_transpose=True, phase2_config=t(256), phase3_config=t(128),
        phase4_config=t(256),
    )  # fmt: skip
    args = case(512, 896, 2, 1024, 2, 256)
    out, ref = both(args, cfg, lnc=1)
    compare(out, ref)
    plain = blockwise_mm_bwd_mxfp8(**args, config=MXFP8MOEBwdConfig.routed(top_k=2))
    assert not torch.equal(plain[0], ref[0])  # the 384-chunk grouping is really different


@pytest.mark.slow
@pytest.mark.parametrize(
    "T, H, E, B, K, I, bias",
    [
        (1024, 1024, 4, 512, 4, 256, False),
        (1024, 2048, 2, 256, 2, 128, True),
        (512, 1024, 1, 512, 1, 384, False),
    ],
)
def test_upstream_table_shapes(T: int, H: int, E: int, B: int, K: int, I: int, bias: bool) -> None:  # noqa: E741
    """Shapes from the upstream baseline table (bwd spec §11.4), LNC 2."""
    args = case(T, H, E, B, K, I, bias=bias)
    out, ref = both(args, MXFP8MOEBwdConfig.routed(top_k=K, bias=bias), lnc=2)
    compare(out, ref)
