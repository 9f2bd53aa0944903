"""``mxcli make-inputs prefill|bwd -o IN``: a complete, valid input file for a run command."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Debug,
    Force,
    Json,
    NoVerifyHashes,
    Quiet,
    Steps,
    guarded,
    print_json,
    stdout_console,
)


class Kind(str, enum.Enum):
    prefill = "prefill"
    bwd = "bwd"


def _opt(flag: str, help: str, **kw: Any) -> Any:
    return typer.Option(flag, help=help, show_default=kw.pop("show_default", True), **kw)


def make_inputs(
    kind: Annotated[Kind, typer.Argument(help="Which kernel the inputs are for: prefill or bwd.")],
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="Input .safetensors to write.", show_default=False),
    ],
    tokens: Annotated[int, _opt("--tokens", "Tokens T (prefill: B*S).")] = 128,
    batch: Annotated[
        int, _opt("--batch", "prefill: batch B of hidden_states [B, S, H] (S = T/B).")
    ] = 1,
    hidden: Annotated[int, _opt("--hidden", "Hidden size H (prefill: a multiple of 512).")] = 512,
    experts: Annotated[int, _opt("--experts", "Experts E (prefill: 0 = no router).")] = 16,
    top_k: Annotated[int, _opt("--top-k", "Experts per token K.")] = 2,
    router_act: Annotated[
        str, _opt("--router-act", "prefill router: sigmoid, softmax or noaux_tc.")
    ] = "softmax",
    n_group: Annotated[int, _opt("--n-group", "prefill NOAUX_TC: expert groups.")] = 1,
    topk_group: Annotated[int, _opt("--topk-group", "prefill NOAUX_TC: groups kept.")] = 1,
    routed_scaling_factor: Annotated[
        float, _opt("--routed-scaling-factor", "prefill NOAUX_TC: affinity multiplier.")
    ] = 1.0,
    router_bias: Annotated[
        bool | None,
        _opt(
            "--router-bias/--no-router-bias",
            "prefill: draw a router bias (default: only for noaux_tc).",
            show_default=False,
        ),
    ] = None,
    router_dtype: Annotated[
        str | None,
        _opt(
            "--router-dtype",
            "prefill: router weight dtype bf16 or fp16 (default: fp16, bf16 for noaux_tc).",
            show_default=False,
        ),
    ] = None,
    residual: Annotated[
        bool, _opt("--residual/--no-residual", "prefill: add a residual input.")
    ] = False,
    unpadded_hidden_size: Annotated[
        int | None,
        _opt(
            "--unpadded-hidden-size",
            "prefill: real H; columns past it are zero.",
            show_default=False,
        ),
    ] = None,
    pack_scales: Annotated[
        bool, _opt("--pack-scales/--no-pack-scales", "prefill kwarg recorded in the file.")
    ] = True,
    pack_affinities: Annotated[
        bool, _opt("--pack-affinities/--no-pack-affinities", "prefill kwarg recorded in the file.")
    ] = False,
    emit_norm_bf16: Annotated[
        bool, _opt("--emit-norm-bf16/--no-emit-norm-bf16", "prefill kwarg recorded in the file.")
    ] = False,
    intermediate: Annotated[
        int, _opt("--intermediate", "bwd: intermediate size I (per TP rank).")
    ] = 128,
    block_size: Annotated[int, _opt("--block-size", "bwd: tokens per block B.")] = 128,
    router: Annotated[
        str,
        _opt(
            "--router",
            "bwd routing: seeded (K distinct experts per token) or prefill (the prefill reference).",
        ),
    ] = "seeded",
    dense: Annotated[bool, _opt("--dense", "bwd: single-expert dense layout (E=1, K=1).")] = False,
    bias: Annotated[bool, _opt("--bias", "bwd: config.bias (also return bias gradients).")] = False,
    clamp: Annotated[
        str | None,
        _opt(
            "--clamp",
            "bwd: gate/up clamp limits 'NL_LO,NL_HI,L_LO,L_HI' (empty = unset).",
            show_default=False,
        ),
    ] = None,
    prequantize: Annotated[
        bool, _opt("--prequantize", "bwd: store the weights as MXFP8 x4 data + e8m0 scales.")
    ] = False,
    scale_layout: Annotated[
        str | None,
        _opt(
            "--scale-layout",
            "bwd with --prequantize: packed or unpacked scales (default: packed).",
            show_default=False,
        ),
    ] = None,
    weights: Annotated[
        Path | None,
        _opt(
            "--weights",
            "prep-weights output folder: take the layer's real weights and kwargs.",
            show_default=False,
        ),
    ] = None,
    layer: Annotated[int | None, _opt("--layer", "Layer of --weights.", show_default=False)] = None,
    no_verify_hashes: NoVerifyHashes = False,
    seed: Annotated[int, _opt("--seed", "Random seed: the same flags give the same bytes.")] = 0,
    force: Force = False,
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Write a complete, valid input file: seeded synthetic data or a prepared checkpoint layer.

    bwd inputs route the tokens, build the block plan, run the forward reference for the
    gate/up checkpoint and draw an output gradient.
    """

    def body() -> None:
        from mxcli import inputs as mk
        from mxcli.errors import InputError
        from mxcli.fsutil import check_output_path, refuse_inputs

        check_output_path(output, force)
        refuse_inputs(output, folders=[("--weights folder", weights)])
        for flag, value in (("tokens", tokens), ("batch", batch)):
            if value < 1:
                raise InputError(f"{flag}: expected a positive integer, got {value}")
        if (weights is None) != (layer is None):
            raise InputError("weights: --weights DIR and --layer L go together")
        with Steps(quiet) as steps:
            with steps.step(f"Making {kind.value} inputs"):
                if weights is not None:
                    assert layer is not None
                    made = mk.inputs_from_weights(
                        kind.value,
                        weights,
                        layer,
                        tokens=tokens,
                        batch=batch,
                        block_size=block_size,
                        seed=seed,
                        residual=residual,
                        prequantize=prequantize,
                        verify_hashes=not no_verify_hashes,
                    )
                elif kind is Kind.prefill:
                    if tokens % batch:
                        raise InputError(
                            f"tokens: expected a multiple of --batch {batch}, got {tokens}"
                        )
                    made = mk.make_prefill_inputs(
                        batch=batch, seq=tokens // batch, hidden=hidden, experts=experts or None,
                        top_k=top_k, router_act_fn=router_act, n_group=n_group, topk_group=topk_group,
                        routed_scaling_factor=routed_scaling_factor, router_bias=router_bias,
                        router_dtype=router_dtype, residual=residual,
                        unpadded_hidden_size=unpadded_hidden_size, pack_scales=pack_scales,
                        pack_affinities=pack_affinities, emit_norm_bf16=emit_norm_bf16, seed=seed,
                    )  # fmt: skip
                else:
                    made = mk.make_bwd_inputs(
                        tokens=tokens, hidden=hidden, intermediate=intermediate, experts=experts,
                        top_k=top_k, block_size=block_size, dense=dense, bias=bias,
                        clamp=_parse_clamp(clamp), prequantize=prequantize, scale_layout=scale_layout,
                        router=router, seed=seed,
                    )  # fmt: skip
            with steps.step(f"Writing {output}"):
                mk.write_inputs(made, output, force=force)
        summary = mk.describe_inputs(made, output)
        if json_out:
            print_json(summary)
        elif not quiet:
            _print(summary)

    guarded(debug, body, json_out=json_out)


def _parse_clamp(text: str | None) -> tuple[float | None, ...] | None:
    from mxcli.errors import InputError

    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise InputError(f"clamp: expected 'NL_LO,NL_HI,L_LO,L_HI' (4 values), got {text!r}")
    try:
        return tuple(None if p in ("", "none", "None") else float(p) for p in parts)
    except ValueError:
        raise InputError(f"clamp: expected numbers or empty fields, got {text!r}") from None


def _print(s: dict[str, Any]) -> None:
    from rich.table import Table

    con = stdout_console()
    table = Table(show_header=True, header_style="bold", box=None)
    for col in ("tensor", "dtype", "shape"):
        table.add_column(col)
    for name, info in s["tensors"].items():
        table.add_row(name, info["dtype"], str(info["shape"]))
    con.print(
        f"[bold]{s['kernel']}[/] inputs ({s['generator'].get('source', '?')}, "
        f"seed {s['generator'].get('seed', '-')})"
    )
    con.print(table)
    con.print("kwargs: " + ", ".join(f"{k}={v}" for k, v in s["kwargs"].items() if k != "config"))
    con.print(f"wrote {s['output']}")
