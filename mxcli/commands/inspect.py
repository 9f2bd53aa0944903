"""``mxcli inspect FILE|DIR``: tensors, metadata and manifests; MX tensors decoded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    HASH_DIGITS,
    Steps,
    global_options,
    print_json,
    shape_text,
    st_dtype,
    stdout_console,
)


def inspect(
    ctx: typer.Context,
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
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank",
            help="Folder with --layer: only this rank (default: every rank).",
            show_default=False,
        ),
    ] = None,
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
) -> None:
    """Show what a safetensors file or weight folder holds.

    A file, a prep-weights folder or an export folder (nxdi, compressed-tensors: every file it
    lists). Tensors (dtype, shape, sha256, min/max/mean, NaN/Inf counts), metadata and
    manifests; packed prefill rows and x4 weights become scale histograms and dequantized
    statistics. Hashes show their first 12 hex digits, control characters are shown escaped and
    long metadata values cut (--json gives every value in full).
    """

    from mxcli.inspection import inspect_path

    opts = global_options(ctx)
    with Steps(opts.quiet) as steps, steps.step(f"Reading {path}"):
        data = inspect_path(
            path, layer=layer, rank=rank, stats=stats, verify_hashes=not no_verify_hashes
        )
    if opts.json:
        print_json(data)
    elif not opts.quiet:
        _render(data)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _short(v: Any) -> Any:
    """A metadata value for the screen: sha256 digests cut to their first hex digits."""
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:HASH_DIGITS]
    return v


# metadata values longer than this are cut on screen (--json gives them whole)
MAX_VALUE_CHARS = 200


def printable(text: str) -> str:
    """`text` with its control and format characters escaped (``\\x1b``, ``\\n``,
    ``\\u202e``): a file's metadata and tensor names are the file author's, and must not
    move the cursor, clear the screen or reorder the line on the user's terminal."""
    import unicodedata

    if text.isprintable():
        return text
    return "".join(
        c.encode("unicode_escape").decode("ascii")
        if unicodedata.category(c)[0] in "CZ" and c != " "
        else c
        for c in text
    )


