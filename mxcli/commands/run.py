"""``mxcli run-<kernel>`` (``run-prefill``, ``run-bwd``, one per registered kernel): run one
kernel on an input file, write its outputs. The kwarg flags are generated from the kernel's
scalar table (`mxcli.commands._kernel_flags`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._kernel_flags import command, scalar_param
from mxcli.commands._shared import (
    HASH_DIGITS,
    Force,
    Kernel,
    KernelPath,
    NoVerifyHashes,
    Steps,
    complete_backend,
    global_options,
    kernel_lines,
    print_json,
    print_rows,
    shape_text,
    st_dtype,
    stdout_console,
    wrap_items,
)
from mxcli.kernels.spec import KernelSpec, ScalarArg

# ---- options every run command has ----
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


def _read_object(arg: ScalarArg, path: Path) -> dict[str, Any]:
    """A kwarg given as a JSON file (`ScalarArg.file`): one line for a missing or malformed
    file, or one that is not a JSON object."""
    from mxcli.errors import InputError
    from mxcli.io.jsonfile import read_json

    if not path.exists():
        raise InputError(f"{arg.name}: {path}: no such file")
    data = read_json(path, label=f"{arg.name}: {path}")  # one line for malformed or too deep JSON
    if not isinstance(data, dict):
        raise InputError(f"{arg.name}: {path}: expected a JSON object of {arg.file}")
    return data


def run_command(spec: KernelSpec) -> Callable[..., None]:
    """``run-<short>`` of `spec`: its kwarg flags generated from the spec's scalar table."""

    def run(**kw: Any) -> None:
        overrides: dict[str, Any] = {
            s.name: kw[f"k_{s.name}"] for s in spec.scalars if s.file is None
        }

        opts = global_options(kw["ctx"])  # the root's --json / --quiet
        for s in spec.scalars:
            path = kw[f"k_{s.name}"]
            if s.file is not None and path is not None:
                from mxcli.fsutil import refuse_inputs

                refuse_inputs(kw["output"], [(f"{s.flag_name} file", Path(path))])
                overrides[s.name] = _read_object(s, Path(path))
        _run(
            spec.short,
            overrides,
            input=kw["input"],
            output=kw["output"],
            backend=kw["backend"],
            device=kw["device"],
            weights=kw["weights"],
            layer=kw["layer"],
            allow_nonfinite=kw["allow_nonfinite"],
            force=kw["force"],
            json_out=opts.json,
            quiet=opts.quiet,
            strict=kw["strict"],
            verify_hashes=not kw["no_verify_hashes"],
            nki_kernel=kw["kernel"],
            kernel_path=kw["kernel_path"],
        )

    doc = run_doc(spec.name, spec.title)
    params: list[tuple[str, Any, Any]] = [
        ("ctx", typer.Context, inspect.Parameter.empty),  # the root's global options
        ("input", InputArg, inspect.Parameter.empty),
        ("output", OutputOpt, inspect.Parameter.empty),
        *(scalar_param(s) for s in spec.scalars),
        ("backend", BackendOpt, "auto"),
        ("kernel", Kernel, "mxcli"),
        ("kernel_path", KernelPath, None),
        ("device", DeviceOpt, "cpu"),
        ("weights", WeightsOpt, None),
        ("layer", LayerOpt, None),
        ("no_verify_hashes", NoVerifyHashes, False),
        ("allow_nonfinite", AllowNonfinite, False),
        ("strict", Strict, False),
        ("force", Force, False),
    ]
    return command(run, f"run_{spec.short}", doc, params)


def run_doc(name: str, title: str) -> str:
    """The help of ``run-<short>`` of kernel `name` (`run_command`; ``mxcli --help`` lists its
    first line without loading the kernel)."""
    return (
        f"Run {name} on an input file.\n\n{title + ' ' if title else ''}"
        "A flag overrides the kwarg stored in the input file's metadata; without the flag the "
        "file's value is used, and without either the kernel API's default (in parentheses)."
    )
