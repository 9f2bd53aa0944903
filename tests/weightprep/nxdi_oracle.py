"""Facts about NxD Inference's MoE checkpoint layout, as the tests' oracle (NxDI is not
installable here). Each fact cites its source in aws-neuron/neuronx-distributed-inference at
commit 4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e (src/neuronx_distributed_inference/...).
Facts only: no code of that project is copied.
"""

from __future__ import annotations

COMMIT = "4bcdc54bf3b6ccdad490e5cd0680a3dc95270b8e"
QWEN3 = "models/qwen3_moe/modeling_qwen3_moe.py"
APP = "models/application_base.py"
MX = "models/gpt_oss/mx_layout_transform.py"

# models/qwen3_moe/modeling_qwen3_moe.py:154-157: the HF router weight mlp.gate.weight [E, H] is
# stored unchanged (a clone) under this key.
ROUTER_KEY = "layers.{l}.mlp.router.linear_router.weight"
# :204 and :228: the fused expert keys.
GATE_UP_KEY = "layers.{l}.mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN_KEY = "layers.{l}.mlp.expert_mlps.mlp_op.down_proj.weight"
# :166-170: gate_up_proj is [num_experts, hidden_size, 2 * intermediate_size];
# :175-179, :186-188: expert e's gate_proj.weight.T fills [e, :, 0:I] (the first half);
# :180-184, :189-192: its up_proj.weight.T fills [e, :, I:2I] (the second half).
GATE_UP_SHAPE = ("E", "H", "2I")
GATE_FIRST = True
# :206-212, :215-221: down_proj is [num_experts, intermediate_size, hidden_size], expert e's
# down_proj.weight.T at [e].
DOWN_SHAPE = ("E", "I", "H")
# models/application_base.py:393-397: presharded checkpoints are read, per rank, from
# "weights/tp{rank}_sharded_checkpoint.safetensors" under the compiled model path.
RANK_FILE = "weights/tp{rank}_sharded_checkpoint.safetensors"
# models/gpt_oss/mx_layout_transform.py:146-153 (get_i_tiling_shard_i): per-rank I above 512
# must be a multiple of 512; at most 512, a multiple of 32 (Q_WIDTH 4 x Q_HEIGHT 8, :14-15).
MX_I_RULE = {"tile": 512, "block": 32}
# :112-113 and :176 (get_h_tiling_shard_i, the assert in _tile_transpose_concat_gate_up_weight):
# H is cut into H // (pmax 128 * Q_WIDTH 4) = H // 512 tiles of 512 // 32 = 16 blocks x 8 rows.
MX_H_TILE = 512
# :591-619 (shuffle_hidden_dim): the H dim is viewed as [H/4, 4], those two axes transposed and
# flattened back; :725 applies it to the router weight (dim=-1) on the MX path, whose router key
# there is "layers.{l}.feed_forward.moe.router.linear_router.weight".
SHUFFLE_VIEW = ("H/4", 4)
# :689: moe_tp_degree = tp_degree // moe_ep_degree (the MoE TP x EP ranks make the world).

# -- The MX layout (same commit; mx_layout_transform.py unless named) ---------------------------
# :13-15: PMAX 128, Q_WIDTH 4, Q_HEIGHT 8. :81-92 (convert_gate_up_proj_fp4): gate and up are
# [E, H/4, I] words, each packing 4 consecutive H; :163 and :555: codes per word = Q_WIDTH.
# :176-192, :223-235, :252-253 (_tile_transpose_concat_gate_up_weight): view [E, H/512, 16, 8,
# 1, tp, nIt, qbI, 8, 4] -> permute to [E, 16, 8, concat, H/512, tp, nIt, 4(Q_WIDTH_I), qbI,
# 8(Q_HEIGHT_I)], gate then up on the concat axis -> [E, 128, 2, H/512, tp * I_tp]: word
# [e, p, g, t, col] packs H 512t + 4p + j (j = 0..3), and within a rank's I tile of size T the
# position qw * T/4 + qb * 8 + qh holds tile element qb * 32 + qh * 4 + qw.
# :266-278, :305-315, :329-330 (_tile_transpose_concat_gate_up_scale): [E, 16, 2, H/512,
# tp * I_tp], byte [e, b, g, t, col] of H block 16t + b, the same column order.
# :494-500 (convert_down_proj_fp4): down is [E, I/4, H] words, each 4 consecutive I.
# :576-586 (tile_transpose_down_proj_for_mxfp4_kernel, shuffle_output_hidden False): view
# [E, tp, nIt, qbI, 8, H] -> permute [E, tp, qbI, 8, nIt, H] -> [E, tp * T/4, nIt, H]: word
# [e, k, t, h] of a rank packs I tT + 4k + j; scale [E, tp * T/32, nIt, H], byte of I block
# tT/32 + b. :146-156: nIt = I_tp / 512 above 512, else 1 (T = I_tp).
# :761-762: the keys are "...mlp_op.{proj}.weight" and "...mlp_op.{proj}.scale".
# models/config.py:229-233: is_hidden_dim_shuffled = is_intermediate_dim_shuffled =
# is_mxfp4_compute; is_full_model_shuffled defaults to False (down's output H stays in order).
MX_ROWS_PER_H_TILE = 128  # 512 H / 4 per word
MX_SCALE_KEY = "layers.{l}.mlp.expert_mlps.mlp_op.{proj}.scale"
MX_WEIGHT_DTYPE = "U32"
MX_SCALE_DTYPE = "U8"

