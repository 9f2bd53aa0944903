"""Tiny real-architecture checkpoints written by transformers itself (test-only dependency).

`build_tiny(model_type, path)` makes a 2-layer model of the family with H=128, E=8, top_k=2 from
transformers' own config and model classes, perturbs the norm weights and router biases (zero
or one at init, which would hide a mix-up), casts it to bf16 and `save_pretrained`s it as
safetensors. `model_routing` runs the model's own MoE block on seeded hidden states (after the
model's own norm) and captures the expert indices and weights its router hands the experts.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

TINY: dict[str, Any] = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=64,
    max_position_embeddings=128, pad_token_id=0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
E, K = 8, 2
# Multi-head latent attention at tiny size (DeepSeek-style families).
_MLA_NO_Q_LORA: dict[str, Any] = dict(
    kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32
)
_MLA: dict[str, Any] = dict(q_lora_rank=64, **_MLA_NO_Q_LORA)
# Per model_type: the keys its config class reads for E / top_k and anything else needed to
# make layer 1 a MoE layer at tiny size.
OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=E, num_experts_per_tok=K, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        shared_expert_intermediate_size=128,
    ),
    "qwen3_next": dict(
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        shared_expert_intermediate_size=128,
        layer_types=["full_attention"] * 2,
    ),
    "olmoe": dict(num_experts=E, num_experts_per_tok=K, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=E, num_experts_per_tok=K),
    "minimax": dict(
        num_local_experts=E, num_experts_per_tok=K, layer_types=["full_attention", "full_attention"]
    ),
    "hunyuan_v1_moe": dict(num_experts=E, moe_topk=K),
    "granitemoe": dict(num_local_experts=E, num_experts_per_tok=K),
    "granitemoeshared": dict(
        num_local_experts=E, num_experts_per_tok=K, shared_intermediate_size=128
    ),
    "jetmoe": dict(num_local_experts=E, num_experts_per_tok=K, kv_channels=64),
    "gpt_oss": dict(num_local_experts=E, num_experts_per_tok=K, intermediate_size=128),
    "deepseek_v3": dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        **_MLA,
    ),
    "deepseek_v32": dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        **_MLA,
        index_n_heads=2,
        index_head_dim=64,
        index_topk=16,
    ),
    "glm4_moe": dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
    "glm4_moe_lite": dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.8,
        **_MLA,
    ),
    "dots1": dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
    ),
    "solar_open": dict(
        n_routed_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
    ),
    "exaone_moe": dict(
        num_experts=E,
        num_experts_per_tok=K,
        first_k_dense_replace=1,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
    ),
    "mimo_v2_flash": dict(n_routed_experts=E, num_experts_per_tok=K),
    "bailing_hybrid": dict(
        num_experts=E,
        num_experts_per_token=K,
        first_k_dense_replace=1,
        num_expert_group=2,
        topk_group=1,
        num_shared_experts=1,
        **_MLA,
        layer_types=["full_attention"] * 2,
    ),
    "kimi_linear": dict(
        num_experts=E,
        num_experts_per_token=K,
        first_k_dense_replace=1,
        num_expert_group=2,
        topk_group=1,
        num_shared_experts=1,
        **_MLA_NO_Q_LORA,
        layer_types=["full_attention"] * 2,
    ),
    "minimax_m2": dict(num_local_experts=E, num_experts_per_tok=K),
    "afmoe": dict(
        num_experts=E,
        num_experts_per_tok=K,
        num_dense_layers=1,
        num_shared_experts=1,
        route_scale=2.0,
    ),
    "lfm2_moe": dict(
        num_experts=E,
        num_experts_per_tok=K,
        num_dense_layers=1,
        layer_types=["full_attention"] * 2,
        routed_scaling_factor=1.5,
    ),
    "step3p7": dict(
        num_local_experts=E,
        n_routed_experts=E,
        num_experts_per_tok=K,
        share_expert_dim=128,
        mlp_layer_types=["dense", "sparse"],
        layer_types=["full_attention"] * 2,
    ),
    "llama4": dict(
        num_local_experts=E,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        intermediate_size_mlp=256,
        no_rope_layers=[1, 1],
    ),
}
TEXT_CONFIG = {"llama4", "step3p7"}
VISION: dict[str, dict[str, Any]] = {
    "step3p7": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
    ),
    "llama4": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=56,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    ),
}


def build_tiny(model_type: str, path: Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint of `model_type` to `path` (see the module doc)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    warnings.filterwarnings("ignore")
    kw = {**TINY, **OVERRIDES.get(model_type, {})}
    cls = CONFIG_MAPPING[model_type]
    if model_type in TEXT_CONFIG:
        cfg = cls(text_config=kw, vision_config=VISION.get(model_type))
    else:
        cfg = cls(**kw)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    except ValueError:
        from transformers import AutoModel

        model = AutoModel.from_config(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("layernorm.weight", "norm.weight")) and t.dim() == 1:
                t.add_(0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif name.endswith(("router.bias", "gate.bias")):
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
            elif name.endswith(("gate.weight", "router.weight", "layer.weight", "wg.weight")):
                t.normal_(0.0, 0.08, generator=g)  # distinct logits, not near-ties
    model.to(torch.bfloat16).save_pretrained(str(path))
    return path


def load_model(path: Path) -> Any:
    """The saved model in fp32 (exact upcast of the bf16 weights we converted)."""
    from transformers import AutoModel, AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    except ValueError:  # vision-language wrappers without a causal-LM auto class (Step-3.7)
        return AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()


def decoder_layer(model: Any, layer: int) -> Any:
    for name, mod in model.named_modules():
        if name.endswith(f"layers.{layer}") and "vision" not in name:
            return mod
    raise LookupError(f"no decoder layer {layer}")


def model_routing(
    model: Any, layer: int, norm: str, block: str, x: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [T, K], weights [T, K])`` the model's MoE block routes ``norm(x)`` with.

    Captured where the model hands them on: the experts' ``(hidden, top_k_index,
    top_k_weights)`` arguments; Llama-4 (dense ``[T, E]`` sigmoid scores) and JetMoE (expert-
    sorted gates) from their router's output.
    """
    lay = decoder_layer(model, layer)
    if not hasattr(lay, block):  # transformers 5 renames on load (block_sparse_moe -> mlp)
        block = next(b for b in ("mlp", "feed_forward", "moe") if hasattr(lay, b))
    moe = lay.get_submodule(block)
    T = x.shape[0]
    seen: dict[str, torch.Tensor] = {}

    def on_experts(mod: Any, args: tuple, kwargs: dict) -> None:
        a = list(args) + list(kwargs.values())
        seen["index"], seen["weights"] = a[1].reshape(T, -1), a[2].reshape(T, -1).float()

    def on_router(mod: Any, args: tuple, out: Any) -> None:
        if type(model).__name__.startswith("Llama4"):
            dense = out[0].reshape(T, -1).float()  # sigmoid of the top-k, 0 elsewhere
        else:  # JetMoE: (sorted slot, token, gate, expert sizes, logits)
            _, token, gates, sizes, logits = out
            expert = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
            dense = torch.zeros(T, logits.shape[-1])
            dense[token, expert] = gates.float()
        w, i = dense.topk(top_k, dim=-1)
        seen["index"], seen["weights"] = i, w

    if hasattr(moe, "experts") and not type(model).__name__.startswith("Llama4"):
        h = moe.experts.register_forward_pre_hook(on_experts, with_kwargs=True)
    else:
        h = moe.router.register_forward_hook(on_router)
    try:
        with torch.no_grad():
            xn = lay.get_submodule(norm)(x.to(torch.float32).unsqueeze(0))
            moe(xn)
    finally:
        h.remove()
    return seen["index"], seen["weights"]


def config_of(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))
