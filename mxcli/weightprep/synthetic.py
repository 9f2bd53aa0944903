"""Tiny, deterministic Hugging Face-layout MoE checkpoints for every supported family.

Each builder writes ``config.json`` (the real keys of the family) and sharded safetensors with
the real tensor names, plus ``model.safetensors.index.json``. Shards are cut so that the first
MoE layer's experts span two files (for fused-expert families: its gate/up and its down sit in
different files). DeepSeek-V3 is written as an FP8 128x128 block-scaled source with
``weight_scale_inv`` companions (and an MTP layer past ``num_hidden_layers``); gpt-oss as an
MXFP4 ``_blocks``/``_scales`` source (or bf16 with ``quantized=False``).

Values are a pure function of ``(seed, tensor name)``, so a checkpoint can be written shard by
shard without holding the model, and two builds with the same arguments are byte-identical::

    from mxcli.weightprep.synthetic import build_checkpoint
    ck = build_checkpoint("qwen3_moe", "/tmp/tiny-qwen3")       # softmax router
    ck = build_checkpoint("deepseek_v3", "/tmp/tiny-dsv3")      # noaux_tc router, FP8 source
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "llama4")
VOCAB = 64

# tensor name -> (shape, kind); kinds: "w" weight, "norm" RMSNorm gamma, "bias", "ebias" (fp32
# e_score_correction_bias), "fp8" (FP8 weight; its "_scale_inv" is added), "mxfp4" (blocks +
# scales of a fused [E, out, in] weight)
Spec = dict[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class SyntheticCheckpoint:
    """What `build_checkpoint` wrote."""

    path: Path
    family: str
    config: dict[str, Any]
    moe_layers: list[int]
    files: list[str]


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _values(seed: int, name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    g = _gen(seed, name)
    if kind == "norm":
        return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    if kind == "bias":
        return (0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    if kind == "ebias":
        return (0.05 * torch.randn(shape, generator=g)).to(torch.float32)
    std = 1.0 / max(1, shape[-1]) ** 0.5
    return (std * torch.randn(shape, generator=g)).to(torch.bfloat16)


def fp8_block_quantize(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style FP8 source: ``(w_fp8 [M, N] e4m3, scale_inv [ceil(M/bm), ceil(N/bn)] fp32)``
    with ``scale_inv = amax(block) / 448``, so that ``w ~= w_fp8 * scale_inv``."""
    M, N = w.shape
    bm, bn = block
    gm, gn = -(-M // bm), -(-N // bn)
    x = torch.zeros(gm * bm, gn * bn, dtype=torch.float32)
    x[:M, :N] = w.to(torch.float32)
    blocks = x.view(gm, bm, gn, bn)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = (amax / 448.0).to(torch.float32)
    q = (blocks / scale_inv.view(gm, 1, gn, 1)).clamp(-448, 448).view(gm * bm, gn * bn)[:M, :N]
    return q.to(torch.float8_e4m3fn), scale_inv


def _mxfp4(seed: int, name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Random MXFP4 ``[E, out, in]`` weight: ``_blocks [E, out, in/32, 16]``, ``_scales [E, out, in/32]``."""
    E, o, i = shape
    g = _gen(seed, name)
    blocks = torch.randint(0, 256, (E, o, i // 32, 16), generator=g, dtype=torch.int32).to(
        torch.uint8
    )
    scales = torch.randint(118, 124, (E, o, i // 32), generator=g, dtype=torch.int32).to(
        torch.uint8
    )
    return {name + "_blocks": blocks, name + "_scales": scales}


def _materialize(
    seed: int, name: str, shape: tuple[int, ...], kind: str
) -> dict[str, torch.Tensor]:
    if kind == "mxfp4":
        return _mxfp4(seed, name, shape)
    if kind == "fp8":
        q, s = fp8_block_quantize(_values(seed, name, shape, "w"))
        return {name: q, name + "_scale_inv": s}
    return {name: _values(seed, name, shape, kind)}


def _mlp(
    spec: Spec,
    pre: str,
    names: tuple[str, str, str],
    H: int,
    I: int,  # noqa: E741 (spec notation)
    kind: str = "w",
) -> None:
    gate, up, down = names
    spec[pre + gate] = ((I, H), kind)
    spec[pre + up] = ((I, H), kind)
    spec[pre + down] = ((H, I), kind)


_GUD = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _layer_common(spec: Spec, pre: str, H: int, kind: str = "w") -> None:
    spec[pre + "input_layernorm.weight"] = ((H,), "norm")
    spec[pre + "self_attn.q_proj.weight"] = ((H, H), kind)
    spec[pre + "post_attention_layernorm.weight"] = ((H,), "norm")


def _qwen(v: dict[str, Any], shared: bool) -> tuple[dict[str, Any], Spec, list[int]]:
    H, I, E, N = v["hidden_size"], v["intermediate_size"], v["num_experts"], v["num_layers"]  # noqa: E741
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM"],
        "model_type": "qwen2_moe" if shared else "qwen3_moe",
        "hidden_size": H,
        "intermediate_size": 2 * I,
        "moe_intermediate_size": I,
        "num_hidden_layers": N,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts": E,
        "num_experts_per_tok": v["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
    }
    if shared:
        cfg["shared_expert_intermediate_size"] = v["shared_intermediate_size"] or 2 * I
    cfg.update(v["overrides"])
    spec: Spec = {"model.embed_tokens.weight": ((VOCAB, H), "w")}
    moe = []
    for L in range(N):
        pre = f"model.layers.{L}."
        _layer_common(spec, pre, H)
        step = cfg["decoder_sparse_step"]
        if L not in cfg["mlp_only_layers"] and (L + 1) % step == 0:
            moe.append(L)
            spec[pre + "mlp.gate.weight"] = ((E, H), "w")
            for e in range(E):
                _mlp(spec, f"{pre}mlp.experts.{e}.", _GUD, H, I)
            if shared:
                _mlp(
                    spec,
                    pre + "mlp.shared_expert.",
                    _GUD,
                    H,
                    cfg["shared_expert_intermediate_size"],
                )
                spec[pre + "mlp.shared_expert_gate.weight"] = ((1, H), "w")
        else:
            _mlp(spec, pre + "mlp.", _GUD, H, cfg["intermediate_size"])
    spec["model.norm.weight"] = ((H,), "norm")
    spec["lm_head.weight"] = ((VOCAB, H), "w")
    return cfg, spec, moe


def _mixtral(v: dict[str, Any]) -> tuple[dict[str, Any], Spec, list[int]]:
    H, I, E, N = v["hidden_size"], v["intermediate_size"], v["num_experts"], v["num_layers"]  # noqa: E741
    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": N,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_local_experts": E,
        "num_experts_per_tok": v["top_k"],
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
        **v["overrides"],
    }
    spec: Spec = {"model.embed_tokens.weight": ((VOCAB, H), "w")}
    for L in range(N):
        pre = f"model.layers.{L}."
        _layer_common(spec, pre, H)
        spec[pre + "block_sparse_moe.gate.weight"] = ((E, H), "w")
        for e in range(E):
            _mlp(
                spec,
                f"{pre}block_sparse_moe.experts.{e}.",
                ("w1.weight", "w3.weight", "w2.weight"),
                H,
                I,
            )
    spec["model.norm.weight"] = ((H,), "norm")
    spec["lm_head.weight"] = ((VOCAB, H), "w")
    return cfg, spec, list(range(N))


def _deepseek(v: dict[str, Any]) -> tuple[dict[str, Any], Spec, list[int]]:
    H, I, E, N = v["hidden_size"], v["intermediate_size"], v["num_experts"], v["num_layers"]  # noqa: E741
    kind = "fp8" if v["quantized"] else "w"
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "intermediate_size": 2 * I,
        "moe_intermediate_size": I,
        "num_hidden_layers": N,
        "num_attention_heads": 4,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": v["top_k"],
        "n_group": 4 if E % 4 == 0 else 1,
        "topk_group": 2 if E % 4 == 0 else 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
    }
    if v["quantized"]:
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    cfg.update(v["overrides"])
    Is = I * int(cfg["n_shared_experts"])
    spec: Spec = {"model.embed_tokens.weight": ((VOCAB, H), "w")}
    moe = []
    for L in range(N + 1):  # layer N: the MTP module (not a decoder layer; must be skipped)
        pre = f"model.layers.{L}."
        _layer_common(spec, pre, H, kind)
        if L >= cfg["first_k_dense_replace"]:
            if L < N:
                moe.append(L)
            spec[pre + "mlp.gate.weight"] = ((E, H), "w")
            spec[pre + "mlp.gate.e_score_correction_bias"] = ((E,), "ebias")
            for e in range(E):
                _mlp(spec, f"{pre}mlp.experts.{e}.", _GUD, H, I, kind)
            if Is:
                _mlp(spec, pre + "mlp.shared_experts.", _GUD, H, Is, kind)
        else:
            _mlp(spec, pre + "mlp.", _GUD, H, cfg["intermediate_size"], kind)
    spec["model.norm.weight"] = ((H,), "norm")
    spec["lm_head.weight"] = ((VOCAB, H), "w")
    return cfg, spec, moe


def _gpt_oss(v: dict[str, Any]) -> tuple[dict[str, Any], Spec, list[int]]:
    H, I, E, N = v["hidden_size"], v["intermediate_size"], v["num_experts"], v["num_layers"]  # noqa: E741
    cfg: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": N,
        "num_attention_heads": 4,
        "num_local_experts": E,
        "num_experts_per_tok": v["top_k"],
        "experts_per_token": v["top_k"],
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
    }
    if v["quantized"]:
        cfg["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    cfg.update(v["overrides"])
    spec: Spec = {"model.embed_tokens.weight": ((VOCAB, H), "w")}
    for L in range(N):
        pre = f"model.layers.{L}."
        _layer_common(spec, pre, H)
        spec[pre + "mlp.router.weight"] = ((E, H), "w")
        spec[pre + "mlp.router.bias"] = ((E,), "bias")
        if v["quantized"]:
            spec[pre + "mlp.experts.gate_up_proj"] = ((E, 2 * I, H), "mxfp4")  # out x in
            spec[pre + "mlp.experts.gate_up_proj_bias"] = ((E, 2 * I), "bias")
            spec[pre + "mlp.experts.down_proj"] = ((E, H, I), "mxfp4")
        else:
            spec[pre + "mlp.experts.gate_up_proj"] = ((E, H, 2 * I), "w")  # in x out, interleaved
            spec[pre + "mlp.experts.gate_up_proj_bias"] = ((E, 2 * I), "bias")
            spec[pre + "mlp.experts.down_proj"] = ((E, I, H), "w")
        spec[pre + "mlp.experts.down_proj_bias"] = ((E, H), "bias")
    spec["model.norm.weight"] = ((H,), "norm")
    spec["lm_head.weight"] = ((VOCAB, H), "w")
    return cfg, spec, list(range(N))


def _llama4(v: dict[str, Any]) -> tuple[dict[str, Any], Spec, list[int]]:
    H, I, E, N = v["hidden_size"], v["intermediate_size"], v["num_experts"], v["num_layers"]  # noqa: E741
    text = {
        "model_type": "llama4_text",
        "hidden_size": H,
        "intermediate_size": I,
        "intermediate_size_mlp": 2 * I,
        "num_hidden_layers": N,
        "num_attention_heads": 4,
        "num_local_experts": E,
        "num_experts_per_tok": v["top_k"],
        "interleave_moe_layer_step": 2 if N > 1 else 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
    }
    text.update(v["overrides"])
    cfg = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 64},
        "torch_dtype": "bfloat16",
    }
    step = text["interleave_moe_layer_step"]
    moe_layers = text.get("moe_layers") or list(range(step - 1, N, step))
    base = "language_model.model."
    spec: Spec = {base + "embed_tokens.weight": ((VOCAB, H), "w")}
    for L in range(N):
        pre = f"{base}layers.{L}."
        _layer_common(spec, pre, H)
        if L in moe_layers:
            spec[pre + "feed_forward.router.weight"] = ((E, H), "w")
            spec[pre + "feed_forward.experts.gate_up_proj"] = ((E, H, 2 * I), "w")
            spec[pre + "feed_forward.experts.down_proj"] = ((E, I, H), "w")
            _mlp(spec, pre + "feed_forward.shared_expert.", _GUD, H, I)
        else:
            _mlp(spec, pre + "feed_forward.", _GUD, H, text["intermediate_size_mlp"])
    spec[base + "norm.weight"] = ((H,), "norm")
    spec["language_model.lm_head.weight"] = ((VOCAB, H), "w")
    return cfg, spec, sorted(moe_layers)


_BUILDERS: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], Spec, list[int]]]] = {
    "qwen3_moe": lambda v: _qwen(v, shared=False),
    "qwen2_moe": lambda v: _qwen(v, shared=True),
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
}
_DEFAULT_LAYERS = {"deepseek_v3": 3, "llama4": 2}
_DEFAULT_TOP_K = {"llama4": 1}


def _split_points(names: list[str], moe_layers: list[int], num_shards: int) -> list[int]:
    """Indices where new shards start: the first cut halves the first MoE layer's experts (so
    they span exactly two files), the others split the tensors after that layer evenly."""
    if num_shards <= 1:
        return []
    n = len(names)
    first = [
        i
        for i, nm in enumerate(names)
        if moe_layers and f"layers.{moe_layers[0]}." in nm and ".experts." in nm
    ]
    if len(first) < 2:
        return [k * n // num_shards for k in range(1, num_shards)]
    cuts = [first[len(first) // 2]]
    rest0 = first[-1] + 1
    more = num_shards - 2
    cuts += (
        [rest0 + k * (n - rest0) // (more + 1) for k in range(1, more + 1)]
        if n - rest0 > more
        else []
    )
    return sorted({c for c in cuts if 0 < c < n})


def build_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    num_layers: int | None = None,
    hidden_size: int = 256,
    intermediate_size: int = 128,
    num_experts: int = 8,
    top_k: int | None = None,
    shared_intermediate_size: int | None = None,
    quantized: bool = True,
    num_shards: int = 3,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> SyntheticCheckpoint:
    """Write a tiny `family` checkpoint into `out_dir` (created; must be empty or absent).

    `quantized` selects the FP8 (DeepSeek-V3) or MXFP4 (gpt-oss) source form; other families
    are bf16. `config_overrides` replaces config.json keys (for Llama-4, text_config keys).
    """
    if family not in _BUILDERS:
        raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    v = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_experts": num_experts,
        "top_k": top_k or _DEFAULT_TOP_K.get(family, 2),
        "num_layers": num_layers or _DEFAULT_LAYERS.get(family, 2),
        "shared_intermediate_size": shared_intermediate_size,
        "quantized": quantized,
        "overrides": dict(config_overrides or {}),
    }
    cfg, spec, moe = _BUILDERS[family](v)
    names = list(spec)
    cuts = _split_points(names, moe, num_shards)
    bounds = [0, *cuts, len(names)]
    nshards = len(bounds) - 1
    files = (
        ["model.safetensors"]
        if nshards == 1
        else [f"model-{i + 1:05d}-of-{nshards:05d}.safetensors" for i in range(nshards)]
    )
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from mxcli.errors import MxcliError
    from mxcli.fsutil import atomic_output

    weight_map: dict[str, str] = {}
    total = 0
    for fname, a, b in zip(files, bounds[:-1], bounds[1:], strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for name in names[a:b]:
            shape, kind = spec[name]
            tensors.update(_materialize(seed, name, shape, kind))
        # atomic, and a full disk is one line (`mxcli demo` writes these)
        with atomic_output(out / fname, force=True) as tmp:
            try:
                save_file(tensors, str(tmp), metadata={"format": "pt"})
            except SafetensorError as exc:
                raise MxcliError(f"{out / fname}: cannot write ({exc}); nothing written") from None
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
        del tensors
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if nshards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return SyntheticCheckpoint(out, family, cfg, moe, files)
