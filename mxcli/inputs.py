"""Complete, valid kernel inputs: seeded synthetic data, or a prepared checkpoint layer.

Synthetic distributions follow the upstream tests (prefill spec §7, bwd spec §11.1):

- prefill: ``hidden_states = 0.5*N(0,1)`` bf16 ``[B, S, H]``; ``gamma = 1 + 0.2*N(0,1)`` bf16
  ``[1, H]``; ``residual = 0.5*N(0,1)`` bf16; router ``W = 0.1*N(0,1)`` (fp16 for SIGMOID/SOFTMAX,
  bf16 for NOAUX_TC), passed *arranged* (`arrange_router_weights`); ``router_bias = 0.1*N(0,1)``
  ``[1, E]`` (fp16, fp32 for NOAUX_TC). With ``unpadded_hidden_size < H`` the pad columns of the
  activations and the pad rows of the router weight are zero.
- bwd: tokens routed by the upstream test router (``K`` distinct experts per token, uniform,
  legacy numpy RNG seeded with ``seed``) or by the prefill reference; block plan from `build_block_plan`; ``W_gu, W_d =
  U(-0.1, 0.1)`` bf16; affinities ``U[0,1)`` on the chosen experts, bf16 ``[T*E, 1]``;
  ``hidden_states = U[0,1)`` bf16; ``output_hidden_states_grad = U(-1, 1)`` bf16; the gate/up
  checkpoint from the MXFP8 forward reference (`blockwise_mm_fwd_mxfp8`).

The data come from one ``torch.Generator`` seeded with ``seed`` (the seeded bwd router from the
legacy numpy RNG, seeded likewise): the same arguments give the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.io.files import describe_tensors, write_file
from mxcli.io.metadata import inputs_metadata
from mxcli.kernels import backends
from mxcli.kernels.blockwise_moe import SPEC as BWD
from mxcli.kernels.blockwise_moe import (
    MXFP8MOEBwdConfig,
    blockwise_mm_fwd_mxfp8,
    build_block_plan,
    build_dense_block_plan,
    build_expert_affinities_masked,
    prequantize_weights,
)
from mxcli.kernels.blockwise_moe.config import ClampLimits
from mxcli.kernels.blockwise_moe.contract import DIM_MULTIPLE
from mxcli.kernels.blockwise_moe.spec import bwd_input_bytes
from mxcli.kernels.blockwise_moe.upstream_cases import upstream_router_choices
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL
from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType, arrange_router_weights
from mxcli.kernels.rmsnorm_mx_prefill.contract import validate as validate_prefill
from mxcli.kernels.rmsnorm_mx_prefill.spec import prefill_input_bytes
from mxcli.kernels.spec import get_spec
from mxcli.memory import check_input_memory
from mxcli.weightprep.manifest import load_backward_weights, load_manifest, load_prefill_inputs


@dataclass
class KernelInputs:
    """Input tensors named as the kernel arguments, their scalar kwargs, and how they were made."""

    kernel: str
    tensors: dict[str, torch.Tensor]
    kwargs: dict[str, Any]
    generator: dict[str, Any] = field(default_factory=dict)
    # not written to the file: what a check needs besides it (e.g. the bf16 weights behind
    # pre-quantized ones)
    extras: dict[str, Any] = field(default_factory=dict)


# the seeded bwd router draws from numpy's legacy RNG, which takes 32-bit seeds; one range for
# every kind keeps a seed valid whatever it is used for
SEED_MAX = 2**32 - 1


def _gen(seed: int) -> torch.Generator:
    if not 0 <= int(seed) <= SEED_MAX:
        raise InputError(f"seed (--seed): expected an integer in [0, {SEED_MAX}], got {seed}")
    return torch.Generator().manual_seed(int(seed))


def _normal(
    g: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0
) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


def _uniform(g: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float32) * (high - low) + low


def _check_positive(**values: int | None) -> None:
    for name, v in values.items():
        if v is not None and int(v) < 1:
            raise InputError(f"{name}: expected a positive integer, got {v}")


# --------------------------------------------------------------------------------------------
# rmsnorm_mx_prefill
# --------------------------------------------------------------------------------------------


def make_prefill_inputs(
    *,
    batch: int = 1,
    seq: int = 128,
    hidden: int = 512,
    experts: int | None = 16,
    top_k: int = 2,
    router_act_fn: Any = "SOFTMAX",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    router_bias: bool | None = None,
    router_dtype: str | None = None,
    residual: bool = False,
    unpadded_hidden_size: int | None = None,
    eps: float = 1e-6,
    pack_scales: bool = True,
    pack_affinities: bool = False,
    emit_norm_bf16: bool = False,
    seed: int = 0,
) -> KernelInputs:
    """Seeded synthetic inputs for ``rmsnorm_mx_prefill`` (``experts=None``: no router).

    ``router_bias`` defaults to on for NOAUX_TC (where it is required) and off otherwise;
    ``router_dtype`` (``bf16``/``fp16``) defaults to the upstream tests' choice.
    """
    _check_positive(batch=batch, seq=seq, hidden=hidden, experts=experts, top_k=top_k)
    if hidden % 512:
        raise InputError(f"hidden: expected a multiple of 512, got {hidden}")
    act = RouterActFnType.coerce(router_act_fn)
    noaux = act is RouterActFnType.NOAUX_TC
    H = int(hidden)
    N = H if unpadded_hidden_size is None else int(unpadded_hidden_size)
    if not 0 < N <= H:
        raise InputError(f"unpadded_hidden_size: expected a value in (0, {H}], got {N}")
    T = int(batch) * int(seq)
    check_input_memory(f"{T} tokens x hidden {H}", prefill_input_bytes(T, H, residual))
    g = _gen(seed)
    shape = (int(batch), int(seq), H)
    hs = _normal(g, shape, 0.5)
    gamma = _normal(g, (1, H), 0.2, 1.0)
    tensors: dict[str, torch.Tensor] = {}
    res = _normal(g, shape, 0.5) if residual else None
    if N < H:
        hs[..., N:] = 0.0
        if res is not None:
            res[..., N:] = 0.0
    tensors["hidden_states"] = hs.to(torch.bfloat16)
    tensors["gamma"] = gamma.to(torch.bfloat16)
    if experts:
        E = int(experts)
        w_dtype = (
            _dtype(router_dtype) if router_dtype else (torch.bfloat16 if noaux else torch.float16)
        )
        w = _normal(g, (H, E), 0.1)
        if N < H:
            w[N:] = 0.0
        tensors["router_weights"] = arrange_router_weights(w.to(w_dtype), act)
        want_bias = noaux if router_bias is None else bool(router_bias)
        if want_bias:
            b_dtype = torch.float32 if noaux else torch.float16
            tensors["router_bias"] = _normal(g, (1, E), 0.1).to(b_dtype)
    if res is not None:
        tensors["residual"] = res.to(torch.bfloat16)
    kwargs: dict[str, Any] = {
        "eps": float(eps),
        "pack_scales": bool(pack_scales),
        "emit_norm_bf16": bool(emit_norm_bf16),
        "unpadded_hidden_size": None if N == H else N,
    }
    if experts:
        kwargs.update(
            top_k=int(top_k),
            router_act_fn=act,
            pack_affinities=bool(pack_affinities),
        )
        if noaux:
            kwargs.update(
                n_group=int(n_group),
                topk_group=int(topk_group),
                routed_scaling_factor=float(routed_scaling_factor),
            )
    generator = {
        "source": "synthetic",
        "seed": int(seed),
        "batch": int(batch),
        "seq": int(seq),
        "hidden": H,
        "experts": int(experts or 0),
        "distributions": "hidden 0.5*N(0,1); gamma 1+0.2*N(0,1); residual 0.5*N(0,1); "
        "router 0.1*N(0,1); bias 0.1*N(0,1)",
    }
    # the kernel contract's own validation (top_k <= 8 and <= E, n_group | E, ...): what the
    # kernel would reject is never written
    validate_prefill(
        tensors["hidden_states"],
        tensors["gamma"],
        tensors.get("router_weights"),
        tensors.get("router_bias"),
        residual=tensors.get("residual"),
        **kwargs,
    )
    return KernelInputs(PREFILL.name, tensors, kwargs, generator)


def _dtype(name: str) -> torch.dtype:
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    try:
        return table[str(name).lower()]
    except KeyError:
        raise InputError(f"router_dtype: expected bf16 or fp16, got {name!r}") from None


# --------------------------------------------------------------------------------------------
# blockwise_mm_bwd_mxfp8
# --------------------------------------------------------------------------------------------


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


def make_bwd_inputs(
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
    _check_positive(
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
    g = _gen(seed)
    # draw order of the upstream generator (bwd spec §11.1): W_d, W_gu, A, X, dY
    if weights is None:
        w_d = _uniform(g, (E, I, H), -0.1, 0.1).to(torch.bfloat16)
        w_gu = _uniform(g, (E, H, 2, I), -0.1, 0.1).to(torch.bfloat16)
    else:
        w_gu, w_d = (w.to(torch.bfloat16) for w in weights)
        for name, w in (("gate_up_proj_weight", w_gu), ("down_proj_weight", w_d)):
            bad = ~torch.isfinite(w)
            if bool(bad.any()):  # every gradient would be NaN
                nan = int(torch.isnan(w).sum())
                raise InputError(
                    f"{name}: expected finite values, got {nan} NaN and {int(bad.sum()) - nan} Inf"
                )
    a_rand = _uniform(g, (T, E), 0.0, 1.0)
    x = _uniform(g, (T, H), 0.0, 1.0)
    dy = _uniform(g, (T, H), -1.0, 1.0).to(torch.bfloat16)
    if hidden_states is not None:
        x = hidden_states.reshape(-1, H)
        if x.shape[0] != T:
            raise InputError(f"hidden_states: expected {T} tokens, got {x.shape[0]}")
    if unpadded_hidden_size is not None and unpadded_hidden_size < H:
        x = x.clone()
        x[:, unpadded_hidden_size:] = 0.0
        dy[:, unpadded_hidden_size:] = 0.0
    if routing is None and router == "prefill" and not dense:
        routing, x = _prefill_routing(T, H, E, K, seed)
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
        b_gu = _uniform(g, (E, 2, I), -0.1, 0.1).to(torch.bfloat16)
        b_d = _uniform(g, (E, H), -0.1, 0.1).to(torch.bfloat16)

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
        BWD.name,
        tensors,
        {"block_size": B, "config": config},
        generator,
        extras={
            "weights": {"gate_up_proj_weight": w_gu, "down_proj_weight": w_d},
            "forward_output": fwd.output,
        },
    )


def _prefill_routing(
    T: int, H: int, E: int, K: int, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Route T tokens with the prefill reference (SOFTMAX router): ((index, affinities), norm)."""
    if H % 512:
        raise InputError(f"hidden: prefill routing needs a multiple of 512, got {H}")

    pre = make_prefill_inputs(
        seq=T,
        hidden=H,
        experts=E,
        top_k=K,
        router_act_fn="SOFTMAX",
        emit_norm_bf16=True,
        seed=(seed + 1) % (SEED_MAX + 1),
    )
    out = _reference_outputs(pre.tensors, PREFILL.resolve_kwargs(pre.kwargs))
    return (out["expert_index"], out["expert_affinities"].float()), out["norm_bf16"]


