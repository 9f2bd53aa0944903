"""The inputs of ``blockwise_mm_bwd_mxfp8`` (its `InputsPart`, called by `mxcli.inputs`).

Synthetic distributions follow the upstream tests (bwd spec §11.1): tokens routed by the upstream
test router (``K`` distinct experts per token, uniform, legacy numpy RNG seeded with ``seed``) or
by the prefill reference; block plan from `build_block_plan`; ``W_gu, W_d = U(-0.1, 0.1)`` bf16;
affinities ``U[0,1)`` on the chosen experts, bf16 ``[T*E, 1]``; ``hidden_states = U[0,1)`` bf16;
``output_hidden_states_grad = U(-1, 1)`` bf16; the gate/up checkpoint from the MXFP8 forward
reference (`blockwise_mm_fwd_mxfp8`). One ``torch.Generator`` seeded with ``seed`` (the seeded
router from the legacy numpy RNG, seeded likewise): the same arguments give the same bytes.

This module sits on the floor of `mxcli.inputs`; the spec names it and never imports it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.inputs import KernelInputs, check_positive, seeded, uniform
from mxcli.kernels.blockwise_moe.config import ClampLimits, MXFP8MOEBwdConfig
from mxcli.kernels.blockwise_moe.contract import DIM_MULTIPLE
from mxcli.kernels.blockwise_moe.forward import blockwise_mm_fwd_mxfp8
from mxcli.kernels.blockwise_moe.plan import (
    build_block_plan,
    build_dense_block_plan,
    build_expert_affinities_masked,
)
from mxcli.kernels.blockwise_moe.prequant import prequantize_weights
from mxcli.kernels.blockwise_moe.spec import SPEC, bwd_input_bytes
from mxcli.kernels.blockwise_moe.upstream_cases import upstream_router_choices
from mxcli.kernels.rmsnorm_mx_prefill import inputs as prefill_inputs
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC as PREFILL
from mxcli.kernels.spec import InputParam
from mxcli.memory import check_input_memory
from mxcli.weightprep.manifest import load_backward_weights

# make-inputs' flags (the defaults make a small test case; the kernel API's own are the run
# command's, noted by make-inputs' help where they differ)
PARAMS: tuple[InputParam, ...] = (
    InputParam("tokens", "Tokens T.", int, 128, with_weights="used"),
    InputParam("hidden", "Hidden size H (a multiple of 128).", int, 512, with_weights="fact"),
    InputParam("experts", "Experts E.", int, 16, with_weights="fact"),
    InputParam("top_k", "Experts per token K.", int, 2, with_weights="fact"),
    InputParam("intermediate", "intermediate size I (per TP rank).", int, 128, with_weights="fact"),
    InputParam("block_size", "tokens per block B.", int, 128, with_weights="used"),
    InputParam(
        "routing",
        "seeded (K distinct experts per token) or prefill (the prefill reference).",
        str,
        "seeded",
        choices=("seeded", "prefill"),
    ),
    InputParam("dense", "single-expert dense layout (E=1, K=1).", bool, False, flag="--dense"),
    InputParam("bias", "config.bias (also return bias gradients).", bool, False, flag="--bias"),
    InputParam("clamp", "gate/up clamp limits 'NL_LO,NL_HI,L_LO,L_HI' (empty = unset).", str),
    InputParam(
        "prequantize",
        "store the weights as MXFP8 x4 data + e8m0 scales.",
        bool,
        False,
        flag="--prequantize",
        with_weights="used",
    ),
    InputParam(
        "scale_layout",
        "with --prequantize: packed or unpacked scales (default: packed).",
        str,
        None,
        with_weights="fact",
    ),
    InputParam(
        "residual",
        "with --weights: add a residual input to the prefill that routes the tokens.",
        bool,
        False,
        flag="--residual/--no-residual",
        with_weights="weights-only",
    ),
    InputParam(
        "seed", "Random seed: the same flags give the same bytes.", int, 0, with_weights="used"
    ),
)


def _clamp_limits(clamp: Any) -> Any:
    """``None``, a `ClampLimits`, or ``(nl_lower, nl_upper, l_lower, l_upper)`` (None = unset)."""
    if clamp is None or isinstance(clamp, ClampLimits):
        return clamp
    values = list(clamp)
    if len(values) != 4:
        raise InputError(
            "clamp: expected 4 limits (non_linear lower, upper, linear lower, upper), "
            f"got {len(values)}"
        )
    return ClampLimits(*[None if v is None else float(v) for v in values])


def generate(
    *,
    tokens: int = 256,
    hidden: int = 256,
    intermediate: int = 128,
    experts: int = 2,
    top_k: int = 1,
    block_size: int = 128,
    dense: bool = False,
    bias: bool = False,
    clamp: Any = None,
    prequantize: bool = False,
    scale_layout: str | None = None,
    router: str = "seeded",
    seed: int = 0,
    hidden_states: torch.Tensor | None = None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator_info: dict[str, Any] | None = None,
    unpadded_hidden_size: int | None = None,
) -> KernelInputs:
    """Seeded synthetic inputs for ``blockwise_mm_bwd_mxfp8``.

    Routing: ``router="seeded"`` draws K distinct experts per token (`upstream_router_choices`); ``router="prefill"`` runs the
    prefill reference (SOFTMAX router, 0.1*N(0,1) weights) on ``0.5*N(0,1)`` hidden states and
    takes its top-K and affinities, with its bf16 RMSNorm output as ``hidden_states``. Then the
    block plan (`build_block_plan`, or the dense identity plan with ``dense``), the MXFP8 forward
    reference for the gate/up checkpoint, and a ``U(-1, 1)`` output gradient.

    ``hidden_states``, ``routing`` (``(expert_index [T, K], affinities [T, E])``) and ``weights``
    (``(gate_up [E, H, 2, I], down [E, I, H])``) replace the synthetic ones (real checkpoints).
    ``prequantize`` stores the weights as x4 data + E8M0 scales (``scale_layout`` packed or
    unpacked; default: the config's, packed). ``unpadded_hidden_size``: the model's real H when
    the weights are zero-padded past it (`mxcli.weightprep.padding`); the hidden states and the
    output gradient are then zero there too, which keeps the padding exact.
    """
    check_positive(
        tokens=tokens,
        hidden=hidden,
        intermediate=intermediate,
        experts=experts,
        top_k=top_k,
        block_size=block_size,
    )
    T, H, I, E, K, B = (int(v) for v in (tokens, hidden, intermediate, experts, top_k, block_size))  # noqa: E741
    if weights is not None:
        E, H, _, I = (int(d) for d in weights[0].shape)  # noqa: E741
    else:  # the kernel's rule (bwd spec §10), checked before the forward's wrapX chunks say "K"
        for flag, v in (("hidden", H), ("intermediate", I)):
            if v <= 0 or v % DIM_MULTIPLE:
                raise InputError(
                    f"{flag} (--{flag}): expected a positive multiple of {DIM_MULTIPLE} "
                    f"(the backward kernel's {flag[0].upper()}), got {v}"
                )
    if dense and (E != 1 or K != 1):
        raise InputError(f"dense: needs experts=1 and top_k=1, got experts={E}, top_k={K}")
    if dense and bias:
        raise InputError("dense: the single-expert dense path has no bias gradients (bias=True)")
    if router not in ("seeded", "prefill"):
        raise InputError(f"router: expected seeded or prefill, got {router!r}")
    limits = _clamp_limits(clamp)
    check_input_memory(
        f"{T} tokens (hidden {H}, intermediate {I}, experts {E}, top-k {K})",
        bwd_input_bytes(T, H, I, E, 1 if dense else K, drawn=weights is None),
    )
    g = seeded(seed)
    # draw order of the upstream generator (bwd spec §11.1): W_d, W_gu, A, X, dY
    if weights is None:
        w_d = uniform(g, (E, I, H), -0.1, 0.1).to(torch.bfloat16)
        w_gu = uniform(g, (E, H, 2, I), -0.1, 0.1).to(torch.bfloat16)
    else:
        w_gu, w_d = (w.to(torch.bfloat16) for w in weights)
        for name, w in (("gate_up_proj_weight", w_gu), ("down_proj_weight", w_d)):
            bad = ~torch.isfinite(w)
            if bool(bad.any()):  # every gradient would be NaN
                nan = int(torch.isnan(w).sum())
                raise InputError(
                    f"{name}: expected finite values, got {nan} NaN and {int(bad.sum()) - nan} Inf"
                )
    a_rand = uniform(g, (T, E), 0.0, 1.0)
    x = uniform(g, (T, H), 0.0, 1.0)
    dy = uniform(g, (T, H), -1.0, 1.0).to(torch.bfloat16)
    if hidden_states is not None:
        x = hidden_states.reshape(-1, H)
        if x.shape[0] != T:
            raise InputError(f"hidden_states: expected {T} tokens, got {x.shape[0]}")
    if unpadded_hidden_size is not None and unpadded_hidden_size < H:
        x = x.clone()
        x[:, unpadded_hidden_size:] = 0.0
        dy[:, unpadded_hidden_size:] = 0.0
    if routing is None and router == "prefill" and not dense:
        routing, x = prefill_inputs.routed(T, H, E, K, seed)
    if dense:
        choices = torch.zeros(T, 1, dtype=torch.int32)
        affinities = a_rand
    elif routing is not None:
        choices, affinities = routing
        choices = choices.to(torch.int32)
        affinities = affinities.to(torch.float32)
        K = int(choices.shape[1])
    else:
        if K > E:
            raise InputError(f"top_k: expected <= experts={E}, got {K}")
        choices = upstream_router_choices(T, E, K, seed=seed)
        affinities = a_rand
    a_flat = build_expert_affinities_masked(affinities.to(torch.bfloat16), choices)  # [T*E, 1]
    x = x.to(torch.bfloat16)
    b_gu = b_d = None
    if bias:
        b_gu = uniform(g, (E, 2, I), -0.1, 0.1).to(torch.bfloat16)
        b_d = uniform(g, (E, H), -0.1, 0.1).to(torch.bfloat16)

    if dense:
        tpi, b2e = build_dense_block_plan(T, B)
        config = MXFP8MOEBwdConfig(clamp_limits=limits) if limits else MXFP8MOEBwdConfig()
    else:
        tpi, b2e = build_block_plan(choices, E, B)
        extra: dict[str, Any] = {"bias": bool(bias)}
        if limits is not None:
            extra["clamp_limits"] = limits
        config = MXFP8MOEBwdConfig.routed(top_k=K, **extra)
    p1, p2 = config.phase1_config, config.phase2_config  # filled by the config's validation
    assert p1 is not None and p2 is not None
    if scale_layout is not None:
        if scale_layout not in ("packed", "unpacked"):
            raise InputError(f"scale_layout: expected packed or unpacked, got {scale_layout!r}")
        for pc in (p1, p2):
            pc.enable_scale_packing = scale_layout == "packed"

    fwd = blockwise_mm_fwd_mxfp8(
        x, a_flat, w_gu, w_d, tpi, b2e, B,
        clamp_limits=limits, gate_up_proj_bias=b_gu, down_proj_bias=b_d,
        quant_scheme=config.quant_scheme, tile_k=p1.effective_tile_k,
    )  # fmt: skip
    tensors: dict[str, torch.Tensor] = {
        "hidden_states": x,
        "expert_affinities_masked": a_flat,
        "gate_up_proj_weight": w_gu,
        "down_proj_weight": w_d,
        "token_position_to_id": tpi,
        "block_to_expert": b2e,
        "output_hidden_states_grad": dy,
        "gate_up_proj_act_checkpoint_T": fwd.gate_up_proj_act_checkpoint_T.to(torch.bfloat16),
    }
    if prequantize:
        pq = prequantize_weights(w_gu, w_d, config=config)
        tensors.update(pq.as_kwargs())
    generator = {
        "source": "synthetic",
        "seed": int(seed),
        "tokens": T,
        "hidden": H,
        "intermediate": I,
        "experts": E,
        "top_k": K,
        "router": "dense"
        if dense
        else (router if routing is None or router == "prefill" else "given"),
        "prequantized": bool(prequantize),
        "distributions": "W_gu, W_d U(-0.1,0.1); affinities U[0,1); hidden U[0,1); "
        "output grad U(-1,1)",
    }
    generator.update(generator_info or {})
    return KernelInputs(
        SPEC.name,
        tensors,
        {"block_size": B, "config": config},
        generator,
        extras={
            "weights": {"gate_up_proj_weight": w_gu, "down_proj_weight": w_d},
            "forward_output": fwd.output,
        },
    )


# the Python name the tests and scripts know
make_bwd_inputs = generate


def from_flags(flags: dict[str, Any]) -> KernelInputs:
    """`generate` from make-inputs' flag values (`PARAMS`)."""
    return generate(
        tokens=flags["tokens"], hidden=flags["hidden"], intermediate=flags["intermediate"],
        experts=flags["experts"], top_k=flags["top_k"], block_size=flags["block_size"],
        dense=flags["dense"], bias=flags["bias"], clamp=parse_clamp(flags["clamp"]),
        prequantize=flags["prequantize"], scale_layout=flags["scale_layout"],
        router=flags["routing"], seed=flags["seed"],
    )  # fmt: skip


def check_flags(flags: dict[str, Any], given: set[str]) -> None:
    """Flag combinations refused before any work (make-inputs)."""
    if "scale_layout" in given and not flags["prequantize"]:
        raise InputError("scale_layout: --scale-layout applies only with --prequantize")


def parse_clamp(text: str | None) -> tuple[float | None, ...] | None:
    """``--clamp 'NL_LO,NL_HI,L_LO,L_HI'`` (an empty field: unset)."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise InputError(f"clamp: expected 'NL_LO,NL_HI,L_LO,L_HI' (4 values), got {text!r}")
    try:
        return tuple(None if p in ("", "none", "None") else float(p) for p in parts)
    except ValueError:
        raise InputError(f"clamp: expected numbers or empty fields, got {text!r}") from None


# --------------------------------------------------------------------------------------------
# From a prepared checkpoint (``mxcli prep-weights`` output folder)
# --------------------------------------------------------------------------------------------


def from_layer(m: Any, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The bf16 ``gate_up_proj_weight`` and ``down_proj_weight`` when the folder has them, else
    the MXFP8 x4 data and scales with the matching scale layout in the config."""
    fmt = "bf16" if "bf16" in m.settings["formats"] else "mxfp8"
    w = load_backward_weights(m, layer, fmt=fmt)
    kwargs: dict[str, Any] = {}
    layout = w.pop("scale_layout", None)
    if layout is not None:
        packed = layout == "packed"
        kwargs["config"] = {
            "phase1_config": {"enable_scale_packing": packed},
            "phase2_config": {"enable_scale_packing": packed},
        }
    return dict(w), kwargs


def from_weights(
    m: Any,
    weights: str | os.PathLike[str],
    layer: int,
    rank: int,
    *,
    tokens: int = 128,
    batch: int = 1,
    block_size: int = 128,
    seed: int = 0,
    residual: bool = False,
    prequantize: bool = False,
) -> KernelInputs:
    """The tokens routed by the prefill reference with the layer's router, its bf16 RMSNorm
    output as the MoE input; then the block plan, the forward reference's checkpoint and a
    ``U(-1, 1)`` output gradient as for synthetic inputs, with the layer's bf16 expert weights
    (pre-quantized with ``prequantize``, in the folder's scale layout)."""
    tensors, kw, info = prefill_inputs.layer_activations(
        m, weights, layer, rank, tokens=tokens, batch=batch, seed=seed, residual=residual
    )
    if "bf16" not in m.settings["formats"]:
        raise InputError(
            f"{weights}: bwd inputs need the bf16 expert weights "
            "(prep-weights --formats bf16,mxfp8)"
        )
    pre_kwargs = PREFILL.resolve_kwargs({**kw, "emit_norm_bf16": True})
    out = prefill_inputs.reference_outputs(tensors, pre_kwargs)
    aff = out["expert_affinities"].float()  # [T, E]
    K = int(pre_kwargs["top_k"])
    index = out.get("expert_index")
    if index is None:  # NOAUX_TC returns dense affinities only
        # ties in ascending expert order, as the kernel selects (api spec §8.14); torch.topk's
        # order among equal affinities is unspecified
        index = torch.sort(aff, dim=1, descending=True, stable=True).indices[:, :K]
    w = load_backward_weights(m, layer, rank, fmt="bf16")
    gu, d = w["gate_up_proj_weight"], w["down_proj_weight"]
    E_r, H = int(gu.shape[0]), int(gu.shape[1])
    if E_r != aff.shape[1]:
        raise InputError(
            f"{weights}: bwd inputs need all {aff.shape[1]} experts on rank {rank} "
            f"(prepared with --ep 1), this folder has {E_r}"
        )
    # norm_bf16 is [T, Hp]; the expert stacks are [E, Hb, ...] with Hb <= Hp, and the columns
    # past the model's H are zero in both (zero gamma rows)
    x = out["norm_bf16"][:, :H]
    return generate(
        tokens=tokens, block_size=block_size, seed=seed, prequantize=prequantize,
        scale_layout=m.settings.get("scale_layout") if prequantize else None,
        hidden_states=x, routing=(index, aff), weights=(gu, d),
        unpadded_hidden_size=m.padding(rank).hidden_size,
        generator_info={**info, "router": f"prefill reference ({pre_kwargs['router_act_fn'].name})"},
    )  # fmt: skip


def layer_facts(m: Any, layer: int, rank: int = 0) -> dict[str, Any]:
    """The prefill's facts (hidden, experts, router), the expert stack's ``intermediate`` (I
    per rank) and the folder's MXFP8 ``scale_layout``."""
    facts = prefill_inputs.layer_facts(m, layer, rank)
    facts["scale_layout"] = m.settings.get("scale_layout")
    specs = m.rank_entry(layer, rank)["tensors"]
    if "gate_up_proj_weight" in specs:
        facts["intermediate"] = int(specs["gate_up_proj_weight"]["shape"][-1])
    return facts


__all__ = [
    "PARAMS",
    "check_flags",
    "from_flags",
    "from_layer",
    "from_weights",
    "generate",
    "layer_facts",
    "make_bwd_inputs",
    "parse_clamp",
]