def cut(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """`text` (escaped, `printable`) cut to `limit` characters with a note of its full length."""
    if len(text) > limit:
        return f"{printable(text[:limit])}... ({len(text):,} characters; --json shows all)"
    return printable(text)


def _value(v: Any) -> str:
    import json

    v = _short(v)
    return cut(v if isinstance(v, str) else json.dumps(v, default=str))


def _print_mapping(con: Any, head: str, value: Any, width: int, indent: int = 4) -> None:
    """``head k=v, k=v, ...`` wrapped between items (continuation lines indented by `indent`);
    a JSON string is shown as what it holds."""
    import json

    from mxcli.commands._shared import wrap_items

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            pass
    parts = _parts(value) if isinstance(value, dict) else [_value(value)]
    for line in wrap_items(head, parts, width, indent=indent):
        _out(con, line)


def _parts(mapping: dict[str, Any]) -> list[str]:
    """``k=v`` items; a nested mapping's items between braces, so that lines break between
    them too: ``model_math={scoring=softmax``, ``top_k=2``, ..., ``topk_group=1}``."""
    parts: list[str] = []
    for k, v in mapping.items():
        if isinstance(v, dict) and v:
            inner = _parts(v)
            inner[0], inner[-1] = f"{cut(str(k))}={{{inner[0]}", inner[-1] + "}"
            parts += inner
        else:
            parts.append(f"{cut(str(k))}={_value(v)}")
    return parts


def _out(con: Any, line: str, style: str | None = None) -> None:
    from rich.text import Text

    con.print(Text(printable(line), style=style or ""), soft_wrap=True)


def _render(data: dict[str, Any], con: Any = None) -> None:
    """The report at the console's width: full tensor names always (a row too wide for the
    terminal is listed name first, its other columns below), lists wrapped between items."""
    from mxcli.commands._shared import print_rows, wrap_items

    con = con or stdout_console()
    width = con.width
    if data["kind"] == "file":
        _out(con, f"{data['path']} ({data['size']:,} bytes)", "bold")
        if data["metadata"]:
            _out(con, "metadata", "bold")
            keys = {k: cut(k) for k in data["metadata"]}
            pad = max(len(k) for k in keys.values()) + 3
            for k, v in data["metadata"].items():
                _print_mapping(con, f"  {keys[k]}".ljust(pad), v, width, indent=pad + 1)
        rows = [[cut(r["name"]), st_dtype(r["dtype"]), shape_text(r["shape"]),
                 r["sha256"][:HASH_DIGITS]] for r in data["tensors"]]  # fmt: skip
        print_rows(con, ["tensor", "dtype", "shape", "sha256"], rows, indent=2, title="tensors")
        if any("min" in r for r in data["tensors"]):
            stats = [[cut(r["name"]), *(_fmt(r.get(k)) for k in ("min", "max", "mean", "nan",
                                                                  "inf"))]
                     for r in data["tensors"]]  # fmt: skip
            print_rows(con, ["tensor", "min", "max", "mean", "NaN", "Inf"], stats,
                       right=frozenset({1, 2, 3, 4, 5}), indent=2, title="values")  # fmt: skip
        for mx in data.get("mx", []):
            _render_mx(mx, con)
    elif data["kind"] == "prep-weights":
        _out(con, f"{data['path']}: prep-weights output of a {data['source'].get('family')} "
                  f"checkpoint ({data['source'].get('path')})", "bold")  # fmt: skip
        for key in ("model", "settings", "router"):
            _print_mapping(con, f"{key}:", data[key], width)
        shown = "layer" if "layer_details" in data else "layers"
        _out(con, f"ranks: {len(data['ranks'] or [])}; {shown}: " + ", ".join(data["layers"]))
        for L, entry in data["layers"].items():
            per_rank = entry["rank_tensors"]
            for r, specs in per_rank.items():
                title = f"layer {L}"
                if len(per_rank) > 1:
                    title += f", rank {r} ({entry['files'].get(r)})"
                rows = [[k, v["dtype"], shape_text(v["shape"]),
                         (v.get("sha256") or "-")[:HASH_DIGITS]] for k, v in specs.items()]  # fmt: skip
                print_rows(con, ["tensor", "dtype", "shape", "sha256"], rows, indent=2, title=title)
            specs = entry["tensors"]
            passed = [f"{k} as {v['kernel_arg']}" for k, v in specs.items()
                      if v.get("kernel_arg") and v["kernel_arg"] != k]  # fmt: skip
            if passed:
                for line in wrap_items("  kernel args:", passed, width):
                    _out(con, line)
            _print_mapping(con, "  prefill kwargs:", entry["prefill_kwargs"], width)
        for detail in data.get("layer_details", []):
            _out(con, f"layer {detail['layer']}, rank {detail['rank']}:", "bold")
            _render(detail, con)
    elif data["kind"] == "export":
        src = data["source"]
        _out(con, f"{data['path']}: {data['output_format']} export of a {src.get('family')} "
                  f"checkpoint ({src.get('path')})", "bold")  # fmt: skip
        for key in ("model", "settings"):
            _print_mapping(con, f"{key}:", data[key], width)
        for line in wrap_items(f"files ({len(data['files'])}):",
                               [f["path"] for f in data["files"]], width):  # fmt: skip
            _out(con, line)
        for f in data["files"]:
            _render(f, con)
    else:
        for line in wrap_items(f"files ({len(data['files'])}):",
                               [f["path"] for f in data["files"]], width):  # fmt: skip
            _out(con, line)
        for f in data["files"]:
            _render(f, con)


def _render_mx(mx: dict[str, Any], con: Any) -> None:
    from mxcli.commands._shared import aligned_rows, wrap_items

    d = mx["dequantized"]
    parts = [str(mx["kind"])]
    if "scale_layout" in mx:
        parts.append(f"{mx['scale_layout']} scales")
    parts.append(f"{mx['groups']:,} MX groups")
    for line in wrap_items(f"{mx['tensor']}:", parts, con.width):
        _out(con, line, "bold")
    for line in wrap_items("  dequantized:", [f"min {_fmt(d['min'])}", f"max {_fmt(d['max'])}",
                           f"mean {_fmt(d['mean'])}", f"std {_fmt(d['std'])}",
                           f"zero codes {mx['zero_codes']:.2%}"], con.width):  # fmt: skip
        _out(con, line)
    hist = mx["scale_exponents"]
    top = max(hist.values()) if hist else 1
    rows = [["scale", "groups", ""]]
    rows += [[k, f"{n:,}", "#" * max(1, round(30 * n / top))] for k, n in hist.items()]
    lines = aligned_rows(rows, right=frozenset({1}))
    _out(con, "  scale exponents", "bold")
    _out(con, "    " + lines[0], "bold")
    for line in lines[1:]:
        _out(con, "    " + line)
    if "packed_affinities" in mx:
        a = mx["packed_affinities"]
        _out(con, f"  packed affinities: min {_fmt(a['min'])} max {_fmt(a['max'])} "
                  f"mean {_fmt(a['mean'])}")  # fmt: skip
