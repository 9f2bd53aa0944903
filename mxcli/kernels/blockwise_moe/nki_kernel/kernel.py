"""The jit entry of ``blockwise_mm_bwd_mxfp8``'s NKI kernel: setup, then the blocks one after
the other, block b+1's indices, prologue and phase 1 overlapping block b's phases 3/4 (package
docstring).
"""

from __future__ import annotations

from typing import Any

import nki
import nki.language as nl

from .alloc import (
    _alloc_outputs,
    _alloc_scratch,
    _block_tensors,
    _constants,
    _init_outputs,
    _zero_unused_experts,
)
from .indices import _setup_indices
from .phase1 import _block_phase1, _prologue
from .phase2 import _block_phase2
from .phase34 import _phase3, _phase4, _write_bias
from .plan import BwdKernelConfig, _geometry
from .state import LaunchTensors
from .weights import _quantize_weights


def blockwise_mm_bwd_mxfp8_nki(
    hidden_states: Any,
    expert_affinities_masked: Any,
    gate_up_proj_weight: Any,
    down_proj_weight: Any,
    token_position_to_id: Any,
    block_to_expert: Any,
    output_hidden_states_grad: Any,
    gate_up_proj_act_checkpoint_T: Any,
    config: BwdKernelConfig,
    gate_act_checkpoint_T: Any = None,
    intermediate_checkpoint_T: Any = None,
    scaled_intermediate_checkpoint_T: Any = None,
    gate_up_weight_scales: Any = None,
    down_weight_scales: Any = None,
    num_valid_tokens: Any = None,
) -> tuple[Any, ...]:
    """The NKI kernel. Tensors are HBM tensors in the API reference's layouts (bwd spec §0
    G4; MX data as uint32 x4 words / uint8 scales); `config` is the launcher's plan
    (`nki_backend.kernel_config`), which also did every input check of bwd spec §10. Returns
    the gradient tuple of the API reference (bias grads appended when ``config.bias``)."""
    cfg = config
    assert tuple(hidden_states.shape) == (cfg.T, cfg.H), "hidden_states: shape differs from config"
    assert tuple(gate_up_proj_act_checkpoint_T.shape) == (cfg.N, 2, cfg.I, cfg.B), (
        "gate_up_proj_act_checkpoint_T: shape differs from config"
    )
    assert cfg.pq_d == (down_weight_scales is not None), "down_weight_scales: config mismatch"
    assert cfg.pq_gu == (gate_up_weight_scales is not None), "gate_up_weight_scales: mismatch"
    assert cfg.nv == (num_valid_tokens is not None), "num_valid_tokens: config mismatch"
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    assert lnc == 1 or lnc == 2, "launch: LNC 1 or 2"
    geo = _geometry(cfg, lnc, pid)
    t = LaunchTensors(
        hidden_states=hidden_states,
        expert_affinities_masked=expert_affinities_masked,
        gate_up_proj_weight=gate_up_proj_weight,
        down_proj_weight=down_proj_weight,
        token_position_to_id=token_position_to_id,
        block_to_expert=block_to_expert,
        output_hidden_states_grad=output_hidden_states_grad,
        gate_up_proj_act_checkpoint_T=gate_up_proj_act_checkpoint_T,
        gate_act_checkpoint_T=gate_act_checkpoint_T,
        intermediate_checkpoint_T=intermediate_checkpoint_T,
        scaled_intermediate_checkpoint_T=scaled_intermediate_checkpoint_T,
        gate_up_weight_scales=gate_up_weight_scales,
        down_weight_scales=down_weight_scales,
        num_valid_tokens=num_valid_tokens,
    )
    _alloc_outputs(cfg, t)
    _alloc_scratch(cfg, geo, t)
    _constants(cfg, t)
    zero_jobs: list[Any] = [[], []]
    if not cfg.dense or cfg.nv:
        zero_jobs = _init_outputs(cfg, geo, t)
    w_dense = None
    if cfg.dense:
        w_dense = _quantize_weights(cfg, geo, t, None)
    # Blocks overlap: block b+1's indices, prologue and phase 1 are issued during block b's
    # phases 3/4 (DMA-bound read-modify-writes that leave the compute engines room; engines
    # and DMA queues run in program order, so the overlap has to be in the program). The
    # scratch handed from phase 1 to phases 2-4 alternates between two sets (`_block_tensors`).
    tb = _block_tensors(t, 0)
    st = _prologue(cfg, geo, t, w_dense, 0)
    tn: Any = None
    if cfg.N > 1:
        tn = _block_tensors(t, 1)
    fr = _block_phase1(cfg, geo, tb, 0, zero_jobs[0], st, tn)
    for b in range(cfg.N):
        tnn: Any = None
        if b + 2 < cfg.N:
            tnn = _block_tensors(t, b + 2)
        jobs: list[Any] = []
        if b == 0:
            jobs = zero_jobs[1]
        if tn is not None:
            _setup_indices(cfg, t, fr.next_blk, b + 1)
        if b + 1 == cfg.N and not cfg.dense:
            # every block's expert flag is set by now (`_rmw_index`); before the last block's
            # phases 2-4 rather than at the end, where nothing would overlap it
            _zero_unused_experts(cfg, geo, t)
        _block_phase2(cfg, geo, tb, b, jobs, fr)
        nfr: Any = None
        if tn is not None and geo.overlap:
            st = _prologue(cfg, geo, t, w_dense, b + 1, fr.next_blk)
        _phase3(cfg, geo, tb, fr.blk, b)
        # (before phase 3 it would overwrite the S scratch phase 3 of the other core may still
        # be reading: the LNC race check catches that order)
        if tn is not None and geo.overlap:
            nfr = _block_phase1(cfg, geo, tn, b + 1, [], st, tnn)
        if tn is not None and not geo.overlap and geo.overlap4:
            st = _prologue(cfg, geo, t, w_dense, b + 1, fr.next_blk)
        _phase4(cfg, geo, tb, fr.blk, b)
        if cfg.bias:
            _write_bias(cfg, geo, t, fr.blk)
        if tn is not None and not geo.overlap:
            if not geo.overlap4:
                st = _prologue(cfg, geo, t, w_dense, b + 1, fr.next_blk)
            nfr = _block_phase1(cfg, geo, tn, b + 1, [], st, tnn)
        tb, fr, tn = tn, nfr, tnn
    if cfg.bias:
        return (t.hsg, t.dea, t.dwgu, t.dwd, t.dbgu, t.dbd)
    return (t.hsg, t.dea, t.dwgu, t.dwd)


# ``nki.jit`` object for launches (``blockwise_mm_bwd_mxfp8_jit[2](...)``); the plain function
# above is what ``nki.simulate`` and the interpreter run.
blockwise_mm_bwd_mxfp8_jit = nki.jit(blockwise_mm_bwd_mxfp8_nki)
