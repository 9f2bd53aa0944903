"""Model families: one declarative table entry each (ecosystem §2.4, §3).

An entry says where a family's config values live, which decoder layers are MoE, where the
RMSNorm gamma before the MoE, the router weight and bias sit, how the experts are stored on disk
(`PerExpert`, `Fused`), the shared expert if any, and which router mode of the prefill kernel
reproduces the family's routing (and whether exactly).

Canonical kernel layouts every expert layout is mapped to (bwd spec §1):
``gate_up [E, H, 2, I]`` (gate = ``[:, :, 0]``, up = ``[:, :, 1]``) and ``down [E, I, H]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mxcli.errors import InputError, MxcliError, shape_error
from mxcli.weightprep.checkpoint import FP8_SOURCE_DTYPES, Checkpoint, CheckpointReader
from mxcli.weightprep.sources import decode_mxfp4, dequant_fp8_block

REQUIRED = object()

# Prefill kernel limits (prefill spec §2.3): beyond them the router is not expressible.
MAX_EXPERTS = 512
MAX_TOP_K = 8
MAX_GROUPS = 8


class ConfigError(MxcliError):
    """config.json lacks a key the family needs, or holds a value mxcli does not support."""


@dataclass(frozen=True)
class RouterSpec:
    """The prefill kernel's router mode for a family, and how faithful it is.

    ``act_fn`` is a `RouterActFnType` name. ``exact`` is False when the kernel's mode computes
    different affinities than the family's own router; ``notes`` say how. ``bwd_notes`` are the
    family's departures from the backward kernel's MLP (activation, where the affinity applies).
    """

    act_fn: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    exact: bool = True
    notes: tuple[str, ...] = ()
    bwd_notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The manifest's and the plan's ``router`` entry."""
        return {
            "act_fn": self.act_fn,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "exact": self.exact,
            "notes": list(self.notes),
            "backward_notes": list(self.bwd_notes),
        }


# -- expert layouts on disk ---------------------------------------------------------------------


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def t2(x: torch.Tensor) -> torch.Tensor:
    """Contiguous transpose of the last two dims (through an int16 view for 16-bit dtypes, which
    torch copies several times faster)."""
    if x.element_size() == 2:
        return x.view(torch.int16).transpose(-1, -2).contiguous().view(x.dtype)
    return x.transpose(-1, -2).contiguous()


class Scratch:
    """Reusable work buffers, one per key: page-faulting fresh memory for every expert chunk
    costs more than the copies themselves on many hosts."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype)
            self._bufs[key] = buf
        return buf[:n].view(shape)

    def transpose(self, x: torch.Tensor, key: str = "t") -> torch.Tensor:
        """`t2` into a reused buffer (valid until the next call with the same key)."""
        if x.element_size() == 2:
            out = self.get(key, (x.shape[-1], x.shape[-2]), torch.int16)
            out.copy_(x.view(torch.int16).transpose(-1, -2))
            return out.view(x.dtype)
        return t2(x)


def load_weight(rd: CheckpointReader, name: str, fp8_block: tuple[int, int] | None) -> torch.Tensor:
    """One 2-D source weight as bf16, FP8 block weights dequantized with ``name + "_scale_inv"``."""
    info = rd.ckpt.info(name)
    if info.dtype in FP8_SOURCE_DTYPES:
        scale_name = name + "_scale_inv"
        if not rd.ckpt.has(scale_name):
            raise ConfigError(f"{name}: FP8 weight without its {scale_name} (cannot dequantize)")
        return dequant_fp8_block(
            rd.get(name), rd.get(scale_name), fp8_block or (128, 128), name=name
        )
    return _to_bf16(rd.get(name))


@dataclass(frozen=True)
class PerExpert:
    """One ``[I, H]`` gate, ``[I, H]`` up and ``[H, I]`` down Linear weight per expert (out x in).

    Qwen, DeepSeek (``gate_proj/up_proj/down_proj``) and Mixtral (``w1/w3/w2``).
    ``gate_up[e] = stack(gate.T, up.T, axis=1)`` -> ``[H, 2, I]``; ``down[e] = down.T`` -> ``[I, H]``.
    """

    gate: str = "mlp.experts.{e}.gate_proj.weight"
    up: str = "mlp.experts.{e}.up_proj.weight"
    down: str = "mlp.experts.{e}.down_proj.weight"

    def expected(self, prefix: str, E: int, H: int, I: int) -> dict[str, tuple[int, ...]]:  # noqa: E741
        out: dict[str, tuple[int, ...]] = {}
        for e in range(E):
            out[prefix + self.gate.format(e=e)] = (I, H)
            out[prefix + self.up.format(e=e)] = (I, H)
            out[prefix + self.down.format(e=e)] = (H, I)
        return out

    def load(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        H: int,
        I: int,  # noqa: E741
        fp8_block: Any,  # noqa: E741
        scratch: Scratch | None = None,
        key: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1`` as ``(gate_up [c, H, 2, I], down [c, I, H])`` bf16, in `scratch`
        buffers (valid until the next load with the same `key`) when one is given."""
        c = e1 - e0
        sc = scratch or Scratch()
        gate_up = sc.get(key + "gate_up", (c, H, 2, I), torch.bfloat16)  # [c, H, 2, I]
        down = sc.get(key + "down", (c, I, H), torch.bfloat16)  # [c, I, H]
        for j, e in enumerate(range(e0, e1)):
            gate_up[j, :, 0, :] = sc.transpose(
                load_weight(rd, prefix + self.gate.format(e=e), fp8_block)
            )
            gate_up[j, :, 1, :] = sc.transpose(
                load_weight(rd, prefix + self.up.format(e=e), fp8_block)
            )
            down[j] = sc.transpose(load_weight(rd, prefix + self.down.format(e=e), fp8_block))
        return gate_up, down


