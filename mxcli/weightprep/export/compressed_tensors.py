"""``--output-format compressed-tensors``: a Hugging Face checkpoint folder whose routed-expert
Linear weights are MXFP8 in compressed-tensors form, everything else copied unchanged.

The on-disk form is the one the compressed_tensors library (0.20.1; the tests' oracle) writes and
reads for format ``mxfp8-quantized`` (`compressors/mxfp8/base.py`): per expert projection
``X.weight`` float8_e4m3fn ``[out, in]`` and ``X.weight_scale`` uint8 E8M0 ``[out, in/32]``
(value = ``fp8 * 2^(byte - 127)``, groups of 32 along ``in``), and ``config.json``'s
``quantization_config`` with ``quant_method: compressed-tensors``, the MXFP8 preset scheme
(8-bit float weights, group 32, uint8 scales; dynamic MXFP8 activations) targeting the expert
modules.

Targets (issue 30): one ``re:`` target per family, matching the routed experts' module names in
the checkpoint (``...experts.{e}.w1`` for Mixtral) and also the names vLLM's MoE probe asks
about: vLLM picks a FusedMoE layer's scheme from ``<layer>.0.gate_proj``, ``.0.up_proj`` and
``.0.down_proj`` whatever the checkpoint calls them, and leaves the experts unquantized when
none matches (vllm-project/vllm@0043d6b5 ``compressed_tensors_moe/compressed_tensors_moe.py``
:40-42 and :57-58). Nothing else matches (tests/weightprep/test_ct_targets.py checks it with
compressed_tensors' own matcher on every PerExpert family's transformers skeleton).

Scale rule: by default (``ct``) the bytes compressed_tensors' own MXFP8 compressor writes for
the same weights (`mxcli.mx.ScaleRule.CT`: OCP's exponent, one more when the group maximum's
mantissa is 1.75 or more, so no group saturates). ``--scale-rule neuron|ocp|rceil`` writes
another rule's bytes: the format stores plain E8M0 bytes and every reader decodes
``code * 2^(byte - 127)`` whatever chose the byte, but it has no field for the rule
(QuantizationArgs forbids extra keys), so the rule is recorded in the shard metadata and in
``mxcli-export.json``.

A compressed-tensors MXFP8 source is passed through byte for byte under the ``ct`` rule (its
bytes already follow it); under another rule it is re-quantized from its exact values.

``--formats bf16`` writes the experts in bf16 (exactly the dequantized source) and no
quantization_config: the escape hatch for stacks that cannot take MX.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from mxcli import __version__
from mxcli.errors import InputError
from mxcli.fsutil import default_mode
from mxcli.io.jsonfile import read_json
from mxcli.mx import dequantize_mx, quantize_mx
from mxcli.weightprep.checkpoint import FP8_SOURCE_DTYPES, INDEX_NAME, Checkpoint
from mxcli.weightprep.export import COMPRESSED_TENSORS
from mxcli.weightprep.export.base import tensor_row
from mxcli.weightprep.export.folder import SIDECAR, export_folder, write_json, write_record
from mxcli.weightprep.export.verifying import (
    Report,
    compare_keys,
    over_range,
    plan_for,
    refuse_hashes_only,
    sqnr,
)
from mxcli.weightprep.families import PerExpert, load_weight
from mxcli.weightprep.fp8 import Fp8Semantics, clip_codes
from mxcli.weightprep.sources import CtQuant
from mxcli.weightprep.writer import StreamingWriter, TensorSpec, write_index

NAME = COMPRESSED_TENSORS.name
CT_FORMAT = "mxfp8-quantized"
MX_GROUP = 32


def _mx_args(dynamic: bool) -> dict[str, Any]:
    """QuantizationArgs of the compressed-tensors MXFP8 preset (quant_scheme.py, ``MXFP8``)."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": MX_GROUP,
        "strategy": "group",
        "dynamic": dynamic,
        "scale_dtype": "torch.uint8",
    }


# vLLM's MoE probe names (see the module doc): the projections of expert 0 under these names
VLLM_PROBE = ("gate_proj", "up_proj", "down_proj")


def expert_targets(fam: Any) -> list[str]:
    """One ``re:`` target matching exactly the family's routed-expert Linear modules
    (``<...>.experts.<e>.<proj>``) under their checkpoint names and vLLM's probe names."""
    ex = fam.experts
    names = [tmpl.rsplit(".", 2)[1] for tmpl in (ex.gate, ex.up, ex.down)]  # drop ".weight"
    alts = list(dict.fromkeys([*names, *VLLM_PROBE]))
    return [r"re:.*\.experts\.\d+\.(" + "|".join(map(re.escape, alts)) + r")$"]


