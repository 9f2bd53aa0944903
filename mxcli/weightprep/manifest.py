"""The output folder of ``mxcli prep-weights`` and its ``manifest.json``: schema and loaders.

Folder layout::

    OUT/
      manifest.json                  # the whole run (every rank, every layer converted so far)
      rank{r}/                       # r = ep_rank * tp + tp_rank
        layer_{L:03d}.safetensors    # one file per MoE layer, tensors named "layers.{L}.<key>"
        model.safetensors.index.json # Hugging Face style: {"metadata": {"total_size"}, "weight_map"}
        manifest.json                # the same manifest restricted to this rank ("rank_view": r)

``manifest.json`` (schema_version 1)::

    format          "mxcli.prep-weights"
    schema_version  1
    tool            {"name": "mxcli", "version"}
    root            folder the "file" paths are relative to, relative to this manifest ("." or "..")
    rank_view       null, or the rank this manifest is restricted to
    source          {"path", "family", "model_type", "source_format",
                     "files": {name: {"size", "mtime_ns", "sha256"}},   # sha256 null until hashed
                     "config": {config.json key: value used},
                     "config_defaults": [{"key", "value", "from"}],  # keys config.json lacks
                     "hub": null | {"repo_id", "revision", "commit"}}  # a Hub repo id source
    model           {"num_layers", "moe_layers", "num_experts", "hidden_size", "padded_hidden_size",
                     "intermediate_size", "shared_intermediate_size", "top_k"}
    padding         {"hidden_size", "prefill_hidden_size" (Hp = ceil(H/512)*512),
                     "backward_hidden_size" (Hb = ceil(H/128)*128),
                     "intermediate_size_per_rank" (the real I_TP),
                     "padded_intermediate_size_per_rank" (Ip = ceil(I_TP/128)*128),
                     "shared_intermediate_size_per_rank", "padded_shared_intermediate_size_per_rank"}
                    (`mxcli.weightprep.padding`; absent in folders of older versions: no padding)
    settings        {"tp", "ep", "formats", "scale_layout", "scale_rule", "elem", "quant_scheme",
                     "tile_k", "fp8_range", "output_format", "fast_dma_transpose"}
    fp8             {"variant", "range", "max", "mode", "description", "scale_rule",
                     "scale_exponent"}   # the outputs' FP8 semantics (`mxcli.weightprep.fp8`)
    source_fp8      null | {"variant", "max", "declared_by"}   # what the source declares
    router          {"act_fn", "top_k", "n_group", "topk_group", "routed_scaling_factor",
                     "exact", "notes", "backward_notes"}
    notes           [str]
    ranks           [{"rank", "tp_rank", "ep_rank", "dir", "intermediate_range",
                      "expert_range", "shared_intermediate_range"}]
    layers          {"<L>": {
                        "layer", "prefill_kwargs": {"router_act_fn", "top_k", "n_group",
                            "topk_group", "routed_scaling_factor", "unpadded_hidden_size", "eps"},
                        "router_exact", "notes", "source_tensors", "source_bytes", "seconds",
                        "peak_rss_bytes",
                        "ranks": {"<r>": {"file", "bytes",
                            "tensors": {key: {"name", "dtype", "shape", "sha256",
                                              "kernel_arg", "layout"}}}},
                        "fp8_clipped",  # codes saturated for --fp8-range 240
                        "check": null | {"<r>": {key: {"exact", "sqnr_db", "max_abs_diff",
                            "changed_values", "values"}}}}}   # the last two: MXFP8 keys

Tensor keys of a layer (``layers.{L}.<key>`` in the file): ``gamma [Hp]``, ``router_weights
[Hp, E]`` (arranged for ``router_act_fn``), ``router_bias [E]``; bf16 ``gate_up_proj_weight
[E_r, Hb, 2, Ip]`` and ``down_proj_weight [E_r, Ip, Hb]``; MXFP8 (bwd spec §5.5)
``gate_up_proj_weight_mxfp8 [E_r, 2Ip/4, Hb]`` U32 x4 + ``gate_up_weight_scales``,
``down_proj_weight_mxfp8 [E_r, Hb/4, Ip]`` + ``down_weight_scales``; gpt-oss
``gate_up_proj_bias [E_r, 2, Ip]``, ``down_proj_bias [E_r, Hb]``; a shared expert under
``shared_expert.<same keys>`` with E=1, and Qwen2's ``shared_expert_gate_weight [1, H]``.
Pad rows and columns (past H, past I_TP) are zero.

The manifest is written and read here only, as a typed `ManifestRecord` (`new_manifest`,
`write_manifest`, `read_manifest`); so is an export folder's ``mxcli-export.json``
(`ExportRecord`: `new_export_record`, `write_export_record`, `read_export_record`).

Readers: `load_manifest`, `load_layer_tensors`, `load_prefill_inputs`, `load_backward_weights`.

The readers check the manifest against the files it describes, so that a hand-edited manifest
or a damaged layer file is refused rather than used: `load_manifest` that the padding is
consistent (padded sizes are the true sizes rounded up, as `model`, the layers' prefill kwargs
and the tensor shapes it lists say); reading a tensor, that its shape is the manifest's, that
the pad rows and columns are zero, and (unless ``verify_hashes=False``, the commands'
``--no-verify-hashes``, for huge layers) that its sha256 is the manifest's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.io.files import tensor_sha256
from mxcli.io.jsonfile import read_json

if TYPE_CHECKING:
    from mxcli.weightprep.padding import Padding
    from mxcli.weightprep.plan import Plan

MANIFEST_NAME = "manifest.json"
FORMAT = "mxcli.prep-weights"
SCHEMA_VERSION = 1
EXPORT_FORMAT = "mxcli.export"  # an export folder's record (`ExportRecord`)


class ManifestError(MxcliError):
    """A prep-weights output folder is missing, incomplete or from an incompatible version."""


# -- the records, typed: each key written and read here, once ---------------------------------
#
# `ManifestRecord` is ``manifest.json`` (the layout above), `ExportRecord` an export folder's
# ``mxcli-export.json`` (`mxcli.weightprep.export.folder`). A record keeps, as read, the keys an
# older version left out (`_absent`: written out again as absent) and those a newer one added
# (`_extra`: written after the known ones), so that reading and writing a record gives back
# the same bytes. Sections kept as plain dicts are written by the module that owns their keys
# (`PrepOptions.settings`, `Rank.to_dict`, `Padding.to_dict`, the converter's layer records).


@dataclass
class _Record:
    """A JSON object with known keys (the dataclass fields, in their written order)."""

    _absent: set[str] = field(default_factory=set, repr=False, compare=False)
    _extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # fields written only when not None (a key older versions omit rather than write null)
    _OMIT_NONE: ClassVar[tuple[str, ...]] = ()
    # fields holding a record, or a {key: record} map, by class
    _NESTED: ClassVar[dict[str, type[_Record]]] = {}
    _NESTED_MAPS: ClassVar[dict[str, type[_Record]]] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        absent = self.__dict__.get("_absent")
        if absent and not name.startswith("_"):
            absent.discard(name)  # set since it was read: written

    @classmethod
    def _keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if not f.name.startswith("_")]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self._keys():
            v = getattr(self, k)
            if k in self._absent or (v is None and k in self._OMIT_NONE):
                continue
            out[k] = _plain(v)
        out.update(self._extra)
        return out

    @classmethod
    def from_dict(cls: type[R], d: dict[str, Any]) -> R:
        """The record of `d` (keys it lacks take their defaults and stay absent when written)."""
        known = cls._keys()
        kw: dict[str, Any] = {}
        absent = set()
        for k in known:
            if k not in d:
                absent.add(k)
                continue
            v = d[k]
            sub = cls._NESTED.get(k)
            if sub is not None and isinstance(v, dict):
                v = sub.from_dict(v)
            sub = cls._NESTED_MAPS.get(k)
            if sub is not None and isinstance(v, dict):
                v = {name: sub.from_dict(e) if isinstance(e, dict) else e for name, e in v.items()}
            kw[k] = v
        rec = cls(**kw)
        rec._absent = absent
        rec._extra = {k: v for k, v in d.items() if k not in known}
        return rec


R = TypeVar("R", bound=_Record)


def _plain(v: Any) -> Any:
    if isinstance(v, _Record):
        return v.to_dict()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


@dataclass
class SourceFile(_Record):
    """``source.files[name]``: a source file as the run found it (``sha256`` once hashed)."""

    size: int = 0
    mtime_ns: int = 0
    sha256: str | None = None


@dataclass
class SourceRecord(_Record):
    """``source``: what was converted."""

    path: str = ""
    family: str = ""
    model_type: str = ""
    source_format: str = ""
    files: dict[str, SourceFile] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # config.json key: value used
    config_defaults: list[dict[str, Any]] = field(default_factory=list)  # keys config.json lacks
    hub: dict[str, Any] | None = None  # {"repo_id", "revision", "commit"} of a Hub source
    _NESTED_MAPS: ClassVar[dict[str, type[_Record]]] = {"files": SourceFile}


@dataclass
class ModelRecord(_Record):
    """``model``: the source model's sizes."""

    num_layers: int = 0
    moe_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    hidden_size: int = 0
    padded_hidden_size: int | None = None
    intermediate_size: int = 0
    shared_intermediate_size: int | None = None
    top_k: int = 0