@dataclass(frozen=True)
class Fused:
    """All experts in one tensor per projection: ``gate_up [E, H, 2I]`` and ``down [E, I, H]``
    (in x out), or their MXFP4 form ``<name>_blocks [E, out, in/32, 16]`` + ``<name>_scales``.

    - ``interleaved`` (gpt-oss): gate = ``[..., 0::2]``, up = ``[..., 1::2]`` of the 2I axis, so
      ``view(E, H, I, 2).transpose(-1, -2)`` -> ``[E, H, 2, I]``.
    - otherwise (Llama-4): gate = first half, so ``view(E, H, 2, I)``.
    Biases (gpt-oss): ``gate_up_bias [E, 2I]`` (same interleave) -> ``[E, 2, I]``; ``down_bias [E, H]``.
    """

    gate_up: str
    down: str
    interleaved: bool
    gate_up_bias: str | None = None
    down_bias: str | None = None

    def mxfp4(self, ckpt: Checkpoint, prefix: str) -> bool:
        return ckpt.has(prefix + self.gate_up + "_blocks")

    def expected(
        self,
        prefix: str,
        E: int,
        H: int,
        I: int,  # noqa: E741
        ckpt: Checkpoint | None = None,  # noqa: E741
    ) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        if ckpt is not None and self.mxfp4(ckpt, prefix):
            # MXFP4 stores out x in, 32 values (16 bytes) per block along `in`
            for n, (o, i) in ((self.gate_up, (2 * I, H)), (self.down, (H, I))):
                if i % 32:
                    raise InputError(
                        f"{prefix + n}: MXFP4 needs its input dim ({i}) a multiple of 32"
                    )
                out[prefix + n + "_blocks"] = (E, o, i // 32, 16)
                out[prefix + n + "_scales"] = (E, o, i // 32)
        else:
            out[prefix + self.gate_up] = (E, H, 2 * I)
            out[prefix + self.down] = (E, I, H)
        if self.gate_up_bias:
            out[prefix + self.gate_up_bias] = (E, 2 * I)
        if self.down_bias:
            out[prefix + self.down_bias] = (E, H)
        return out

    def _split_2i(self, x: torch.Tensor, I: int) -> torch.Tensor:  # noqa: E741
        """``[..., 2I]`` -> ``[..., 2, I]`` (gate, up)."""
        if self.interleaved:
            return x.view(*x.shape[:-1], I, 2).transpose(-1, -2)
        return x.view(*x.shape[:-1], 2, I)

    def load(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        H: int,
        I: int,  # noqa: E741
        fp8_block: Any,  # noqa: E741
        scratch: Scratch | None = None,
        key: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1`` as ``(gate_up [c, H, 2, I], down [c, I, H])`` bf16 (see `PerExpert.load`)."""
        sc = scratch or Scratch()
        if self.mxfp4(rd.ckpt, prefix):
            gu_name, d_name = prefix + self.gate_up, prefix + self.down
            gu_oi = decode_mxfp4(
                rd.get_rows(gu_name + "_blocks", e0, e1), rd.get_rows(gu_name + "_scales", e0, e1)
            )
            d_oi = decode_mxfp4(
                rd.get_rows(d_name + "_blocks", e0, e1), rd.get_rows(d_name + "_scales", e0, e1)
            )
            gu = t2(gu_oi)  # [c, 2I, H] -> [c, H, 2I] (transformers: transpose(1, 2))
            down = t2(d_oi)  # [c, H, I] -> [c, I, H]
        else:
            gu = _to_bf16(rd.get_rows(prefix + self.gate_up, e0, e1))  # [c, H, 2I]
            down = _to_bf16(rd.get_rows(prefix + self.down, e0, e1)).contiguous()  # [c, I, H]
        gate_up = sc.get(key + "gate_up", (e1 - e0, H, 2, I), torch.bfloat16)
        gate_up.copy_(self._split_2i(gu, I))  # [c, H, 2, I]
        return gate_up, down

    def load_biases(
        self,
        rd: CheckpointReader,
        prefix: str,
        e0: int,
        e1: int,
        I: int,  # noqa: E741
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gub = db = None
        if self.gate_up_bias:
            gub = self._split_2i(
                rd.get_rows(prefix + self.gate_up_bias, e0, e1), I
            ).contiguous()  # [c, 2, I]
        if self.down_bias:
            db = rd.get_rows(prefix + self.down_bias, e0, e1).contiguous()  # [c, H]
        return gub, db


@dataclass(frozen=True)
class Shared:
    """A dense shared expert (``[Is, H]`` gate/up, ``[H, Is]`` down), written as an E=1 stack for
    the backward kernel's single-expert dense path; optionally its sigmoid gate ``[1, H]``."""

    mlp: PerExpert
    intermediate: str  # role name in the resolved config values
    gate_weight: str | None = None


# -- layer rules and routers --------------------------------------------------------------------


def _all_layers(v: dict[str, Any], L: int) -> bool:
    return True


def _qwen_layers(v: dict[str, Any], L: int) -> bool:
    step = int(v["decoder_sparse_step"])
    return (
        v["num_experts"] > 0 and L not in v["mlp_only_layers"] and step > 0 and (L + 1) % step == 0
    )


def _deepseek_layers(v: dict[str, Any], L: int) -> bool:
    return L >= int(v["first_k_dense_replace"]) and L % int(v["moe_layer_freq"]) == 0


def _llama4_layers(v: dict[str, Any], L: int) -> bool:
    if v.get("moe_layers") is not None:
        return L in v["moe_layers"]
    step = int(v["interleave_moe_layer_step"])
    return step > 0 and (L + 1) % step == 0


def _softmax_renorm(v: dict[str, Any]) -> RouterSpec:
    # Mixtral: softmax, top-k, always renormalised == softmax over the K selected logits.
    return RouterSpec("SOFTMAX", v["top_k"])


def _qwen_router(v: dict[str, Any]) -> RouterSpec:
    if v["norm_topk_prob"]:
        return RouterSpec("SOFTMAX", v["top_k"])
    return RouterSpec(
        "SOFTMAX",
        v["top_k"],
        exact=False,
        notes=(
            "norm_topk_prob=false: the model weights experts by softmax(logits)[top-k] without "
            "renormalisation; the kernel's SOFTMAX renormalises over the K selected, so its "
            "affinities are larger by 1/sum(top-k probabilities) (selection is identical)",
        ),
    )


def _deepseek_router(v: dict[str, Any]) -> RouterSpec:
    if v["scoring_func"] != "sigmoid":
        raise ConfigError(
            f"config.json: scoring_func={v['scoring_func']!r} is not supported (expected 'sigmoid')"
        )
    if v["topk_method"] != "noaux_tc":
        raise ConfigError(
            f"config.json: topk_method={v['topk_method']!r} is not supported (expected 'noaux_tc')"
        )
    E, G = v["num_experts"], int(v["n_group"])
    if G <= 0 or E % G:
        raise ConfigError(f"config.json: n_routed_experts ({E}) is not divisible by n_group ({G})")
    notes: list[str] = []
    exact = True
    if not v["norm_topk_prob"]:
        exact = False
        notes.append(
            "norm_topk_prob=false: the kernel's NOAUX_TC always renormalises the selected weights"
        )
    return RouterSpec(
        "NOAUX_TC",
        v["top_k"],
        n_group=G,
        topk_group=int(v["topk_group"]),
        routed_scaling_factor=float(v["routed_scaling_factor"]),
        exact=exact,
        notes=tuple(notes),
    )


def _gpt_oss_router(v: dict[str, Any]) -> RouterSpec:
    return RouterSpec(
        "SOFTMAX",
        v["top_k"],
        bwd_notes=(
            "gpt-oss experts use a clamped SwiGLU (alpha 1.702, limit "
            f"{v['swiglu_limit']}, up + 1) and biases; the backward kernel's MLP is plain SiLU "
            "without biases: the biases are written, the activation is not expressible",
        ),
    )


def _llama4_router(v: dict[str, Any]) -> RouterSpec:
    return RouterSpec(
        "SIGMOID",
        v["top_k"],
        bwd_notes=(
            "Llama-4 scales the expert *input* by the router score (PRE_SCALE); the backward "
            "kernel applies the affinity to the intermediate (AFFINITY_ON_I): not expressible",
        ),
    )


def with_kernel_limits(spec: RouterSpec, E: int) -> RouterSpec:
    """Add notes (and clear ``exact``) where the prefill kernel's limits are exceeded."""
    problems = []
    if E > MAX_EXPERTS:
        problems.append(f"E={E} > {MAX_EXPERTS}")
    if spec.top_k > MAX_TOP_K:
        problems.append(f"top_k={spec.top_k} > {MAX_TOP_K}")
    if spec.act_fn == "NOAUX_TC" and spec.n_group > MAX_GROUPS:
        problems.append(f"n_group={spec.n_group} > {MAX_GROUPS}")
    if spec.act_fn == "NOAUX_TC" and spec.topk_group > MAX_GROUPS:
        problems.append(f"topk_group={spec.topk_group} > {MAX_GROUPS}")
    if not problems:
        return spec
    note = (
        "exceeds the prefill kernel's router limits (" + ", ".join(problems) + "): not expressible"
    )
    return RouterSpec(**{**spec.__dict__, "exact": False, "notes": (*spec.notes, note)})


# -- the table ----------------------------------------------------------------------------------

# Config keys: role -> key (a tuple lists alternative spellings, first found wins) and default.
_COMMON = {
    "hidden_size": ("hidden_size", REQUIRED),
    "num_layers": ("num_hidden_layers", REQUIRED),
    "eps": ("rms_norm_eps", 1e-6),
}
_QWEN_KEYS = {
    **_COMMON,
    "num_experts": ("num_experts", REQUIRED),
    "top_k": ("num_experts_per_tok", REQUIRED),
    "intermediate_size": ("moe_intermediate_size", REQUIRED),
    "norm_topk_prob": ("norm_topk_prob", False),
    "decoder_sparse_step": ("decoder_sparse_step", 1),
    "mlp_only_layers": ("mlp_only_layers", []),
}


@dataclass(frozen=True)
class Family:
    """One model family: config keys, tensor names (relative to the layer prefix), layer rule,
    expert layout and router mode."""

    name: str
    model_types: tuple[str, ...]
    keys: dict[str, tuple[Any, Any]]
    prefixes: tuple[str, ...]  # decoder layer name prefix, "{L}" = layer index
    gamma: str
    router_weight: str
    router_bias: str | None
    experts: PerExpert | Fused
    is_moe_layer: Callable[[dict[str, Any], int], bool]
    router: Callable[[dict[str, Any]], RouterSpec]
    shared: Shared | None = None
    text_config: bool = False  # values live in config["text_config"] (Llama-4)
    notes: tuple[str, ...] = field(default=())


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            keys=_QWEN_KEYS,
            prefixes=("model.layers.{L}.",),
            gamma="post_attention_layernorm.weight",
            router_weight="mlp.gate.weight",
            router_bias=None,
            experts=PerExpert(),
            is_moe_layer=_qwen_layers,
            router=_qwen_router,
        ),
        Family(
            name="qwen2_moe",
            model_types=("qwen2_moe",),
            keys={
                **_QWEN_KEYS,
                "shared_intermediate_size": ("shared_expert_intermediate_size", REQUIRED),
            },
            prefixes=("model.layers.{L}.",),
            gamma="post_attention_layernorm.weight",
            router_weight="mlp.gate.weight",
            router_bias=None,
            experts=PerExpert(),
            is_moe_layer=_qwen_layers,
            router=_qwen_router,
            shared=Shared(
                PerExpert(
                    "mlp.shared_expert.gate_proj.weight",
                    "mlp.shared_expert.up_proj.weight",
                    "mlp.shared_expert.down_proj.weight",
                ),
                "shared_intermediate_size",
                gate_weight="mlp.shared_expert_gate.weight",
            ),
            notes=(
                "the shared expert output is scaled by sigmoid(x @ shared_expert_gate.T) (written, not applied by the kernels)",
            ),
        ),
        Family(
            name="mixtral",
            model_types=("mixtral",),
            keys={
                **_COMMON,
                "eps": ("rms_norm_eps", 1e-5),
                "num_experts": ("num_local_experts", REQUIRED),
                "top_k": ("num_experts_per_tok", REQUIRED),
                "intermediate_size": ("intermediate_size", REQUIRED),
            },
            prefixes=("model.layers.{L}.",),
            gamma="post_attention_layernorm.weight",
            router_weight="block_sparse_moe.gate.weight",
            router_bias=None,
            experts=PerExpert(
                "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight",
                "block_sparse_moe.experts.{e}.w2.weight",
            ),
            is_moe_layer=_all_layers,
            router=_softmax_renorm,
        ),
        Family(
            name="deepseek_v3",
            model_types=("deepseek_v3",),
            keys={
                **_COMMON,
                "num_experts": ("n_routed_experts", REQUIRED),
                "top_k": ("num_experts_per_tok", REQUIRED),
                "intermediate_size": ("moe_intermediate_size", REQUIRED),
                "n_group": ("n_group", REQUIRED),
                "topk_group": ("topk_group", REQUIRED),
                "routed_scaling_factor": ("routed_scaling_factor", REQUIRED),
                "first_k_dense_replace": ("first_k_dense_replace", REQUIRED),
                "norm_topk_prob": ("norm_topk_prob", True),
                "moe_layer_freq": ("moe_layer_freq", 1),
                "n_shared_experts": ("n_shared_experts", 0),
                "scoring_func": ("scoring_func", "sigmoid"),
                "topk_method": ("topk_method", "noaux_tc"),
            },
            prefixes=("model.layers.{L}.",),
            gamma="post_attention_layernorm.weight",
            router_weight="mlp.gate.weight",
            router_bias="mlp.gate.e_score_correction_bias",
            experts=PerExpert(),
            is_moe_layer=_deepseek_layers,
            router=_deepseek_router,
            shared=Shared(
                PerExpert(
                    "mlp.shared_experts.gate_proj.weight",
                    "mlp.shared_experts.up_proj.weight",
                    "mlp.shared_experts.down_proj.weight",
                ),
                "shared_intermediate_size",
            ),
            notes=("layers past num_hidden_layers (the MTP module) are not converted",),
        ),
        Family(
            name="gpt_oss",
            model_types=("gpt_oss",),
            keys={
                **_COMMON,
                "eps": ("rms_norm_eps", 1e-5),
                "num_experts": ("num_local_experts", REQUIRED),
                "top_k": (("num_experts_per_tok", "experts_per_token"), REQUIRED),
                "intermediate_size": ("intermediate_size", REQUIRED),
                "swiglu_limit": ("swiglu_limit", 7.0),
            },
            prefixes=("model.layers.{L}.",),
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
            router=_gpt_oss_router,
        ),
        Family(
            name="llama4",
            model_types=("llama4", "llama4_text"),
            keys={
                **_COMMON,
                "eps": ("rms_norm_eps", 1e-5),
                "num_experts": ("num_local_experts", REQUIRED),
                "top_k": ("num_experts_per_tok", REQUIRED),
                "intermediate_size": ("intermediate_size", REQUIRED),
                "interleave_moe_layer_step": ("interleave_moe_layer_step", 1),
                "moe_layers": ("moe_layers", None),
            },
            prefixes=("language_model.model.layers.{L}.", "model.layers.{L}."),
            gamma="post_attention_layernorm.weight",
            router_weight="feed_forward.router.weight",
            router_bias=None,
            experts=Fused(
                "feed_forward.experts.gate_up_proj",
                "feed_forward.experts.down_proj",
                interleaved=False,
            ),
            is_moe_layer=_llama4_layers,
            router=_llama4_router,
            shared=Shared(
                PerExpert(
                    "feed_forward.shared_expert.gate_proj.weight",
                    "feed_forward.shared_expert.up_proj.weight",
                    "feed_forward.shared_expert.down_proj.weight",
                ),
                "intermediate_size",
            ),
            text_config=True,
        ),
    )
}

