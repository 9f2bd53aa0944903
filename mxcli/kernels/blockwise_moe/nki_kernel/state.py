"""The kernel's state between its helpers, as ``nl.NKIObject`` dataclasses (nki_python_subset.md
"Classes": built in traced code, their fields tensors, views, ints and lists of those).

`LaunchTensors` is the launch's (inputs, outputs, HBM scratch, constant tiles), `BlockTensors`
one block's view of it (the scratch set of its parity and the phase-3/4 operands it allocates).
`BlockIndices` holds a block's index tiles and bias accumulators, `Weights` the expert's
phase-1/2 weight operands; `Prologue`, `P1Loads`, `Checkpoints`, `SwigluTerms`, `P1Operands`,
`Phase1Out` and `P2Loads` are what one step of a phase hands to the next (package docstring,
steps 0-5). `MxOperand` is a quantized operand in HBM or in SBUF (`operands`).

Fields hold None until the step that fills them ran (setup, or a phase of the block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nki.language as nl


@dataclass
class MxOperand(nl.NKIObject):
    """A quantized MX operand, wrapX along its contraction (bwd spec §5.5).

    In HBM: ``layout`` (a `QLayout`), ``data`` (x4 words), ``scales`` (uint8) and ``expert``
    (a ``(1, 1)`` int32 SBUF view selecting the leading axis at run time through
    ``scalar_offset``, or None). On chip: ``layout`` None, ``q`` (x4 data ``[lanes, chunk,
    F]``), ``views`` (one scale view per chunk), ``c_lo`` (its first column) and, for an
    operand quantized in place (`_onchip_operand`), its chunks ``tiles``."""

    layout: Any = None
    data: Any = None
    scales: Any = None
    expert: Any = None
    q: Any = None
    views: Any = None
    c_lo: int = 0
    tiles: Any = None


@dataclass
class LaunchTensors(nl.NKIObject):
    """The launch's tensors: the kernel's inputs (by their parameter names), the outputs
    (``hsg``, ``dea``, ``dwgu``, ``dwd``, their expert-major row views ``*_rows``, the bias
    grads ``dbgu``, ``dbd``), the HBM scratch (`_alloc_scratch`: the two sets ``*2`` handed
    from phase 1 to phases 2-4, the quantized phase-3/4 operands ``xq_hbm``, ``gq_hbm``,
    ``sq_hbm`` when spilled, the streamed quantized weights ``wdq_s``, ``wguq_s``, the small
    index scratch) and the constant tiles (`_constants`)."""

    hidden_states: Any = None
    expert_affinities_masked: Any = None
    gate_up_proj_weight: Any = None
    down_proj_weight: Any = None
    token_position_to_id: Any = None
    block_to_expert: Any = None
    output_hidden_states_grad: Any = None
    gate_up_proj_act_checkpoint_T: Any = None
    gate_act_checkpoint_T: Any = None
    intermediate_checkpoint_T: Any = None
    scaled_intermediate_checkpoint_T: Any = None
    gate_up_weight_scales: Any = None
    down_weight_scales: Any = None
    num_valid_tokens: Any = None
    # outputs
    hsg: Any = None
    dea: Any = None
    dwgu: Any = None
    dwd: Any = None
    dwgu_rows: Any = None
    dwd_rows: Any = None
    dbgu: Any = None
    dbd: Any = None
    # scratch
    dgu_s2: Any = None
    s_s2: Any = None
    da_s2: Any = None
    yq2: Any = None
    alpha_s: Any = None
    rmw_s: Any = None
    seen_s: Any = None
    knock_s: Any = None
    xq_hbm: Any = None
    gq_hbm: Any = None
    sq_hbm: Any = None
    wdq_s: Any = None
    wguq_s: Any = None
    # constants
    zero: Any = None
    ones_f32: Any = None
    ones_bf: Any = None
    nv_col: Any = None
    seen_one: Any = None
    rmw_rows: Any = None


@dataclass
class BlockTensors(nl.NKIObject):
    """Block `b`'s tensors (`_block_tensors`): the launch's, and the scratch set of its parity
    (``dgu_s``, ``s_s``, ``da_s``, ``yq``) with the other set (``*_o``, for `_hand_over`); the
    phase-3/4 operands ``xq``, ``gq``, ``sq``, ``yq`` (the HBM scratch, or on chip for the
    block, allocated by its phases)."""

    launch: LaunchTensors
    two_sets: bool
    dgu_s: Any
    s_s: Any
    da_s: Any
    yq: Any
    dgu_s_o: Any
    s_s_o: Any
    da_s_o: Any
    yq_o: Any
    gq: Any
    xq: Any = None
    sq: Any = None


@dataclass
class BlockIndices(nl.NKIObject):
    """A block's index tiles (`_indices_load`, `_setup_indices`, `_rmw_index_finish`): token
    ids ``tok`` (None: dense, plain slices), the expert id ``expert`` (``(1, 1)`` view) and its
    column ``ecol``, affinity indices ``ea_idx``, affinities ``alpha_tok``, the weight grads'
    read rows ``rmw_idx`` (None: nothing to read back); and its bias-grad running sums."""

    tok: Any = None
    ea_idx: Any = None
    expert: Any = None
    rmw_idx: Any = None
    ecol: Any = None
    alpha_tok: Any = None
    acc_bgu: Any = None
    acc_bd: Any = None


@dataclass
class Weights(nl.NKIObject):
    """The expert's phase-1 (``d``: W_d) and phase-2 (``gu``: W_gu) weight operands."""

    d: Any = None
    gu: Any = None


@dataclass
class Checkpoints(nl.NKIObject):
    """One ``[128 i, W tok]`` tile of the checkpoints: G, U and the optional phi(G), Hm, S."""

    g: Any
    u: Any
    act: Any
    hm: Any
    s: Any


@dataclass
class SwigluTerms(nl.NKIObject):
    """The SwiGLU backward terms that need only the checkpoints (`_swiglu_terms`)."""

    act: Any
    dga: Any
    hm: Any


@dataclass
class P1Loads(nl.NKIObject):
    """Phase 1's loads of one window (`_phase1_loads`): dY rows, alpha row, checkpoints."""

    dyw: Any
    alpha: Any
    ck: list[Checkpoints]


@dataclass
class P1Operands(nl.NKIObject):
    """Phase 1's operands of one window (`_phase1_operands`): dY^T quantized, SwiGLU terms."""

    yq: Any
    ys: Any
    sw: list[SwigluTerms]


@dataclass
class Prologue(nl.NKIObject):
    """What a block reads before its phase-1 compute (`_prologue`)."""

    blk: BlockIndices
    w: Weights
    rows: list[Any]
    pre: Any  # P1Loads, or None: loaded per window


@dataclass
class Phase1Out(nl.NKIObject):
    """What phases 2-4 of a block take from its phase 1, and the next block's index loads."""

    blk: BlockIndices
    w: Weights
    next_blk: Any  # BlockIndices, or None after the last block


@dataclass
class P2Loads(nl.NKIObject):
    """Phase 2's loads of one window (`_phase2_loads`): ``[dG|dU]^T`` row tiles, X rows (or
    None: gathered later), the hidden-grad rows it adds to (or None)."""

    rows: list[Any]
    x: Any = None
    hsg_old: Any = None
