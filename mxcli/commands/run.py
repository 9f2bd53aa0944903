"""``mxcli run-prefill`` and ``mxcli run-bwd``: run one kernel on an input file, write its outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    HASH_DIGITS,
    Force,
    Kernel,
    KernelPath,
    NoVerifyHashes,
    Steps,
    complete_backend,
    global_options,
    kernel_defaults,
    kernel_lines,
    print_json,
    print_rows,
    shape_text,
    st_dtype,
    stdout_console,
    wrap_items,
)

# the defaults the help texts show: those of the kernels' public signatures
_PRE = kernel_defaults("kernels/rmsnorm_mx_prefill/contract.py", "rmsnorm_mx_prefill")
_BWD = kernel_defaults("kernels/blockwise_moe/contract.py", "blockwise_mm_bwd_mxfp8")

# ---- options shared by both run commands ----
InputArg = Annotated[
    Path,
    typer.Argument(
        help="Input .safetensors: tensors named as the kernel arguments, kwargs in __metadata__.",
        show_default=False,
    ),
]
OutputOpt = Annotated[
    Path,
    typer.Option(
        "--output", "-o", help="Output .safetensors (written atomically).", show_default=False
    ),
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        "-b",
        help="auto (neuron when available, else reference) or a registered backend "
        "(reference, sim, neuron, ...); an unknown name lists the available ones.",
        autocompletion=complete_backend,
    ),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="Device for the reference backend: cpu or cuda[:N].")
]
WeightsOpt = Annotated[
    Path | None,
    typer.Option(
        "--weights",
        help="prep-weights output folder supplying the layer's weights and kwargs.",
        show_default=False,
    ),
]
LayerOpt = Annotated[
    int | None, typer.Option("--layer", help="Layer to take from --weights.", show_default=False)
]
AllowNonfinite = Annotated[
    bool, typer.Option("--allow-nonfinite", help="Run even if an input holds NaN or Inf.")
]
Strict = Annotated[
    bool,
    typer.Option("--strict", help="Exit 1 when an output holds NaN/Inf the inputs do not explain."),
]


def _run(
    kernel: str,
    overrides: dict[str, Any],
    *,
    input: Path,
    output: Path,
    backend: str,
    device: str,
    weights: Path | None,
    layer: int | None,
    allow_nonfinite: bool,
    force: bool,
    json_out: bool,
    quiet: bool,
    strict: bool = False,
    verify_hashes: bool = True,
    nki_kernel: str = "mxcli",
    kernel_path: str | None = None,
) -> None:
    from mxcli.kernels.selection import parse_implementation
    from mxcli.runs import run_file

    choice = parse_implementation(nki_kernel, kernel, kernel_path)
    with Steps(quiet) as steps:
        summary = run_file(
            kernel,
            input,
            output,
            overrides=overrides,
            backend=backend,
            device=device,
            weights=weights,
            layer=layer,
            allow_nonfinite=allow_nonfinite,
            force=force,
            step=steps.step,
            verify_hashes=verify_hashes,
            nki_kernel=choice,
        )
    if json_out:
        print_json(summary)
    elif not quiet:
        _print_summary(summary)
    for line in summary.get("uninit_reads", ()):
        typer.echo(f"warning: never-written memory read at {line}", err=True)
    _check_nonfinite(summary["nonfinite"], strict)


def _check_nonfinite(counts: dict[str, int], strict: bool) -> None:
    """Warn about unexplained NaN/Inf outputs (`mxcli.verification.finite`); exit 1 if strict."""
    from mxcli.verification.finite import nonfinite_warnings

    for line in nonfinite_warnings(counts):
        typer.echo(line, err=True)
    if counts and strict:
        raise typer.Exit(1)


def _print_summary(s: dict[str, Any]) -> None:
    from rich.text import Text

    con = stdout_console()
    t = s["timing_s"]
    con.print(Text(f"{s['kernel']} on {s['backend']} ({s['device']})", style="bold"),
              soft_wrap=True)  # fmt: skip
    if "nki_kernel" in s:
        for line in kernel_lines("kernel: ", s["nki_kernel"], con.width):
            con.print(Text(line), soft_wrap=True)
    for line in wrap_items("  ran in", [f"{t['run']:.3f} s; read {t['read']:.3f} s",
                           f"write {t['write']:.3f} s"], con.width):  # fmt: skip
        con.print(Text(line), soft_wrap=True)
    rows = [[name, st_dtype(info["dtype"]), shape_text(info["shape"]),
             info["sha256"][:HASH_DIGITS]] for name, info in s["outputs"].items()]  # fmt: skip
    print_rows(con, ["output", "dtype", "shape", "sha256"], rows, indent=2)
    con.print(Text(f"wrote {s['output']}"), soft_wrap=True)


def run_prefill(
    ctx: typer.Context,
    input: InputArg,
    output: OutputOpt,
    eps: Annotated[
        float | None,
        typer.Option(help=f"RMSNorm epsilon (kernel API: {_PRE['eps']}).", show_default=False),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option(
            "--top-k",
            help=f"Experts per token, <= 8 (kernel API: {_PRE['top_k']}).",
            show_default=False,
        ),
    ] = None,
    router_act: Annotated[
        str | None,
        typer.Option(
            "--router-act",
            help="Router activation: sigmoid, softmax or noaux_tc "
            f"(kernel API: {_PRE['router_act_fn']}).",
            show_default=False,
        ),
    ] = None,
    n_group: Annotated[
        int | None,
        typer.Option(
            "--n-group",
            help=f"NOAUX_TC expert groups (kernel API: {_PRE['n_group']}).",
            show_default=False,
        ),
    ] = None,
    topk_group: Annotated[
        int | None,
        typer.Option(
            "--topk-group",
            help=f"NOAUX_TC groups kept (kernel API: {_PRE['topk_group']}).",
            show_default=False,
        ),
    ] = None,
    routed_scaling_factor: Annotated[
        float | None,
        typer.Option(
            "--routed-scaling-factor",
            help=f"NOAUX_TC affinity multiplier (kernel API: {_PRE['routed_scaling_factor']}).",
            show_default=False,
        ),
    ] = None,
    qmx_output_dtype: Annotated[
        str | None,
        typer.Option(
            "--qmx-output-dtype",
            help=f"float8_e4m3fn_x4 or float8_e5m2_x4 (kernel API: {_PRE['qmx_output_dtype']}).",
            show_default=False,
        ),
    ] = None,
    pack_scales: Annotated[
        bool | None,
        typer.Option(
            "--pack-scales/--no-pack-scales",
            help=f"Fold scale tiles (kernel API: {_PRE['pack_scales']}).",
            show_default=False,
        ),
    ] = None,
    pack_affinities: Annotated[
        bool | None,
        typer.Option(
            "--pack-affinities/--no-pack-affinities",
            help=f"Affinities in the row tail (kernel API: {_PRE['pack_affinities']}).",
            show_default=False,
        ),
    ] = None,
    unpadded_hidden_size: Annotated[
        int | None,
        typer.Option(
            "--unpadded-hidden-size",
            help="Real H for the RMS mean (kernel API: H).",
            show_default=False,
        ),
    ] = None,
    emit_norm_bf16: Annotated[
        bool | None,
        typer.Option(
            "--emit-norm-bf16/--no-emit-norm-bf16",
            help=f"Also write norm_bf16 (kernel API: {_PRE['emit_norm_bf16']}).",
            show_default=False,
        ),
    ] = None,
    hidden_interleaved: Annotated[
        bool | None,
        typer.Option(
            "--hidden-interleaved/--no-hidden-interleaved",
            help=f"Inputs stored 4-way interleaved (kernel API: {_PRE['hidden_interleaved']}).",
            show_default=False,
        ),
    ] = None,
    backend: BackendOpt = "auto",
    kernel: Kernel = "mxcli",
    kernel_path: KernelPath = None,
    device: DeviceOpt = "cpu",
    weights: WeightsOpt = None,
    layer: LayerOpt = None,
    no_verify_hashes: NoVerifyHashes = False,
    allow_nonfinite: AllowNonfinite = False,
    strict: Strict = False,
    force: Force = False,
) -> None:
    """Run rmsnorm_mx_prefill on an input file.

    Fused RMSNorm + MXFP8 quantization (+ router top-K). A flag overrides the kwarg stored in
    the input file's metadata; without the flag the file's value is used, and without either
    the kernel API's default (in parentheses).
    """
    overrides = {
        "eps": eps,
        "top_k": top_k,
        "router_act_fn": router_act,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": routed_scaling_factor,
        "qmx_output_dtype": qmx_output_dtype,
        "pack_scales": pack_scales,
        "pack_affinities": pack_affinities,
        "unpadded_hidden_size": unpadded_hidden_size,
        "emit_norm_bf16": emit_norm_bf16,
        "hidden_interleaved": hidden_interleaved,
    }
    opts = global_options(ctx)
    _run(
        "prefill",
        overrides,
        input=input,
        output=output,
        backend=backend,
        device=device,
        weights=weights,
        layer=layer,
        allow_nonfinite=allow_nonfinite,
        force=force,
        json_out=opts.json,
        quiet=opts.quiet,
        strict=strict,
        verify_hashes=not no_verify_hashes,
        nki_kernel=kernel,
        kernel_path=kernel_path,
    )


def run_bwd(
    ctx: typer.Context,
    input: InputArg,
    output: OutputOpt,
    block_size: Annotated[
        int | None,
        typer.Option(
            "--block-size",
            help=f"Tokens per block (128 ... 4096) (kernel API: {_BWD['block_size']}).",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="JSON file of MXFP8MOEBwdConfig fields; updates the "
            "config stored in the input file field by field.",
            show_default=False,
        ),
    ] = None,
    backend: BackendOpt = "auto",
    kernel: Kernel = "mxcli",
    kernel_path: KernelPath = None,
    device: DeviceOpt = "cpu",
    weights: WeightsOpt = None,
    layer: LayerOpt = None,
    no_verify_hashes: NoVerifyHashes = False,
    allow_nonfinite: AllowNonfinite = False,
    strict: Strict = False,
    force: Force = False,
) -> None:
    """Run blockwise_mm_bwd_mxfp8 on an input file.

    The MXFP8 backward pass of a blockwise MoE layer. A flag overrides the kwarg stored in the
    input file's metadata; without the flag the file's value is used, and without either the
    kernel API's default (in parentheses).
    """

    opts = global_options(ctx)
    overrides: dict[str, Any] = {"block_size": block_size}
    if config is not None:
        from mxcli.fsutil import refuse_inputs

        refuse_inputs(output, [("--config file", config)])
        overrides["config"] = _read_config(config)
    _run(
        "bwd",
        overrides,
        input=input,
        output=output,
        backend=backend,
        device=device,
        weights=weights,
        layer=layer,
        allow_nonfinite=allow_nonfinite,
        force=force,
        json_out=opts.json,
        quiet=opts.quiet,
        strict=strict,
        verify_hashes=not no_verify_hashes,
        nki_kernel=kernel,
        kernel_path=kernel_path,
    )


def _read_config(path: Path) -> dict[str, Any]:

    from mxcli.errors import InputError
    from mxcli.io.jsonfile import read_json

    if not path.exists():
        raise InputError(f"config: {path}: no such file")
    data = read_json(path, label=f"config: {path}")  # one line for malformed or too deep JSON
    if not isinstance(data, dict):
        raise InputError(f"config: {path}: expected a JSON object of MXFP8MOEBwdConfig fields")
    return data
