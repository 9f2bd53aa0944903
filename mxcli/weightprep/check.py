"""``--check``: re-read a written layer and compare it with the source checkpoint.

Routing (`check_routing`): the written gamma, router weights and bias are run through the
prefill kernel's reference on seeded hidden states, and its top-K experts and weights are
compared with the family's own routing math computed independently in fp32 from the source
tensors (`route_fp32`): the share of tokens whose expert sets agree (top-k agreement) and the
largest weight error on those tokens are recorded in the manifest (``routing_check``).

Per rank and tensor: bf16 weights, gamma and the router bias must equal the source exactly;
the router weight, un-arranged with the kernel's own `unarrange_router_weights`, must equal the
source's natural-order weight exactly (and its padding rows be zero); MXFP8 weights are decoded
with `dequantize_weights` and reported as SQNR (dB) against the bf16 source. Everything is read
an expert chunk at a time, like the conversion.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.blockwise_moe.prequant import (
    PrequantizedWeights,
    ScaleLayout,
    dequantize_weights,
)
from mxcli.kernels.rmsnorm_mx_prefill import unarrange_router_weights
from mxcli.mx import ScaleRule
from mxcli.weightprep.checkpoint import CheckpointReader, open_safetensors
from mxcli.weightprep.convert import _tp_slice, pad_rows, prequantize, rank_biases, read_prefill
from mxcli.weightprep.families import Fused, Scratch, compare_routing, route_fp32
from mxcli.weightprep.fp8 import clip_codes
from mxcli.weightprep.plan import Plan, layer_file, tensor_name


class _Stat:
    """Running exactness / error energy of one output tensor against its source."""

    def __init__(self, mx: bool = False) -> None:
        self.mx = mx  # an MXFP8 output: count the values its quantization changed
        self.exact = True
        self.nonfinite = 0  # NaN/Inf in the source: such a tensor is never called exact
        self.max_abs = 0.0
        self.signal = 0.0
        self.noise = 0.0
        self.changed = 0  # MXFP8 outputs: values whose decoded MXFP8 differs from the source
        self.values = 0

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        o, r = out.to(torch.float32), ref.to(torch.float32)
        if o.shape != r.shape:
            self.exact = False
            self.max_abs = math.inf
            return
        bad_src = int((~torch.isfinite(r)).sum())
        if bad_src:
            self.nonfinite += bad_src
            self.exact = False
        both_nan = torch.isnan(o) & torch.isnan(r)
        d = torch.where(both_nan, torch.zeros_like(o), o - r)
        if out.dtype == ref.dtype:  # same dtype: the bytes must agree (-0 vs 0, NaN payloads)
            same = torch.equal(
                out.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
            )
        else:  # a decoded MXFP8 weight, or a bf16 one, vs a wider source: values must agree
            same = bool((d == 0).all()) and torch.equal(torch.isnan(o), torch.isnan(r))
        if self.mx:
            # values the MXFP8 quantization changed (issue 22: from an MX or FP8 source every
            # other value passes through exactly; pad rows and columns count as unchanged zeros)
            self.changed += int(((d != 0) | (torch.isnan(o) != torch.isnan(r))).sum())
            self.values += d.numel()
        self.exact = self.exact and same and not self.nonfinite
        if d.numel():
            self.max_abs = max(self.max_abs, float(d.abs().max()))
        self.signal += float(torch.where(both_nan, torch.zeros_like(r), r).double().pow(2).sum())
        self.noise += float(d.double().pow(2).sum())

    def result(self, sqnr: bool) -> dict[str, Any]:
        """JSON-safe numbers: ``max_abs_diff`` null for a shape mismatch, ``sqnr_db`` null when
        there is no error (infinite SQNR) or no signal."""
        out: dict[str, Any] = {
            "exact": self.exact,
            "max_abs_diff": self.max_abs if math.isfinite(self.max_abs) else None,
        }
        if self.nonfinite:
            out["nonfinite_source"] = self.nonfinite
        if self.values:
            out["changed_values"] = self.changed
            out["values"] = self.values
        if sqnr:
            ok = (
                self.noise > 0.0
                and self.signal > 0.0
                and math.isfinite(self.noise)
                and not self.nonfinite
            )
            out["sqnr_db"] = round(10.0 * math.log10(self.signal / self.noise), 3) if ok else None
        return out


def _dequant(
    plan: Plan, data: dict[str, torch.Tensor], prefix: str
) -> tuple[torch.Tensor, torch.Tensor]:
    layout = ScaleLayout(plan.options.scale_layout)
    pq = PrequantizedWeights(
        data[prefix + "gate_up_proj_weight_mxfp8"],
        data[prefix + "gate_up_weight_scales"],
        data[prefix + "down_proj_weight_mxfp8"],
        data[prefix + "down_weight_scales"],
        Grouping(),  # WRAPX, tile_k 512, as written (fast_dma_transpose=False)
        Grouping(),
        layout,
        layout,
        ScaleRule(plan.options.scale_rule),
    )
    gu, dn = dequantize_weights(pq)
    assert gu is not None and dn is not None
    return gu, dn


class _RankCheck:
    """Comparisons of one rank's output file against the source, accumulated per tensor key."""

    def __init__(
        self, plan: Plan, layer: int, f: Any, keys: set[str], rederive: bool = False
    ) -> None:
        self.plan, self.layer, self.f, self.keys = plan, layer, f, keys
        self.stats = {k: _Stat("_mxfp8" in k) for k in keys}
        self.rederive = rederive
        # MXFP8 data and scale keys: bytes that differ from the conversion redone on the source
        self.differing = {k: 0 for k in keys if k.endswith(_MX_KEYS)} if rederive else {}

    def rows(self, key: str, a: int, b: int) -> torch.Tensor:
        return self.f.get_slice(tensor_name(self.layer, key))[a:b]

    def whole(self, key: str) -> torch.Tensor:
        return self.f.get_tensor(tensor_name(self.layer, key))

    def prefill(self, src: dict[str, torch.Tensor]) -> None:
        Hp = self.plan.H_padded
        self.stats["gamma"].add(self.whole("gamma"), pad_rows(src["gamma"], Hp))
        natural = unarrange_router_weights(
            self.whole("router_weights"), self.plan.model.router.act_fn
        )  # [Hp, E]
        self.stats["router_weights"].add(natural, pad_rows(src["router_natural"], Hp))
        if "router_bias" in self.keys:
            self.stats["router_bias"].add(self.whole("router_bias"), src["router_bias"])

    def mlp(self, prefix: str, gu: torch.Tensor, dn: torch.Tensor, a: int, b: int) -> None:
        """Experts ``a:b`` of this rank: bf16 outputs exactly, MXFP8 outputs decoded."""
        st = self.stats
        if prefix + "gate_up_proj_weight" in self.keys:
            st[prefix + "gate_up_proj_weight"].add(
                self.rows(prefix + "gate_up_proj_weight", a, b), gu
            )
            st[prefix + "down_proj_weight"].add(self.rows(prefix + "down_proj_weight", a, b), dn)
        if prefix + "gate_up_proj_weight_mxfp8" in self.keys:
            names = (
                "gate_up_proj_weight_mxfp8",
                "gate_up_weight_scales",
                "down_proj_weight_mxfp8",
                "down_weight_scales",
            )
            got = {prefix + n: self.rows(prefix + n, a, b) for n in names}
            dgu, ddn = _dequant(self.plan, got, prefix)
            st[prefix + "gate_up_proj_weight_mxfp8"].add(dgu, gu)
            st[prefix + "down_proj_weight_mxfp8"].add(ddn, dn)
            if self.rederive:
                # the conversion is deterministic: redo it on the same bf16 chunk (the bytes
                # it wrote, codes clipped for a +-240 target) and compare byte for byte
                for key, want in prequantize(gu, dn, self.plan).items():
                    if key.endswith("_mxfp8"):
                        clip_codes(want, self.plan.options.fp8_range)
                    a8 = got[prefix + key].contiguous().view(torch.uint8)
                    b8 = want.contiguous().view(torch.uint8)
                    self.differing[prefix + key] += int((a8 != b8).sum())

    def add(self, key: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        self.stats[key].add(out, ref)

    def result(self, order: list[str]) -> dict[str, Any]:
        out = {k: self.stats[k].result("_mxfp8" in k) for k in order if k not in _UNCHECKED}
        for k, n in self.differing.items():  # with `rederive`: scale keys are reported too
            out.setdefault(k, {})["differing_bytes"] = n
        return out


def check_layer(
    plan: Plan, rd: CheckpointReader, layer: int, out_root: Any, *, rederive: bool = False
) -> dict[str, Any]:
    """Per rank, per tensor key: ``{"exact", "max_abs_diff"[, "sqnr_db"]}`` (see module doc).

    `rederive` (``verify --checkpoint``): the outputs are compared with what the conversion
    writes, not with the source values: bf16 outputs with the source's bf16 cast, and every
    MXFP8 data and scale tensor byte for byte with the conversion redone on the same chunk
    (``"differing_bytes"``)."""
    fam = plan.model.family
    m = plan.model
    H, I = m.H, m.I  # noqa: E741 (spec notation)
    p = plan.layer_prefix(layer)
    src = read_prefill(rd, plan, layer)
    results: dict[str, Any] = {}
    pad = plan.padding  # outputs are zero-padded: so is what they are compared with
    Hb, Ip = pad.backward_hidden_size, pad.padded_intermediate_size
    Isp = pad.padded_shared_intermediate_size
    step = plan.chunk_experts()
    scratch = Scratch()
    # issue 28: a wider float source (F32, F16 after its bf16 cast) is compared as stored, so
    # the bf16 outputs report their real rounding, never "exact" against their own cast
    wide = set(plan.source_format.split("+")) & _WIDE_SOURCES
    ref = torch.float32 if wide and not rederive else torch.bfloat16
    for rank, outs in zip(plan.ranks, plan.outputs, strict=True):
        with open_safetensors(out_root / rank.dir / layer_file(layer)) as f:
            rc = _RankCheck(plan, layer, f, {o.key for o in outs}, rederive)
            rc.prefill(src)
            if fam.shared and m.shared_I and rank.shared_i_range:
                gu, dn = fam.shared.mlp.load(
                    rd, p, 0, 1, H, m.shared_I, m.fp8_block, scratch, "shared_", ref
                )
                rc.mlp(
                    "shared_expert.",
                    *_tp_slice(gu, dn, *rank.shared_i_range, scratch, "tp_", Hb, Isp),
                    0,
                    1,
                )
                if fam.shared.gate_weight:
                    rc.add(
                        "shared_expert_gate_weight",
                        rc.whole("shared_expert_gate_weight"),
                        rd.get(p + fam.shared.gate_weight),
                    )
            (e_lo, e_hi), (i0, i1) = rank.expert_range, rank.i_range
            for e0 in range(e_lo, e_hi, step):
                e1 = min(e_hi, e0 + step)
                gu, dn = fam.experts.load(rd, p, e0, e1, H, I, m.fp8_block, scratch, "", ref)
                rc.mlp("", *_tp_slice(gu, dn, i0, i1, scratch, "tp_", Hb, Ip), e0 - e_lo, e1 - e_lo)
                if isinstance(fam.experts, Fused):
                    gub, db = rank_biases(
                        *fam.experts.load_biases(rd, p, e0, e1, I), i0, i1, Hb, Ip
                    )
                    if gub is not None:
                        rc.add(
                            "gate_up_proj_bias",
                            rc.rows("gate_up_proj_bias", e0 - e_lo, e1 - e_lo),
                            gub,
                        )
                    if db is not None:
                        rc.add(
                            "down_proj_bias", rc.rows("down_proj_bias", e0 - e_lo, e1 - e_lo), db
                        )
            results[str(rank.rank)] = rc.result([o.key for o in outs])
    return results


_MX_KEYS = ("_proj_weight_mxfp8", "_weight_scales")

# Source formats (`Plan.source_format`) whose values bf16 cannot hold exactly.
_WIDE_SOURCES = {"f32", "f64", "f16"}

# The scale tensors are checked through their data tensor's SQNR.
_UNCHECKED = {
    pre + k
    for pre in ("", "shared_expert.")
    for k in ("gate_up_weight_scales", "down_weight_scales")
}


def summarize(check: dict[str, Any]) -> dict[str, Any]:
    """Worst values over ranks: ``{key: {"exact": all exact, "sqnr_db": min}}``."""
    out: dict[str, Any] = {}
    for per_rank in check.values():
        for key, r in per_rank.items():
            s = out.setdefault(key, {"exact": True})
            s["exact"] = s["exact"] and r["exact"]
            if "sqnr_db" in r:
                cur = s.get("sqnr_db", "unset")
                v = r["sqnr_db"]
                if cur == "unset" or (v is not None and (cur is None or v < cur)):
                    s["sqnr_db"] = v
            if "changed_values" in r:
                s["changed_values"] = s.get("changed_values", 0) + r["changed_values"]
                s["values"] = s.get("values", 0) + r["values"]
    return out


# Routing check: tokens, seed and the pass thresholds of issue 12 ("only near-ties differ").
ROUTING_TOKENS = 512
ROUTING_SEED = 12
MIN_TOPK_AGREEMENT = 0.98
MAX_WEIGHT_ERROR = 0.02


def seeded_hidden_states(T: int, H: int, seed: int = ROUTING_SEED) -> torch.Tensor:
    """``[T, H]`` bf16 N(0, 1) hidden states from a private generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(torch.bfloat16)


def kernel_affinities(
    x: torch.Tensor, tensors: dict[str, torch.Tensor], kwargs: dict[str, Any]
) -> torch.Tensor:
    """Dense ``[T, E]`` affinities of the prefill kernel's reference for hidden states
    ``x [T, H]`` given written prefill `tensors` and `kwargs` (`load_prefill_inputs`)."""
    from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType, rmsnorm_mx_prefill

    act = RouterActFnType.coerce(kwargs["router_act_fn"])
    T, H = x.shape
    Hp = tensors["gamma"].shape[-1]
    xp = torch.zeros(1, T, Hp, dtype=torch.bfloat16)
    xp[0, :, :H] = x  # the kernel's H padding: zero columns, unpadded_hidden_size = H
    outs = rmsnorm_mx_prefill(
        xp,
        tensors["gamma"],
        tensors["router_weights"],
        tensors.get("router_bias"),
        eps=kwargs["eps"],
        top_k=kwargs["top_k"],
        router_act_fn=act,
        n_group=kwargs["n_group"],
        topk_group=kwargs["topk_group"],
        routed_scaling_factor=kwargs["routed_scaling_factor"],
        unpadded_hidden_size=kwargs.get("unpadded_hidden_size") or H,
        backend="reference",
    )
    # outputs: packed, [expert_index (SIGMOID/SOFTMAX)], expert_affinities (prefill spec §2.2)
    return outs[1] if act is RouterActFnType.NOAUX_TC else outs[2]


def check_routing(
    plan: Plan, rd: CheckpointReader, layer: int, out_root: Any, tokens: int = ROUTING_TOKENS
) -> dict[str, Any]:
    """Kernel reference on the written prefill tensors vs the family's fp32 routing (module doc)."""
    from mxcli.weightprep.convert import prefill_kwargs

    m = plan.model
    math_ = m.router.math
    assert math_ is not None
    with open_safetensors(out_root / plan.ranks[0].dir / layer_file(layer)) as f:
        names = set(f.keys())
        tensors = {
            k: f.get_tensor(tensor_name(layer, k))
            for k in ("gamma", "router_weights", "router_bias")
            if tensor_name(layer, k) in names
        }
    x = seeded_hidden_states(tokens, m.H)
    affinities = kernel_affinities(x, tensors, prefill_kwargs(plan))
    src = read_prefill(rd, plan, layer)
    ref_index, ref_w = route_fp32(
        x,
        src["gamma"],
        float(m.values["eps"]),
        rd.get(plan.layer_prefix(layer) + m.family.router_weight),
        src.get("router_bias"),
        math_,
    )
    res = compare_routing(affinities, ref_index, ref_w, m.router.top_k)
    res["seed"] = ROUTING_SEED
    res["passed"] = (
        res["topk_agreement"] >= MIN_TOPK_AGREEMENT and res["max_weight_error"] <= MAX_WEIGHT_ERROR
    )
    return res
