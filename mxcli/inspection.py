"""``mxcli inspect``: what a safetensors file or a prep-weights folder holds.

Per tensor: name, dtype, shape, sha256 prefix, min/max/mean and NaN/Inf counts. MX tensors are
decoded: packed prefill rows (``norm_quant_packed``, with the kwargs and geometry of the file's
metadata) and x4 weights with their E8M0 scales (``gate_up_proj_weight`` + ``gate_up_weight_scales``
in a bwd input file, ``*_proj_weight_mxfp8`` + ``*_weight_scales`` in prep-weights files) become a
histogram of scale exponents and statistics of the dequantized values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.io.files import TensorFile, describe_dtype, tensor_sha256
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.blockwise_moe.prequant import dequantize_weight_x4, scale_row_index, scale_rows
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL
from mxcli.kernels.spec import read_kernel_file
from mxcli.mx import unpack_x4
from mxcli.verification.finite import nonfinite_counts
from mxcli.weightprep.manifest import MANIFEST_NAME, load_manifest, verify_layer_file

# the prefill's packed rows: decoded (codes, scales, values, affinity tail), never shown as bytes
assert PREFILL.packed is not None
PACKED = PREFILL.packed

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def value_stats(t: torch.Tensor) -> dict[str, Any]:
    """min/max/mean/std over the finite values, and the NaN/Inf counts."""
    nan, inf = nonfinite_counts(t)
    v = t.detach().cpu()
    if v.dtype in (torch.uint16, torch.uint32, torch.uint64):
        v = v.to(torch.int64)
    v = v.reshape(-1).to(torch.float64)
    v = v[torch.isfinite(v)]
    out: dict[str, Any] = {"nan": nan, "inf": inf}
    if v.numel():
        out.update(
            min=float(v.min()),
            max=float(v.max()),
            mean=float(v.mean()),
            std=float(v.std()) if v.numel() > 1 else 0.0,
        )
    else:
        out.update(min=None, max=None, mean=None, std=None)
    return out


def scale_histogram(scales: torch.Tensor) -> dict[str, int]:
    """Counts of E8M0 scale bytes, keyed by the power of two they encode (``"2^-7"``)."""
    hist = torch.bincount(scales.reshape(-1).to(torch.int64), minlength=256)
    present = hist.nonzero().reshape(-1).tolist()
    return {("NaN" if b == 255 else f"2^{b - 127}"): int(hist[b]) for b in present}


def _mx_summary(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> dict[str, Any]:
    return {
        "dequantized": value_stats(values),
        "zero_codes": float(((codes & 0x7F) == 0).double().mean()) if codes.numel() else 0.0,
        "scale_exponents": scale_histogram(scales),
        "groups": int(scales.numel()),
    }


def _decode_packed(f: TensorFile) -> dict[str, Any] | None:
    t = f.tensors.get(PACKED.name)
    if t is None:
        return None
    kwargs = f.kwargs
    geo = f.meta_json("geometry") or {}
    H = geo.get("hidden_size") if isinstance(geo, Mapping) else None
    pack_aff = bool(kwargs.get("pack_affinities")) and bool(geo.get("num_experts"))
    if H is None:
        H, _ = PACKED.geometry(kwargs, t)
    dec = PACKED.decode(t, kwargs, int(H), int(geo["num_experts"]) if pack_aff else None)
    out = {
        "tensor": PACKED.name,
        "kind": "packed prefill rows",
        "hidden_size": int(H),
        **_mx_summary(dec.values, dec.codes, dec.scales),
    }
    if dec.affinities is not None:
        out["packed_affinities"] = value_stats(dec.affinities)
    return out


def _weight_layout(f: TensorFile, K: int, rows: int, which: str) -> str:
    """Scale layout of a pre-quantized weight: from the metadata, else from the row count."""
    cfg = f.kwargs.get("config")
    if isinstance(cfg, Mapping):
        phase = cfg.get("phase2_config" if which == "gate_up" else "phase1_config") or {}
        if isinstance(phase, Mapping) and "enable_scale_packing" in phase:
            return "packed" if phase["enable_scale_packing"] else "unpacked"
    layout = f.metadata.get("scale_layout")
    if layout in ("packed", "unpacked"):
        return layout
    if rows == scale_rows(K, "packed"):
        return "packed"
    if rows == scale_rows(K, "unpacked"):
        return "unpacked"
    raise InputError(f"{which} scales: {rows} rows fit neither scale layout for K={K}")


def _x4_pairs(names: list[str]) -> list[tuple[str, str, str]]:
    """(data name, scales name, 'gate_up'|'down') of the x4 weights in a file."""
    pairs = []
    for name in names:
        for which in ("gate_up", "down"):
            for data_suffix in (f"{which}_proj_weight", f"{which}_proj_weight_mxfp8"):
                if name.endswith(data_suffix):
                    prefix = name[: -len(data_suffix)]
                    scales = f"{prefix}{which}_weight_scales"
                    if scales in names:
                        pairs.append((name, scales, which))
    return pairs


def _decode_x4(f: TensorFile, data: str, scales: str, which: str) -> dict[str, Any] | None:
    x4, s = f.tensors[data], f.tensors[scales]
    if x4.dtype != torch.uint32 or s.dtype != torch.uint8 or x4.dim() != 3:
        return None
    K = int(x4.shape[1]) * 4
    layout = _weight_layout(f, K, int(s.shape[1]), which)
    values = dequantize_weight_x4(x4, s, Grouping(), layout)  # [E, K, F]
    compact = s.index_select(1, scale_row_index(K, layout))
    codes = unpack_x4(x4, axis=1)
    return {
        "tensor": data,
        "scales": scales,
        "kind": f"x4 {which} weight",
        "scale_layout": layout,
        "logical_shape": list(values.shape),
        **_mx_summary(values, codes, compact),
    }


def inspect_file(path: str | os.PathLike[str], *, stats: bool = True) -> dict[str, Any]:
    """JSON-ready description of a safetensors file (see the module docstring)."""
    f = read_kernel_file(path)
    meta: dict[str, Any] = {}
    for k in sorted(f.metadata):
        meta[k] = f.meta_json(k)
    tensors = []
    for name, t in f.tensors.items():
        row: dict[str, Any] = {
            "name": name,
            "dtype": describe_dtype(t.dtype),
            "shape": list(t.shape),
            "sha256": tensor_sha256(t),
        }
        if stats:
            if name == PACKED.name or t.dtype in _FP8 or t.dtype == torch.uint32:
                row["note"] = (
                    "MX bytes, decoded below"
                    if name == PACKED.name or t.dtype == torch.uint32
                    else "fp8 codes"
                )
                if t.dtype in _FP8 and name != PACKED.name:
                    row.update(value_stats(t.float()))
                else:
                    row.update(nan=0, inf=0)
            else:
                row.update(value_stats(t))
        tensors.append(row)
    mx: list[dict[str, Any]] = []
    if stats:
        if PACKED.name in f.tensors:
            dec = _decode_packed(f)
            if dec is not None:
                mx.append(dec)
        for data, scales, which in _x4_pairs(list(f.tensors)):
            dec = _decode_x4(f, data, scales, which)
            if dec is not None:
                mx.append(dec)
    return {
        "path": str(f.path),
        "kind": "file",
        "size": f.path.stat().st_size,
        "metadata": meta,
        "tensors": tensors,
        "mx": mx,
    }


def inspect_dir(
    path: str | os.PathLike[str],
    *,
    layer: int | None = None,
    rank: int | None = None,
    stats: bool = True,
    verify_hashes: bool = True,
) -> dict[str, Any]:
    """A prep-weights output folder: its manifest, every rank of every layer (only `layer` with
    ``layer``), and with ``layer`` that layer's file of each rank (of `rank` alone when given)
    in detail, each checked against the manifest first (shapes, padding, sha256 unless not
    `verify_hashes`).

    An export folder (``mxcli-export.json``: nxdi, compressed-tensors): its record and every
    file the record lists. Any other folder: the safetensors files in it. Their files are
    described without data statistics.
    """
    from mxcli.weightprep.export.folder import read_sidecar

    p = Path(path)
    if not (p / MANIFEST_NAME).exists():
        if layer is not None or rank is not None:
            flag = "--layer" if layer is not None else "--rank"
            raise InputError(f"{flag.lstrip('-')}: {flag} applies to a prep-weights folder")
        record = read_sidecar(p)
        if record is not None:
            return _inspect_export(p, record)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise InputError(f"{p}: no manifest.json and no .safetensors files")
        return {
            "path": str(p),
            "kind": "folder",
            "files": [inspect_file(x, stats=False) for x in files],
        }
    m = load_manifest(p, verify_hashes=verify_hashes)
    d = m.data
    out: dict[str, Any] = {
        "path": str(p),
        "kind": "prep-weights",
        "source": {
            k: d.get("source", {}).get(k) for k in ("path", "family", "model_type", "source_format")
        },
        "model": d.get("model"),
        "settings": d.get("settings"),
        "router": d.get("router"),
        "ranks": d.get("ranks"),
        "layers": {},
        "tool": d.get("tool"),
    }
    if layer is not None:
        m.layer(layer)  # a layer the folder lacks: one line naming the layers there
    if rank is not None and layer is None:
        raise InputError("rank: --rank applies with --layer")
    for L in m.layers if layer is None else [layer]:
        entry = m.layer(L)
        ranks: dict[str, Any] = entry.get("ranks", {})
        per_rank = {
            r: {
                k: {
                    "dtype": v["dtype"],
                    "shape": v["shape"],
                    "sha256": v.get("sha256"),
                    "kernel_arg": v.get("kernel_arg"),
                }
                for k, v in info.get("tensors", {}).items()
            }
            for r, info in ranks.items()
        }
        out["layers"][str(L)] = {
            "prefill_kwargs": entry.get("prefill_kwargs"),
            "files": {r: v.get("file") for r, v in ranks.items()},
            "tensors": next(iter(per_rank.values()), {}),  # the first rank's (as before)
            "rank_tensors": per_rank,
            "check": entry.get("check"),
        }
    if layer is not None:
        shown = [rank] if rank is not None else [int(r) for r in m.layer(layer)["ranks"]]
        details = []
        for r in shown:
            verify_layer_file(m, layer, r)
            detail = inspect_file(m.file(layer, r), stats=stats)  # records its scale_layout
            details.append({"layer": layer, "rank": r, **detail})
        out["layer_details"] = details
        out["layer_detail"] = details[0]  # the first rank's (as before)
    return out


def _inspect_export(p: Path, record: Mapping[str, Any]) -> dict[str, Any]:
    """An export folder: what its record says, and every file it lists (each confined to the
    folder: a record naming a file elsewhere is corrupt)."""
    result = record.get("result") if isinstance(record.get("result"), Mapping) else {}
    assert isinstance(result, Mapping)
    names = result.get("files")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InputError(f"{p / 'mxcli-export.json'}: result.files: expected a list of file names")
    root = p.resolve()
    files = []
    for name in names:
        f = (p / name).resolve()
        if not f.is_relative_to(root) or f == root:
            raise InputError(f"{p / 'mxcli-export.json'}: result.files: {name!r} lies outside {p}")
        if f.suffix == ".safetensors":
            if not f.is_file():
                raise InputError(f"{p / name}: listed in mxcli-export.json, but missing")
            files.append(inspect_file(p / name, stats=False))
    source = record.get("source") if isinstance(record.get("source"), Mapping) else {}
    assert isinstance(source, Mapping)
    return {
        "path": str(p),
        "kind": "export",
        "output_format": record.get("output_format"),
        "source": {k: source.get(k) for k in ("path", "family", "model_type", "source_format")},
        "model": record.get("model"),
        "settings": record.get("settings"),
        "result": {k: v for k, v in result.items() if k != "files"},
        "files": files,
        "tool": record.get("tool"),
    }


def inspect_path(
    path: str | os.PathLike[str],
    *,
    layer: int | None = None,
    rank: int | None = None,
    stats: bool = True,
    verify_hashes: bool = True,
) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or folder")
    if p.is_dir():
        return inspect_dir(p, layer=layer, rank=rank, stats=stats, verify_hashes=verify_hashes)
    if layer is not None or rank is not None:
        flag = "--layer" if layer is not None else "--rank"
        raise InputError(f"{flag.lstrip('-')}: {flag} applies to a prep-weights folder, not a file")
    return inspect_file(p, stats=stats)
