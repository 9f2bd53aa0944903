"""``mxcli emulate``: what MXFP8 (Trn3's NEURON scale rule, OCP's floor, RCEIL) does to a model's
training loss against bf16, as a paired experiment over seeds (issues 23, 31). Parses, calls
`mxcli.emulate.study`, prints."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import Force, Steps, global_options, stdout_console

DEFAULT_PLOT = Path("emulate_loss.png")
_OPT = dict(show_default=False)


def emulate(
    ctx: typer.Context,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Local Hugging Face model folder (bf16/fp32 weights; default: the preset's "
            "built-in qwen3_moe).",
            **_OPT,
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Training text (model's tokenizer, or bytes without one; default: the built-in "
            "synthetic corpus, the same on every machine).",
            **_OPT,
        ),
    ] = None,
    preset: Annotated[
        str,
        typer.Option(
            "--preset",
            help="Model and budget: default (about 10 min on 2 CPU cores), cuda-small (about "
            "100M parameters, one GPU with --device cuda), tiny (tests).",
        ),
    ] = "default",
    seeds: Annotated[
        int | None,
        typer.Option(
            "--seeds", help="Paired seeds (preset: 5); the interval is over them.", **_OPT
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="First seed.")] = 0,
    scope: Annotated[
        str,
        typer.Option(
            "--scope",
            help="experts (routed experts in MXFP8) or experts+dense (also every dense linear "
            "but the LM head and the router, as TorchAO Neuron trains).",
        ),
    ] = "experts+dense",
    arms: Annotated[
        str,
        typer.Option(
            "--arms", help="Comma-separated MXFP8 arms: neuron, ocp, rceil (fp32, bf16 always run)."
        ),
    ] = "neuron,ocp,rceil",
    steps: Annotated[
        int | None, typer.Option("--steps", help="Optimizer steps per run (preset).", **_OPT)
    ] = None,
    batch: Annotated[
        int | None, typer.Option("--batch", help="Sequences per step (preset).", **_OPT)
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Tokens per sequence (preset).", **_OPT)
    ] = None,
    lr: Annotated[
        float | None, typer.Option("--lr", help="Peak AdamW learning rate (preset).", **_OPT)
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Time a few steps per arm here and print the projected run time; train nothing.",
        ),
    ] = False,
    plot: Annotated[
        Path, typer.Option("--plot", help="PNG of the loss and gap curves (needs matplotlib).")
    ] = DEFAULT_PLOT,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no PNG.")] = False,
    force: Force = False,
) -> None:
    """Measure what MXFP8 does to a MoE training loss.

    For each seed, every arm (fp32, bf16, MXFP8 NEURON / OCP floor / RCEIL) starts from the
    same weights and sees the same batches. Prints per arm the held-out loss gap to bf16 with
    its 95% interval over seeds and a verdict decided by that interval, gradient SQNR against
    fp32, saturated / flushed / underflowed MX values, and the smallest gap the run resolves."""
    from mxcli.emulate import options as check
    from mxcli.fsutil import atomic_output, check_output_path

    g = global_options(ctx)
    argv = sys.argv[sys.argv.index("emulate") + 1 :] if "emulate" in sys.argv else []
    opts = check.study_options(
        preset, steps=steps, batch=batch, seq_len=seq_len, lr=lr, seeds=seeds, seed=seed,
        scope=scope, arms=arms, device=device,
    )  # fmt: skip
    check.check_model(model)
    check.check_data(data)
    check.check_device(device)
    from mxcli.emulate.study import plot as plot_png
    from mxcli.emulate.study import project_seconds, run_study

    if dry_run:
        with Steps(g.quiet) as progress, progress.step("timing a few steps per arm"):
            with check.flag_errors(model):
                proj = project_seconds(opts, model)
        proj["options"] = {"preset": opts.preset, "steps": opts.steps, "seeds": opts.seeds}
        if g.json:
            _print_strict(proj)
        elif not g.quiet:
            _projection(proj, opts)
        return
    plot_ok = False
    if not no_plot:
        try:
            import matplotlib  # noqa: F401

            plot_ok = True
        except ImportError:
            typer.echo(
                "matplotlib is not installed (pip install 'mxcli[plot]'): no PNG written", err=True
            )
    if plot_ok:
        check_output_path(plot, force)  # refuse before minutes of training, not after
    total = opts.seeds * opts.steps * (2 + len(opts.arms))
    with Steps(g.quiet) as progress, progress.counted("training", total) as adv:

        def on_step(arm: str, s: int, step: int, loss: float | None) -> None:
            shown = "diverged" if loss is None else f"loss {loss:.3f}"
            adv(f"seed {s} {arm} step {step + 1}/{opts.steps} {shown}", done=True)

        with check.flag_errors(model):
            report = run_study(opts, model, data, on_step)
    report["command"] = "mxcli emulate " + " ".join(shlex.quote(a) for a in argv)
    report["plot"] = None
    if plot_ok:
        with atomic_output(plot, force) as tmp:
            plot_png(report, tmp)
        report["plot"] = str(plot)
    if g.json:
        _print_strict(report)
    elif not g.quiet:
        _summary(report)


def _print_strict(data: Any) -> None:
    """Strict JSON (no NaN / Infinity: the study reports those as null with a status)."""
    from mxcli.emulate.study import finite

    sys.stdout.write(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def _fmt(iv: dict[str, Any], f: str = "{:.4f}", sign: bool = False) -> str:
    if iv.get("mean") is None:
        return "n/a"
    spec = "{:+.4f}" if sign else f
    if iv.get("half_width") is None:
        return spec.format(iv["mean"])
    return f"{spec.format(iv['mean'])} ± {iv['half_width']:.4f}"


def _projection(p: dict[str, Any], opts: Any) -> None:
    con = stdout_console()
    per = ", ".join(f"{a} {t:.3f}" for a, t in p["per_step_s"].items())
    con.print(
        f"preset {opts.preset}: {p['parameters'] / 1e6:.2f}M parameters, {p['tokens_per_run']} "
        f"tokens per run, {opts.steps} steps x {opts.seeds} seeds x {len(p['per_step_s'])} arms"
    )
    con.print(f"seconds per step here: {per}")
    con.print(f"projected run time here: {p['projected_s'] / 60:.1f} min")


def _summary(r: dict[str, Any]) -> None:
    con = stdout_console()
    d = r["data"]
    con.print(f"model: {r['model']}, {r['parameters'] / 1e6:.2f}M parameters")
    con.print(
        f"data: {d['source']} ({d['tokens']} tokens, sha256 {d['sha256'][:16]}...); "
        f"{r['tokens_per_run']} tokens per run; seeds {r['seeds'][0]}-{r['seeds'][-1]}; "
        f"scope {r['options']['scope']}"
    )
    con.print("held-out loss (nats/token), mean ± 95% CI half-width over paired seeds:")
    for arm in r["arms"]:
        line = f"  {arm:<7} {_fmt(r['held_out_loss'][arm])}"
        g = r["gap_to_bf16"].get(arm)
        if g is not None:
            rng = "" if g.get("low") is None else f" [{g['low']:+.4f}, {g['high']:+.4f}]"
            line += f"   gap to bf16 {_fmt(g, sign=True)}{rng}: {g['verdict']}"
        con.print(line)
    for arm, kinds in r["grad_sqnr_db_vs_fp32"].items():
        parts = [f"{k} {_fmt(v, '{:.1f}')} dB" for k, v in kinds.items() if v.get("mean")]
        if parts:
            con.print(f"  {arm} step-1 gradient SQNR vs fp32: {', '.join(parts)}")
    for arm, s in r["mx_value_stats"].items():
        vals = {k: v.get("mean") for k, v in s.items()}
        if all(v is not None for v in vals.values()):
            con.print(
                f"  {arm} forward operands: saturated {100 * vals['saturated_fraction']:.4f}%, "
                f"flushed {100 * vals['flushed_fraction']:.5f}%, in underflowed-scale groups "
                f"{100 * vals['underflowed_scale_fraction']:.5f}%"
            )
    det = [f"{a} {v:.4f}" for a, v in r["detectable_gap"].items() if v is not None]
    if det:
        con.print(
            f"smallest gap this run resolves (95% CI half-width): {', '.join(det)} nats/token"
        )
    con.print(f"verdict: {r['verdict']}")
    con.print(f"wall time: {r['timing']['wall_s']:.0f} s; command: {r['command']}")
    if r.get("plot"):
        con.print(f"plot: {r['plot']}")
