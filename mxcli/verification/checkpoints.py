"""``verify --checkpoint OUT --against SRC``: a prepared or exported weight folder against its
source checkpoint (issue 22: the check that silent-load failures lack).

The expected key set of OUT is derived from SRC through the family table and the settings OUT
records (its manifest or ``mxcli-export.json``), then compared with the safetensors headers of
OUT:

- key coverage, per family: every expert of every MoE layer present (named by layer and expert
  when missing); nothing unexpected (an unmapped tensor); no expert left unquantized where the
  output is MXFP8; every scale key present;
- shapes and dtypes, and the TP/EP divisibility of the recorded degrees;
- numerics: SQNR per quantized tensor, bit-exactness where the output is exact (bf16 experts,
  router, everything copied);
- every byte (issue 28): the sha256 the manifest records for each tensor of the mxcli layout,
  and the MXFP8 codes and scales re-derived from the source and compared byte for byte (the
  conversion and the exports are deterministic), under the scale rule and FP8 range the
  manifest or export record says were used. ``hashes_only`` (``--hashes-only``, for huge
  models) skips the re-derivation and every read of the source's tensors: keys, shapes and the
  recorded hashes only (the exports record none: refused there).

`verify_checkpoint` returns a report; ``passed`` is False when anything is missing or wrong.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.io.jsonfile import read_json

# MXFP8 (E4M3, 32-element groups) of any weight keeps ~30 dB; far below means wrong data.
MIN_MXFP8_SQNR_DB = 20.0


class _Report:
    def __init__(self, kind: str, out: Path, against: Path) -> None:
        self.data: dict[str, Any] = {
            "checkpoint": str(out),
            "against": str(against),
            "output_format": kind,
            "missing": [],
            "unexpected": [],
            "wrong": [],
            "unquantized": [],
            "numerics": {},
            "failures": [],
        }

    def fail(self, key: str, what: str) -> None:
        self.data[key].append(what)

    def numeric(self, name: str, exact: bool, sqnr: float | None, want_exact: bool) -> None:
        self.data["numerics"][name] = {"exact": exact, "sqnr_db": sqnr}
        if want_exact and not exact:
            self.data["failures"].append(f"{name}: not bit-exact against the source")
        elif not want_exact and sqnr is not None and sqnr < MIN_MXFP8_SQNR_DB:
            self.data["failures"].append(
                f"{name}: SQNR {sqnr:.1f} dB < {MIN_MXFP8_SQNR_DB:g} dB against the source"
            )

    def finish(self, **extra: Any) -> dict[str, Any]:
        d = self.data
        d.update(extra)
        d["passed"] = not (d["missing"] or d["unexpected"] or d["wrong"] or d["unquantized"]
                           or d["failures"])  # fmt: skip
        return d


def _sqnr(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float | None]:
    o, r = out.to(torch.float64), ref.to(torch.float64)
    exact = torch.equal(o, r)
    noise = float((o - r).pow(2).sum())
    signal = float(r.pow(2).sum())
    if noise == 0 or signal == 0 or not math.isfinite(noise):
        return exact, None
    return exact, round(10 * math.log10(signal / noise), 3)


def _over_range(codes: torch.Tensor, fp8_max: float) -> int:
    """E4M3FN codes whose magnitude exceeds `fp8_max` (NaN codes aside)."""
    v = codes.view(torch.float8_e4m3fn).to(torch.float32).abs()
    return int((v > fp8_max).sum())


def detect_kind(out: Path) -> str:
    from mxcli.weightprep.export.folder import read_sidecar
    from mxcli.weightprep.manifest import MANIFEST_NAME

    if not out.is_dir():
        raise InputError(f"--checkpoint {out}: not a folder")
    side = read_sidecar(out)
    if side is not None:
        return str(side["output_format"])
    if (out / MANIFEST_NAME).is_file():
        return "mxcli"
    raise InputError(
        f"--checkpoint {out}: neither a prep-weights folder (manifest.json) nor an mxcli "
        "export (mxcli-export.json)"
    )


def verify_checkpoint(
    out: str | Path, against: str | Path, *, hashes_only: bool = False
) -> dict[str, Any]:
    """Check `out` against its source `against` (see the module doc)."""
    o, a = Path(out), Path(against)
    kind = detect_kind(o)
    if kind == "mxcli":
        return _verify_mxcli(o, a, rederive=not hashes_only)
    if hashes_only:
        raise InputError(
            f"--hashes-only: {o} is a {kind} export, which records no hashes; run without "
            "--hashes-only (its codes and scales are re-derived from the source)"
        )
    if kind == "compressed-tensors":
        return _verify_ct(o, a)
    if kind == "nxdi":
        return _verify_nxdi(o, a, _Report(kind, o, a))
    raise InputError(f"--checkpoint {o}: unknown output format {kind!r}")


_HASH_CHUNK = 16 << 20


def _file_hashes(path: Path) -> dict[str, str]:
    """sha256 of every tensor's stored bytes in a safetensors file (`tensor_sha256`'s
    definition), streamed from the file a chunk at a time (layers larger than memory)."""
    import hashlib

    from mxcli.weightprep.checkpoint import read_safetensors_header

    header, start = read_safetensors_header(path)
    out: dict[str, str] = {}
    with path.open("rb") as f:
        for name, e in header.items():
            if name == "__metadata__":
                continue
            a, b = (int(x) for x in e["data_offsets"])
            h = hashlib.sha256()
            f.seek(start + a)
            left = b - a
            while left > 0:
                buf = f.read(min(_HASH_CHUNK, left))
                if not buf:
                    break
                h.update(buf)
                left -= len(buf)
            out[name] = h.hexdigest()
    return out


def _plan(against: Path, report: _Report, **opts: Any) -> Any:
    """The plan OUT's settings imply for SRC; a divisibility error becomes a failure."""
    from mxcli.weightprep.plan import PrepOptions, build_plan

    try:
        return build_plan(against, PrepOptions(**opts))
    except InputError as exc:
        if "divisible" in str(exc):
            report.fail("wrong", f"divisibility: {exc}")
            return None
        raise


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from mxcli.weightprep.checkpoint import read_safetensors_header

    header, _ = read_safetensors_header(path)
    return {
        n: (e["dtype"], tuple(int(d) for d in e["shape"]))
        for n, e in header.items()
        if n != "__metadata__"
    }


