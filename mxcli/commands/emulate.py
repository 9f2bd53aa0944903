"""``mxcli emulate``: what MXFP8 (Trn3's NEURON scale rule, and OCP's) does to a model's training
loss, measured off the device (issue 23). Parses, calls `mxcli.emulate.study`, prints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Debug,
    Force,
    Json,
    Quiet,
    Steps,
    guarded,
    print_json,
    stdout_console,
)

DEFAULT_PLOT = Path("emulate_loss.png")


def emulate(
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Local Hugging Face model folder (default: a built-in tiny qwen3_moe).",
            show_default=False,
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Training text (model's tokenizer, or bytes without one; default: Python "
            "stdlib source).",
            show_default=False,
        ),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps per run.")] = 40,
    batch: Annotated[int, typer.Option("--batch", help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 64,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 3e-3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of init and batches.")] = 0,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    plot: Annotated[
        Path, typer.Option("--plot", help="PNG of the loss curves (needs matplotlib).")
    ] = DEFAULT_PLOT,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no PNG.")] = False,
    force: Force = False,
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Measure what MXFP8 does to a MoE model's training loss.

    Fine-tunes N steps as bf16, MXFP8 NEURON and MXFP8 OCP (one seed, identical batches) plus a
    second bf16 seed; report loss curves, final-loss gaps against the bf16
    seed-to-seed spread, expert-gradient SQNR per layer and saturated/flushed fractions."""

    def body() -> int:
        from mxcli.errors import InputError
        from mxcli.fsutil import atomic_output, check_output_path

        for name, v in (("--steps", steps), ("--batch", batch)):
            if v < 1:
                raise InputError(f"{name}: expected a positive integer, got {v}")
        if seq_len < 8:
            raise InputError(f"--seq-len: expected at least 8, got {seq_len}")
        if not lr > 0:
            raise InputError(f"--lr: expected a positive number, got {lr}")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise InputError(f"--device: expected cpu or cuda, got {device!r}")
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
        if model is not None and not (model / "config.json").is_file():
            raise InputError(f"--model: {model}: expected a folder with config.json")
        if data is not None and not data.is_file():
            raise InputError(f"--data: {data}: no such file")
        plot_ok = False
        if not no_plot:
            try:
                import matplotlib  # noqa: F401

                plot_ok = True
            except ImportError:
                typer.echo(
                    "matplotlib is not installed (pip install 'mxcli[plot]'): no PNG written",
                    err=True,
                )
        if plot_ok:
            check_output_path(plot, force)  # refuse before minutes of training, not after

        from mxcli.emulate.patch import PatchRefused
        from mxcli.emulate.study import RUNS, StudyOptions, run_study
        from mxcli.emulate.study import plot as plot_png

        opts = StudyOptions(steps=steps, batch=batch, seq_len=seq_len, lr=lr, seed=seed,
                            device=device)  # fmt: skip
        with Steps(quiet) as progress, progress.counted("training", steps * len(RUNS)) as adv:

            def on_step(run: str, step: int, loss: float) -> None:
                adv(f"{run} step {step + 1}/{steps} loss {loss:.3f}", done=True)

            try:
                report = run_study(opts, model, data, on_step)
            except PatchRefused as exc:
                raise InputError(f"--model: {exc}") from None
            except ValueError as exc:
                if str(exc).startswith("data:"):
                    raise InputError(f"--{exc}") from None
                raise
        report["plot"] = None
        if plot_ok:
            with atomic_output(plot, force) as tmp:
                plot_png(report, tmp)
            report["plot"] = str(plot)
        if json_out:
            print_json(report)
        elif not quiet:
            _summary(report)
        return 0

    guarded(debug, body, json_out=json_out)


def _summary(r: dict[str, Any]) -> None:
    con = stdout_console()
    con.print(f"model: {r['model']}\ndata: {r['data']} ({r['tokens']} tokens)")
    for run, v in r["runs"].items():
        con.print(
            f"  {run:<11} final train loss {v['losses'][-1]:.4f}  held-out {v['eval_loss']:.4f}"
        )
    spread = r["seed_spread"]
    for run, gap in r["final_loss_gap"].items():
        inside = "within" if r["within_seed_spread"][run] else "OUTSIDE"
        con.print(
            f"  {run} - bf16 held-out gap {gap:+.4f} ({inside} the bf16 seed spread {spread:.4f})"
        )
    for run, layers in r["expert_grad_sqnr_db"].items():
        worst = min(min(v.values()) for v in layers.values())
        con.print(
            f"  {run} expert-gradient SQNR vs bf16 (step 1), worst layer/tensor: {worst:.1f} dB"
        )
    for rule, s in r["mx_value_stats"].items():
        con.print(
            f"  {rule} rule: saturated {100 * s['saturated_fraction']:.4f}%, flushed "
            f"{100 * s['flushed_fraction']:.4f}% of {s['values']} operand values"
        )
    if r.get("plot"):
        con.print(f"plot: {r['plot']}")
