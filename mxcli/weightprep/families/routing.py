"""A family's own routing math, the prefill kernel mode that reproduces it, and an fp32 oracle.

`RouterMath` states what a model's router computes, in the terms the kernel's modes are told
apart by (prefill spec §5, ecosystem §2.4):

- ``scoring``: ``softmax`` over all E logits, ``sigmoid`` per logit, or ``sparsemixer``;
- ``bias``: none, ``logit`` (a Linear bias, added before scoring: gpt-oss), ``selection`` (added
  to the scores for choosing only: DeepSeek-V3's ``e_score_correction_bias``, ``expert_bias``),
  or ``probability`` (added to softmax probabilities: ERNIE-4.5);
- ``renormalize``: the K selected weights are divided by their sum;
- ``scale`` (``routed_scaling_factor``), ``n_group`` / ``topk_group`` (group-limited choice).

`kernel_router` maps it to a kernel mode, exactly or not at all: a router the kernel cannot
express is refused with one line naming what is missing (`RouterRefused`), never converted and
called exact. The three modes (`RouterActFnType`):

- ``SOFTMAX``: softmax over the K selected logits == softmax over E, top-K, renormalised;
- ``SIGMOID``: sigmoid of each selected logit, no renormalisation, no scale;
- ``NOAUX_TC``: sigmoid, choice on score + bias (group-limited), weights renormalised and scaled.

`route_fp32` computes the family's routing independently, in fp32, from the natural-order
weights (the `--check` oracle; it shares no code with the kernel reference).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mxcli.errors import MxcliError

# The prefill kernel's limits (prefill spec §2.3): beyond them the router is not expressible.
from mxcli.kernels.rmsnorm_mx_prefill.contract import MAX_EXPERTS, MAX_GROUPS, MAX_TOP_K  # noqa: F401 (re-exported)

SCORINGS = ("softmax", "sigmoid", "sparsemixer")
BIASES = (None, "logit", "selection", "probability")


class ConfigError(MxcliError):
    """config.json lacks a key the family needs, or holds a value mxcli does not support."""


class RouterRefused(ConfigError):
    """The family's router (or its norm, or its experts) is not expressible by the kernels."""


@dataclass(frozen=True)
class RouterMath:
    """What a family's router computes (see the module doc)."""

    scoring: str
    top_k: int
    num_experts: int
    renormalize: bool
    bias: str | None = None
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    renorm_eps: float = 0.0  # added to the denominator (1e-20 DeepSeek, 1e-6 LFM2)

    def to_dict(self) -> dict[str, Any]:
        return {
            "scoring": self.scoring,
            "top_k": self.top_k,
            "renormalize": self.renormalize,
            "bias": self.bias,
            "scale": self.scale,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
        }


@dataclass(frozen=True)
class RouterSpec:
    """The prefill kernel's router mode for a family, and how faithful it is.

    ``act_fn`` is a `RouterActFnType` name. ``exact`` is False when the kernel computes
    different affinities than the family's own router; ``notes`` say how. ``bwd_notes`` are the
    family's departures from the backward kernel's MLP (activation, where the affinity applies);
    the backward is exact only without them.
    """

    act_fn: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    exact: bool = True
    notes: tuple[str, ...] = ()
    bwd_notes: tuple[str, ...] = ()
    math: RouterMath | None = None

    @property
    def backward_exact(self) -> bool:
        return not self.bwd_notes

    def to_dict(self) -> dict[str, Any]:
        """The manifest's and the plan's ``router`` entry."""
        return {
            "act_fn": self.act_fn,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "exact": self.exact,
            "backward_exact": self.backward_exact,
            "notes": list(self.notes),
            "backward_notes": list(self.bwd_notes),
            "model_math": self.math.to_dict() if self.math else None,
        }


def kernel_router(math: RouterMath, family: str) -> RouterSpec:
    """The kernel mode that reproduces `math` exactly; `RouterRefused` when none does."""

    def refuse(what: str) -> RouterRefused:
        return RouterRefused(f"{family}: the prefill kernel cannot express {what}")

    if math.num_experts > MAX_EXPERTS:
        raise refuse(f"E={math.num_experts} experts (at most {MAX_EXPERTS})")
    if math.top_k > MAX_TOP_K:
        raise refuse(f"top_k={math.top_k} (max8 selection: top_k <= {MAX_TOP_K})")
    if math.scoring == "sparsemixer":
        raise refuse("sparsemixer routing (sequential masked-softmax selection)")
    if math.bias == "probability":
        raise refuse("a bias added to the softmax probabilities before top-k")
    if math.scoring == "softmax":
        if not math.renormalize:
            raise refuse(
                "softmax over all E without renormalisation (norm_topk_prob=false): its SOFTMAX "
                "renormalises over the K selected"
            )
        if math.n_group > 1 or math.scale != 1.0 or math.bias == "selection":
            raise refuse("group-limited, scaled or selection-biased softmax routing")
        return RouterSpec("SOFTMAX", math.top_k, math=math)
    if math.scoring != "sigmoid":
        raise refuse(f"scoring {math.scoring!r}")
    if not math.renormalize:
        if math.bias == "selection":
            raise refuse("a selection bias without renormalisation (NOAUX_TC renormalises)")
        if math.scale != 1.0 or math.n_group > 1:
            raise refuse("scaled or group-limited sigmoid routing without renormalisation")
        return RouterSpec("SIGMOID", math.top_k, math=math)
    if math.bias != "selection":
        raise refuse(
            "renormalised sigmoid routing without a selection bias (NOAUX_TC needs the "
            "e_score_correction_bias)"
        )
    # n_group / topk_group (at most MAX_GROUPS, against E and each other): the kernel
    # contract's checks and messages (`check_kernel_kwargs`)
    if math.num_experts < MAX_TOP_K:
        raise refuse(f"NOAUX_TC with E={math.num_experts} < 8 experts")
    return RouterSpec(
        "NOAUX_TC",
        math.top_k,
        n_group=math.n_group,
        topk_group=math.topk_group,
        routed_scaling_factor=math.scale,
        math=math,
    )