@dataclass
class ShardsRecord(_Record):
    """``shards``: a folder prepared by several processes (`mxcli.weightprep.shards`)."""

    count: int = 1
    complete: bool = False
    layers: list[int] | None = None  # the selection the first shard recorded
    _OMIT_NONE: ClassVar[tuple[str, ...]] = ("layers",)


@dataclass
class ManifestRecord(_Record):
    """``manifest.json`` (the layout in the module doc)."""

    format: str = FORMAT
    schema_version: int = SCHEMA_VERSION
    tool: dict[str, Any] = field(default_factory=dict)
    root: str = "."
    rank_view: int | None = None
    source: SourceRecord = field(default_factory=SourceRecord)
    model: ModelRecord = field(default_factory=ModelRecord)
    padding: dict[str, Any] | None = None  # `Padding.to_dict` (absent in older folders)
    settings: dict[str, Any] = field(default_factory=dict)  # `PrepOptions.settings` and more
    fp8: dict[str, Any] | None = None  # `Fp8Semantics.to_dict`
    source_fp8: dict[str, Any] | None = None
    router: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # `Rank.to_dict`
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<L>": the layer's record
    shards: ShardsRecord | None = None
    _OMIT_NONE: ClassVar[tuple[str, ...]] = ("shards",)
    _NESTED: ClassVar[dict[str, type[_Record]]] = {
        "source": SourceRecord,
        "model": ModelRecord,
        "shards": ShardsRecord,
    }

    def rank_view_of(self, rank: int) -> ManifestRecord:
        """The manifest restricted to `rank` (``OUT/rank{r}/manifest.json``, root ``..``)."""
        layers = {}
        for L, entry in self.layers.items():
            e = dict(entry)
            e["ranks"] = {k: v for k, v in entry["ranks"].items() if int(k) == rank}
            if e.get("check"):
                e["check"] = {k: v for k, v in entry["check"].items() if int(k) == rank}
            layers[L] = e
        view = replace(
            self, root="..", rank_view=rank,
            ranks=[r for r in self.ranks if r["rank"] == rank], layers=layers,
        )  # fmt: skip
        view._absent, view._extra = set(self._absent), dict(self._extra)
        return view