def quantization_config(fam: Any) -> dict[str, Any]:
    """``config.json``'s quantization_config, as compressed_tensors' ModelCompressor writes it."""
    return {
        "config_groups": {
            "group_0": {
                "targets": expert_targets(fam),
                "weights": _mx_args(False),
                "input_activations": _mx_args(True),
                "output_activations": None,
                "format": None,
            }
        },
        "format": CT_FORMAT,
        "global_compression_ratio": None,
        "ignore": [],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "producer": f"mxcli {__version__}",
    }


def quantize_weight(
    w: torch.Tensor, fp8_range: int, rule: str = "ct"
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A Linear weight ``[out, in]`` -> (float8_e4m3fn ``[out, in]``, uint8 E8M0 ``[out, in/32]``,
    codes clipped for a +-240 target): `mxcli.mx.quantize_mx`, 32 along ``in``, with the bytes
    of `rule` (``--scale-rule``; a +-240 target takes the NEURON bytes: `Fp8Semantics`)."""
    bytes_rule = Fp8Semantics(fp8_range, rule).rule_bytes
    codes, scales = quantize_mx(w, axis=-1, rule=bytes_rule, scheme="1x32")
    clipped = clip_codes(codes, fp8_range)
    return codes.view(torch.float8_e4m3fn), scales, clipped


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """mxcli's own decoding of an exported expert weight, rounded to bf16 as readers hold it."""
    return dequantize_mx(weight.view(torch.uint8), scale, axis=-1, scheme="1x32").to(torch.bfloat16)


def _expert_names(plan: Any) -> set[str]:
    m = plan.model
    names: set[str] = set()
    for L in plan.layers:
        names.update(m.family.experts.expected(plan.layer_prefix(L), m.E, m.H, m.I))
    return names


def _scale_companions(ckpt: Checkpoint, experts: set[str]) -> dict[str, str]:
    """The source scale tensors of FP8 expert weights (scale name -> weight name); an FP8
    tensor outside the experts is refused (copied unchanged it would lose its scheme)."""
    scale_of = {}
    for n in experts:
        if ckpt.in_header(n) and ckpt.info(n).dtype in FP8_SOURCE_DTYPES:
            for sn in (n + "_scale_inv", n + "_scale"):
                if ckpt.has(sn):
                    scale_of[sn] = n
    for n in ckpt.names():
        if (
            n not in experts
            and n not in scale_of
            and ckpt.in_header(n)
            and ckpt.info(n).dtype in FP8_SOURCE_DTYPES
        ):
            raise InputError(
                f"{n}: FP8 outside the routed experts; the compressed-tensors export copies "
                "those unchanged and would lose their scheme (dequantize them first)"
            )
    return scale_of


def check_plan(plan: Any) -> None:
    o = plan.options
    fam = plan.model.family
    if not isinstance(fam.experts, PerExpert):
        raise InputError(
            f"--output-format compressed-tensors: {fam.name} stores its experts fused "
            f"({type(fam.experts).__name__}); compressed-tensors MXFP8 has per-expert Linear "
            "weights (families with PerExpert layouts only)"
        )
    if o.tp != 1 or o.ep != 1:
        raise InputError(
            "--output-format compressed-tensors: a Hugging Face checkpoint is not sharded by "
            f"rank (got --tp {o.tp} --ep {o.ep}; the serving stack shards it)"
        )
    if o.layers not in (None, "", "all"):
        raise InputError(
            f"--output-format compressed-tensors: exports every MoE layer (got --layers {o.layers})"
        )
    m = plan.model
    if "mxfp8" in o.formats and (m.H % MX_GROUP or m.I % MX_GROUP):
        raise InputError(
            f"--output-format compressed-tensors: MXFP8 groups of 32 need hidden_size ({m.H}) "
            f"and intermediate size ({m.I}) multiples of 32"
        )
    _scale_companions(Checkpoint(plan.source, require_shards=False), _expert_names(plan))


def export_compressed_tensors(
    plan: Any, out: Path | str, force: bool, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out)
    ckpt = Checkpoint(plan.source)
    check_plan(plan)
    mx = "mxfp8" in plan.options.formats
    fp8_range = plan.options.fp8_range
    experts = _expert_names(plan)
    q = plan.model.fp8_block
    scale_of = _scale_companions(ckpt, experts)  # not copied
    # a compressed-tensors MXFP8 source keeps its codes and scales under its own rule
    rule = plan.options.scale_rule
    passthrough = (
        isinstance(q, CtQuant) and q.scheme == "mxfp8" and fp8_range == 448 and rule == "ct"
    )
    stats: dict[str, Any] = {
        "passed_through": 0,
        "experts": 0,
        "clipped": 0,
        "changed_values": 0,
        "values": 0,
        "worst_sqnr_db": None,
    }
    weight_map: dict[str, str] = {}
    total = 0
    fp8_meta = plan.options.fp8().metadata() if mx else {}
    with export_folder(out, ckpt.root, force) as tmp:
        for f in ckpt.root.iterdir():  # tokenizer, generation config, ...: unchanged
            if (
                f.is_file()
                and not f.name.endswith(".safetensors")
                and f.name not in ("config.json", INDEX_NAME, SIDECAR)
            ):
                shutil.copy2(f, tmp / f.name)
        by_file: dict[str, list[str]] = {}
        for n in ckpt.names():
            if n not in scale_of:
                by_file.setdefault(ckpt.info(n).file, []).append(n)
        with ckpt.reader() as rd:
            for fname, names in sorted(by_file.items()):
                specs: list[TensorSpec] = []
                for n in names:
                    info = ckpt.info(n)
                    if n in experts and mx:
                        o_, i_ = info.shape
                        specs.append(TensorSpec(n, "F8_E4M3", (o_, i_)))
                        specs.append(TensorSpec(n + "_scale", "U8", (o_, i_ // MX_GROUP)))
                    elif n in experts:
                        specs.append(TensorSpec(n, "BF16", info.shape))
                    else:
                        specs.append(TensorSpec(n, info.dtype, info.shape))
                md = {"format": "pt", "producer": f"mxcli {__version__} prep-weights", **fp8_meta}
                path = tmp / fname
                with ExitStack() as stack:
                    fd = _open(path, stack)
                    w = StreamingWriter(fd, specs, md)
                    for n in names:
                        if n not in experts:
                            w.write(n, rd.get(n))
                            continue
                        stats["experts"] += 1
                        if progress:
                            progress(2 * ckpt.info(n).shape[0] * ckpt.info(n).shape[1])
                        if mx and passthrough:  # already this format: the bytes stay as they are
                            w.write(n, rd.get(n))
                            w.write(n + "_scale", rd.get(n + "_scale"))
                            stats["passed_through"] += 1
                            continue
                        src = load_weight(rd, n, q)  # bf16, dequantized exactly
                        if not mx:
                            w.write(n, src)
                            continue
                        wq, sc, clipped = quantize_weight(src, fp8_range, rule)
                        w.write(n, wq)
                        w.write(n + "_scale", sc)
                        _account(stats, clipped, dequantized(wq, sc), src)
                    w.finish()
                    os.ftruncate(fd, w.total_bytes)
                for spec in specs:
                    weight_map[spec.name] = fname
                total += sum(spec.nbytes for spec in specs)
        config = dict(ckpt.config)
        config.pop("quantization_config", None)
        if mx:
            config["quantization_config"] = quantization_config(plan.model.family)
        write_json(tmp / "config.json", config)
        if len(by_file) > 1 or ckpt.index_name:
            write_index(tmp / INDEX_NAME, weight_map, total, {"producer": f"mxcli {__version__}"})
        result = {
            "output": str(out),
            "output_format": NAME,
            "family": plan.model.family.name,
            "source_format": plan.source_format,
            "experts_format": "mxfp8" if mx else "bf16",
            "quantization_config": config.get("quantization_config"),
            "expert_tensors": stats["experts"],
            "passed_through": stats["passed_through"],
            "scale_rule": rule if mx else None,
            "fp8": plan.options.fp8().to_dict() if mx else None,
            "fp8_clipped": stats["clipped"],
            "changed_values": stats["changed_values"],
            "values": stats["values"],
            "worst_sqnr_db": stats["worst_sqnr_db"],
            "files": sorted(by_file),
            "notes": (
                [
                    "expert codes and scales passed through from the compressed-tensors source: "
                    "their scale bytes follow compressed_tensors' generate_mx_scales rule"
                ]
                if stats["passed_through"]
                else []
            ),
        }
        write_record(tmp, plan, NAME, result)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


def _open(path: Path, stack: ExitStack) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, default_mode())
    stack.callback(os.close, fd)
    return fd


def _account(stats: dict[str, Any], clipped: int, deq: torch.Tensor, src: torch.Tensor) -> None:
    """Clipped codes, values the MXFP8 quantization changed, and the worst per-tensor SQNR."""
    stats["clipped"] += clipped
    d = deq.to(torch.float32) - src.to(torch.float32)
    stats["changed_values"] += int((d != 0).sum())
    stats["values"] += d.numel()
    noise = float(d.double().pow(2).sum())
    signal = float(src.to(torch.float64).pow(2).sum())
    if noise > 0 and signal > 0:
        db = round(10 * math.log10(signal / noise), 3)
        worst = stats["worst_sqnr_db"]
        stats["worst_sqnr_db"] = db if worst is None else min(worst, db)


_EXPERT_NUM = re.compile(r"layers\.(\d+)\..*experts\.(\d+)\.")


def _expert_label(name: str) -> str:
    mt = _EXPERT_NUM.search(name)
    return f"layer {mt.group(1)}, expert {mt.group(2)}" if mt else ""


def vllm_probe_misses(experts: set[str], pats: list[re.Pattern[str]]) -> list[str]:
    """vLLM picks a FusedMoE layer's scheme from ``<experts>.0.gate_proj``, ``.0.up_proj`` and
    ``.0.down_proj`` whatever the checkpoint calls them, and serves the experts unquantized
    when the probe matches no target (vllm-project/vllm@0043d6b5 compressed_tensors/
    compressed_tensors_moe/compressed_tensors_moe.py:40-42, :57-58): each probe name no target
    matches, once per experts module."""
    blocks = sorted({n.split(".experts.")[0] + ".experts" for n in experts if ".experts." in n})
    out = []
    for b in blocks:
        missed = [b + p for p in (".0.gate_proj", ".0.up_proj", ".0.down_proj")
                  if not any(pt.match(b + p) for pt in pats)]  # fmt: skip
        if missed:
            out.append(
                f"{', '.join(missed)}: vLLM's MoE probe name(s) match no quantization target; "
                "vLLM would serve these experts unquantized"
            )
    return out


def verify(out: Path, against: Path, hashes_only: bool = False) -> dict[str, Any]:
    """``verify --checkpoint`` of a compressed-tensors export: key coverage, the
    quantization_config's targets (and vLLM's probe names), and every code and scale byte
    re-derived from the source under the recorded rule and range."""
    from mxcli.weightprep.export.folder import read_record
    from mxcli.weightprep.manifest import ExportRecord

    refuse_hashes_only(out, NAME, hashes_only)
    rederive = True
    rep = Report(NAME, out, against)
    side = read_record(out) or ExportRecord()
    s = side.settings
    plan = plan_for(
        against, rep, formats=tuple(s.get("formats", ("bf16", "mxfp8"))),
        scale_rule=s.get("scale_rule", "ocp"), fp8_range=int(s.get("fp8_range", 448)),
        output_format=NAME,
    )  # fmt: skip
    if plan is None:
        return rep.finish()
    mx = "mxfp8" in plan.options.formats
    fp8_max = float(side.fp8.get("max", 448.0))
    m = plan.model
    src = Checkpoint(against)
    experts = set()
    for L in m.moe_layers():
        experts.update(m.family.experts.expected(plan.layer_prefix(L), m.E, m.H, m.I))
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    companions = set()
    for n in src.names():
        info = src.info(n)
        if n in experts:
            if info.dtype in FP8_SOURCE_DTYPES:
                companions.update({n + "_scale", n + "_scale_inv"})
            if mx:
                expected[n] = ("F8_E4M3", info.shape)
                expected[n + "_scale"] = ("U8", (info.shape[0], info.shape[1] // MX_GROUP))
            else:
                expected[n] = ("BF16", info.shape)
    for n in src.names():
        if n not in experts and n not in companions:
            info = src.info(n)
            expected[n] = (info.dtype, info.shape)
    dst = Checkpoint(out)
    actual = {n: (dst.info(n).dtype, dst.info(n).shape) for n in dst.names() if dst.in_header(n)}
    ok = set(compare_keys(rep, expected, actual, "", _expert_label))
    cfg = read_json(out / "config.json")
    q = cfg.get("quantization_config")
    if mx:
        if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
            rep.fail("wrong", "config.json: no compressed-tensors quantization_config")
        else:
            targets = [t[3:] for g in q.get("config_groups", {}).values()
                       for t in g.get("targets", []) if t.startswith("re:")]  # fmt: skip
            pats = [re.compile(t) for t in targets] or [re.compile(p[3:]) for p in
                                                        expert_targets(m.family)]  # fmt: skip
            for n in sorted(experts):
                module = n.rsplit(".", 1)[0]
                if not any(p.match(module) for p in pats):
                    rep.fail("unquantized", f"{n}: not matched by any quantization_config target")
            for n in expected:
                module = n.rsplit(".", 1)[0]
                if (
                    n not in experts
                    and n.endswith(".weight")
                    and any(p.match(module) for p in pats)
                ):
                    rep.fail("wrong", f"{n}: matched by a quantization target but not quantized")
            for probe in vllm_probe_misses(experts, pats):
                rep.fail("unquantized", probe)
    # what the export did, as its record says: passed a compressed-tensors MXFP8 source through,
    # or quantized under the recorded scale rule and range (`compressed_tensors.quantize_weight`)
    passed = int(side.result.get("passed_through") or 0) > 0
    fp8 = plan.options.fp8()
    how = "its source's bytes (passed through)" if passed else (
        f"the MXFP8 of the source (scale rule {fp8.scale_rule}, +-{fp8.max:g})"
    )  # fmt: skip
    with src.reader() as rs, dst.reader() as rd:
        for n in sorted(ok):
            if n.endswith("_scale") and n[: -len("_scale")] in experts:
                continue
            if n in experts:
                ref = load_weight(rs, n, m.fp8_block)
                if mx:
                    if n + "_scale" not in ok:
                        continue
                    codes = rd.get(n).view(torch.uint8)
                    over = over_range(codes, fp8_max)
                    if over:
                        rep.fail(
                            "wrong", f"{n}: {over} FP8 codes beyond the declared +-{fp8_max:g}"
                        )
                    scales = rd.get(n + "_scale")
                    if rederive:
                        if passed:
                            want = rs.get(n).view(torch.uint8), rs.get(n + "_scale")
                        else:
                            want_c, want_s = quantize_mx(
                                ref, axis=-1, rule=fp8.rule_bytes, scheme="1x32"
                            )
                            clip_codes(want_c, fp8.fp8_range)
                            want = want_c.view(torch.uint8), want_s
                        diff = int((codes != want[0]).sum()) + int(
                            (scales.view(torch.uint8) != want[1].view(torch.uint8)).sum()
                        )
                        if diff:
                            rep.fail("wrong", f"{n}: {diff} code or scale bytes differ from {how}")
                    got = dequantize_mx(codes, scales)
                    exact, db = sqnr(got.to(torch.bfloat16), ref)
                    rep.numeric(n, exact, db, False)
                else:
                    exact, db = sqnr(rd.get(n), ref)
                    rep.numeric(n, exact, db, True)
            else:
                a, b = rd.get(n), rs.get(n)
                same = torch.equal(
                    a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                )
                if not same:
                    rep.numeric(n, False, sqnr(a, b)[1], True)
    return rep.finish(family=m.family.name, layers=m.moe_layers(), experts=len(experts))


def dry_run_view(plan: Any) -> dict[str, Any]:
    """``--dry-run``'s view (`mxcli.weightprep.export.base.Exporter`): expert 0's tensors of
    the first layer, and the bytes written per layer and in all."""
    m = plan.model
    L = plan.layers[0]
    rows = []
    # check_plan admits PerExpert layouts only: expert 0's Linear weights, [out, in]
    for n, (o_, i_) in m.family.experts.expected(plan.layer_prefix(L), 1, m.H, m.I).items():
        if "mxfp8" in plan.options.formats:
            rows += [
                tensor_row(n, "F8_E4M3", (o_, i_)),
                tensor_row(n + "_scale", "U8", (o_, i_ // MX_GROUP)),
            ]
        else:
            rows.append(tensor_row(n, "BF16", (o_, i_)))
    per_layer = sum(r["bytes"] for r in rows) * m.E
    note = f"expert 0 of {m.E} shown; every other tensor is copied unchanged"
    return {"outputs_per_layer": {f"layer {L}": rows}, "write_per_layer": per_layer,
            "write_total": per_layer * len(plan.layers), "note": note}  # fmt: skip
