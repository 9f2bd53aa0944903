"""``mxcli make-inputs prefill|bwd -o IN``: a complete, valid input file for a run command."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Force,
    NoVerifyHashes,
    Steps,
    global_options,
    print_json,
    print_rows,
    shape_text,
    st_dtype,
    stdout_console,
    wrap_items,
)


class Kind(str, enum.Enum):
    prefill = "prefill"
    bwd = "bwd"


class Routing(str, enum.Enum):
    seeded = "seeded"
    prefill = "prefill"


# flags that only one kind of input uses (given for the other kind they are refused)
_PREFILL_ONLY = ("batch", "residual", "router_act", "n_group", "topk_group", "routed_scaling_factor",
                 "router_bias", "router_dtype", "unpadded_hidden_size", "pack_scales",
                 "pack_affinities", "emit_norm_bf16")  # fmt: skip
_BWD_ONLY = ("intermediate", "block_size", "routing", "dense", "bias", "clamp", "prequantize",
             "scale_layout")  # fmt: skip
# with --weights: what the prepared layer fixes (a flag may repeat it, not contradict it) ...
_LAYER_FACTS = ("hidden", "experts", "intermediate", "top_k", "router_act", "n_group",
                "topk_group", "routed_scaling_factor", "unpadded_hidden_size", "scale_layout")  # fmt: skip
# ... what it makes meaningless, and the prefill output kwargs that still apply
_NOT_WITH_WEIGHTS = ("router_bias", "router_dtype", "routing", "dense", "bias", "clamp")
_OUTPUT_KWARGS = ("pack_scales", "pack_affinities", "emit_norm_bf16")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _opt(flag: str, help: str, **kw: Any) -> Any:
    return typer.Option(flag, help=help, show_default=kw.pop("show_default", True), **kw)


def make_inputs(
    ctx: typer.Context,
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
    top_k: Annotated[
        int, _opt("--top-k", "Experts per token K (the kernel API's default: 1).")
    ] = 2,
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
        bool,
        _opt("--residual/--no-residual", "prefill (bwd with --weights): add a residual input."),
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
    block_size: Annotated[
        int, _opt("--block-size", "bwd: tokens per block B (the kernel API's default: 4096).")
    ] = 128,
    routing: Annotated[
        Routing,
        _opt(
            "--routing",
            "bwd: seeded (K distinct experts per token) or prefill (the prefill reference).",
        ),
    ] = Routing.seeded,
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
    rank: Annotated[
        int | None,
        _opt("--rank", "Rank of --weights (a TP/EP folder; default: 0).", show_default=False),
    ] = None,
    no_verify_hashes: NoVerifyHashes = False,
    seed: Annotated[int, _opt("--seed", "Random seed: the same flags give the same bytes.")] = 0,
    force: Force = False,
) -> None:
    """Write a kernel input file: synthetic, or from --weights.

    Seeded synthetic data, or a prepared checkpoint layer (--weights and --layer). bwd
    inputs route the tokens, build the block plan, run the forward reference for the gate/up
    checkpoint and draw an output gradient. The defaults make a small test case (the kernel
    API's own defaults, which run-prefill and run-bwd fall back to, are noted where they
    differ). With --weights the layer fixes the shapes and the router: such a flag may repeat
    the layer's value, and is refused when it contradicts it.
    """
    opts = global_options(ctx)
    json_out, quiet = opts.json, opts.quiet

    def body() -> None:
        from mxcli.fsutil import check_output_path, refuse_inputs

        given = {n for n in ctx.params if _from_command_line(ctx, n)}
        _check_flags(kind, given, locals_=dict(ctx.params), weights=weights)
        check_output_path(output, force)
        refuse_inputs(output, folders=[("--weights folder", weights)])
        if rank is not None and weights is None:
            from mxcli.errors import InputError

            raise InputError("rank: --rank applies with --weights")
        if weights is not None and layer is not None:
            _check_weight_flags(given, dict(ctx.params), weights, layer, rank or 0)

        from mxcli import inputs as mk  # torch: after the flags are known to be good
        from mxcli.errors import InputError

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
                        rank=rank or 0,
                    )
                    n_ranks = made.generator.get("ranks", 1)
                    if rank is None and n_ranks > 1 and not quiet:  # never a silent choice
                        import sys

                        print(f"note: {weights} has {n_ranks} ranks; using rank 0 (--rank R "
                              "for another)", file=sys.stderr)  # fmt: skip
                    for name in _OUTPUT_KWARGS:  # output layout, not a fact of the layer
                        if name in given:
                            made.kwargs[name] = ctx.params[name]
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
                        router=routing.value, seed=seed,
                    )  # fmt: skip
            with steps.step(f"Writing {output}"):
                mk.write_inputs(made, output, force=force)
        summary = mk.describe_inputs(made, output)
        if json_out:
            print_json(summary)
        elif not quiet:
            _print(summary)

    body()


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _check_flags(
    kind: Kind, given: set[str], locals_: dict[str, Any], weights: Path | None
) -> None:
    """Refuse a flag that does nothing here: one of the other kind's, ``--scale-layout``
    without ``--prequantize``, and with ``--weights`` one the layer makes meaningless."""
    from mxcli.errors import InputError

    other = _BWD_ONLY if kind is Kind.prefill else _PREFILL_ONLY
    for name in other:
        if name in given and not (name == "residual" and weights is not None):
            raise InputError(
                f"{name}: {_flag(name)} applies to make-inputs "
                f"{'bwd' if kind is Kind.prefill else 'prefill'} only"
            )
    if "scale_layout" in given and not locals_["prequantize"]:
        raise InputError("scale_layout: --scale-layout applies only with --prequantize")
    if weights is None:
        return
    for name in _NOT_WITH_WEIGHTS:
        if name in given:
            raise InputError(
                f"{name}: {_flag(name)} does not apply with --weights (the layer's own is used)"
            )


def _check_weight_flags(
    given: set[str], locals_: dict[str, Any], weights: Path, layer: int, rank: int
) -> None:
    """Refuse a flag that contradicts what the layer fixes (`mxcli.inputs.layer_facts`)."""
    from mxcli.errors import InputError
    from mxcli.inputs import layer_facts

    facts = layer_facts(weights, layer, rank)
    for name in _LAYER_FACTS:
        if name not in given or name not in facts:
            continue
        value, fixed = locals_[name], facts[name]
        same = value in fixed if isinstance(fixed, list) else (
            str(value).lower() == str(fixed).lower() if isinstance(fixed, str) else value == fixed
        )  # fmt: skip
        if not same:
            shown = " or ".join(map(str, fixed)) if isinstance(fixed, list) else fixed
            raise InputError(
                f"{name}: expected {shown} (layer {layer} of {weights}), got {_flag(name)} "
                f"{getattr(value, 'value', value)}; leave it out with --weights"
            )


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
    from rich.text import Text

    con = stdout_console()
    gen = s["generator"]
    source = str(gen.get("source", "?"))
    if source == "weights":  # which layer and rank of which folder
        source = f"layer {gen.get('layer')}, rank {gen.get('rank')} of {gen.get('ranks')} of {gen.get('weights')}"
    con.print(Text(f"{s['kernel']} inputs ({source}, seed {gen.get('seed', '-')})",
                   style="bold"), soft_wrap=True)  # fmt: skip
    rows = [[name, st_dtype(info["dtype"]), shape_text(info["shape"])]
            for name, info in s["tensors"].items()]  # fmt: skip
    print_rows(con, ["tensor", "dtype", "shape"], rows, indent=2)
    kwargs = [f"{k}={v}" for k, v in s["kwargs"].items() if k != "config"]
    for line in wrap_items("kwargs:", kwargs, con.width):
        con.print(Text(line), soft_wrap=True)
    con.print(Text(f"wrote {s['output']}"), soft_wrap=True)