def new_manifest(plan: Plan, source_files: dict[str, SourceFile]) -> ManifestRecord:
    """The manifest of a run of `plan` before any layer is converted."""
    from mxcli import __version__

    m = plan.model
    return ManifestRecord(
        tool={"name": "mxcli", "version": __version__},
        source=SourceRecord(
            path=str(plan.source),
            family=m.family.name,
            model_type=plan.model_type,
            source_format=plan.source_format,
            files=source_files,
            config=m.used,
            config_defaults=[d.to_dict() for d in m.defaulted],
            hub=plan.hub,
        ),
        model=ModelRecord(
            num_layers=m.num_layers,
            moe_layers=m.moe_layers(),
            num_experts=m.E,
            hidden_size=m.H,
            padded_hidden_size=plan.H_padded,
            intermediate_size=m.I,
            shared_intermediate_size=m.shared_I,
            top_k=int(m.values["top_k"]),
        ),
        padding=plan.padding.to_dict(),
        settings={**plan.options.settings(), "fast_dma_transpose": False},
        fp8=plan.options.fp8().to_dict(),
        source_fp8=plan.source_fp8,
        router=m.router.to_dict(),
        notes=list(plan.notes),
        ranks=[rk.to_dict() for rk in plan.ranks],
    )


def read_manifest(path: Path) -> ManifestRecord:
    """``manifest.json`` at `path`, checked (`read_manifest_json`), as its record."""
    return ManifestRecord.from_dict(read_manifest_json(path))


