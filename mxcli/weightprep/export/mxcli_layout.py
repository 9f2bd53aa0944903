"""``--output-format mxcli``: mxcli's own layout, the kernels' inputs per layer and rank with a
``manifest.json`` (`mxcli.weightprep.manifest`). It is written layer by layer by
`mxcli.weightprep.runner` (resumable, shardable), so its `Exporter` has no writer of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxcli.errors import MxcliError
from mxcli.weightprep.export import MXCLI
from mxcli.weightprep.export.verifying import Report, compare_keys, file_hashes, headers, plan_for

NAME = MXCLI.name


def verify(out: Path, against: Path, hashes_only: bool = False) -> dict[str, Any]:
    """``verify --checkpoint`` of a prep-weights folder: keys, shapes and dtypes per rank file,
    each tensor against the sha256 its manifest records, and (unless `hashes_only`) each layer
    re-derived from the source (`mxcli.weightprep.check.check_layer`)."""
    from mxcli.weightprep.check import check_layer
    from mxcli.weightprep.checkpoint import Checkpoint
    from mxcli.weightprep.manifest import load_manifest
    from mxcli.weightprep.plan import layer_file, tensor_name

    rederive = not hashes_only
    rep = Report(NAME, out, against)
    m = load_manifest(out)
    s = m.settings
    layers = ",".join(str(L) for L in m.layers) or None
    plan = plan_for(
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
            ok = compare_keys(rep, exp, headers(path), f"{rank.dir}/{layer_file(L)}: ")
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


def _check_hashes(rep: Report, m: Any, layer: int, rank: int, path: Path, where: str) -> None:
    """Every tensor of one layer file against the sha256 its manifest records."""
    try:
        entry = m.rank_entry(layer, rank)
    except MxcliError:
        return  # a rank the manifest lacks is reported by the key comparison
    got = file_hashes(path)
    for key, spec in entry["tensors"].items():
        h = got.get(spec["name"])
        if h is not None and h != spec.get("sha256"):
            rep.fail("wrong", f"{where}{key}: sha256 differs from the manifest's (a damaged or "
                              "replaced file)")  # fmt: skip
