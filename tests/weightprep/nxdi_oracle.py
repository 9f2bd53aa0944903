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
