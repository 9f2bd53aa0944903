"""NKI kernel of ``blockwise_mm_bwd_mxfp8`` for Trn3 (NeuronCore-v4), NKI 0.6 API.

MXFP8 backward of a blockwise, dropless MoE layer with SwiGLU experts. The numerics are those
of the torch reference beside this package (`backward.py`, bwd spec §4, §6); this package is the
same computation written as NKI instructions and runs unchanged on the real ``nki.simulate``, on
mxcli's interpreter (`mxcli.nkisim`) and on Trainium.

Import this package only with an ``nki`` package importable: the real one, or mxcli's
interpreter through `mxcli.kernels.nki_runtime.load_kernel_module` (never at package import
time). Its modules import each other relatively, so that the interpreter's private copy of the
package is self-contained.

Modules, in the order the kernel runs them: `plan` (the launcher's `BwdKernelConfig`, one core's
`Geometry`, the SBUF budgets), `state` (the dataclasses the helpers hand each other), `operands`
and `quant` (MX operands, their loads and quantization), `alloc` (outputs, scratch, constants,
zeroing), `weights` (step 1), `indices` (step 0), `phase1` (step 2), `phase2` (steps 3-4),
`phase34` (steps 5-6) and `kernel` (the jit entry, the block loop).

Everything here is inside the NKI 0.6 meta-programming subset (nki_python_subset.md): the
kernel receives tensors and one `BwdKernelConfig` (an ``nl.NKIObject`` of ints, bools, tuples
and ``nki`` dtypes) that the launcher (`nki_backend.kernel_config`) builds after validating the
inputs and planning the launch (wrapX chunk lists, packed-scale placement, DMA runs). The
helpers hand each other ``NKIObject`` dataclasses (`state`: the launch's and the block's
tensors, the block's indices, each phase's loads and operands), built while tracing. There is
no validation here beyond ``assert``s of what the launcher guarantees.

Dataflow of one block ``b`` of ``B`` token positions, expert ``e = block_to_expert[b]``
(bwd spec §4.2, §6; ``P = 128`` partitions, ``W = min(B, 512)`` tokens per window):

0. indices: ``tok [P, B/P]`` (position ``t*P + p`` on partition ``p``), clamped below at -1,
   ``ea_idx = max(tok*E + e, -1)``: an fp32 multiply by ``E`` (tensor_scalar operands are fp32),
   then an int32 add of the broadcast expert id, as upstream computes affinity offsets. Padding
   ids (-1, or >= T) are then -1 or past the end, so ``oob_mode.skip`` drops them from every
   indirect gather (rows stay 0) and scatter. ``alpha`` is gathered per token, then broadcast
   to all partitions through a small HBM scratch (stride-0 read).
1. weights: ``W_d[e]`` (contraction H) and ``W_gu[e]`` as ``[2I, H]`` (contraction 2I) are
   loaded with one 3-D ``dma_transpose`` per wrapX chunk straight into the wrapX layout
   (lane ``p``, column ``f``, byte ``j`` <- ``w[f, k0 + j*v + p]``) and quantized on chip, or
   taken pre-quantized (same layout, §5.5; packed scales of a chunk that does not start on a
   512 boundary are moved into their data's 32-partition quadrant while loading). They stay
   resident in SBUF for the block when they fit `RESIDENT_BUDGET` (W_gu quantized a share per
   phase-1 window, `_wgu_staged`), else W_d is spilled to an HBM scratch (x4 data + e8m0
   scales) and streamed per window, and W_gu is quantized per phase-2 column group from its
   transpose (`_wgu_fly`). Dense mode quantizes both once into the scratch.
2. phase 1 per window: ``dY`` rows gathered (tokens on partitions), PE-transposed into the wrapX
   layout along H and ``quantize_mx``-ed; ``D^T [I, W] = mx(W_d, dY^T)`` per 128-row I tile
   (``nc_matmul_mx``, fp32 PSUM accumulation over the H chunks). SwiGLU backward on ``[i, tok]``
   tiles against the bf16 checkpoint (ScalarE ``silu``/``silu_dx``, VectorE products with the
   spec's bf16 rounding points), clamp masks, affinity grad ``sum_i D*Hm`` as a ones-matmul over
   the partitions. ``dG | dU`` and ``S`` (bf16, ``[2I, B]`` / ``[I, B]``) go to a shared HBM
   scratch: under LNC 2 phase 1 is split over I (SHARD_ON_FREE) and the halves meet there.
3. phase 2 per window: ``[dG|dU]^T`` chunk rows loaded whole (contiguous DMA runs), then
   interleaved into the wrapX layout along 2I by one VectorE copy, quantized;
   ``R [W, H] = mx(dGU, W_gu)`` per 128-token tile; hidden-state grad rows scattered (or
   gathered, added in fp32, rounded to bf16 and scattered when accumulating).
4. phases 3/4 operands (contraction over the block's tokens), quantized along the tokens:
   ``X`` rows gathered and ``dY``'s taken from phase 1's rows, interleaved into the wrapX
   layout; ``dGU`` PE-transposed from phase 2's row tiles and ``S`` from the scratch (during
   phase 3). The stationary ``X`` and ``S`` stay in SBUF when they fit `STATIONARY_BUDGET`
   (scales packed four chunks to a tile), the moving ``dGU`` / ``dY`` go through HBM scratch.
5. phases 3/4: ``dW_gu[e] = bf16(dW_gu[e] + bf16(mx(X^T, dGU)))`` and
   ``dW_d[e] = bf16(dW_d[e] + bf16(mx(S^T, dY)))`` tile by tile, or a whole output row tile at
   a time where the moving operands are on chip and blocks do not overlap (`_phase34_rows`):
   the old value gathered per row (``oob_mode.skip``) only where an earlier block had expert
   ``e`` (a per-expert flag, `_rmw_index`), else taken as +0 without a read; written through a
   ``scalar_offset`` DMA.
   The weight grads of experts without any block are zeroed once the flags are final
   (`_zero_unused_experts`); dense block 0 writes instead.
6. bias grads (routed only): per 128-token tile fp32 sums (ones-matmul / free-axis reduce),
   bf16 running sums per block, then a bf16 read-modify-write per block.

Engine balance and overlap (cost model, `mxcli profile bwd`): the PSUM evictions of the
phase-2 and phase-3/4 results run on ScalarE (``tensor_copy(engine=scalar)``, bit-exact as on
VectorE: one fp32 -> bf16 rounding; alternating with VectorE in `_phase34_rows`), the
checkpoint-only SwiGLU products on GpSimd, the other
elementwise work on VectorE. Every phase is a software pipeline: the loads (and in phase 1 the
operands) of window / column group k+1 are issued before the compute and write-backs of k,
since DMA engines and queues start transfers in program order; loads, write-backs, gathers
and zeroing use different DMA queues (`_load`, `_store`).

LNC 2 (SHARD_ON_FREE): phase 1 splits the 128-row I tiles, phases 2-4 split the 128-column H
tiles between the two cores; the affinity-grad partials are added in fp32 (core 0's half
first) and written by core 0. Both cores zero exactly the output regions they later update.
Blocks overlap: block b+1's indices, prologue and phase 1 are issued during block b's phases
3/4 where their working sets fit (`_geometry`), so the three shared scratch tensors handed
between the cores (``dgu_s``, ``s_s``, ``da_s``) come in two sets used by alternate blocks
(`_block_tensors`); after each block's phase 1 both cores ``core_barrier`` on both sets: this
block's (written by both, then read by both) and the previous block's (its last reads, in
phases 2-3, come before this point on both cores; the next writes after it).

Supported: routed and ``single_expert_dense`` paths, on-the-fly or pre-quantized weights
(packed or unpacked scales), ``accumulate_hidden_states_grad``, bias grads, clamp masks,
``num_valid_tokens`` (dense), ``fast_dma_transpose`` grouping (errata 1), any ``tile_k``,
the optional ``gate_act`` / ``intermediate`` / ``scaled_intermediate`` checkpoints (used as
given), LNC 1 and 2. The launcher rejects what this kernel does not implement (the 1x32 quant
scheme, AFFINITY_ON_H, a missing gate/up checkpoint).
"""

from __future__ import annotations

from .kernel import blockwise_mm_bwd_mxfp8_jit, blockwise_mm_bwd_mxfp8_nki
from .plan import SBUF_BUDGET, BwdKernelConfig, KTile

__all__ = [
    "SBUF_BUDGET",
    "BwdKernelConfig",
    "KTile",
    "blockwise_mm_bwd_mxfp8_jit",
    "blockwise_mm_bwd_mxfp8_nki",
]
