"""``mxcli make-inputs KERNEL -o IN``: a complete, valid input file for a run command.

KERNEL is a registered kernel's short name (``prefill``, ``bwd``, ...); the flags are generated
from the kernels' generator parameters (`InputParam`, in ``mxcli/kernels/<kernel>/inputs.py``).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._kernel_flags import MergedParam, command, merge_params, merged_param
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
from mxcli.kernels.spec import InputParam, KernelSpec


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _tables() -> tuple[dict[str, KernelSpec], dict[str, dict[str, InputParam]], list[MergedParam]]:
    """The kernels with an inputs part (by short name), each one's parameters by name, and the
    union of their flags."""
    from mxcli.kernels.spec import all_specs

    specs = {s.short: s for s in all_specs() if s.part("inputs") is not None}
    params = {short: tuple(spec.inputs().PARAMS) for short, spec in specs.items()}
    by_kernel = {short: {p.name: p for p in ps} for short, ps in params.items()}
    merged = merge_params([(specs[short], ps) for short, ps in params.items()])
    return specs, by_kernel, merged


def _from_command_line(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _check_flags(
    short: str,
    given: set[str],
    by_kernel: dict[str, dict[str, InputParam]],
    values: dict[str, Any],
    weights: Path | None,
) -> None:
    """Refuse a flag that does nothing here: another kernel's, one the kernel takes only with
    --weights, a text flag outside its choices, and with --weights one the layer makes
    meaningless (`InputParam.with_weights`)."""
    from mxcli.errors import InputError

    mine = by_kernel[short]
    for name in given:
        p = mine.get(name)
        if p is None or (p.with_weights == "weights-only" and weights is None):
            owners = [k for k, ps in by_kernel.items()
                      if name in ps and ps[name].with_weights != "weights-only"]  # fmt: skip
            raise InputError(
                f"{name}: {_flag(name)} applies to make-inputs {' or '.join(owners)} only"
            )
        if p.choices and values[name] is not None and values[name] not in p.choices:
            raise InputError(
                f"{name}: expected {_flag(name)} {' or '.join(p.choices)}, got {values[name]!r}"
            )
        if weights is not None and p.with_weights == "refused":
            raise InputError(
                f"{name}: {_flag(name)} does not apply with --weights (the layer's own is used)"
            )


def _check_weight_flags(
    spec: KernelSpec,
    facts: dict[str, Any],
    given: set[str],
    params: dict[str, InputParam],
    values: dict[str, Any],
    weights: Path,
    layer: int,
) -> None:
    """Refuse a flag that contradicts what the layer fixes (the kernel's ``layer_facts``)."""
    from mxcli.errors import InputError

    for name, p in params.items():
        if p.with_weights != "fact" or name not in given or name not in facts:
            continue
        value, fixed = values[name], facts[name]
        same = value in fixed if isinstance(fixed, list) else (
            str(value).lower() == str(fixed).lower() if isinstance(fixed, str) else value == fixed
        )  # fmt: skip
        if not same:
            shown = " or ".join(map(str, fixed)) if isinstance(fixed, list) else fixed
            raise InputError(
                f"{name}: expected {shown} (layer {layer} of {weights}), got {_flag(name)} "
                f"{getattr(value, 'value', value)}; leave it out with --weights"
            )


def make_inputs(ctx: typer.Context, **kw: Any) -> None:
    """The body of ``make-inputs`` (its flags: `make_command`)."""
    kind: str = getattr(kw["kind"], "value", kw["kind"])
    output: Path = kw["output"]
    weights: Path | None = kw["weights"]
    layer: int | None = kw["layer"]
    rank: int | None = kw["rank"]
    opts = global_options(ctx)
    json_out, quiet, force = opts.json, opts.quiet, kw["force"]

    def body() -> None:
        from mxcli.errors import InputError
        from mxcli.fsutil import check_output_path, refuse_inputs

        specs, by_kernel, merged = _tables()
        spec, params = specs[kind], by_kernel[kind]
        union = {m.name for m in merged}
        given = {n for n in ctx.params if n in union and _from_command_line(ctx, n)}
        # this kernel's values: a flag whose kernels differ in default is None unless given
        values = {
            n: (kw[n] if kw[n] is not None or n in given else p.default) for n, p in params.items()
        }
        _check_flags(kind, given, by_kernel, values, weights)
        check = getattr(spec.inputs(), "check_flags", None)
        if check is not None:
            check(values, given)
        check_output_path(output, force)
        refuse_inputs(output, folders=[("--weights folder", weights)])
        if rank is not None and weights is None:
            raise InputError("rank: --rank applies with --weights")
        if (weights is None) != (layer is None):
            raise InputError("weights: --weights DIR and --layer L go together")
        if weights is not None and layer is not None:
            from mxcli.inputs import layer_facts

            facts = layer_facts(spec, weights, layer, rank or 0)
            _check_weight_flags(spec, facts, given, params, values, weights, layer)

        from mxcli import inputs as mk  # torch: after the flags are known to be good

        with Steps(quiet) as steps:
            with steps.step(f"Making {kind} inputs"):
                if weights is not None:
                    assert layer is not None
                    used = ("used", "weights-only")
                    made = mk.inputs_from_weights(
                        spec,
                        weights,
                        layer,
                        verify_hashes=not kw["no_verify_hashes"],
                        rank=rank or 0,
                        **{n: v for n, v in values.items() if params[n].with_weights in used},
                    )
                    n_ranks = made.generator.get("ranks", 1)
                    if rank is None and n_ranks > 1 and not quiet:  # never a silent choice
                        import sys

                        print(f"note: {weights} has {n_ranks} ranks; using rank 0 (--rank R "
                              "for another)", file=sys.stderr)  # fmt: skip
                    for name, p in params.items():  # output layout, not a fact of the layer
                        if p.with_weights == "output" and name in given:
                            made.kwargs[name] = values[name]
                else:
                    made = mk.inputs_from_flags(spec, values)
            with steps.step(f"Writing {output}"):
                mk.write_inputs(made, output, force=force)
        summary = mk.describe_inputs(made, output)
        if json_out:
            print_json(summary)
        elif not quiet:
            _print(summary)

    body()


def make_command() -> Callable[..., None]:
    """``make-inputs``: a kernel by short name, and the union of the registered kernels'
    generator parameters as flags (`mxcli.commands._kernel_flags`)."""
    specs, _, merged = _tables()
    shorts = list(specs)
    kind_enum = enum.Enum("KernelName", {s: s for s in shorts}, type=str)  # type: ignore[misc]
    kind_hint = Annotated[
        kind_enum,  # type: ignore[valid-type]
        typer.Argument(help=f"Which kernel the inputs are for: {' or '.join(shorts)}."),
    ]
    output_hint = Annotated[
        Path,
        typer.Option("--output", "-o", help="Input .safetensors to write.", show_default=False),
    ]
    params: list[tuple[str, Any, Any]] = [
        ("ctx", typer.Context, inspect.Parameter.empty),
        ("kind", kind_hint, inspect.Parameter.empty),
        ("output", output_hint, inspect.Parameter.empty),
        *(merged_param(m, specs) for m in merged),
        ("weights", WeightsOpt, None),
        ("layer", LayerOpt, None),
        ("rank", RankOpt, None),
        ("no_verify_hashes", NoVerifyHashes, False),
        ("force", Force, False),
    ]
    return command(make_inputs, "make_inputs", DOC, params)


DOC = """Write a kernel input file: synthetic, or from --weights.

    Seeded synthetic data, or a prepared checkpoint layer (--weights and --layer). The flags are
    the kernels' generator parameters (a flag names the kernels it applies to when not every
    kernel has it). The defaults make a small test case (the kernel API's own defaults, which
    the run commands fall back to, are noted where they differ). With --weights the layer fixes
    the shapes and the router: such a flag may repeat the layer's value, and is refused when it
    contradicts it.
    """

WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        help="prep-weights output folder: take the layer's real weights and kwargs.",
        show_default=False,
    ),
]
LayerOpt = Annotated[
    int | None, typer.Option("--layer", help="Layer of --weights.", show_default=False)
]
RankOpt = Annotated[
    int | None,
    typer.Option(
        "--rank", help="Rank of --weights (a TP/EP folder; default: 0).", show_default=False
    ),
]


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
