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
                     "tile_k", "fast_dma_transpose"}
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
                        "check": null | {"<r>": {key: {"exact", "sqnr_db", "max_abs_diff"}}}}}

Tensor keys of a layer (``layers.{L}.<key>`` in the file): ``gamma [Hp]``, ``router_weights
[Hp, E]`` (arranged for ``router_act_fn``), ``router_bias [E]``; bf16 ``gate_up_proj_weight
[E_r, Hb, 2, Ip]`` and ``down_proj_weight [E_r, Ip, Hb]``; MXFP8 (bwd spec §5.5)
``gate_up_proj_weight_mxfp8 [E_r, 2Ip/4, Hb]`` U32 x4 + ``gate_up_weight_scales``,
``down_proj_weight_mxfp8 [E_r, Hb/4, Ip]`` + ``down_weight_scales``; gpt-oss
``gate_up_proj_bias [E_r, 2, Ip]``, ``down_proj_bias [E_r, Hb]``; a shared expert under
``shared_expert.<same keys>`` with E=1, and Qwen2's ``shared_expert_gate_weight [1, H]``.
Pad rows and columns (past H, past I_TP) are zero.

Readers: `load_manifest`, `load_layer_tensors`, `load_prefill_inputs`, `load_backward_weights`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.io.files import tensor_sha256

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
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not a readable manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(
            f"{path}: not a prep-weights manifest (format {data.get('format') if isinstance(data, dict) else None!r})"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(
            f"{path}: manifest schema_version {data.get('schema_version')} is not {SCHEMA_VERSION}"
        )
    return data


def load_manifest(path: str | Path) -> Manifest:
    """Load the manifest of an output folder (``OUT``, ``OUT/rank{r}`` or a manifest.json)."""
    p = _manifest_path(path)
    data = read_manifest_json(p)
    return Manifest(data, p, (p.parent / data.get("root", ".")).resolve())


def _as_manifest(m: Manifest | str | Path) -> Manifest:
    return m if isinstance(m, Manifest) else load_manifest(m)


def load_layer_tensors(
    path: Manifest | str | Path,
    layer: int,
    rank: int = 0,
    *,
    keys: list[str] | None = None,
    verify: bool = False,
) -> dict[str, torch.Tensor]:
    """The tensors of one layer on one rank, by key (``"gamma"``, ``"router_weights"``, ...).

    `keys` selects some (default all); `verify` checks each against the manifest's sha256.
    """
    from safetensors import safe_open

    m = _as_manifest(path)
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
        with safe_open(str(fpath), framework="pt", device="cpu") as f:
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
            raise ManifestError(f"{fpath}: {k} does not match its sha256 in the manifest")
    return out


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