def compare_keys(
    report: _Report,
    expected: dict[str, tuple[str, tuple[int, ...]]],
    actual: dict[str, tuple[str, tuple[int, ...]]],
    where: str,
    describe: Any = None,
) -> list[str]:
    """Missing, unexpected and wrong (dtype/shape) keys; returns the names that match."""
    ok = []
    for n, (dt, shape) in expected.items():
        got = actual.get(n)
        label = f"{where}{n}" + (f" ({describe(n)})" if describe and describe(n) else "")
        if got is None:
            report.fail("missing", label)
        elif got[0] != dt and got[1] == shape and dt in ("F8_E4M3", "U32") and got[0] == "BF16":
            report.fail("unquantized", f"{label}: {got[0]}, expected {dt}")
        elif got != (dt, shape):
            report.fail(
                "wrong", f"{label}: expected {dt} {list(shape)}, got {got[0]} {list(got[1])}"
            )
        else:
            ok.append(n)
    for n in actual:
        if n not in expected:
            report.fail("unexpected", f"{where}{n} (not mapped to any source tensor)")
    return ok


# -- mxcli's own layout ---------------------------------------------------------------------------


def _verify_mxcli(out: Path, against: Path, *, rederive: bool = True) -> dict[str, Any]:
    from mxcli.weightprep.check import check_layer
    from mxcli.weightprep.checkpoint import Checkpoint
    from mxcli.weightprep.manifest import load_manifest
    from mxcli.weightprep.plan import layer_file, tensor_name

    rep = _Report("mxcli", out, against)
    m = load_manifest(out)
    s = m.settings
    layers = ",".join(str(L) for L in m.layers) or None
    plan = _plan(
        against, rep, tp=int(s["tp"]), ep=int(s["ep"]), formats=tuple(s["formats"]),
        scale_layout=s["scale_layout"], scale_rule=s["scale_rule"],
        fp8_range=int(s.get("fp8_range", 448)), layers=layers,
    )  # fmt: skip
    if plan is None:
        return rep.finish()
    expected_layers = plan.model.moe_layers()
    for L in expected_layers:
        if L not in m.layers:
            rep.fail("missing", f"layer {L}: a MoE layer of the source with no output")
    ckpt = Checkpoint(against)
    for L in plan.layers:
        complete = True
        for rank, outs in zip(plan.ranks, plan.outputs, strict=True):
            path = out / rank.dir / layer_file(L)
            e0, e1 = rank.expert_range
            if not path.is_file():
                rep.fail(
                    "missing", f"{rank.dir}/{layer_file(L)} (layer {L}, experts {e0}-{e1 - 1})"
                )
                complete = False
                continue
            exp = {tensor_name(L, o.key): (o.dtype, o.shape) for o in outs}
            ok = compare_keys(rep, exp, _headers(path), f"{rank.dir}/{layer_file(L)}: ")
            complete = complete and len(ok) == len(exp)
            if L in m.layers:
                _check_hashes(rep, m, L, rank.rank, path, f"{rank.dir}/{layer_file(L)}: ")
        if not complete or not rederive:
            continue
        with ckpt.reader() as rd:
            res = check_layer(plan, rd, L, out, rederive=True)
        rule = f"scale rule {plan.options.scale_rule}, +-{plan.options.fp8().max:g}"
        for r, per in res.items():
            for key, st in per.items():
                name = f"layers.{L}.{key} rank {r}"
                if st.get("differing_bytes"):
                    rep.fail("wrong", f"{name}: {st['differing_bytes']} bytes differ from the "
                                      f"MXFP8 of the source ({rule})")  # fmt: skip
                if "exact" in st:
                    rep.numeric(name, bool(st["exact"]), st.get("sqnr_db"), "_mxfp8" not in key)
    return rep.finish(
        family=plan.model.family.name, layers=plan.layers, ranks=len(plan.ranks),
        rederived=rederive,
    )  # fmt: skip