def write_manifest(out: Path, manifest: ManifestRecord, indexes: bool = True) -> None:
    """Write OUT/manifest.json and, per rank, its index and rank-view manifest (all atomic).

    ``indexes=False`` (a shard of a multi-process run, before the last one finishes): the
    manifest alone, so that no index names a partial set of layers."""
    from mxcli.weightprep.checkpoint import INDEX_NAME
    from mxcli.weightprep.writer import write_index, write_json

    manifest.layers = dict(sorted(manifest.layers.items(), key=lambda kv: int(kv[0])))
    for rk in manifest.ranks if indexes else []:
        r = rk["rank"]
        rdir = out / rk["dir"]
        rdir.mkdir(parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        total = 0
        for entry in manifest.layers.values():
            fe = entry["ranks"].get(str(r))
            if fe is None:
                continue
            fname = Path(fe["file"]).name
            for t in fe["tensors"].values():
                weight_map[t["name"]] = fname
            total += int(fe["bytes"])
        write_index(rdir / INDEX_NAME, weight_map, total, {"format": FORMAT, "rank": r})
        write_json(rdir / MANIFEST_NAME, manifest.rank_view_of(r).to_dict())
    write_json(out / MANIFEST_NAME, manifest.to_dict())


@dataclass
class ExportSource(_Record):
    """An export record's ``source``."""

    path: str = ""
    family: str = ""
    model_type: str = ""
    source_format: str = ""
    fp8: dict[str, Any] | None = None  # the FP8 semantics the source declares


@dataclass
class ExportModel(_Record):
    """An export record's ``model``."""

    num_layers: int = 0
    moe_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0


@dataclass
class ExportRecord(_Record):
    """``mxcli-export.json``: what an export wrote, from what, with its FP8 semantics."""

    format: str = EXPORT_FORMAT
    output_format: str = ""
    tool: dict[str, Any] = field(default_factory=dict)
    source: ExportSource = field(default_factory=ExportSource)
    model: ExportModel = field(default_factory=ExportModel)
    settings: dict[str, Any] = field(default_factory=dict)  # `PrepOptions.settings`
    fp8: dict[str, Any] = field(default_factory=dict)  # `Fp8Semantics.to_dict`
    result: dict[str, Any] = field(default_factory=dict)  # the export's result
    files: list[str] | None = None  # every file written (relative), added at publishing
    _OMIT_NONE: ClassVar[tuple[str, ...]] = ("files",)
    _NESTED: ClassVar[dict[str, type[_Record]]] = {"source": ExportSource, "model": ExportModel}


def new_export_record(plan: Plan, output_format: str, result: dict[str, Any]) -> ExportRecord:
    """The record of an export of `plan` in `output_format` with its `result`."""
    from mxcli import __version__

    m = plan.model
    return ExportRecord(
        output_format=output_format,
        tool={"name": "mxcli", "version": __version__},
        source=ExportSource(
            path=str(plan.source),
            family=m.family.name,
            model_type=plan.model_type,
            source_format=plan.source_format,
            fp8=plan.source_fp8,
        ),
        model=ExportModel(
            num_layers=m.num_layers,
            moe_layers=plan.layers,
            num_experts=m.E,
            hidden_size=m.H,
            intermediate_size=m.I,
        ),
        settings=plan.options.settings(),
        fp8=plan.options.fp8().to_dict(),
        result=result,
    )


def read_export_record(path: Path) -> ExportRecord:
    """The export record at `path` (one line naming it when it is not one)."""
    data = read_json(path, MxcliError)
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise MxcliError(f"{path}: not an mxcli export sidecar")
    return ExportRecord.from_dict(data)


def write_export_record(path: Path, record: ExportRecord) -> None:
    """Write `record` at `path` (inside the export's temporary folder: published whole)."""
    import json
    import os

    from mxcli.fsutil import default_mode

    path.write_text(json.dumps(record.to_dict(), indent=2) + "\n")
    os.chmod(path, default_mode())


@dataclass
class Manifest:
    """A loaded ``manifest.json``; file paths resolve against `root`."""

    record: ManifestRecord
    path: Path  # the manifest.json file
    root: Path  # folder the per-layer "file" paths are relative to
    verify_hashes: bool = True  # the readers' default: check each tensor's sha256

    @cached_property
    def data(self) -> dict[str, Any]:
        """The manifest as JSON (for readers that show it whole)."""
        return self.record.to_dict()

    @property
    def layers(self) -> list[int]:
        return sorted(int(k) for k in self.record.layers)

    @property
    def ranks(self) -> list[int]:
        return [int(r["rank"]) for r in self.record.ranks]

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.record.settings)

    def layer(self, layer: int) -> dict[str, Any]:
        entry = self.record.layers.get(str(int(layer)))
        if entry is None:
            have = ",".join(str(L) for L in self.layers) or "none"
            raise InputError(f"layer {layer}: not in {self.path.parent} (layers there: {have})")
        return dict(entry)

    def rank_entry(self, layer: int, rank: int = 0) -> dict[str, Any]:
        entry = self.layer(layer)["ranks"].get(str(int(rank)))
        if entry is None:
            have = ",".join(self.layer(layer)["ranks"])
            raise InputError(f"rank {rank}: not in {self.path.parent} (ranks there: {have})")
        return dict(entry)

    def file(self, layer: int, rank: int = 0) -> Path:
        return self.root / self.rank_entry(layer, rank)["file"]

    def padding(self, rank: int = 0) -> Padding:
        """The padded and true sizes (`mxcli.weightprep.padding`) of this folder's tensors."""
        from mxcli.weightprep.padding import Padding

        rec = self.record
        if rec.padding is not None:
            return Padding.from_dict(rec.padding)
        model = rec.model  # an older folder: sizes as stored, nothing padded
        r = next((x for x in rec.ranks if int(x["rank"]) == rank), rec.ranks[0])
        i0, i1 = r["intermediate_range"]
        sr = r.get("shared_intermediate_range")
        Is = sr[1] - sr[0] if sr else None
        H = int(model.hidden_size)
        return Padding(H, int(model.padded_hidden_size or H), H, i1 - i0, i1 - i0, Is, Is)

    def prefill_kwargs(self, layer: int) -> dict[str, Any]:
        """Keyword arguments for `rmsnorm_mx_prefill` (router act fn as `RouterActFnType`)."""
        from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType

        kw = dict(self.layer(layer)["prefill_kwargs"])
        kw["router_act_fn"] = RouterActFnType.coerce(kw["router_act_fn"])
        return kw


