"""``mxcli inspect FILE|DIR``: tensors, metadata and manifests; MX tensors decoded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import Debug, Json, Quiet, Steps, guarded, print_json, stdout_console


def inspect(
    path: Annotated[
        Path,
        typer.Argument(
            help="A .safetensors file or a prep-weights output folder.", show_default=False
        ),
    ],
    layer: Annotated[
        int | None,
        typer.Option(
            "--layer", help="Folder: also inspect this layer's file in detail.", show_default=False
        ),
    ] = None,
    rank: Annotated[int, typer.Option("--rank", help="Folder: rank of --layer.")] = 0,
    stats: Annotated[
        bool,
        typer.Option(
            "--stats/--no-stats",
            help="Read the data: min/max/mean, NaN/Inf counts and MX decoding.",
        ),
    ] = True,
    no_verify_hashes: Annotated[
        bool,
        typer.Option(
            "--no-verify-hashes",
            help="Folder with --layer: skip the sha256 check of the layer file against the "
            "manifest (for huge layers; shapes and padding are still checked).",
        ),
    ] = False,
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Show what a safetensors file or a prep-weights folder holds; MX tensors decoded.

    Tensors (dtype, shape, sha256, min/max/mean, NaN/Inf counts), metadata and manifests; packed
    prefill rows and x4 weights become scale histograms and dequantized statistics.
    """

    def body() -> None:
        from mxcli.inspection import inspect_path

        with Steps(quiet) as steps, steps.step(f"Reading {path}"):
            data = inspect_path(
                path, layer=layer, rank=rank, stats=stats, verify_hashes=not no_verify_hashes
            )
        if json_out:
            print_json(data)
        elif not quiet:
            _render(data)

    guarded(debug, body, json_out=json_out)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _render(data: dict[str, Any], con: Any = None) -> None:
    import json

    from rich.table import Table

    con = con or stdout_console()
    if data["kind"] == "file":
        con.print(f"[bold]{data['path']}[/] ({data['size']:,} bytes)")
        if data["metadata"]:
            meta = Table(title="metadata", show_header=False, box=None)
            meta.add_column("key", style="cyan")
            meta.add_column("value", overflow="fold")
            for k, v in data["metadata"].items():
                meta.add_row(k, v if isinstance(v, str) else json.dumps(v, default=str))
            con.print(meta)
        t = Table(title="tensors", header_style="bold")
        for col in ("name", "dtype", "shape", "sha256", "min", "max", "mean", "NaN", "Inf"):
            t.add_column(
                col, justify="right" if col in ("min", "max", "mean", "NaN", "Inf") else "left"
            )
        for row in data["tensors"]:
            t.add_row(
                row["name"],
                row["dtype"],
                str(row["shape"]),
                row["sha256"][:12],
                _fmt(row.get("min")),
                _fmt(row.get("max")),
                _fmt(row.get("mean")),
                _fmt(row.get("nan")),
                _fmt(row.get("inf")),
            )
        con.print(t)
        for mx in data.get("mx", []):
            _render_mx(mx, con)
    elif data["kind"] == "prep-weights":
        con.print(
            f"[bold]{data['path']}[/]: prep-weights output of a "
            f"{data['source'].get('family')} checkpoint ({data['source'].get('path')})"
        )
        for key in ("model", "settings", "router"):
            con.print(f"[cyan]{key}[/]: " + json.dumps(data[key], default=str))
        con.print(
            f"[cyan]ranks[/]: {len(data['ranks'] or [])}; [cyan]layers[/]: "
            + ", ".join(data["layers"])
        )
        for L, entry in data["layers"].items():
            t = Table(title=f"layer {L}", header_style="bold")
            for col in ("tensor", "dtype", "shape", "kernel arg", "sha256"):
                t.add_column(col)
            for k, v in entry["tensors"].items():
                t.add_row(
                    k,
                    v["dtype"],
                    str(v["shape"]),
                    str(v.get("kernel_arg") or "-"),
                    (v.get("sha256") or "-")[:12],
                )
            con.print(t)
            con.print("prefill kwargs: " + json.dumps(entry["prefill_kwargs"], default=str))
        if "layer_detail" in data:
            _render(data["layer_detail"], con)
    else:
        for f in data["files"]:
            _render(f, con)


def _render_mx(mx: dict[str, Any], con: Any) -> None:
    from rich.table import Table

    d = mx["dequantized"]
    title = f"{mx['tensor']}: {mx['kind']}"
    if "scale_layout" in mx:
        title += f", {mx['scale_layout']} scales"
    con.print(
        f"[bold]{title}[/]: {mx['groups']:,} MX groups, dequantized min {_fmt(d['min'])} "
        f"max {_fmt(d['max'])} mean {_fmt(d['mean'])} std {_fmt(d['std'])}, "
        f"zero codes {mx['zero_codes']:.2%}"
    )
    hist = mx["scale_exponents"]
    t = Table(title="scale exponents", header_style="bold", box=None)
    t.add_column("scale")
    t.add_column("groups", justify="right")
    t.add_column("")
    top = max(hist.values()) if hist else 1
    for k, n in hist.items():
        t.add_row(k, f"{n:,}", "#" * max(1, round(30 * n / top)))
    con.print(t)
    if "packed_affinities" in mx:
        a = mx["packed_affinities"]
        con.print(
            f"packed affinities: min {_fmt(a['min'])} max {_fmt(a['max'])} mean {_fmt(a['mean'])}"
        )
