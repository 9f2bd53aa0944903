# ruff: noqa: E741  (spec notation: I is the intermediate size)
"""The released MoE models at their real sizes, without their data.

`CONFIGS` holds the MoE-relevant keys of each model's released ``config.json`` (Hugging Face repo
in the key). `moe_tensors` lists, written out plainly per model (no code shared with
mxcli.weightprep), the real names, dtypes and shapes of one MoE layer's tensors that
prep-weights reads. `write_meta_checkpoint` writes ``config.json`` and an index with those
names, and optionally shards of some layers whose headers are real and whose data are never
written (sparse files), so whole models can be planned with ``--dry-run``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}  # fmt: skip
_GPT_OSS_Q = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}  # fmt: skip

CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek-ai/DeepSeek-V3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "vocab_size": 129280, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "quantization_config": _FP8,
    },
    "moonshotai/Kimi-K2-Instruct": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_nextn_predict_layers": 0, "n_routed_experts": 384,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "vocab_size": 163840, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "quantization_config": _FP8,
    },
    "zai-org/GLM-4.5": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 92, "num_nextn_predict_layers": 1, "n_routed_experts": 160,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "partial_rotary_factor": 0.5, "use_qk_norm": True, "vocab_size": 151552,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen3-235B-A22B": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    },
    "openai/gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "swiglu_limit": 7.0, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "sliding_window": 128, "vocab_size": 201088, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", "quantization_config": _GPT_OSS_Q,
    },
    "openai/gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
        "swiglu_limit": 7.0, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "sliding_window": 128, "vocab_size": 201088, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16", "quantization_config": _GPT_OSS_Q,
    },
    "meta-llama/Llama-4-Scout-17B-16E": {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_local_experts": 16,
            "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
            "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 202048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        },
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408},
        "torch_dtype": "bfloat16",
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    },
}  # fmt: skip

# MoE layers of each model (first_k_dense_replace, decoder_sparse_step, interleave step ...)
MOE_LAYERS: dict[str, list[int]] = {
    "deepseek-ai/DeepSeek-V3": list(range(3, 61)),
    "moonshotai/Kimi-K2-Instruct": list(range(1, 61)),
    "zai-org/GLM-4.5": list(range(3, 92)),
    "Qwen/Qwen3-30B-A3B": list(range(48)),
    "Qwen/Qwen3-235B-A22B": list(range(94)),
    "openai/gpt-oss-20b": list(range(24)),
    "openai/gpt-oss-120b": list(range(36)),
    "meta-llama/Llama-4-Scout-17B-16E": list(range(48)),
    "mistralai/Mixtral-8x7B-v0.1": list(range(32)),
}

_BITS = {"BF16": 16, "F32": 32, "F8_E4M3": 8, "U8": 8}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * _BITS[dtype] // 8


def _fp8(name: str, shape: tuple[int, int]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        name: ("F8_E4M3", shape),
        name + "_scale_inv": ("F32", (-(-shape[0] // 128), -(-shape[1] // 128))),
    }


def moe_tensors(repo: str, L: int) -> dict[str, tuple[str, tuple[int, ...]]]:  # noqa: C901
    """name -> (safetensors dtype, shape) of what prep-weights reads in MoE layer `L`."""
    c = CONFIGS[repo]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if c["model_type"] in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        H, I, E = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        Is = I * c["n_shared_experts"]
        fp8 = "quantization_config" in c
        p = f"model.layers.{L}."
        out[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        out[p + "mlp.gate.weight"] = ("BF16", (E, H))
        out[p + "mlp.gate.e_score_correction_bias"] = ("F32", (E,))

        def linear(name: str, shape: tuple[int, int]) -> None:
            out.update(_fp8(name, shape) if fp8 else {name: ("BF16", shape)})

        for e in range(E):
            linear(p + f"mlp.experts.{e}.gate_proj.weight", (I, H))
            linear(p + f"mlp.experts.{e}.up_proj.weight", (I, H))
            linear(p + f"mlp.experts.{e}.down_proj.weight", (H, I))
        linear(p + "mlp.shared_experts.gate_proj.weight", (Is, H))
        linear(p + "mlp.shared_experts.up_proj.weight", (Is, H))
        linear(p + "mlp.shared_experts.down_proj.weight", (H, Is))
    elif c["model_type"] == "qwen3_moe":
        H, I, E = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"]
        p = f"model.layers.{L}."
        out[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        out[p + "mlp.gate.weight"] = ("BF16", (E, H))
        for e in range(E):
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = ("BF16", (I, H))
            out[p + f"mlp.experts.{e}.up_proj.weight"] = ("BF16", (I, H))
            out[p + f"mlp.experts.{e}.down_proj.weight"] = ("BF16", (H, I))
    elif c["model_type"] == "mixtral":
        H, I, E = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
        p = f"model.layers.{L}."
        out[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        out[p + "block_sparse_moe.gate.weight"] = ("BF16", (E, H))
        for e in range(E):
            out[p + f"block_sparse_moe.experts.{e}.w1.weight"] = ("BF16", (I, H))
            out[p + f"block_sparse_moe.experts.{e}.w3.weight"] = ("BF16", (I, H))
            out[p + f"block_sparse_moe.experts.{e}.w2.weight"] = ("BF16", (H, I))
    elif c["model_type"] == "gpt_oss":
        H, I, E = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
        p = f"model.layers.{L}."
        out[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        out[p + "mlp.router.weight"] = ("BF16", (E, H))
        out[p + "mlp.router.bias"] = ("BF16", (E,))
        # MXFP4: [E, out, in/32, 16] bytes (two E2M1 codes each) + [E, out, in/32] E8M0
        out[p + "mlp.experts.gate_up_proj_blocks"] = ("U8", (E, 2 * I, H // 32, 16))
        out[p + "mlp.experts.gate_up_proj_scales"] = ("U8", (E, 2 * I, H // 32))
        out[p + "mlp.experts.gate_up_proj_bias"] = ("BF16", (E, 2 * I))
        out[p + "mlp.experts.down_proj_blocks"] = ("U8", (E, H, I // 32, 16))
        out[p + "mlp.experts.down_proj_scales"] = ("U8", (E, H, I // 32))
        out[p + "mlp.experts.down_proj_bias"] = ("BF16", (E, H))
    elif c["model_type"] == "llama4":
        t = c["text_config"]
        H, I, E = t["hidden_size"], t["intermediate_size"], t["num_local_experts"]
        p = f"language_model.model.layers.{L}."
        out[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        out[p + "feed_forward.router.weight"] = ("BF16", (E, H))
        out[p + "feed_forward.experts.gate_up_proj"] = ("BF16", (E, H, 2 * I))
        out[p + "feed_forward.experts.down_proj"] = ("BF16", (E, I, H))
        out[p + "feed_forward.shared_expert.gate_proj.weight"] = ("BF16", (I, H))
        out[p + "feed_forward.shared_expert.up_proj.weight"] = ("BF16", (I, H))
        out[p + "feed_forward.shared_expert.down_proj.weight"] = ("BF16", (H, I))
    else:
        raise KeyError(repo)
    return out


def shard_name(L: int, n: int) -> str:
    return f"model-{L + 1:05d}-of-{n:05d}.safetensors"


def write_sparse_shard(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file with a real header whose data region is a hole: never written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, (dtype, shape) in sorted(tensors.items()):
        n = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)  # the data: a sparse hole


def write_meta_checkpoint(
    out: Path, repo: str, *, index: bool = True, shards_for: tuple[int, ...] = ()
) -> Path:
    """``config.json`` (+ an index naming every MoE layer's tensors, one shard per decoder
    layer) (+ sparse shards holding the layers in `shards_for`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIGS[repo], indent=2))
    n = len(MOE_LAYERS[repo]) and max(MOE_LAYERS[repo]) + 1
    if index:
        weight_map: dict[str, str] = {}
        total = 0
        for L in MOE_LAYERS[repo]:
            for name, (dtype, shape) in moe_tensors(repo, L).items():
                weight_map[name] = shard_name(L, n)
                total += nbytes(dtype, shape)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    for L in shards_for:
        write_sparse_shard(out / shard_name(L, n), moe_tensors(repo, L))
    return out