# aws-neuron/neuronx-distributed@fbac349b (src/neuronx_distributed/...), the MX dtypes:
# quantization/quantization_config.py:107-109: F4E2M1FN_X4 = uint16, F8E4M3FN_X4 = uint32;
# :125-129: 4 codes per word for both; :134: F8E8M0 scales are uint8; :241-256
# (is_ocp_mx_quantized): blockwise, F4E2M1FN_X4 / F8E4M3FN_X4 / F8E5M2_X4, F8E8M0 scales.
# quantization/quantization_layers.py:1086-1112: the expert column-parallel MX weight is
# (E, in_tile/4, 2, in/in_tile, out_pp * 4 / 2) with stride 1, partitioned on dim 4;
# :1289-1315: the row-parallel one (E, in_tile_pp/4, in_pp/in_tile_pp, out * 4), on dim 1;
# :145-150: the last dim is divided by the codes per word.
# quantization/microscaling/transform_weights.py:253-322 (get_mxfp8_tensor_from_uint32): byte j
# (bits 8j) of a word is element j (:299-310), an E4M3FN code (:258), scaled by 2^(byte - 127)
# (:278, :312).
# modules/moe/moe_fused_tkg_mx.py:119-122: the fused TKG MX wrapper reinterprets the expert
# weights as float4_e2m1fn_x4; modules/moe/blockwise.py:1176-1253 (BlockwiseMatmulMXNKIFunc) calls
# nkilib's bwmm_shard_on_block_mx, which takes float8_e4m3fn_x4 weights
# (aws-neuron/nki-library@d2ad3a57, src/nkilib_src/nkilib/core/moe/moe_cte/
# bwmm_shard_on_block_mx.py:134-137).
FP8_WORD_BYTE_ORDER = "little"  # byte j = element j

# World rank -> (ep_rank, tp_rank) for MoE, same NxD commit:
# modules/moe/moe_process_group.py:22-33: the MoE groups come from
# initialize_model_parallel(tp=moe_tp, ep=moe_ep, mesh_only=True);
# parallel_layers/parallel_state.py:620-628: cluster_ranks_exp = arange(world).reshape(PP,
# DP_exp, EP, TP), TP contiguous; :155-162: an EP group is cluster_ranks_exp[pp, dp, :, tp];
# trace/trace.py:783, parallel_state.py:978-996: a rank's ep_rank is its index in its EP group;
# trace.py:801: its TP piece is rank % tp; parallel_state.py:1025-1028: ep_rank holds experts
# [ep_rank * E/ep, (ep_rank + 1) * E/ep).


def world_rank(ep_rank: int, tp_rank: int, tp: int) -> int:
    return ep_rank * tp + tp_rank


def mx_i_tile(i_tp: int) -> int:
    return MX_I_RULE["tile"] if i_tp > MX_I_RULE["tile"] else i_tp