_BY_MODEL_TYPE = {mt: f for f in FAMILIES.values() for mt in f.model_types}


def detect_family(config: dict[str, Any], model_type: str | None = None) -> Family:
    """The family for ``--model-type`` (when given and not ``auto``) or ``config["model_type"]``."""
    supported = ", ".join(sorted(_BY_MODEL_TYPE))
    if model_type and model_type != "auto":
        fam = _BY_MODEL_TYPE.get(model_type)
        if fam is None:
            raise ConfigError(
                f"--model-type {model_type!r} is not supported (supported: {supported})"
            )
        return fam
    mt = config.get("model_type")
    if mt is None:
        raise ConfigError(
            f"config.json: missing key 'model_type' (or pass --model-type: {supported})"
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
    fp8_block: tuple[int, int] | None  # DeepSeek FP8 source block size
    router: RouterSpec

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
        if k in cfg:
            return k, cfg[k]
    return keys[0], REQUIRED


def resolve_config(config: dict[str, Any], family: Family) -> ModelConfig:
    """Read the family's keys from config.json; `ConfigError` for a missing or unusable value."""
    cfg = config
    where = "config.json"
    if family.text_config and isinstance(config.get("text_config"), dict):
        cfg, where = config["text_config"], "config.json text_config"
    values: dict[str, Any] = {}
    used: dict[str, Any] = {}
    key_of: dict[str, str] = {}
    for role, (key, default) in family.keys.items():
        k, val = _lookup(cfg, key)
        if val is REQUIRED:
            if default is REQUIRED:
                raise ConfigError(f"{where}: missing key {k!r} (needed by {family.name})")
            val = default
        values[role], used[k], key_of[role] = val, val, k
    for role in ("hidden_size", "num_layers", "num_experts", "top_k", "intermediate_size"):
        if not isinstance(values[role], int) or isinstance(values[role], bool) or values[role] <= 0:
            raise ConfigError(
                f"{where}: {key_of[role]} must be a positive integer, got {values[role]!r}"
            )
    if family.name == "deepseek_v3":
        values["shared_intermediate_size"] = int(values["intermediate_size"]) * int(
            values["n_shared_experts"] or 0
        )
    fp8_block, qmethod = _quantization(config, family)
    used["quantization_config.quant_method"] = qmethod
    router = with_kernel_limits(family.router(values), int(values["num_experts"]))
    return ModelConfig(family, values, used, fp8_block, router)


def _quantization(
    config: dict[str, Any], family: Family
) -> tuple[tuple[int, int] | None, str | None]:
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
    raise ConfigError(
        f"config.json: quantization_config.quant_method {method!r} is not supported for {family.name} "
        "(supported: fp8 block-scaled, mxfp4 for gpt_oss)"
    )


def check_shape(ckpt: Checkpoint, name: str, expected: tuple[int, ...], why: str) -> None:
    """`InputError` when the header shape of `name` disagrees with the config."""
    got = ckpt.info(name).shape
    if tuple(got) != tuple(expected):
        raise shape_error(f"{name} ({why})", list(expected), list(got))


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