def _check_hashes(rep: _Report, m: Any, layer: int, rank: int, path: Path, where: str) -> None:
    """Every tensor of one layer file against the sha256 its manifest records."""
    try:
        entry = m.rank_entry(layer, rank)
    except MxcliError:
        return  # a rank the manifest lacks is reported by the key comparison
    got = _file_hashes(path)
    for key, spec in entry["tensors"].items():
        h = got.get(spec["name"])
        if h is not None and h != spec.get("sha256"):
            rep.fail("wrong", f"{where}{key}: sha256 differs from the manifest's (a damaged or "
                              "replaced file)")  # fmt: skip


# -- compressed-tensors ---------------------------------------------------------------------------

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


def _verify_ct(out: Path, against: Path, *, rederive: bool = True) -> dict[str, Any]:
    from mxcli.mx import dequantize_mx, quantize_mx
    from mxcli.weightprep.checkpoint import FP8_SOURCE_DTYPES, Checkpoint
    from mxcli.weightprep.export.compressed_tensors import MX_GROUP, expert_targets
    from mxcli.weightprep.export.folder import read_sidecar
    from mxcli.weightprep.families import load_weight
    from mxcli.weightprep.fp8 import clip_codes

    rep = _Report("compressed-tensors", out, against)
    side = read_sidecar(out) or {}
    s = side.get("settings", {})
    plan = _plan(
        against, rep, formats=tuple(s.get("formats", ("bf16", "mxfp8"))),
        scale_rule=s.get("scale_rule", "ocp"), fp8_range=int(s.get("fp8_range", 448)),
        output_format="compressed-tensors",
    )  # fmt: skip
    if plan is None:
        return rep.finish()
    mx = "mxfp8" in plan.options.formats
    fp8_max = float((side.get("fp8") or {}).get("max", 448.0))
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
    passed = int((side.get("result") or {}).get("passed_through") or 0) > 0
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
                    over = _over_range(codes, fp8_max)
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
                    exact, db = _sqnr(got.to(torch.bfloat16), ref)
                    rep.numeric(n, exact, db, False)
                else:
                    exact, db = _sqnr(rd.get(n), ref)
                    rep.numeric(n, exact, db, True)
            else:
                a, b = rd.get(n), rs.get(n)
                same = torch.equal(
                    a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                )
                if not same:
                    rep.numeric(n, False, _sqnr(a, b)[1], True)
    return rep.finish(family=m.family.name, layers=m.moe_layers(), experts=len(experts))


