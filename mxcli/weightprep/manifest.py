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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.io.files import tensor_sha256
from mxcli.io.jsonfile import read_json

if TYPE_CHECKING:
    from mxcli.weightprep.padding import Padding

MANIFEST_NAME = "manifest.json"
FORMAT = "mxcli.prep-weights"
SCHEMA_VERSION = 1


class ManifestError(MxcliError):
    """A prep-weights output folder is missing, incomplete or from an incompatible version."""


@dataclass
class Manifest:
    """A loaded ``manifest.json``; file paths resolve against `root`."""

    data: dict[str, Any]
    path: Path  # the manifest.json file
    root: Path  # folder the per-layer "file" paths are relative to
    verify_hashes: bool = True  # the readers' default: check each tensor's sha256

    @property
    def layers(self) -> list[int]:
        return sorted(int(k) for k in self.data["layers"])

    @property
    def ranks(self) -> list[int]:
        return [int(r["rank"]) for r in self.data["ranks"]]

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.data["settings"])

    def layer(self, layer: int) -> dict[str, Any]:
        entry = self.data["layers"].get(str(int(layer)))
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

        d = self.data.get("padding")
        if d is not None:
            return Padding.from_dict(d)
        model = self.data["model"]  # an older folder: sizes as stored, nothing padded
        r = next((x for x in self.data["ranks"] if int(x["rank"]) == rank), self.data["ranks"][0])
        i0, i1 = r["intermediate_range"]
        sr = r.get("shared_intermediate_range")
        Is = sr[1] - sr[0] if sr else None
        H = int(model["hidden_size"])
        return Padding(H, int(model.get("padded_hidden_size") or H), H, i1 - i0, i1 - i0, Is, Is)

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
    data = read_manifest_json(p)
    m = Manifest(data, p, (p.parent / data.get("root", ".")).resolve(), verify_hashes)
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
    model = m.data.get("model") or {}
    if m.data.get("padding") is not None:  # (older folders: nothing padded, sizes as stored)
        problem = padding_problem(pad, "padding")
        if problem is None and model.get("hidden_size") != H:
            problem = f"model.hidden_size is {model.get('hidden_size')}, padding.hidden_size {H}"
        padded = model.get("padded_hidden_size")
        if problem is None and padded is not None and padded != Hp:
            problem = f"model.padded_hidden_size is {padded}, padding.prefill_hidden_size {Hp}"
        if problem is not None:
            raise _wrong(m, problem)
    E = model.get("num_experts")
    for L, entry in m.data["layers"].items():
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
