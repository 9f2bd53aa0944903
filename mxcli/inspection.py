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
    rank: int = 0,
    stats: bool = True,
    verify_hashes: bool = True,
) -> dict[str, Any]:
    """A prep-weights output folder: its manifest, and one layer file in detail with ``layer``,
    checked against the manifest first (shapes, padding, sha256 unless not `verify_hashes`).

    Any other folder: the safetensors files in it, each described without data statistics.
    """
    p = Path(path)
    if not (p / MANIFEST_NAME).exists():
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
    for L in m.layers:
        entry = m.layer(L)
        ranks: dict[str, Any] = entry.get("ranks", {})
        first: dict[str, Any] = next(iter(ranks.values()), {})
        out["layers"][str(L)] = {
            "prefill_kwargs": entry.get("prefill_kwargs"),
            "files": {r: v.get("file") for r, v in ranks.items()},
            "tensors": {
                k: {
                    "dtype": v["dtype"],
                    "shape": v["shape"],
                    "sha256": v.get("sha256"),
                    "kernel_arg": v.get("kernel_arg"),
                }
                for k, v in first.get("tensors", {}).items()
            },
            "check": entry.get("check"),
        }
    if layer is not None:
        verify_layer_file(m, layer, rank)
        detail = inspect_file(m.file(layer, rank), stats=stats)  # records its scale_layout
        out["layer_detail"] = {"layer": layer, "rank": rank, **detail}
    return out


def inspect_path(
    path: str | os.PathLike[str],
    *,
    layer: int | None = None,
    rank: int = 0,
    stats: bool = True,
    verify_hashes: bool = True,
) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or folder")
    if p.is_dir():
        return inspect_dir(p, layer=layer, rank=rank, stats=stats, verify_hashes=verify_hashes)
    if layer is not None:
        raise InputError("layer: --layer applies to a prep-weights folder, not a file")
    return inspect_file(p, stats=stats)