def _reference_outputs(tensors: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The prefill reference's named outputs (the router of synthetic bwd inputs)."""
    call = PREFILL.call(tensors, kwargs)
    return PREFILL.name_outputs(call, backends.get(PREFILL.name, "reference")(call))


# --------------------------------------------------------------------------------------------
# From a prepared checkpoint (``mxcli prep-weights`` output folder)
# --------------------------------------------------------------------------------------------


def _prefill_layer(m: Any, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, pre_kwargs = load_prefill_inputs(m, layer)
    return dict(tensors), dict(pre_kwargs)


def _bwd_layer(m: Any, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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


_LAYER_INPUTS: dict[str, Callable[[Any, int], tuple[dict[str, torch.Tensor], dict[str, Any]]]] = {
    PREFILL.name: _prefill_layer,
    BWD.name: _bwd_layer,
}


def layer_run_inputs(
    kernel: str, weights: str | os.PathLike[str], layer: int, *, verify_hashes: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and kwargs a prepared layer supplies to a run command (``--weights --layer``).

    prefill: ``gamma``, ``router_weights`` (and ``router_bias``) with the router kwargs;
    bwd: the bf16 ``gate_up_proj_weight`` and ``down_proj_weight`` when the folder has them,
    else the MXFP8 x4 data and scales with the matching scale layout in the config.
    """
    m = load_manifest(Path(weights), verify_hashes=verify_hashes)
    return _LAYER_INPUTS[get_spec(kernel).name](m, layer)


def inputs_from_weights(
    kind: str,
    weights: str | os.PathLike[str],
    layer: int,
    *,
    tokens: int = 128,
    batch: int = 1,
    block_size: int = 128,
    seed: int = 0,
    residual: bool = False,
    prequantize: bool = False,
    verify_hashes: bool = True,
    rank: int = 0,
) -> KernelInputs:
    """Inputs for one layer and `rank` of a prepared checkpoint, with seeded ``0.5*N(0,1)``
    hidden states (the rank is recorded: a TP/EP folder's ranks hold different slices).

    prefill: the layer's norm weight, router and router kwargs. bwd: the tokens are routed by the
    prefill reference with the layer's router; its bf16 RMSNorm output is the MoE input; then the
    block plan, the forward reference's checkpoint and a ``U(-1, 1)`` output gradient as for
    synthetic inputs, with the layer's bf16 expert weights (pre-quantized with ``prequantize``,
    in the folder's scale layout).
    """
    _check_positive(tokens=tokens, batch=batch)
    if tokens % batch:
        raise InputError(f"tokens: expected a multiple of --batch {batch}, got {tokens}")
    m = load_manifest(Path(weights), verify_hashes=verify_hashes)  # checked against its files
    m.rank_entry(layer, rank)  # a rank the folder lacks: one line naming those it has
    padding = m.padding(rank)
    w_tensors, kw = load_prefill_inputs(m, layer, rank)
    Hp = int(w_tensors["gamma"].shape[-1])
    N = kw.get("unpadded_hidden_size") or Hp
    check_input_memory(f"{tokens} tokens x hidden {Hp}", prefill_input_bytes(tokens, Hp, residual))
    g = _gen(seed)
    hs = _normal(g, (batch, tokens // batch, Hp), 0.5)
    hs[..., N:] = 0.0
    tensors = {"hidden_states": hs.to(torch.bfloat16), **w_tensors}
    if residual:
        res = _normal(g, (batch, tokens // batch, Hp), 0.5)
        res[..., N:] = 0.0
        tensors["residual"] = res.to(torch.bfloat16)
    info = {
        "source": "weights",
        "weights": str(weights),
        "layer": int(layer),
        "rank": int(rank),
        "ranks": len(m.ranks),
        "seed": int(seed),
        "tokens": int(tokens),
        "family": m.data.get("source", {}).get("family"),
        # run-* and verify read it: bwd gradients are un-padded to these true sizes
        "padding": padding.to_dict(),
    }
    if get_spec(kind) is PREFILL:
        return KernelInputs(PREFILL.name, tensors, dict(kw), info)

    # bwd: route with the prefill reference, feed its bf16 norm to the experts
    if "bf16" not in m.settings["formats"]:
        raise InputError(
            f"{weights}: bwd inputs need the bf16 expert weights "
            "(prep-weights --formats bf16,mxfp8)"
        )
    pre_kwargs = PREFILL.resolve_kwargs({**kw, "emit_norm_bf16": True})
    out = _reference_outputs(tensors, pre_kwargs)
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
    return make_bwd_inputs(
        tokens=tokens, block_size=block_size, seed=seed, prequantize=prequantize,
        scale_layout=m.settings.get("scale_layout") if prequantize else None,
        hidden_states=x, routing=(index, aff), weights=(gu, d),
        unpadded_hidden_size=padding.hidden_size,
        generator_info={**info, "router": f"prefill reference ({pre_kwargs['router_act_fn'].name})"},
    )  # fmt: skip


def layer_facts(weights: str | os.PathLike[str], layer: int, rank: int = 0) -> dict[str, Any]:
    """What a prepared layer fixes, by `make-inputs` flag (underscored): ``hidden`` (the
    model's and the padded H), ``experts``, ``intermediate`` (I per rank), and the router's
    ``top_k``, ``router_act``, ``n_group``, ``topk_group``, ``routed_scaling_factor`` and
    ``unpadded_hidden_size``, and the folder's MXFP8 ``scale_layout``. Read from the manifest
    alone (no tensor data)."""
    from mxcli.weightprep.manifest import load_manifest

    m = load_manifest(Path(weights))
    kw = m.prefill_kwargs(layer)
    specs = m.rank_entry(layer, rank)["tensors"]
    hp = int(specs["gamma"]["shape"][-1])
    facts: dict[str, Any] = {
        "hidden": sorted({hp, int(kw.get("unpadded_hidden_size") or hp)}),
        "experts": int(specs["router_weights"]["shape"][-1]),
        "top_k": int(kw["top_k"]),
        "router_act": str(getattr(kw["router_act_fn"], "name", kw["router_act_fn"])).lower(),
        "n_group": int(kw.get("n_group", 1)),
        "topk_group": int(kw.get("topk_group", 1)),
        "routed_scaling_factor": float(kw.get("routed_scaling_factor", 1.0)),
        "unpadded_hidden_size": kw.get("unpadded_hidden_size"),
        "scale_layout": m.settings.get("scale_layout"),
    }
    if "gate_up_proj_weight" in specs:
        facts["intermediate"] = int(specs["gate_up_proj_weight"]["shape"][-1])
    return facts


def describe_inputs(inputs: KernelInputs, path: str | os.PathLike[str]) -> dict[str, Any]:
    """JSON-ready summary of written inputs (``make-inputs --json``)."""
    spec = get_spec(inputs.kernel)
    return {
        "kernel": inputs.kernel,
        "output": str(path),
        "generator": inputs.generator,
        "kwargs": spec.dump_kwargs(spec.resolve_kwargs(inputs.kwargs)),
        "tensors": describe_tensors(inputs.tensors),
    }


def make_inputs(kernel: str, **params: Any) -> KernelInputs:
    """Seeded synthetic inputs of `kernel` (`make_prefill_inputs`, `make_bwd_inputs`)."""
    return _SYNTHETIC[get_spec(kernel).name](**params)


_SYNTHETIC: dict[str, Callable[..., KernelInputs]] = {
    PREFILL.name: make_prefill_inputs,
    BWD.name: make_bwd_inputs,
}


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_inputs(
    inputs: KernelInputs, path: str | os.PathLike[str], *, force: bool = False
) -> None:
    """Write an input file: tensors by argument name, kwargs and generator in the metadata."""
    spec = get_spec(inputs.kernel)
    kwargs = spec.dump_kwargs(spec.resolve_kwargs(inputs.kwargs))
    write_file(
        path, inputs.tensors, inputs_metadata(spec.name, kwargs, inputs.generator), force=force
    )


__all__ = [
    "KernelInputs",
    "describe_inputs",
    "inputs_from_weights",
    "layer_run_inputs",
    "make_bwd_inputs",
    "make_inputs",
    "make_prefill_inputs",
    "write_inputs",
]
