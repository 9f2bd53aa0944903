"""The profile shapes of ``rmsnorm_mx_prefill`` (its `ProfilePart`: ``profile prefill``'s shape
flags and the inputs of a shape, `mxcli.kernels.profiling`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels.profiling import positive
from mxcli.kernels.rmsnorm_mx_prefill.contract import RouterActFnType
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC, prefill_input_bytes
from mxcli.kernels.spec import InputParam, show_value
from mxcli.memory import check_input_memory

# the router defaults are the kernel API's (its public signature, the one place holding them):
# every kernel that --kernel offers runs with them (nkilib refuses NOAUX_TC with pack_affinities)
PARAMS: tuple[InputParam, ...] = (
    InputParam("tokens", "T, tokens.", int, None),
    InputParam("hidden", "H, hidden size.", int, None),
    InputParam("experts", "E, router experts.", int, None),
    InputParam("top_k", "K, experts per token.", int, SPEC.default("top_k")),
    InputParam(
        "router_act",
        "Router activation: sigmoid, softmax or noaux_tc.",
        str,
        show_value(SPEC.default("router_act_fn")),
    ),
    InputParam("n_group", "NOAUX_TC groups.", int, SPEC.default("n_group")),
    InputParam("topk_group", "NOAUX_TC groups kept.", int, SPEC.default("topk_group")),
    InputParam(
        "pack_affinities",
        "Affinities in the row tail (nkilib refuses it with noaux_tc).",
        bool,
        SPEC.default("pack_affinities"),
        flag="--pack-affinities/--no-pack-affinities",
    ),
)
NOTE = (
    "The router flags default to the kernel API's values (DeepSeek-V3's router: top-K 8, "
    "noaux_tc, 8 groups, 4 kept)."
)


@dataclass(frozen=True)
class PrefillShape:
    """Prefill launch shape: T tokens, hidden H, E experts, top-K, router activation. No
    defaults: the kernel API's are in its signature (``profile prefill`` shows them), and a
    benchmark names its router (DeepSeek-V3's: top-K 8, noaux_tc, 8 groups, 4 kept)."""

    tokens: int
    hidden: int
    experts: int
    top_k: int
    router_act: str
    n_group: int
    topk_group: int
    pack_affinities: bool  # nkilib's kernel refuses it with NOAUX_TC


def inputs(shape: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Zero inputs at the shape flags' values."""
    return prefill_inputs(PrefillShape(**shape))


def prefill_inputs(s: PrefillShape) -> tuple[dict[str, Any], dict[str, Any]]:
    """Zero inputs of the prefill kernel at shape `s` (values do not matter in check-only)."""
    for k in ("tokens", "hidden", "experts", "top_k", "n_group", "topk_group"):
        positive(k, getattr(s, k))
    acts = {a.name.lower(): a for a in RouterActFnType}
    if s.router_act.lower() not in acts:
        raise InputError(
            f"router_act: expected one of {', '.join(sorted(acts))}, got {s.router_act!r}"
        )
    act = acts[s.router_act.lower()]
    # refuse what cannot fit before anything is allocated (make-inputs' estimate, one place)
    check_input_memory(
        f"{s.tokens} tokens x hidden {s.hidden}", prefill_input_bytes(s.tokens, s.hidden, False)
    )
    bf = torch.bfloat16
    tensors = {
        "hidden_states": torch.zeros(1, s.tokens, s.hidden, dtype=bf),
        "gamma": torch.ones(s.hidden, dtype=bf),
        "router_weights": torch.zeros(s.hidden, s.experts, dtype=bf),
        "router_bias": torch.zeros(s.experts, dtype=torch.float32),
    }
    kwargs: dict[str, Any] = {
        "top_k": s.top_k,
        "router_act_fn": act,
        "pack_affinities": bool(s.pack_affinities),
    }
    if act is RouterActFnType.NOAUX_TC:
        kwargs.update(n_group=s.n_group, topk_group=s.topk_group, routed_scaling_factor=2.5)
    return tensors, kwargs


__all__ = ["NOTE", "PARAMS", "PrefillShape", "inputs", "prefill_inputs"]
