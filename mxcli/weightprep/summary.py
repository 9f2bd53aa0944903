"""Human-readable text of a plan (``--dry-run``) and of a run's result (stdout)."""

from __future__ import annotations

import os
from typing import Any


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _rate(bytes_per_s: float) -> str:
    """A throughput in the unit that shows it (``4.80 MB/s``, never ``0.000 GB/s``)."""
    from mxcli.memory import human_bytes

    return f"{human_bytes(bytes_per_s)}/s"


def _ranges(xs: list[int]) -> str:
    from mxcli.weightprep.plan import _ranges as r

    return r(xs) or "none"


def _fit(lines: list[str], width: int) -> str:
    """Lines wrapped at spaces to `width`, never inside a word, a number or a name; a
    ``key          value`` line continues under its value, any other under a 4-space indent."""
    import textwrap

    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        key = line[:14]
        indent = 14 if len(key) == 14 and key.endswith("  ") and key.strip() else 4
        out += textwrap.wrap(line, width, subsequent_indent=" " * indent,
                             break_long_words=False, break_on_hyphens=False)  # fmt: skip
    return "\n".join(out)


def format_plan(plan: dict[str, Any], width: int = 80) -> str:
    r = plan["router"]
    o = plan["options"]
    lines = [
        f"source        {plan['source']}"
        + (
            f" (Hub {plan['hub']['repo_id']} at {plan['hub']['commit']})" if plan.get("hub") else ""
        ),
        f"family        {plan['family']} (model_type {plan['model_type']}, weights {plan['source_format']})",
        f"MoE layers    {_ranges(plan['moe_layers'])} of {plan['num_layers']}; converting {_ranges(plan['layers'])}",
        f"experts       E={plan['num_experts']} top_k={plan['top_k']}  H={plan['hidden_size']}"
        + (
            f" (padded to {plan['padded_hidden_size']} for prefill)"
            if plan["padded_hidden_size"] != plan["hidden_size"]
            else ""
        )
        + f"  I={plan['intermediate_size']} (I_TP={plan['intermediate_size_per_rank']})"
        + (
            f"  shared I={plan['shared_intermediate_size']}"
            if plan["shared_intermediate_size"]
            else ""
        ),
        f"parallel      tp={o['tp']} ep={o['ep']} -> {len(plan['ranks'])} rank(s); workers={o['workers']}",
        f"router        {r['act_fn']} top_k={r['top_k']}"
        + (
            f" n_group={r['n_group']} topk_group={r['topk_group']} routed_scaling_factor={r['routed_scaling_factor']}"
            if r["act_fn"] == "NOAUX_TC"
            else ""
        )
        + ("" if r["exact"] else "  [NOT EXACT]")
        + ("" if r.get("backward_exact", True) else "  [backward NOT EXACT]"),
        f"formats       {','.join(o['formats'])}; scales {o['scale_layout']}, rule {o['scale_rule']}",
    ]
    for note in r["notes"] + r["backward_notes"] + plan["notes"]:
        lines.append(f"note          {note}")
    first = next(iter(plan["outputs_per_layer"]))
    lines.append(f"outputs per layer and rank ({first} shown):")
    outs = plan["outputs_per_layer"][first]
    # long key names (other stacks' layouts): their common dotted prefix is said once
    common = os.path.commonprefix([t["name"] for t in outs]) if len(outs) > 1 else ""
    common = common[: common.rfind(".") + 1]
    if len(common) > 8:
        lines.append(f"  under {common}")
    cut = len(common) if len(common) > 8 else 0
    wn = max((len(t["name"]) - cut for t in outs), default=0)
    wd = max([5] + [len(t["dtype"]) for t in outs])
    ws = max((len(str(t["shape"])) for t in outs), default=0)
    for t in outs:
        lines.append(
            f"  {t['name'][cut:]:<{wn}}  {t['dtype']:<{wd}} {str(t['shape']):<{ws}}  "
            f"{_gb(t['bytes'])}"
        )
    per = plan.get("per_layer") or []
    if per:
        lo, hi = min(e["source_bytes"] for e in per), max(e["source_bytes"] for e in per)
        lines.append(
            f"per layer     read {_gb(lo)}" + (f"-{_gb(hi)}" if hi != lo else "")
            + f", write {_gb(per[0]['output_bytes'])} (all ranks)"
        )  # fmt: skip
    lines += [
        f"total         read {_gb(plan['source_bytes'])}, write {_gb(plan['output_bytes'])}",
        f"peak memory   ~{_gb(plan['estimated_peak_memory_bytes'])} (estimate)",
    ]
    return _fit(lines, width)


