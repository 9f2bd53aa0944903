"""``mxcli prep-weights``: a Hugging Face MoE checkpoint -> kernel-ready weights."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mxcli.commands._shared import force_option, global_options, print_json, stdout_console
from mxcli.weightprep import export  # the registered output formats (light: no torch)


def main(
    ctx: typer.Context,
    source: str = typer.Argument(
        ...,
        help="Hugging Face checkpoint folder (config.json + safetensors), or a Hub repo id "
        "such as Qwen/Qwen3-30B-A3B (needs mxcli[hub]; only config, index and the selected "
        "layers' shards are fetched; HF_HUB_OFFLINE=1 reads the cache only).",
    ),
    output: Path = typer.Argument(None, help="Output folder (not needed with --dry-run)."),
    revision: str = typer.Option(
        None, "--revision", help="Hub repo id only: branch, tag or commit (default: main)."
    ),
    model_type: str = typer.Option(
        "auto", "--model-type", help="Model family; auto = config.json's model_type."
    ),
    layers: str = typer.Option(
        "all", "--layers", help="Layers to convert, e.g. 3-10 or 0,2,5-7 (dense ones are skipped)."
    ),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks: I is sliced contiguously."),
    ep: int = typer.Option(
        1, "--ep", help="Expert-parallel ranks: experts are split contiguously."
    ),
    formats: str = typer.Option(
        "auto",
        "--formats",
        help=f"Expert weight formats: bf16, mxfp8 or both; auto = {export.formats_help()}.",
    ),
    scale_layout: str = typer.Option(
        "packed", "--scale-layout", help="MXFP8 scale layout: packed or unpacked."
    ),
    scale_rule: str = typer.Option(
        "auto",
        "--scale-rule",
        help="E8M0 scale rule: neuron (Trn3), ocp, rceil (torchao) or ct (compressed-tensors' "
        "own); auto = ct for compressed-tensors (ocp with --fp8-range 240), else neuron.",
    ),
    nxdi_base: Path | None = typer.Option(
        None,
        "--nxdi-base",
        help="nxdi: NxD Inference's own sharded checkpoint of the same model (its compiled "
        "path, or weights/): write complete rank files, its MoE tensors replaced, the rest copied.",
        show_default=False,
    ),
    output_format: str = typer.Option(
        export.default().name, "--output-format", help=export.choices_help()
    ),
    fp8_range: int = typer.Option(
        448,
        "--fp8-range",
        help="FP8 target range: 448 (OCP E4M3FN) or 240 (Neuron FP8: codes saturated at 240).",
    ),
    workers: int = typer.Option(
        1, "--workers", help="Layers converted in parallel (memory grows with it)."
    ),
    threads: int = typer.Option(
        0,
        "--threads",
        help="Torch threads per worker; 0 = auto (CPUs / workers - 1, for the writer).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
    resume: bool = typer.Option(
        False, "--resume", help="Keep layers whose outputs match the manifest; redo the rest."
    ),
    force: Annotated[bool, force_option("Overwrite an existing output folder.")] = False,
    check: bool = typer.Option(
        False, "--check", help="Re-read outputs; record SQNR and exactness in the manifest."
    ),
    allow_nonfinite: bool = typer.Option(
        False, "--allow-nonfinite", help="Convert source weights holding NaN or Inf."
    ),
    shard: str = typer.Option(
        None,
        "--shard",
        help="I/N: convert shard I (0-based) of N, a byte-balanced share of the layers, into a "
        "folder the other shards share. Default: from torchrun (RANK/WORLD_SIZE) or Slurm "
        "(SLURM_PROCID/SLURM_NTASKS, SLURM_ARRAY_TASK_ID/COUNT); 0/1 turns sharding off.",
    ),
    finalize: bool = typer.Option(
        False,
        "--finalize",
        help="Convert nothing: write the indexes and final manifest once every shard is done "
        "(refuses, naming the missing shards, before). The last shard to finish does it too.",
    ),
) -> None:
    """Prepare a Hugging Face MoE checkpoint for the kernels.

    Writes, per layer and rank, what the prefill and backward kernels read, and a manifest
    that the other commands take their kwargs from (--weights DIR --layer L).
    """
    opts = global_options(ctx)
    json_out, quiet = opts.json, opts.quiet
    opts.interrupt_hint = interrupt_hint(output_format, dry_run)

    def body() -> None:
        from mxcli.errors import InputError

        if dry_run and check:
            raise InputError(
                "check: --check re-reads the written outputs and --dry-run writes none; "
                "give one of them"
            )
        from mxcli.weightprep.plan import PrepOptions, parse_formats
        from mxcli.weightprep.runner import prepare_weights
        from mxcli.weightprep.shards import from_env, parse_shard
        from mxcli.weightprep.summary import format_plan, format_result

        fmt = output_format.lower()
        rule = scale_rule.lower()  # "auto" is resolved by PrepOptions
        if formats.strip().lower() == "auto":  # the format's own (an unknown one: refused later)
            fmts = (export.find(fmt) or export.default()).default_formats
        else:
            fmts = parse_formats(formats)
        opts = PrepOptions(
            tp=tp, ep=ep, formats=fmts, scale_layout=scale_layout.lower(),
            scale_rule=rule, layers=layers, model_type=model_type, workers=workers,
            threads=threads, check=check, allow_nonfinite=allow_nonfinite, fp8_range=fp8_range,
            output_format=fmt, nxdi_base=None if nxdi_base is None else str(nxdi_base),
        )  # fmt: skip
        import os

        part = parse_shard(shard) if shard is not None else from_env(os.environ)
        reporter = None
        if not dry_run and not quiet and not finalize:
            from mxcli.weightprep.progress import RichReporter

            reporter = RichReporter()
        res = prepare_weights(
            source, output, opts, dry_run=dry_run, resume=resume, force=force, reporter=reporter,
            revision=revision, shard=part, finalize=finalize,
        )  # fmt: skip
        if json_out:
            print_json(res.get("plan", res))
        elif not quiet and "output_format" in res:
            from mxcli.weightprep.export.summary import format_export

            typer.echo(format_export(res, stdout_console().width))
        elif not quiet:
            width = stdout_console().width
            typer.echo(format_plan(res["plan"], width) if dry_run else format_result(res, width))

    body()


def interrupt_hint(output_format: str, dry_run: bool) -> str:
    """What an interrupted run tells the user to do next: only mxcli's own layout resumes
    (an export is published whole or not at all: its temporary folder is removed)."""
    if dry_run:
        return "a dry run writes nothing"
    exp = export.find(output_format.lower())
    if exp is None or not exp.resumable:
        return "an export is published whole or not at all: nothing was written; run the same command again"
    return "finished layers are kept: run the same command with --resume to continue"
