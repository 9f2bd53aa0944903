"""The inputs of ``rmsnorm_mx_prefill`` (its `InputsPart`, called by `mxcli.inputs`).

Synthetic distributions follow the upstream tests (prefill spec §7): ``hidden_states =
0.5*N(0,1)`` bf16 ``[B, S, H]``; ``gamma = 1 + 0.2*N(0,1)`` bf16 ``[1, H]``; ``residual =
0.5*N(0,1)`` bf16; router ``W = 0.1*N(0,1)`` (fp16 for SIGMOID/SOFTMAX, bf16 for NOAUX_TC),
passed *arranged* (`arrange_router_weights`); ``router_bias = 0.1*N(0,1)`` ``[1, E]`` (fp16, fp32
for NOAUX_TC). With ``unpadded_hidden_size < H`` the pad columns of the activations and the pad
rows of the router weight are zero. One ``torch.Generator`` seeded with ``seed``: the same
arguments give the same bytes.

This module sits on the floor of `mxcli.inputs` (it reads prepared folders, `mxcli.weightprep`);
the spec names it and never imports it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.inputs import SEED_MAX, KernelInputs, check_positive, normal, seeded
from mxcli.kernels import backends
from mxcli.kernels.rmsnorm_mx_prefill.contract import RouterActFnType
from mxcli.kernels.rmsnorm_mx_prefill.contract import validate as validate_prefill
from mxcli.kernels.rmsnorm_mx_prefill.router_weights import arrange_router_weights
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC, prefill_input_bytes
from mxcli.kernels.spec import InputParam
from mxcli.memory import check_input_memory
from mxcli.weightprep.manifest import load_prefill_inputs

# make-inputs' flags (the defaults make a small test case; the kernel API's own are the run
# command's, noted by make-inputs' help where they differ)
PARAMS: tuple[InputParam, ...] = (
    InputParam("tokens", "Tokens T (B*S).", int, 128, with_weights="used"),
    InputParam(
        "batch", "batch B of hidden_states [B, S, H] (S = T/B).", int, 1, with_weights="used"
    ),
    InputParam("hidden", "Hidden size H (a multiple of 512).", int, 512, with_weights="fact"),
    InputParam("experts", "Experts E (0 = no router).", int, 16, with_weights="fact"),
    InputParam("top_k", "Experts per token K.", int, 2, with_weights="fact"),
    InputParam(
        "router_act",
        "router: sigmoid, softmax or noaux_tc.",
        str,
        "softmax",
        with_weights="fact",
    ),
    InputParam("n_group", "NOAUX_TC: expert groups.", int, 1, with_weights="fact"),
    InputParam("topk_group", "NOAUX_TC: groups kept.", int, 1, with_weights="fact"),
    InputParam(
        "routed_scaling_factor",
        "NOAUX_TC: affinity multiplier.",
        float,
        1.0,
        with_weights="fact",
    ),
    InputParam(
        "router_bias",
        "draw a router bias (default: only for noaux_tc).",
        bool,
        None,
        flag="--router-bias/--no-router-bias",
    ),
    InputParam(
        "router_dtype",
        "router weight dtype bf16 or fp16 (default: fp16, bf16 for noaux_tc).",
        str,
        None,
    ),
    InputParam(
        "residual",
        "add a residual input.",
        bool,
        False,
        flag="--residual/--no-residual",
        with_weights="used",
    ),
    InputParam(
        "unpadded_hidden_size", "real H; columns past it are zero.", int, None, with_weights="fact"
    ),
    InputParam(
        "pack_scales",
        "kwarg recorded in the file.",
        bool,
        True,
        flag="--pack-scales/--no-pack-scales",
        with_weights="output",
    ),
    InputParam(
        "pack_affinities",
        "kwarg recorded in the file.",
        bool,
        False,
        flag="--pack-affinities/--no-pack-affinities",
        with_weights="output",
    ),
    InputParam(
        "emit_norm_bf16",
        "kwarg recorded in the file.",
        bool,
        False,
        flag="--emit-norm-bf16/--no-emit-norm-bf16",
        with_weights="output",
    ),
    InputParam(
        "seed", "Random seed: the same flags give the same bytes.", int, 0, with_weights="used"
    ),
)


def generate(
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
    check_positive(batch=batch, seq=seq, hidden=hidden, experts=experts, top_k=top_k)
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
    g = seeded(seed)
    shape = (int(batch), int(seq), H)
    hs = normal(g, shape, 0.5)
    gamma = normal(g, (1, H), 0.2, 1.0)
    tensors: dict[str, torch.Tensor] = {}
    res = normal(g, shape, 0.5) if residual else None
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
        w = normal(g, (H, E), 0.1)
        if N < H:
            w[N:] = 0.0
        tensors["router_weights"] = arrange_router_weights(w.to(w_dtype), act)
        want_bias = noaux if router_bias is None else bool(router_bias)
        if want_bias:
            b_dtype = torch.float32 if noaux else torch.float16
            tensors["router_bias"] = normal(g, (1, E), 0.1).to(b_dtype)
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
    return KernelInputs(SPEC.name, tensors, kwargs, generator)


# the Python name the tests and scripts know
make_prefill_inputs = generate


def from_flags(flags: dict[str, Any]) -> KernelInputs:
    """`generate` from make-inputs' flag values (`PARAMS`)."""
    tokens, batch = int(flags["tokens"]), int(flags["batch"])
    for flag, value in (("tokens", tokens), ("batch", batch)):
        if value < 1:
            raise InputError(f"{flag}: expected a positive integer, got {value}")
    if tokens % batch:
        raise InputError(f"tokens: expected a multiple of --batch {batch}, got {tokens}")
    return generate(
        batch=batch, seq=tokens // batch, hidden=flags["hidden"],
        experts=flags["experts"] or None, top_k=flags["top_k"], router_act_fn=flags["router_act"],
        n_group=flags["n_group"], topk_group=flags["topk_group"],
        routed_scaling_factor=flags["routed_scaling_factor"], router_bias=flags["router_bias"],
        router_dtype=flags["router_dtype"], residual=flags["residual"],
        unpadded_hidden_size=flags["unpadded_hidden_size"], pack_scales=flags["pack_scales"],
        pack_affinities=flags["pack_affinities"], emit_norm_bf16=flags["emit_norm_bf16"],
        seed=flags["seed"],
    )  # fmt: skip


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