# -- NxD Inference ---------------------------------------------------------------------------------


def _verify_nxdi(out: Path, against: Path, report: _Report) -> dict[str, Any]:
    """An nxdi export: keys and shapes per rank file; bf16 experts and the router bit-exact; MX
    experts decoded from NxD's layout, their SQNR against the source, and their codes and scales
    equal to mxcli's MXFP8 of the source under the recorded scale rule and range."""
    from mxcli.weightprep.checkpoint import Checkpoint, open_safetensors, st_dtype
    from mxcli.weightprep.export.folder import read_sidecar
    from mxcli.weightprep.export.nxdi import (
        DOWN,
        GATE_UP,
        ROUTER,
        expected_tensors,
        is_mx,
        rank_i_range,
        rank_moe,
        router_tensor,
        world_ranks,
    )
    from mxcli.weightprep.export.nxdi import plan_rank_file as _rank_file

    side = read_sidecar(out) or {}
    s = side.get("settings", {})
    layers = side.get("model", {}).get("moe_layers")
    plan = _plan(
        against, report, tp=int(s.get("tp", 1)), ep=int(s.get("ep", 1)),
        formats=tuple(s.get("formats", ("bf16",))), scale_rule=s.get("scale_rule", "neuron"),
        fp8_range=int(s.get("fp8_range", 448)), output_format="nxdi",
        layers=",".join(map(str, layers)) if layers else None, nxdi_base=s.get("nxdi_base"),
    )  # fmt: skip
    if plan is None:
        return dict(report.finish())

    def rank_file(r: int) -> str:
        return str(_rank_file(plan, r))

    for L in plan.model.moe_layers():
        if L not in plan.layers:
            report.fail("missing", f"layer {L}: a MoE layer of the source with no output")
    m, fam = plan.model, plan.model.family
    mx = is_mx(plan)
    fp8 = plan.options.fp8()
    ranks = world_ranks(plan)
    ok: dict[int, set[str]] = {}
    for r, exp in expected_tensors(plan).items():
        path = out / rank_file(r)
        if not path.is_file():
            rk = ranks[r]
            report.fail("missing", f"{rank_file(r)} (experts {rk.expert_range[0]}-"
                                   f"{rk.expert_range[1] - 1}, I {rk.i_range[0]}-{rk.i_range[1] - 1})")  # fmt: skip
            continue
        ok[r] = set(compare_keys(report, exp, _headers(path), f"{rank_file(r)}: "))
    if plan.options.nxdi_base is not None and len(ok) == len(ranks):
        from mxcli.weightprep.export.nxdi import base_untouched

        for item in base_untouched(plan, out):  # complete files: the rest is the base's
            report.fail("wrong", item)
    ckpt = Checkpoint(against)
    with ckpt.reader() as rd:
        for r, good in ok.items():
            rk = ranks[r]
            where = f"{rank_file(r)}: "
            with open_safetensors(out / rank_file(r)) as f:
                for L in plan.layers:
                    p = plan.layer_prefix(L)
                    e0, e1 = rk.expert_range
                    gu, dn = fam.experts.load(rd, p, e0, e1, m.H, m.I, m.fp8_block)
                    gu_r, dn_r = rank_moe(gu, dn, *rank_i_range(plan, rk))
                    exact = {ROUTER.format(l=L): router_tensor(plan, rd.get(p + fam.router_weight))}
                    if not mx:
                        exact.update({GATE_UP.format(l=L): gu_r, DOWN.format(l=L): dn_r})
                    for name, ref in exact.items():
                        if name not in good:
                            continue
                        got = f.get_tensor(name)
                        same = st_dtype(got.dtype) == st_dtype(ref.dtype) and torch.equal(
                            got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)
                        )
                        report.numeric(where + name, same, None, True)
                    if mx:
                        _verify_nxdi_mx(report, f, where, L, gu_r, dn_r, fp8, good)
    return dict(report.finish(family=fam.name, layers=plan.layers, ranks=len(plan.ranks)))


