"""The family table: one declarative entry per MoE family transformers ships (ecosystem §2.4, §3).

An entry gives the config keys (with their aliases across transformers versions), which decoder
layers are MoE, the norm feeding the MoE (RMSNorm with ``w`` or ``1 + w``), where the gamma,
router weight and bias sit, how the experts are stored, the shared expert, the router math
(`RouterMath`, from the config values) and the backward's departures. `resolve_config` reads a
config through an entry and maps its router math to a kernel mode (`kernel_router`), or refuses.
Families whose norm or blocks the kernels cannot express are in `REFUSED`, each with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from mxcli.errors import shape_error
from mxcli.weightprep.checkpoint import Checkpoint
from mxcli.weightprep.families.layouts import Fused, FusedDense, PerExpert, Shared, Stacked
from mxcli.weightprep.families.routing import (
    ConfigError,
    RouterMath,
    RouterRefused,
    RouterSpec,
    check_kernel_kwargs,
    kernel_router,
    with_backward,
)
from mxcli.weightprep.sources import CT_QUANT_METHOD, CtQuant, ct_quant

REQUIRED = object()

# Norm kinds (the RMSNorm before the MoE block).
NORM_W = "rmsnorm"  # x_hat * w
NORM_1PW = "rmsnorm(1+w)"  # x_hat * (1 + w), folded into gamma (`fold_gamma`)


def fold_gamma(w: torch.Tensor, norm: str) -> torch.Tensor:
    """The kernel's gamma for a family's norm weight `w`.

    ``x_hat * w``: `w` as stored. ``x_hat * (1 + w)``: ``1 + w`` computed and stored in fp32,
    i.e. rounded once, to nearest-even, to fp32 — the same rounding the models apply
    (``1.0 + self.weight.float()`` in fp32), so the kernel's fp32 ``x * gamma`` sees the very
    factor the model multiplies by. For bf16 weights the sum is exact whenever ``|w| >= 2**-16``
    (w's lowest bit is then at least 2**-23, fp32's ulp at 1) or ``w == 0``; a smaller ``|w|``
    rounds to nearest-even, exactly as the model's own fp32 sum does.
    """
    if norm == NORM_1PW:
        return 1.0 + w.to(torch.float32)
    return w


# -- MoE layer rules: `mlp_layer_types` ("dense"/"sparse") wins wherever a config has it -------


def _typed(v: dict[str, Any], L: int) -> bool | None:
    types = v.get("mlp_layer_types")
    if isinstance(types, list) and L < len(types):
        return str(types[L]).lower() in ("sparse", "moe")
    return None


def _all_layers(v: dict[str, Any], L: int) -> bool:
    t = _typed(v, L)
    return True if t is None else t


def _qwen_layers(v: dict[str, Any], L: int) -> bool:
    t = _typed(v, L)
    if t is not None:
        return t
    step = v["decoder_sparse_step"] or 1
    return L not in (v["mlp_only_layers"] or []) and step > 0 and (L + 1) % step == 0


def _deepseek_layers(v: dict[str, Any], L: int) -> bool:
    t = _typed(v, L)
    if t is not None:
        return t
    freq = v.get("moe_layer_freq") or 1
    return L >= (v.get("first_k_dense_replace") or 0) and L % freq == 0


def _dense_prefix_layers(v: dict[str, Any], L: int) -> bool:
    t = _typed(v, L)
    if t is not None:
        return t
    return L >= (v.get("num_dense_layers") or 0)


def _llama4_layers(v: dict[str, Any], L: int) -> bool:
    if v.get("moe_layers") is not None:
        return L in v["moe_layers"]
    step = v["interleave_moe_layer_step"]
    return step > 0 and (L + 1) % step == 0


# -- router math from config values -------------------------------------------------------------


def _softmax(v: dict[str, Any]) -> RouterMath:
    # Mixtral, Qwen, OLMoE, MiniMax, HunYuan: softmax over E, top-k, renormalised when
    # norm_topk_prob (Mixtral/MiniMax/HunYuan always); Granite/JetMoE/gpt-oss: softmax over
    # the top-k logits, which is the same.
    return RouterMath(
        "softmax", v["top_k"], v["num_experts"], renormalize=bool(v.get("norm_topk_prob", True))
    )


def _softmax_logit_bias(v: dict[str, Any]) -> RouterMath:
    return replace(_softmax(v), bias="logit")  # gpt-oss: the router Linear has a bias


def _sigmoid_topk_logits(v: dict[str, Any]) -> RouterMath:
    return RouterMath("sigmoid", v["top_k"], v["num_experts"], renormalize=False)  # Llama-4


def _deepseek(v: dict[str, Any]) -> RouterMath:
    method = v.get("topk_method") or "noaux_tc"
    if method != "noaux_tc":
        raise RouterRefused(
            f"config.json: topk_method={method!r} (DeepSeek-V2 greedy routing: softmax over all E, "
            "no renormalisation) is not expressible; the kernel's NOAUX_TC is 'noaux_tc'"
        )
    scoring = str(v.get("scoring_func") or "sigmoid")
    if scoring != "sigmoid":
        raise RouterRefused(
            f"config.json: scoring_func={scoring!r} with a selection bias is not expressible "
            "(the kernel's NOAUX_TC scores with sigmoid)"
        )
    return RouterMath(
        scoring,
        v["top_k"],
        v["num_experts"],
        renormalize=bool(v["norm_topk_prob"]),
        bias="selection",
        scale=float(v["routed_scaling_factor"]),
        n_group=v["n_group"],
        topk_group=v["topk_group"],
        renorm_eps=1e-20,
    )


def _sigmoid_bias_one_group(v: dict[str, Any], renorm_eps: float = 0.0) -> RouterMath:
    # MiniMax-M2, Step-3.7, AFMoE, LFM2-MoE: sigmoid, choice on score + bias, renormalised
    use_bias = bool(v.get("use_expert_bias", True))
    return RouterMath(
        "sigmoid",
        v["top_k"],
        v["num_experts"],
        renormalize=bool(v.get("norm_topk_prob", True)),
        bias="selection" if use_bias else None,
        # a family without the key (MiniMax-M2) does not scale
        scale=float(v.get("routed_scaling_factor", 1.0)),
        renorm_eps=renorm_eps,
    )


# -- backward departures ------------------------------------------------------------------------


def _gpt_oss_bwd(v: dict[str, Any]) -> tuple[str, ...]:
    return (
        "gpt-oss experts use a clamped SwiGLU (alpha 1.702, limit "
        f"{v['swiglu_limit']}, up + 1) and biases; the backward kernel's MLP is plain SiLU "
        "without biases: the biases are written, the activation is not expressible",
    )


def _llama4_bwd(v: dict[str, Any]) -> tuple[str, ...]:
    return (
        "Llama-4 scales the expert *input* by the router score (PRE_SCALE); the backward "
        "kernel applies the affinity to the intermediate (AFFINITY_ON_I): not expressible",
    )


def _jetmoe_bwd(v: dict[str, Any]) -> tuple[str, ...]:
    return (
        "JetMoE adds an output bias (mlp.bias [H]) after the expert sum; the backward kernel has "
        "no output bias: not written, the backward is not exact",
    )


def _step3p7_bwd(v: dict[str, Any]) -> tuple[str, ...]:
    limits = [x for x in (v.get("swiglu_limits") or []) if x]
    if not limits:
        return ()
    return (
        "Step-3.7 clamps the SwiGLU of some layers (swiglu_limits); the backward kernel's SiLU "
        "is unclamped: not exact on those layers",
    )


def _no_bwd(v: dict[str, Any]) -> tuple[str, ...]:
    return ()


# -- the table ----------------------------------------------------------------------------------

# role -> (config key, or a tuple of aliases across transformers versions (first found wins),
# default). Every alias below was read from a transformers 5.23 config class or a released
# config.json. A default is the family's transformers default (`_values` asks the installed
# config class first; these are the fallback, read from TRANSFORMERS_DEFAULTS_VERSION's classes
# and checked against the installed ones by tests/weightprep/test_config_defaults.py); keys
# transformers does not read (topk_method, scoring_func, moe_layer_freq: its DeepSeek-V3 code is
# always sigmoid on every layer past first_k_dense_replace, modeling_deepseek_v3.py:136 and :492
# in 5.23) keep mxcli's reading.
TRANSFORMERS_DEFAULTS_VERSION = "5.23.0"
E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk")
_COMMON: dict[str, tuple[Any, Any]] = {
    "hidden_size": ("hidden_size", REQUIRED),
    "num_layers": ("num_hidden_layers", REQUIRED),
    "eps": ("rms_norm_eps", 1e-6),
    "num_experts": (E_KEYS, REQUIRED),
    "top_k": (K_KEYS, REQUIRED),
    "mlp_layer_types": ("mlp_layer_types", None),
}
_QWEN_KEYS = {
    **_COMMON,
    "intermediate_size": ("moe_intermediate_size", REQUIRED),
    "norm_topk_prob": ("norm_topk_prob", False),
    "decoder_sparse_step": ("decoder_sparse_step", 1),
    "mlp_only_layers": ("mlp_only_layers", []),
}
_DEEPSEEK_KEYS = {
    **_COMMON,
    "intermediate_size": ("moe_intermediate_size", REQUIRED),
    "n_group": (("n_group", "num_expert_group"), 1),
    "topk_group": ("topk_group", 1),
    "routed_scaling_factor": ("routed_scaling_factor", 1.0),
    "first_k_dense_replace": ("first_k_dense_replace", 0),
    "norm_topk_prob": (("norm_topk_prob", "moe_renormalize"), True),
    "moe_layer_freq": ("moe_layer_freq", 1),
    "n_shared_experts": (("n_shared_experts", "num_shared_experts"), 0),
    "scoring_func": ("scoring_func", "sigmoid"),
    "topk_method": ("topk_method", "noaux_tc"),
}
_MIXTRAL_KEYS = {
    **_COMMON,
    "eps": ("rms_norm_eps", 1e-5),
    "intermediate_size": ("intermediate_size", REQUIRED),
}


def _defaults(keys: dict[str, tuple[Any, Any]], **defaults: Any) -> dict[str, tuple[Any, Any]]:
    """`keys` with the defaults of the roles named replaced (a family's transformers defaults)."""
    return {role: (k, defaults.get(role, d)) for role, (k, d) in keys.items()}


# DeepseekV3Config / DeepseekV32Config (transformers 5.23): the DeepSeek-V3 sizes
_DEEPSEEK_V3_KEYS = _defaults(
    _DEEPSEEK_KEYS,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    n_shared_experts=1,
)


def _per_expert(
    base: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> PerExpert:
    return PerExpert(*(f"{base}.experts.{{e}}.{n}.weight" for n in names))


def _dense(
    base: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> PerExpert:
    return PerExpert(*(f"{base}.{n}.weight" for n in names))


_MIXTRAL_NAMES = ("w1", "w3", "w2")
_LAYER = ("model.layers.{L}.",)


@dataclass(frozen=True)
class Family:
    """One model family (see the module doc). Tensor names are relative to the layer prefix;
    ``router_bias`` lists the bias's spellings (the first present is used)."""

    name: str
    model_types: tuple[str, ...]
    keys: dict[str, tuple[Any, Any]]
    gamma: str
    router_weight: str
    experts: PerExpert | Fused | Stacked
    is_moe_layer: Callable[[dict[str, Any], int], bool]
    math: Callable[[dict[str, Any]], RouterMath]
    real_model: str
    router_bias: str | None = None
    router_bias_aliases: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = _LAYER
    norm: str = NORM_W
    backward: Callable[[dict[str, Any]], tuple[str, ...]] = _no_bwd
    shared: Shared | None = None
    shared_size: Callable[[dict[str, Any]], int] | None = None
    text_config: bool = False  # values live in config["text_config"] (multimodal wrappers)
    notes: tuple[str, ...] = field(default=())


def _moe_i_times_shared(v: dict[str, Any]) -> int:
    return int(v["intermediate_size"]) * int(v.get("n_shared_experts") or 0)


def _shared_key(v: dict[str, Any]) -> int:
    return int(v.get("shared_intermediate_size") or 0)


def _deepseek_like(
    name: str,
    real: str,
    *,
    base: str = "mlp",
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    bias: str = "mlp.gate.e_score_correction_bias",
    shared: bool = True,
    keys: dict[str, tuple[Any, Any]] | None = None,
    notes: tuple[str, ...] = (),
    also: tuple[str, ...] = (),
) -> Family:
    return Family(
        name=name,
        model_types=(name, *also),
        keys=keys or _DEEPSEEK_KEYS,
        gamma="post_attention_layernorm.weight",
        router_weight=f"{base}.gate.weight",
        router_bias=bias,
        router_bias_aliases=(f"{base}.gate.expert_bias", f"{base}.e_score_correction_bias"),
        experts=_per_expert(base, names),
        is_moe_layer=_deepseek_layers,
        math=_deepseek,
        shared=Shared(_dense(f"{base}.shared_experts"), "shared_intermediate_size")
        if shared
        else None,
        shared_size=_moe_i_times_shared if shared else None,
        real_model=real,
        notes=notes,
    )


_GRANITE_EXPERTS = Fused(
    "block_sparse_moe.input_linear.weight",
    "block_sparse_moe.output_linear.weight",
    interleaved=False,
    out_in=True,
)
_QWEN_SHARED = Shared(
    _dense("mlp.shared_expert"),
    "shared_intermediate_size",
    gate_weight="mlp.shared_expert_gate.weight",
)
_QWEN_SHARED_NOTE = (
    "the shared expert output is scaled by sigmoid(x @ shared_expert_gate.T) (written, not "
    "applied by the kernels)",
)

FAMILY_LIST: tuple[Family, ...] = (
    # -- softmax, top-k, renormalised: SOFTMAX ---------------------------------------------------
    Family(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        keys=_QWEN_KEYS,
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.gate.weight",
        experts=_per_expert("mlp"),
        is_moe_layer=_qwen_layers,
        math=_softmax,
        real_model="Qwen/Qwen3-30B-A3B",
    ),
    Family(
        name="qwen2_moe",
        model_types=("qwen2_moe",),
        keys={
            **_QWEN_KEYS,
            "shared_intermediate_size": ("shared_expert_intermediate_size", REQUIRED),
        },
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.gate.weight",
        experts=_per_expert("mlp"),
        is_moe_layer=_qwen_layers,
        math=_softmax,
        shared=_QWEN_SHARED,
        shared_size=_shared_key,
        real_model="Qwen/Qwen1.5-MoE-A2.7B (norm_topk_prob=false: refused)",
        notes=_QWEN_SHARED_NOTE,
    ),
    Family(
        name="qwen3_next",
        model_types=("qwen3_next",),
        keys={
            **_QWEN_KEYS,
            "norm_topk_prob": ("norm_topk_prob", True),
            "shared_intermediate_size": ("shared_expert_intermediate_size", 512),
        },
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.gate.weight",
        experts=_per_expert("mlp"),
        is_moe_layer=_qwen_layers,
        math=_softmax,
        norm=NORM_1PW,
        shared=_QWEN_SHARED,
        shared_size=_shared_key,
        real_model="Qwen/Qwen3-Next-80B-A3B (top_k=10: refused)",
        notes=_QWEN_SHARED_NOTE,
    ),
    Family(
        name="olmoe",
        model_types=("olmoe",),
        keys={
            **_QWEN_KEYS,
            "eps": ("rms_norm_eps", 1e-5),
            "intermediate_size": ("intermediate_size", REQUIRED),
        },
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.gate.weight",
        experts=_per_expert("mlp"),
        is_moe_layer=_all_layers,
        math=_softmax,
        real_model="allenai/OLMoE-1B-7B-0924 (norm_topk_prob=false: refused)",
    ),
    Family(
        name="mixtral",
        model_types=("mixtral",),
        keys=_MIXTRAL_KEYS,
        gamma="post_attention_layernorm.weight",
        router_weight="block_sparse_moe.gate.weight",
        experts=_per_expert("block_sparse_moe", _MIXTRAL_NAMES),
        is_moe_layer=_all_layers,
        math=_softmax,
        real_model="mistralai/Mixtral-8x7B-v0.1",
    ),
    Family(
        name="minimax",
        model_types=("minimax",),
        keys={**_MIXTRAL_KEYS, "intermediate_size": ("intermediate_size", REQUIRED)},
        gamma="post_attention_layernorm.weight",
        router_weight="block_sparse_moe.gate.weight",
        experts=_per_expert("block_sparse_moe", _MIXTRAL_NAMES),
        is_moe_layer=_all_layers,
        math=_softmax,
        real_model="MiniMaxAI/MiniMax-Text-01-hf",
    ),
    Family(
        name="hunyuan_v1_moe",
        model_types=("hunyuan_v1_moe",),
        keys={
            **_COMMON,
            "eps": ("rms_norm_eps", 1e-5),
            "intermediate_size": ("intermediate_size", REQUIRED),  # the experts' size
            "shared_intermediate_size": ("intermediate_size", 0),
            "num_shared_expert": ("num_shared_expert", 1),
        },
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.gate.wg.weight",
        experts=_per_expert("mlp"),
        is_moe_layer=_all_layers,
        math=_softmax,
        shared=Shared(_dense("mlp.shared_mlp"), "shared_intermediate_size"),
        shared_size=lambda v: (
            int(v["shared_intermediate_size"] or 0) * int(v.get("num_shared_expert") or 1)
        ),
        real_model="tencent/Hunyuan-A13B-Instruct",
    ),
    Family(
        name="granitemoe",
        model_types=("granitemoe",),
        keys={**_COMMON, "intermediate_size": ("intermediate_size", REQUIRED)},
        gamma="post_attention_layernorm.weight",
        router_weight="block_sparse_moe.router.layer.weight",
        experts=_GRANITE_EXPERTS,
        is_moe_layer=_all_layers,
        math=_softmax,
        real_model="ibm-granite/granite-3.1-3b-a800m-instruct",
    ),
    Family(
        name="granitemoeshared",
        model_types=("granitemoeshared",),
        keys={
            **_COMMON,
            "intermediate_size": ("intermediate_size", REQUIRED),
            "shared_intermediate_size": ("shared_intermediate_size", 0),
        },
        gamma="post_attention_layernorm.weight",
        router_weight="block_sparse_moe.router.layer.weight",
        experts=_GRANITE_EXPERTS,
        is_moe_layer=_all_layers,
        math=_softmax,
        shared=Shared(
            FusedDense("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"),
            "shared_intermediate_size",
        ),
        shared_size=_shared_key,
        real_model="ibm-research/moe-7b-1b-active-shared-experts",
    ),
    Family(
        name="jetmoe",
        model_types=("jetmoe",),
        keys={**_COMMON, "intermediate_size": ("intermediate_size", REQUIRED)},
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.router.layer.weight",
        experts=Fused(
            "mlp.input_linear.weight", "mlp.output_linear.weight", interleaved=False, out_in=True
        ),
        is_moe_layer=_all_layers,
        math=_softmax,
        backward=_jetmoe_bwd,
        real_model="jetmoe/jetmoe-8b",
    ),
    Family(
        name="gpt_oss",
        model_types=("gpt_oss",),
        keys={
            **_MIXTRAL_KEYS,
            "swiglu_limit": ("swiglu_limit", 7.0),
        },
        gamma="post_attention_layernorm.weight",
        router_weight="mlp.router.weight",
        router_bias="mlp.router.bias",
        experts=Fused(
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            interleaved=True,
            gate_up_bias="mlp.experts.gate_up_proj_bias",
            down_bias="mlp.experts.down_proj_bias",
        ),
        is_moe_layer=_all_layers,
        math=_softmax_logit_bias,
        backward=_gpt_oss_bwd,
        real_model="openai/gpt-oss-20b",
    ),
    # -- sigmoid of the top-k logits: SIGMOID ---------------------------------------------------
    Family(
        name="llama4",
        model_types=("llama4", "llama4_text"),
        keys={
            **_MIXTRAL_KEYS,
            "interleave_moe_layer_step": ("interleave_moe_layer_step", 1),
            "moe_layers": ("moe_layers", None),
        },
        prefixes=("language_model.model.layers.{L}.", "model.language_model.layers.{L}.") + _LAYER,
        gamma="post_attention_layernorm.weight",
        router_weight="feed_forward.router.weight",
        experts=Fused(
            "feed_forward.experts.gate_up_proj",
            "feed_forward.experts.down_proj",
            interleaved=False,
        ),
        is_moe_layer=_llama4_layers,
        math=_sigmoid_topk_logits,
        backward=_llama4_bwd,
        shared=Shared(_dense("feed_forward.shared_expert"), "intermediate_size"),
        shared_size=lambda v: int(v["intermediate_size"]),
        text_config=True,
        real_model="meta-llama/Llama-4-Scout-17B-16E",
    ),
    # -- DeepSeek-V3 routing (sigmoid + correction bias, group-limited): NOAUX_TC ---------------
    _deepseek_like(
        "deepseek_v3",
        "deepseek-ai/DeepSeek-V3",
        keys=_DEEPSEEK_V3_KEYS,
        notes=("layers past num_hidden_layers (the MTP module) are not converted",),
        # Kimi-K2 ships its own config code (model_type kimi_k2) over the DeepSeek-V3
        # architecture and config keys (DeepseekV3ForCausalLM)
        also=("kimi_k2",),
    ),
    _deepseek_like("deepseek_v32", "deepseek-ai/DeepSeek-V3.2-Exp", keys=_DEEPSEEK_V3_KEYS),
    _deepseek_like(
        "glm4_moe",
        "zai-org/GLM-4.5",
        keys=_defaults(_DEEPSEEK_KEYS, eps=1e-5, first_k_dense_replace=1, n_shared_experts=1),
    ),
    _deepseek_like(
        "glm4_moe_lite",
        "zai-org/GLM-4.7-Flash",
        # its config class makes layer 0 dense, the others MoE, when mlp_layer_types is missing
        keys=_defaults(
            _DEEPSEEK_KEYS,
            eps=1e-5,
            routed_scaling_factor=1.8,
            first_k_dense_replace=1,
            n_shared_experts=1,
        ),
    ),
    _deepseek_like(
        "dots1",
        "rednote-hilab/dots.llm1.inst",
        keys={**_DEEPSEEK_KEYS, "norm_topk_prob": ("norm_topk_prob", False)},
    ),
    _deepseek_like(
        "solar_open",
        "upstage/Solar-Open-100B",
        keys=_defaults(_DEEPSEEK_KEYS, eps=1e-5, n_shared_experts=1),
    ),
    _deepseek_like(
        "exaone_moe",
        "LGAI-EXAONE/K-EXAONE-236B-A23B",
        keys=_defaults(
            _DEEPSEEK_KEYS, eps=1e-5, routed_scaling_factor=2.5, first_k_dense_replace=1
        ),
    ),
    _deepseek_like(
        "mimo_v2_flash",
        "XiaomiMiMo/MiMo-V2-Flash",
        shared=False,
        keys=_defaults(_DEEPSEEK_KEYS, eps=1e-5, first_k_dense_replace=1),
    ),
    _deepseek_like(
        "bailing_hybrid",
        "inclusionAI/Ring-flash-linear-2.0",
        keys=_defaults(_DEEPSEEK_V3_KEYS, first_k_dense_replace=2),
    ),
    _deepseek_like(
        "kimi_linear",
        "moonshotai/Kimi-Linear-48B-A3B-Instruct",
        keys=_defaults(
            _DEEPSEEK_KEYS,
            eps=1e-5,
            routed_scaling_factor=2.446,
            first_k_dense_replace=1,
            n_shared_experts=1,
        ),
        base="block_sparse_moe",
        names=_MIXTRAL_NAMES,
        bias="block_sparse_moe.gate.e_score_correction_bias",
    ),
    # -- sigmoid + selection bias, one group: NOAUX_TC with n_group = 1 -------------------------
    Family(
        name="minimax_m2",
        model_types=("minimax_m2",),
        keys={**_MIXTRAL_KEYS, "eps": ("rms_norm_eps", 1e-6)},
        gamma="post_attention_layernorm.weight",
        router_weight="block_sparse_moe.gate.weight",
        router_bias="block_sparse_moe.e_score_correction_bias",
        router_bias_aliases=("block_sparse_moe.gate.e_score_correction_bias",),
        experts=_per_expert("block_sparse_moe", _MIXTRAL_NAMES),
        is_moe_layer=_all_layers,
        math=_sigmoid_bias_one_group,
        real_model="MiniMaxAI/MiniMax-M2",
    ),
    Family(
        name="step3p7",
        model_types=("step3p7",),
        keys={
            **_COMMON,
            "eps": ("rms_norm_eps", 1e-5),
            "intermediate_size": ("moe_intermediate_size", REQUIRED),
            "routed_scaling_factor": ("moe_router_scaling_factor", 1.0),
            "shared_intermediate_size": (("share_expert_dim", "share_expert_dims"), 1280),
            "swiglu_limits": ("swiglu_limits", None),
        },
        prefixes=("language_model.layers.{L}.", "model.language_model.layers.{L}.") + _LAYER,
        gamma="post_attention_layernorm.weight",
        router_weight="moe.gate.weight",
        router_bias="moe.router_bias",
        router_bias_aliases=("moe.gate.e_score_correction_bias",),
        experts=Stacked("moe.gate_proj.weight", "moe.up_proj.weight", "moe.down_proj.weight"),
        is_moe_layer=_all_layers,
        math=_sigmoid_bias_one_group,
        norm=NORM_1PW,
        backward=_step3p7_bwd,
        shared=Shared(_dense("share_expert"), "shared_intermediate_size"),
        shared_size=_shared_key,
        text_config=True,
        real_model="stepfun-ai/Step-3.7-Flash",
    ),
    Family(
        name="afmoe",
        model_types=("afmoe",),
        keys={
            **_COMMON,
            "eps": ("rms_norm_eps", 1e-5),
            "intermediate_size": ("moe_intermediate_size", REQUIRED),
            "routed_scaling_factor": ("route_scale", 1.0),
            "num_dense_layers": ("num_dense_layers", 1),
            "n_shared_experts": ("num_shared_experts", 2),
        },
        gamma="pre_mlp_layernorm.weight",
        router_weight="mlp.router.gate.weight",
        router_bias="mlp.expert_bias",
        experts=_per_expert("mlp"),
        is_moe_layer=_dense_prefix_layers,
        math=partial(_sigmoid_bias_one_group, renorm_eps=1e-20),
        shared=Shared(_dense("mlp.shared_experts"), "shared_intermediate_size"),
        shared_size=_moe_i_times_shared,
        real_model="arcee-ai/Trinity-Mini",
        notes=("the block's post_mlp_layernorm (after the MoE output) is not a kernel input",),
    ),
    Family(
        name="lfm2_moe",
        model_types=("lfm2_moe",),
        keys={
            **_COMMON,
            "eps": ("norm_eps", 1e-5),
            "intermediate_size": ("moe_intermediate_size", REQUIRED),
            "routed_scaling_factor": ("routed_scaling_factor", 1.0),
            "num_dense_layers": ("num_dense_layers", 2),
            "norm_topk_prob": ("norm_topk_prob", True),
            "use_expert_bias": ("use_expert_bias", True),
        },
        gamma="ffn_norm.weight",
        router_weight="feed_forward.gate.weight",
        router_bias="feed_forward.expert_bias",
        experts=_per_expert("feed_forward", _MIXTRAL_NAMES),
        is_moe_layer=_dense_prefix_layers,
        math=partial(_sigmoid_bias_one_group, renorm_eps=1e-6),
        real_model="LiquidAI/LFM2-8B-A1B",
    ),
)

FAMILIES: dict[str, Family] = {f.name: f for f in FAMILY_LIST}


@dataclass(frozen=True)
class Refused:
    """A family the kernels cannot express at all, and why (one line)."""

    name: str
    reason: str
    real_model: str
    router: str  # the family's router, for the README table


REFUSED_LIST: tuple[Refused, ...] = (
    Refused(
        "deepseek_v2",
        "greedy routing (softmax over all E, top-k, no renormalisation, scaled)",
        "deepseek-ai/DeepSeek-V2-Lite",
        "softmax over E, greedy / group-limited greedy",
    ),
    Refused(
        "ernie4_5_moe",
        "a bias added to the softmax probabilities before top-k (moe_statics.e_score_correction_bias)",
        "baidu/ERNIE-4.5-21B-A3B-PT",
        "softmax + probability bias",
    ),
    Refused(
        "phimoe",
        "sparsemixer routing and LayerNorm blocks",
        "microsoft/Phi-3.5-MoE-instruct",
        "sparsemixer",
    ),
    Refused(
        "dbrx", "a LayerNorm (not RMSNorm) before the MoE", "databricks/dbrx-base", "softmax top-k"
    ),
    Refused(
        "cohere2_moe",
        "a LayerNorm (not RMSNorm) before a parallel attention/MoE block",
        "CohereLabs/command-a-moe (unreleased)",
        "softmax top-k",
    ),
    Refused(
        "flex_olmo",
        "post-norm blocks (the MoE reads the un-normalised residual stream)",
        "allenai/FlexOlmo-7x7B-1T",
        "softmax, no renormalisation",
    ),
    Refused(
        "longcat_flash",
        "zero (identity) experts among the routed ones",
        "meituan-longcat/LongCat-Flash-Chat",
        "softmax + bias, zero experts",
    ),
    Refused(
        "qwen3_5_moe",
        "a (1 + w) RMSNorm inside a vision-language wrapper whose released configs route more "
        "than 8 experts per token",
        "Qwen/Qwen3.5-397B-A17B",
        "softmax top-k renormalised",
    ),
)
REFUSED: dict[str, Refused] = {r.name: r for r in REFUSED_LIST}

_BY_MODEL_TYPE = {mt: f for f in FAMILY_LIST for mt in f.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def detect_family(config: dict[str, Any], model_type: str | None = None) -> Family:
    """The family for ``--model-type`` (when given and not ``auto``) or ``config["model_type"]``."""
    supported = ", ".join(supported_model_types())
    if model_type and model_type != "auto":
        fam = _BY_MODEL_TYPE.get(model_type)
        if fam is None:
            if model_type in REFUSED:
                raise RouterRefused(
                    f"--model-type {model_type}: not expressible by the kernels: "
                    f"{REFUSED[model_type].reason}"
                )
            raise ConfigError(
                f"--model-type {model_type!r} is not supported (supported: {supported})"
            )
        return fam
    mt = config.get("model_type")
    if mt is None:
        raise ConfigError(
            f"config.json: missing key 'model_type' (or pass --model-type: {supported})"
        )
    if str(mt) in REFUSED:
        raise RouterRefused(
            f"config.json: model_type {mt!r} is not expressible by the kernels: {REFUSED[str(mt)].reason}"
        )
    fam = _BY_MODEL_TYPE.get(str(mt))
    if fam is None:
        raise ConfigError(
            f"config.json: model_type {mt!r} is not a supported MoE family (supported: {supported})"
        )
    return fam


@dataclass(frozen=True)
class ModelConfig:
    """The config values of one checkpoint, resolved through its family."""

    family: Family
    values: dict[str, Any]  # role -> value
    used: dict[str, Any]  # config key -> value, as recorded in the manifest
    # DeepSeek FP8 source block size, or a compressed-tensors source's scheme (`CtQuant`)
    fp8_block: tuple[int, int] | CtQuant | None
    router: RouterSpec
    defaulted: tuple[Defaulted, ...] = ()  # keys config.json lacks, read as transformers does

    def defaults_note(self) -> str | None:
        """The plan's and the manifest's line on the keys read with their defaults."""
        if not self.defaulted:
            return None
        by: dict[str, list[str]] = {}
        for d in self.defaulted:
            by.setdefault(d.source, []).append(f"{d.key}={d.value!r}")
        parts = [f"{', '.join(kv)} ({src})" for src, kv in by.items()]
        return "config.json lacks these keys, read with their defaults: " + "; ".join(parts)

    @property
    def H(self) -> int:
        return int(self.values["hidden_size"])

    @property
    def E(self) -> int:
        return int(self.values["num_experts"])

    @property
    def I(self) -> int:  # noqa: E743 - the spec's name for the intermediate size
        return int(self.values["intermediate_size"])

    @property
    def shared_I(self) -> int | None:
        if self.family.shared is None:
            return None
        Is = int(self.values.get(self.family.shared.intermediate) or 0)
        return Is or None

    @property
    def num_layers(self) -> int:
        return int(self.values["num_layers"])

    def moe_layers(self) -> list[int]:
        return [L for L in range(self.num_layers) if self.family.is_moe_layer(self.values, L)]


def _lookup(cfg: dict[str, Any], key: Any) -> tuple[str, Any]:
    keys = key if isinstance(key, tuple) else (key,)
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return k, cfg[k]
    return keys[0], REQUIRED


# The most decoder layers a plan iterates over (released MoE configs have under 100, e.g.
# Qwen3-235B-A22B 94): a larger num_hidden_layers is a broken config, refused before any loop
# runs over it (10**12 hung --dry-run).
MAX_LAYERS = 4096

# role -> (what a value must be, test). Sizes are positive integers; counts and layer rules are
# integers >= 0; router values are numbers whose range is the prefill kernel's to judge
# (`check_kernel_kwargs`), so a NaN or a negative value reaches the kernel contract's message.
_POSITIVE = ("hidden_size", "num_layers", "num_experts", "top_k", "intermediate_size")
_COUNTS = (
    "first_k_dense_replace", "moe_layer_freq", "n_shared_experts", "decoder_sparse_step",
    "num_dense_layers", "interleave_moe_layer_step", "num_shared_expert",
    "shared_intermediate_size",
)  # fmt: skip


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(role: str) -> tuple[str, Callable[[Any], bool]] | None:
    if role == "num_layers":
        return f"an integer in [1, {MAX_LAYERS}]", lambda v: _is_int(v) and 0 < v <= MAX_LAYERS
    if role in _POSITIVE:
        return "a positive integer", lambda v: _is_int(v) and v > 0
    if role in _COUNTS:
        return "an integer >= 0", lambda v: _is_int(v) and v >= 0
    if role in ("n_group", "topk_group"):
        return "an integer", _is_int
    if role in ("eps", "routed_scaling_factor", "swiglu_limit"):
        return "a number", _is_number
    if role in ("norm_topk_prob", "use_expert_bias"):
        return "true or false", lambda v: isinstance(v, bool)
    if role in ("scoring_func", "topk_method"):
        return "a string", lambda v: isinstance(v, str)
    if role in ("mlp_only_layers", "moe_layers"):
        return (
            "a list of layer indices (integers >= 0)",
            lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
        )
    if role == "mlp_layer_types":
        return (
            "a list of strings ('dense'/'sparse')",
            lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        )
    if role == "swiglu_limits":
        return (
            "a list of numbers or nulls",
            lambda v: isinstance(v, list) and all(x is None or _is_number(x) for x in v),
        )
    return None


def _check_value(where: str, key: str, role: str, value: Any) -> None:
    kind = _kind(role)
    if kind is not None and not kind[1](value):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(f"{where}: {key} must be {kind[0]}, got {shown}")


def _transformers_config(config: dict[str, Any], family: Family) -> tuple[Any, str] | None:
    """The family's installed transformers config class built from `config` (its present
    keys), and ``"transformers X.Y ClassName"``; None when transformers is not installed, the
    family is not one of its model types, or the class refuses the config (any exception:
    transformers is an optional dependency and its checks are not mxcli's messages)."""
    try:
        import logging
        import warnings

        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = CONFIG_MAPPING[family.name]
        present = {k: v for k, v in config.items() if v is not None}
        tf_logger = logging.getLogger("transformers")
        level = tf_logger.level
        tf_logger.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inst = cls(**present)
                if family.text_config:
                    inst = inst.get_text_config()
        finally:
            tf_logger.setLevel(level)
        return inst, f"transformers {transformers.__version__} {type(inst).__name__}"
    except Exception:
        return None


@dataclass(frozen=True)
class Defaulted:
    """A config key absent from config.json, read as transformers defaults it."""

    key: str
    value: Any
    source: str  # "transformers 5.23.0 DeepseekV3Config" or the family table's

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "from": self.source}


def _values(
    config: dict[str, Any], family: Family
) -> tuple[dict[str, Any], dict[str, Any], str, list[Defaulted], dict[str, str]]:
    cfg = config
    where = "config.json"
    if family.text_config and isinstance(config.get("text_config"), dict):
        cfg, where = config["text_config"], "config.json text_config"
    values: dict[str, Any] = {}
    used: dict[str, Any] = {}
    key_of: dict[str, str] = {}
    missing: dict[str, tuple[str, Any]] = {}  # role -> (key, table default)
    for role, (key, default) in family.keys.items():
        k, val = _lookup(cfg, key)
        key_of[role] = k
        if val is REQUIRED:
            if default is REQUIRED:
                raise ConfigError(f"{where}: missing key {k!r} (needed by {family.name})")
            missing[role] = (k, default)
            continue
        _check_value(where, k, role, val)  # before anything iterates over it (num_layers)
        values[role] = used[k] = val
    defaulted: list[Defaulted] = []
    if missing:
        tf = _transformers_config(config, family)
        table = f"mxcli's {family.name} table (transformers {TRANSFORMERS_DEFAULTS_VERSION})"
        for role, (k, default) in missing.items():
            val, source = default, table
            if tf is not None and getattr(tf[0], k, None) is not None:
                val, source = getattr(tf[0], k), tf[1]
            if val is not None:
                _check_value(f"{source} default", k, role, val)
                defaulted.append(Defaulted(k, val, source))
            values[role] = val
    if family.shared_size is not None:
        values["shared_intermediate_size"] = family.shared_size(values)
    return values, used, where, defaulted, key_of


def resolve_config(config: dict[str, Any], family: Family) -> ModelConfig:
    """Read the family's keys from config.json and map its router to a kernel mode.

    `ConfigError` for a missing or unusable value; `RouterRefused` when the router (or, with a
    forced family, the config's own semantics) is not expressible (see `check_semantics`).
    """
    values, used, where, defaulted, key_of = _values(config, family)
    math_ = family.math(values)
    check_semantics(config, family, math_)
    router = with_backward(kernel_router(math_, family.name), family.backward(values))
    roles = ("eps", "top_k", "n_group", "topk_group", "routed_scaling_factor")
    kernel_keys: dict[str, str] = {a: key_of[a] for a in roles if a in key_of}
    check_kernel_kwargs(router, values["eps"], math_.num_experts, where, kernel_keys)
    if math_.bias is None and family.router_bias is not None and family.name != "gpt_oss":
        family = replace(family, router_bias=None)  # e.g. LFM2 with use_expert_bias=false
    fp8_block, qmethod = _quantization(config, family)
    used["quantization_config.quant_method"] = qmethod
    return ModelConfig(family, values, used, fp8_block, router, tuple(defaulted))


# -- semantic checks of a forced family (--model-type) ------------------------------------------


def _traits(fam: Family, m: RouterMath) -> dict[str, Any]:
    return {
        "norm": fam.norm,
        "scoring": m.scoring,
        "top-k normalisation": m.renormalize,
        "router bias": m.bias,
    }


def check_semantics(config: dict[str, Any], family: Family, math_: RouterMath) -> None:
    """`RouterRefused` when the config contradicts a family forced with ``--model-type``.

    The config's own family (by its model_type), when known, is resolved too and its norm,
    scoring function, top-k normalisation and bias kind must match the forced family's.
    Whatever the model_type, explicit keys must agree: ``scoring_func``, ``norm_topk_prob``.
    """
    own_mt = str(config.get("model_type") or "")
    forced = own_mt not in family.model_types
    if not forced:
        return
    prefix = f"--model-type {family.name}: config.json (model_type {own_mt!r})"
    if own_mt in REFUSED:
        raise RouterRefused(f"{prefix} is not expressible: {REFUSED[own_mt].reason}")
    own = _BY_MODEL_TYPE.get(own_mt)
    if own is not None:
        try:
            own_math = own.math(_values(config, own)[0])
        except ConfigError:
            own_math = None
        if own_math is not None:
            mine, theirs = _traits(family, math_), _traits(own, own_math)
            diff = [f"{k} {theirs[k]} vs {mine[k]}" for k in mine if mine[k] != theirs[k]]
            if diff:
                raise RouterRefused(f"{prefix} contradicts {family.name}: " + "; ".join(diff))
    cfg = config.get("text_config") if family.text_config else None
    cfg = cfg if isinstance(cfg, dict) else config
    sf = cfg.get("scoring_func")
    if sf is not None and str(sf) != math_.scoring:
        raise RouterRefused(f"{prefix} has scoring_func={sf!r}; {family.name} uses {math_.scoring}")
    ntp = cfg.get("norm_topk_prob", cfg.get("moe_renormalize"))
    if ntp is not None and bool(ntp) != math_.renormalize:
        raise RouterRefused(
            f"{prefix} has norm_topk_prob={ntp}; {family.name} "
            + ("renormalises" if math_.renormalize else "does not renormalise")
        )


_BIAS_SUFFIXES = ("e_score_correction_bias", "expert_bias")


def bind_tensor_names(
    m: ModelConfig, ckpt: Checkpoint, prefix: str, forced: bool = False
) -> ModelConfig:
    """`m` with the router bias spelling this checkpoint uses; `RouterRefused` when a forced
    family has no bias but the checkpoint's router has one (its math would be ignored)."""
    fam = m.family
    if fam.router_bias is not None:
        for name in (fam.router_bias, *fam.router_bias_aliases):
            if ckpt.has(prefix + name):
                return replace(m, family=replace(fam, router_bias=name))
        return m
    if forced:
        for name in ckpt.names():
            if name.startswith(prefix) and name.endswith(_BIAS_SUFFIXES):
                raise RouterRefused(
                    f"--model-type {fam.name}: the checkpoint's router has a selection bias "
                    f"({name}) that {fam.name} does not use"
                )
    return m


def _quantization(
    config: dict[str, Any], family: Family
) -> tuple[tuple[int, int] | CtQuant | None, str | None]:
    q = config.get("quantization_config")
    if q is None:
        return None, None
    if not isinstance(q, dict):
        raise ConfigError("config.json: quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size", [128, 128])
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ConfigError(
                f"config.json: quantization_config.weight_block_size {block!r} is not [rows, cols]"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt not in ("e4m3", "e5m2"):
            raise ConfigError(f"config.json: quantization_config.fmt {fmt!r} is not supported")
        return (block[0], block[1]), "fp8"
    if method == "mxfp4" and isinstance(family.experts, Fused):
        return None, "mxfp4"
    if method == CT_QUANT_METHOD and not isinstance(family.experts, Fused):
        return ct_quant(q), CT_QUANT_METHOD
    raise ConfigError(
        f"config.json: quantization_config.quant_method {method!r} is not supported for {family.name} "
        "(supported: fp8 block-scaled, compressed-tensors MXFP8/FP8 for per-expert layouts, "
        "mxfp4 for gpt_oss)"
    )


def check_shape(ckpt: Checkpoint, name: str, expected: tuple[int, ...], why: str) -> None:
    """`InputError` when the header shape of `name` disagrees with the config."""
    got = ckpt.info(name).shape
    if tuple(got) != tuple(expected):
        raise shape_error(f"{name} ({why})", list(expected), list(got))


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