def check_kernel_kwargs(
    spec: RouterSpec, eps: Any, num_experts: int, where: str, keys: dict[str, str]
) -> None:
    """`ConfigError` when the prefill kernel would refuse this router's kwargs (and ``eps``),
    with the kernel contract's own message: the contract's kwarg parsers and `validate` run on
    meta tensors of the model's E (no data), so a plan refuses exactly what make-inputs and
    run-prefill would refuse later (prefill spec §2.3). `keys` maps a kernel argument to the
    config key it was read from (named first in the message)."""
    from mxcli.kernels.rmsnorm_mx_prefill.contract import HIDDEN_MULTIPLE, RouterActFnType
    from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC

    kwargs = {
        "router_act_fn": spec.act_fn,
        "top_k": spec.top_k,
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "eps": eps,
    }
    meta = torch.device("meta")
    try:
        parsed = SPEC.resolve_kwargs(kwargs)
        act = RouterActFnType.coerce(spec.act_fn)
        bias = (
            torch.empty(num_experts, dtype=torch.float32, device=meta)
            if act is RouterActFnType.NOAUX_TC
            else None
        )
        SPEC.validate(
            torch.empty(1, 1, HIDDEN_MULTIPLE, dtype=torch.bfloat16, device=meta),
            torch.empty(HIDDEN_MULTIPLE, dtype=torch.float32, device=meta),
            torch.empty(HIDDEN_MULTIPLE, num_experts, dtype=torch.bfloat16, device=meta),
            bias,
            **parsed,
        )
    except ValueError as exc:  # PrefillValidationError / InputError: the contract's message
        key = keys.get(str(exc).split(":", 1)[0])
        raise ConfigError(
            f"{where}{' ' + key if key else ''}: the prefill kernel refuses it: {exc}"
        ) from None


def with_backward(spec: RouterSpec, notes: tuple[str, ...]) -> RouterSpec:
    return replace(spec, bwd_notes=(*spec.bwd_notes, *notes))


# -- the fp32 oracle ----------------------------------------------------------------------------


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest entries of each row, descending; exact ties in ascending
    index order. The families' own code calls ``torch.topk``, whose order among equal values is
    unspecified (on CPU it is neither ascending nor stable); the hardware's ``max8`` +
    ``nc_find_index8`` give the k-th of equal values the k-th occurrence (api spec §8.14), so
    the oracle decides ties as the kernel does, and a tie (an all-zero router, a padding token)
    cannot fail the check."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route_fp32(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    math: RouterMath,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's routing of hidden states ``x [T, H]`` in fp32, from the source tensors.

    ``gamma [H]`` is the effective RMSNorm scale (``1 + w`` already applied for such norms),
    ``weight [E, H]`` the router weight as stored (out x in), ``bias [E]`` the router bias.
    Returns ``(index [T, K] int64, weights [T, K] fp32)``, index in descending choice order.
    """
    f32 = torch.float32
    xf = x.to(f32)
    xn = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * gamma.to(f32)
    logits = xn @ weight.to(f32).T  # [T, E]
    b = bias.to(f32) if bias is not None else None
    if math.bias == "logit" and b is not None:
        logits = logits + b
    T, E = logits.shape
    K = math.top_k
    if math.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    choice = scores + b if (math.bias == "selection" and b is not None) else scores
    if math.n_group > 1:
        g = choice.view(T, math.n_group, E // math.n_group)
        group_score = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        keep = _top(group_score, math.topk_group)
        mask = torch.zeros(T, math.n_group, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(E // math.n_group, dim=1), -torch.inf)
    index = _top(choice, K)  # [T, K]
    w = scores.gather(1, index)
    if math.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + math.renorm_eps)
    return index, w * math.scale


def compare_routing(
    kernel_affinities: torch.Tensor,
    ref_index: torch.Tensor,
    ref_weights: torch.Tensor,
    top_k: int,
) -> dict[str, Any]:
    """Top-k agreement and weight error of dense kernel affinities ``[T, E]`` against a
    reference ``(index [T, K], weights [T, K])``.

    A token agrees when the kernel's K largest affinities name the same expert set; the weight
    error is the largest ``|kernel - reference|`` over the agreeing tokens' selected experts.
    """
    aff = kernel_affinities.to(torch.float32)
    T = aff.shape[0]
    k_index = _top(aff, top_k)
    k_set = torch.zeros_like(aff, dtype=torch.bool).scatter_(1, k_index, True)
    r_set = torch.zeros_like(aff, dtype=torch.bool).scatter_(1, ref_index, True)
    agree = (k_set == r_set).all(dim=1)
    err = 0.0
    if bool(agree.any()):
        dense_ref = torch.zeros_like(aff).scatter_(1, ref_index, ref_weights.to(torch.float32))
        err = float((aff[agree] - dense_ref[agree]).abs().max())
    return {
        "tokens": T,
        "topk_agreement": round(float(agree.to(torch.float32).mean()), 6),
        "max_weight_error": round(err, 6),
    }