def format_result(res: dict[str, Any], width: int = 80) -> str:
    if res.get("finalized") is True and "layers_written" not in res:  # --finalize
        return (
            f"finalized {res['output']}: {len(res['layers'])} layer(s) x {res['ranks']} rank(s) "
            f"from {res['shards']} shard(s)\nmanifest {res['manifest']}"
        )
    lines = [
        f"wrote {len(res['layers_written'])} layer(s) x {res['ranks']} rank(s) to {res['output']}"
        + (f" ({len(res['layers_skipped'])} already complete)" if res["layers_skipped"] else ""),
        f"router {res['router_act_fn']}"
        + ("" if res["router_exact"] else " (not exact: see manifest notes)")
        + ("" if res.get("backward_exact", True) else "; backward not exact (see notes)"),
    ]
    if res.get("fp8"):
        fp8 = res["fp8"]
        lines.append(
            f"FP8 {fp8['description']}, scale rule {fp8['scale_rule']}"
            + (f"; {res['fp8_clipped']} codes clipped" if res.get("fp8_clipped") else "")
        )
    if res.get("throughput_gbps"):
        # a rate only where it measures the conversion: with --check the time includes the
        # re-reading and the routing check
        rate = "" if res.get("check") else f" ({_rate(res['throughput_gbps'] * 1e9)})"
        lines.append(
            f"{_gb(res['source_bf16_bytes'])} of bf16 experts in {res['seconds']:.1f} s"
            f"{rate or ' (with --check)'}, peak RSS {_gb(res['peak_rss_bytes'])}"
        )
    for L, s in (res.get("check") or {}).items():
        bad = [k for k, v in s.items() if not v["exact"] and "_mxfp8" not in k]
        sq = [v["sqnr_db"] for v in s.values() if v.get("sqnr_db") is not None]
        ch = [(v["changed_values"], v["values"]) for v in s.values() if "changed_values" in v]
        lines.append(
            f"check layer {L}: "
            + ("bf16/router exact" if not bad else f"MISMATCH in {', '.join(bad)}")
            + (f"; MXFP8 SQNR min {min(sq):.2f} dB" if sq else "")
            + (
                f"; {sum(c for c, _ in ch):,} of {sum(n for _, n in ch):,} MXFP8 values differ "
                "from the source's"
                if ch
                else ""
            )
        )
    routing = res.get("routing_check") or {}
    for L, rc in routing.items():
        lines.append(
            f"routing layer {L}: {'pass' if rc['passed'] else 'FAIL'}, top-k agreement "
            f"{rc['topk_agreement']:.2%}, max weight error {rc['max_weight_error']:.4f}"
        )
    sh = res.get("shard")
    if sh:
        from mxcli.weightprep.shards import describe

        lines.append(
            f"shard {sh['index']}/{sh['count']} (from {sh['from']}): layers {describe(sh['layers'])}; "
            + ("all shards done, indexes written" if sh["finalized"] else "waiting for shards "
               + ", ".join(m["shard"] for m in sh["missing_shards"]) + " (the last one, or "
               "--finalize, writes the indexes)")
        )  # fmt: skip
    if routing:
        tokens = next(iter(routing.values()))["tokens"]
        lines.append(f"  (routing: {tokens} seeded tokens against the family's fp32 routing)")
    lines.append(f"manifest {res['manifest']}")
    return _fit(lines, width)