def reference_outputs(tensors: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The prefill reference's named outputs (the router of the backward's inputs)."""
    call = SPEC.call(tensors, kwargs)
    return SPEC.name_outputs(call, backends.get(SPEC.name, "reference")(call))


def routed(
    T: int, H: int, E: int, K: int, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Route T tokens with the prefill reference (SOFTMAX router): ((index, affinities), norm)."""
    if H % 512:
        raise InputError(f"hidden: prefill routing needs a multiple of 512, got {H}")
    pre = generate(
        seq=T,
        hidden=H,
        experts=E,
        top_k=K,
        router_act_fn="SOFTMAX",
        emit_norm_bf16=True,
        seed=(seed + 1) % (SEED_MAX + 1),
    )
    out = reference_outputs(pre.tensors, SPEC.resolve_kwargs(pre.kwargs))
    return (out["expert_index"], out["expert_affinities"].float()), out["norm_bf16"]


# --------------------------------------------------------------------------------------------
# From a prepared checkpoint (``mxcli prep-weights`` output folder)
# --------------------------------------------------------------------------------------------


def from_layer(m: Any, layer: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``gamma``, ``router_weights`` (and ``router_bias``) with the router kwargs."""
    tensors, pre_kwargs = load_prefill_inputs(m, layer)
    return dict(tensors), dict(pre_kwargs)


def layer_activations(
    m: Any,
    weights: str | os.PathLike[str],
    layer: int,
    rank: int,
    *,
    tokens: int,
    batch: int,
    seed: int,
    residual: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors, kwargs, generator info) of the layer's prefill: its norm weight, router and
    router kwargs, with seeded ``0.5*N(0,1)`` hidden states (and residual) zero past the
    model's H."""
    check_positive(tokens=tokens, batch=batch)
    if tokens % batch:
        raise InputError(f"tokens: expected a multiple of --batch {batch}, got {tokens}")
    padding = m.padding(rank)
    w_tensors, kw = load_prefill_inputs(m, layer, rank)
    Hp = int(w_tensors["gamma"].shape[-1])
    N = kw.get("unpadded_hidden_size") or Hp
    check_input_memory(f"{tokens} tokens x hidden {Hp}", prefill_input_bytes(tokens, Hp, residual))
    g = seeded(seed)
    hs = normal(g, (batch, tokens // batch, Hp), 0.5)
    hs[..., N:] = 0.0
    tensors = {"hidden_states": hs.to(torch.bfloat16), **w_tensors}
    if residual:
        res = normal(g, (batch, tokens // batch, Hp), 0.5)
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
    return tensors, dict(kw), info


def from_weights(
    m: Any,
    weights: str | os.PathLike[str],
    layer: int,
    rank: int,
    *,
    tokens: int = 128,
    batch: int = 1,
    seed: int = 0,
    residual: bool = False,
) -> KernelInputs:
    """The layer's norm weight, router and router kwargs with seeded hidden states."""
    tensors, kw, info = layer_activations(
        m, weights, layer, rank, tokens=tokens, batch=batch, seed=seed, residual=residual
    )
    return KernelInputs(SPEC.name, tensors, kw, info)


def layer_facts(m: Any, layer: int, rank: int = 0) -> dict[str, Any]:
    """What a prepared layer fixes, by make-inputs flag: ``hidden`` (the model's and the padded
    H), ``experts`` and the router's ``top_k``, ``router_act``, ``n_group``, ``topk_group``,
    ``routed_scaling_factor`` and ``unpadded_hidden_size``. From the manifest alone."""
    kw = m.prefill_kwargs(layer)
    specs = m.rank_entry(layer, rank)["tensors"]
    hp = int(specs["gamma"]["shape"][-1])
    return {
        "hidden": sorted({hp, int(kw.get("unpadded_hidden_size") or hp)}),
        "experts": int(specs["router_weights"]["shape"][-1]),
        "top_k": int(kw["top_k"]),
        "router_act": str(getattr(kw["router_act_fn"], "name", kw["router_act_fn"])).lower(),
        "n_group": int(kw.get("n_group", 1)),
        "topk_group": int(kw.get("topk_group", 1)),
        "routed_scaling_factor": float(kw.get("routed_scaling_factor", 1.0)),
        "unpadded_hidden_size": kw.get("unpadded_hidden_size"),
    }


__all__ = [
    "PARAMS",
    "from_flags",
    "from_layer",
    "from_weights",
    "generate",
    "layer_facts",
    "make_prefill_inputs",
    "reference_outputs",
    "routed",
]