def _verify_nxdi_mx(
    report: _Report, f: Any, where: str, L: int, gu_r: torch.Tensor, dn_r: torch.Tensor,
    fp8: Any, good: set[str],
) -> None:  # fmt: skip
    """One layer's MX experts of one rank file, decoded from NxD's layout."""
    from mxcli.mx import dequantize_mx
    from mxcli.weightprep.export.nxdi import (
        DOWN,
        DOWN_SCALE,
        GATE_UP,
        GATE_UP_SCALE,
        mx_down_codes,
        mx_gate_up_codes,
        quantize_rank,
    )

    gc, gs, dc, ds, _ = quantize_rank(gu_r, dn_r, fp8)
    for key, skey, unlay, src, want in (
        (GATE_UP, GATE_UP_SCALE, mx_gate_up_codes, gu_r, (gc, gs)),
        (DOWN, DOWN_SCALE, mx_down_codes, dn_r, (dc, ds)),
    ):
        name, sname = key.format(l=L), skey.format(l=L)
        if name not in good or sname not in good:
            continue  # a missing or misshapen key is already reported
        codes, scales = unlay(f.get_tensor(name), f.get_tensor(sname))
        over = _over_range(codes, fp8.max)
        if over:
            report.fail(
                "wrong", f"{where}{name}: {over} FP8 codes beyond the declared +-{fp8.max:g}"
            )
        if not (torch.equal(codes, want[0]) and torch.equal(scales, want[1])):
            # the quantizer is deterministic: other bytes mean another rule, range or layout
            report.fail(
                "wrong",
                f"{where}{name}: codes or scales differ from MXFP8 of the source "
                f"(scale rule {fp8.scale_rule}, +-{fp8.max:g})",
            )
        got = dequantize_mx(codes, scales, axis=1)
        exact, db = _sqnr(got.to(torch.bfloat16), src)
        report.numeric(where + name, exact, db, False)


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"verify --checkpoint {rep['checkpoint']} ({rep['output_format']}) against "
        f"{rep['against']}: {'PASS' if rep['passed'] else 'FAIL'}"
    ]
    for key in ("missing", "unexpected", "wrong", "unquantized", "failures"):
        for item in rep[key]:
            lines.append(f"  {key}: {item}")
    if rep.get("rederived") is False:
        lines.append("  hashes only (--hashes-only): no weight re-derived from the source")
    num = rep["numerics"]
    sq = [v["sqnr_db"] for v in num.values() if v.get("sqnr_db") is not None]
    ex = sum(1 for v in num.values() if v["exact"])
    lines.append(
        f"  numerics: {len(num)} tensors compared, {ex} bit-exact"
        + (f", worst SQNR {min(sq):.2f} dB" if sq else "")
    )
    return "\n".join(lines)


__all__ = ["MxcliError", "detect_kind", "format_report", "verify_checkpoint"]