def gate_up_word_position(h: int, i: int, i_tp: int) -> tuple[int, int, int, int]:
    """(p, t, col, byte) of H index `h` and rank-local I index `i` in gate_up's MX weight."""
    tile = mx_i_tile(i_tp)
    t, hh = divmod(h, MX_H_TILE)
    p, j = divmod(hh, 4)
    it, m = divmod(i, tile)
    qb, r = divmod(m, 32)
    qh, qw = divmod(r, 4)
    return p, t, it * tile + qw * (tile // 4) + qb * 8 + qh, j


def down_word_position(i: int, h: int, i_tp: int) -> tuple[int, int, int, int]:
    """(k, t, h, byte) of rank-local I index `i` and H index `h` in down's MX weight."""
    tile = mx_i_tile(i_tp)
    t, m = divmod(i, tile)
    k, j = divmod(m, 4)
    return k, t, h, j


# How a rank's slice is cut, from aws-neuron/neuronx-distributed at commit
# fbac349b61a3adbb123c2983835af692840ff62f (src/neuronx_distributed/...):
# modules/moe/experts.py:94-111: gate_up_proj is an ExpertFusedColumnParallelLinear with
# output_size = 2 * intermediate_size and stride=2; :130-134: down_proj an
# ExpertFusedRowParallelLinear with input_size = intermediate_size.
# modules/moe/moe_parallel_layers.py:232-238: the column-parallel weight is
# (n_local_experts, input_size, output_size_per_partition), partitioned on dim 2; :371: the
# row-parallel one on dim 1.
# trace/trace.py:678-686 (create_local_weight): the partition dim is split into pieces of
# per_partition_size / stride; rank r takes pieces r, r + world, r + 2 * world, ... and
# concatenates them (stride 2 on 2I: its gate slice, then its up slice).
NXD = "aws-neuron/neuronx-distributed@fbac349b61a3adbb123c2983835af692840ff62f"
GATE_UP_STRIDE = 2


def local_slice(full_dim: int, tp: int, rank: int, stride: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the partition dim that rank `rank` of `tp` holds, in order."""
    piece = full_dim // tp // stride
    return [(k * piece, (k + 1) * piece) for k in range(rank, stride * tp, tp)]


def shuffled_position(h: int, H: int) -> int:
    """Where the old H index `h` lands under shuffle_hidden_dim: view [H/4, 4] -> [4, H/4]."""
    i, j = divmod(h, 4)  # old index h = 4 * i + j
    return j * (H // 4) + i


def mx_i_ok(i_tp: int) -> bool:
    if i_tp > MX_I_RULE["tile"]:
        return i_tp % MX_I_RULE["tile"] == 0
    return i_tp % MX_I_RULE["block"] == 0


# -- Complete rank checkpoints and NxDI's shard-on-I padding (issue 30; same NxDI commit) ------
# models/application_base.py:389-400: with save_sharded_checkpoint, load_weights reads each
# rank's weights/tp{rank}_sharded_checkpoint.safetensors whole (load_file) and :415 hands that
# list to nxd_model.initialize: the file is the rank's complete weights. :69-70 and :706-712
# (get_state_dict): HF names lose their "model." prefix before the model's conversion.
# models/qwen3_moe/modeling_qwen3_moe.py:131-133: "rank_util.rank" = arange(tp) int32;
# :137-139: "layers.{l}.self_attn.rank_util.rank" likewise; :142-152: q_norm/k_norm renamed
# q_layernorm/k_layernorm.
RANK_UTIL_KEYS = ("rank_util.rank", "layers.{l}.self_attn.rank_util.rank")
QK_NORM_KEYS = (
    "layers.{l}.self_attn.q_layernorm.weight",
    "layers.{l}.self_attn.k_layernorm.weight",
)
# models/config.py:40: SHARD_ON_INTERMEDIATE_DIMENSION_PER_TP = 256.
# models/qwen3_moe/modeling_qwen3_moe.py:273-282 (maybe_pad_intermediate): with
# blockwise_matmul_config.use_shard_on_intermediate_dynamic_while and I_TP = I / moe_tp not a
# multiple of 256, the model's I becomes ceil(I_TP / 256) * 256 * moe_tp and
# moe_intermediate_pad_size the difference; :197-203: gate_up [E, H, 2I] is viewed
# [E, H, 2, I], padded on the right of its last dim by that size and flattened back;
# :224-227: down [E, I, H] padded at the bottom of I. NxD then shards the padded tensors
# (stride 2 on gate_up's 2I, see local_slice).
SHARD_ON_I = 256


def padded_i(I: int, tp: int) -> int:  # noqa: E741
    """NxDI's whole I under shard-on-I padding (maybe_pad_intermediate)."""
    i_tp = I // tp
    if i_tp % SHARD_ON_I == 0:
        return I
    return -(-i_tp // SHARD_ON_I) * SHARD_ON_I * tp