def _manifest_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise ManifestError(f"{p}: not found (is this a `mxcli prep-weights` output folder?)")
    return p


def read_manifest_json(path: Path) -> dict[str, Any]:
    data = read_json(path, ManifestError)  # one line for malformed or too deeply nested JSON
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(
            f"{path}: not a prep-weights manifest (format {data.get('format') if isinstance(data, dict) else None!r})"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(
            f"{path}: manifest schema_version {data.get('schema_version')} is not {SCHEMA_VERSION}"
        )
    check_paths(data, path)
    return data


def check_paths(data: dict[str, Any], path: Path) -> None:
    """Every path the manifest records (``root``, ``ranks[i].dir``, each layer's rank
    ``file``) stays inside its folder, links resolved: one that points elsewhere would make
    ``--force`` delete, ``--finalize`` write and the readers read outside it. A rank view
    (``rank_view`` set) lies one level down: its root is ``..``, the output folder."""
    from mxcli.fsutil import confined

    root = data.get("root", ".")
    want = "." if data.get("rank_view") is None else ".."
    if root != want:
        raise ManifestError(f"{path}: root is {root!r}, expected {want!r}; a corrupt manifest")
    base = path.parent / root
    ranks = data.get("ranks")
    layers = data.get("layers")
    if not isinstance(ranks, list) or not isinstance(layers, dict):
        raise ManifestError(f"{path}: ranks or layers missing or malformed; a corrupt manifest")
    for i, rk in enumerate(ranks):
        rel = rk.get("dir") if isinstance(rk, dict) else None
        confined(base, rel, f"ranks[{i}].dir", path, error=ManifestError)
    for L, entry in layers.items():
        files = entry.get("ranks") if isinstance(entry, dict) else None
        if not isinstance(files, dict):
            raise ManifestError(f"{path}: layers.{L}.ranks is malformed; a corrupt manifest")
        for r, fe in files.items():
            rel = fe.get("file") if isinstance(fe, dict) else None
            confined(base, rel, f"layers.{L}.ranks.{r}.file", path, error=ManifestError)


def load_manifest(path: str | Path, *, verify_hashes: bool = True) -> Manifest:
    """Load the manifest of an output folder (``OUT``, ``OUT/rank{r}`` or a manifest.json),
    checked for consistency (`check_manifest`); `verify_hashes` is the readers' default."""
    p = _manifest_path(path)
    rec = read_manifest(p)
    m = Manifest(rec, p, (p.parent / rec.root).resolve(), verify_hashes)
    check_manifest(m)
    return m


def _wrong(m: Manifest, what: str) -> ManifestError:
    return ManifestError(f"{m.path}: {what}; the manifest does not describe its files")


def check_manifest(m: Manifest) -> None:
    """The padding against itself, `model`, each layer's prefill kwargs and tensor shapes."""
    try:
        pad = m.padding()
    except (KeyError, TypeError, ValueError, IndexError):
        raise _wrong(m, "malformed padding") from None
    H, Hp, Hb = pad.hidden_size, pad.prefill_hidden_size, pad.backward_hidden_size
    Ip, Isp = pad.padded_intermediate_size, pad.padded_shared_intermediate_size
    model = m.record.model
    if m.record.padding is not None:  # (older folders: nothing padded, sizes as stored)
        problem = padding_problem(pad, "padding")
        if problem is None and model.hidden_size != H:
            problem = f"model.hidden_size is {model.hidden_size}, padding.hidden_size {H}"
        padded = model.padded_hidden_size
        if problem is None and padded is not None and padded != Hp:
            problem = f"model.padded_hidden_size is {padded}, padding.prefill_hidden_size {Hp}"
        if problem is not None:
            raise _wrong(m, problem)
    E = model.num_experts
    for L, entry in m.record.layers.items():
        u = (entry.get("prefill_kwargs") or {}).get("unpadded_hidden_size") or Hp
        if u != H:
            raise _wrong(m, f"layer {L}: unpadded_hidden_size is {u}, padding.hidden_size {H}")
        for r, fe in entry.get("ranks", {}).items():
            shapes = {k: list(v.get("shape", [])) for k, v in fe.get("tensors", {}).items()}
            for key, dims in _padded_dims(Hp, Hb, Ip, Isp).items():
                shape = shapes.get(key)
                if shape is None:
                    continue
                for d, size in dims.items():
                    if len(shape) <= d or shape[d] != size:
                        raise _wrong(
                            m, f"layer {L} rank {r}: {key} has shape {shape}, the padding "
                            f"gives dim {d} = {size}",
                        )  # fmt: skip
            rw = shapes.get("router_weights")
            if rw is not None and E and math.prod(rw) != Hp * int(E):
                raise _wrong(m, f"layer {L} rank {r}: router_weights {rw} is not [{Hp}, {E}]")


def padding_problem(pad: Padding, where: str) -> str | None:
    """What makes a recorded `Padding` impossible (each padded size is its true size rounded
    up to the kernel's multiple, `mxcli.weightprep.padding`), or None; `where` names it."""
    from mxcli.weightprep.padding import BWD_MULTIPLE, PREFILL_H_MULTIPLE, round_up

    H = pad.hidden_size
    rules: list[tuple[str, int | None, int]] = [
        ("prefill_hidden_size", pad.prefill_hidden_size, round_up(H, PREFILL_H_MULTIPLE)),
        ("backward_hidden_size", pad.backward_hidden_size, round_up(H, BWD_MULTIPLE)),
        ("padded_intermediate_size_per_rank", pad.padded_intermediate_size,
         round_up(pad.intermediate_size, BWD_MULTIPLE)),
    ]  # fmt: skip
    if pad.shared_intermediate_size:
        rules.append(("padded_shared_intermediate_size_per_rank",
                      pad.padded_shared_intermediate_size,
                      round_up(pad.shared_intermediate_size, BWD_MULTIPLE)))  # fmt: skip
    for name, got, want in rules:
        if got != want:
            return f"{where}.{name} is {got}, expected {want} ({where}.hidden_size {H})"
    return None


def _padded_dims(Hp: int, Hb: int, Ip: int, Isp: int | None) -> dict[str, dict[int, int]]:  # noqa: N803
    """Tensor key -> {dim: padded size} of the bf16 tensors (module docstring layout)."""
    dims: dict[str, dict[int, int]] = {
        "gamma": {0: Hp},
        "gate_up_proj_weight": {1: Hb, 3: Ip},
        "down_proj_weight": {1: Ip, 2: Hb},
    }
    if Isp:
        dims["shared_expert.gate_up_proj_weight"] = {1: Hb, 3: Isp}
        dims["shared_expert.down_proj_weight"] = {1: Isp, 2: Hb}
    return dims


def _check_pad_zero(m: Manifest, fpath: Path, key: str, t: torch.Tensor) -> None:
    """The pad rows and columns of a bf16 tensor (past H, past I_TP) must be zero: else the
    manifest's true sizes are not those of the data."""
    pad = m.padding()
    H, I = pad.hidden_size, pad.intermediate_size  # noqa: E741
    Is = pad.shared_intermediate_size
    true = {"gamma": {0: H}, "gate_up_proj_weight": {1: H, 3: I},
            "down_proj_weight": {1: I, 2: H}}  # fmt: skip
    if Is:
        true["shared_expert.gate_up_proj_weight"] = {1: H, 3: Is}
        true["shared_expert.down_proj_weight"] = {1: Is, 2: H}
    for d, n in true.get(key, {}).items():
        if n < t.shape[d] and bool(t.narrow(d, n, t.shape[d] - n).any()):
            raise ManifestError(
                f"{fpath}: {key} is not zero past index {n} of dim {d}, where the manifest "
                "says it is padding; the manifest does not describe its files"
            )


def _as_manifest(m: Manifest | str | Path) -> Manifest:
    return m if isinstance(m, Manifest) else load_manifest(m)


def load_layer_tensors(
    path: Manifest | str | Path,
    layer: int,
    rank: int = 0,
    *,
    keys: list[str] | None = None,
    verify: bool | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of one layer on one rank, by key (``"gamma"``, ``"router_weights"``, ...).

    `keys` selects some (default all). Shapes and zero padding are always checked; `verify`
    checks each against the manifest's sha256 (default: the manifest's ``verify_hashes``).
    """
    from safetensors import safe_open

    from mxcli.fsutil import utf8_path

    m = _as_manifest(path)
    if verify is None:
        verify = m.verify_hashes
    entry = m.rank_entry(layer, rank)
    specs = entry["tensors"]
    wanted = list(specs) if keys is None else list(keys)
    unknown = [k for k in wanted if k not in specs]
    if unknown:
        raise InputError(
            f"layer {layer} rank {rank}: no tensor {unknown[0]!r} (have: {', '.join(specs)})"
        )
    fpath = m.root / entry["file"]
    if not fpath.is_file():
        raise ManifestError(f"{fpath}: listed in the manifest but missing")
    out: dict[str, torch.Tensor] = {}
    try:
        with utf8_path(fpath) as opened, safe_open(opened, framework="pt", device="cpu") as f:
            for k in wanted:
                out[k] = f.get_tensor(specs[k]["name"])
    except MxcliError:
        raise
    except Exception as exc:
        raise ManifestError(f"{fpath}: cannot read ({exc})") from None
    for k, t in out.items():
        if list(t.shape) != list(specs[k]["shape"]):
            raise ManifestError(
                f"{fpath}: {k} has shape {list(t.shape)}, manifest says {specs[k]['shape']}"
            )
        if verify and tensor_sha256(t) != specs[k]["sha256"]:
            raise ManifestError(
                f"{fpath}: {k} does not match its sha256 in the manifest (a damaged or "
                "replaced file; --no-verify-hashes skips this check)"
            )
        _check_pad_zero(m, fpath, k, t)
    return out


def verify_layer_file(m: Manifest, layer: int, rank: int = 0) -> None:
    """Every tensor of a layer file against the manifest (names, shapes, zero padding, and the
    sha256 unless the manifest was loaded with ``verify_hashes=False``), one at a time."""
    for key in m.rank_entry(layer, rank)["tensors"]:
        load_layer_tensors(m, layer, rank, keys=[key])


def load_prefill_inputs(
    path: Manifest | str | Path, layer: int, rank: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, kwargs)`` for `rmsnorm_mx_prefill`: tensors ``gamma``, ``router_weights`` and
    ``router_bias`` (when the family has one); kwargs ``router_act_fn``, ``top_k``,
    ``n_group``, ``topk_group``, ``routed_scaling_factor``, ``unpadded_hidden_size``, ``eps``.

    The hidden states given to the kernel must be zero-padded to ``gamma``'s length when
    ``unpadded_hidden_size`` is smaller.
    """
    m = _as_manifest(path)
    keys = [
        k
        for k in ("gamma", "router_weights", "router_bias")
        if k in m.rank_entry(layer, rank)["tensors"]
    ]
    return load_layer_tensors(m, layer, rank, keys=keys), m.prefill_kwargs(layer)


def load_backward_weights(
    path: Manifest | str | Path,
    layer: int,
    rank: int = 0,
    *,
    fmt: str = "mxfp8",
    shared: bool = False,
) -> dict[str, Any]:
    """Weight keyword arguments for `blockwise_mm_bwd_mxfp8` from one layer and rank.

    ``fmt="bf16"``: ``gate_up_proj_weight`` and ``down_proj_weight``. ``fmt="mxfp8"``: the x4
    data under those names plus ``gate_up_weight_scales`` / ``down_weight_scales``, and
    ``scale_layout`` (``"packed"`` means the backward config's phase 1/2
    ``enable_scale_packing=True``). `shared` selects the shared expert (an E=1 stack).
    """
    m = _as_manifest(path)
    if fmt not in m.settings["formats"]:
        raise InputError(
            f"--format {fmt}: {m.path.parent} holds {', '.join(m.settings['formats'])} weights only"
        )
    pre = "shared_expert." if shared else ""
    if fmt == "bf16":
        keys = {
            "gate_up_proj_weight": pre + "gate_up_proj_weight",
            "down_proj_weight": pre + "down_proj_weight",
        }
    elif fmt == "mxfp8":
        keys = {
            "gate_up_proj_weight": pre + "gate_up_proj_weight_mxfp8",
            "gate_up_weight_scales": pre + "gate_up_weight_scales",
            "down_proj_weight": pre + "down_proj_weight_mxfp8",
            "down_weight_scales": pre + "down_weight_scales",
        }
    else:
        raise InputError(f"fmt: expected 'bf16' or 'mxfp8', got {fmt!r}")
    if shared and keys["down_proj_weight"] not in m.rank_entry(layer, rank)["tensors"]:
        raise InputError(f"layer {layer}: this model has no shared expert")
    t = load_layer_tensors(m, layer, rank, keys=list(keys.values()))
    out: dict[str, Any] = {arg: t[key] for arg, key in keys.items()}
    if fmt == "mxfp8":
        out["scale_layout"] = m.settings["scale_layout"]
    return out
