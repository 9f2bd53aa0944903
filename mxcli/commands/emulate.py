"""``mxcli emulate``: what MXFP8 (Trn3's NEURON scale rule, OCP's floor, RCEIL) does to a model's
training loss against bf16, as a paired experiment over seeds (issues 23, 31). Parses, calls
`mxcli.emulate.study`, prints."""

from __future__ import annotations

import json
import math
import shlex
import sys
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
    stdout_console,
)

DEFAULT_PLOT = Path("emulate_loss.png")
_OPT = dict(show_default=False)


def emulate(
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
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Measure what MXFP8 does to a MoE training loss.

    For each seed, every arm (fp32, bf16, MXFP8 NEURON / OCP floor / RCEIL) starts from the
    same weights and sees the same batches. Prints per arm the held-out loss gap to bf16 with
    its 95% interval over seeds and a verdict decided by that interval, gradient SQNR against
    fp32, saturated / flushed / underflowed MX values, and the smallest gap the run resolves."""
    argv = sys.argv[sys.argv.index("emulate") + 1 :] if "emulate" in sys.argv else []

    def body() -> int:
        from mxcli.errors import InputError
        from mxcli.fsutil import atomic_output, check_output_path

        opts = _options(InputError)
        _check_paths(InputError)
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError(f"--device {device}: CUDA is not available on this machine")
        from mxcli.emulate.patch import PatchRefused
        from mxcli.emulate.study import plot as plot_png
        from mxcli.emulate.study import project_seconds, run_study

        if dry_run:
            with Steps(quiet) as progress, progress.step("timing a few steps per arm"):
                try:
                    proj = project_seconds(opts, model)
                except PatchRefused as exc:
                    raise InputError(f"--model: {exc}") from None
            proj["options"] = {"preset": opts.preset, "steps": opts.steps, "seeds": opts.seeds}
            if json_out:
                _print_strict(proj)
            elif not quiet:
                _projection(proj, opts)
            return 0
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
        total = opts.seeds * opts.steps * (2 + len(opts.arms))
        with Steps(quiet) as progress, progress.counted("training", total) as adv:

            def on_step(arm: str, s: int, step: int, loss: float | None) -> None:
                shown = "diverged" if loss is None else f"loss {loss:.3f}"
                adv(f"seed {s} {arm} step {step + 1}/{opts.steps} {shown}", done=True)

            try:
                report = run_study(opts, model, data, on_step)
            except PatchRefused as exc:
                raise InputError(f"--model: {exc}") from None
            except ValueError as exc:
                if str(exc).startswith("data:"):
                    raise InputError(f"--{exc}") from None
                raise
        report["command"] = "mxcli emulate " + " ".join(shlex.quote(a) for a in argv)
        report["plot"] = None
        if plot_ok:
            with atomic_output(plot, force) as tmp:
                plot_png(report, tmp)
            report["plot"] = str(plot)
        if json_out:
            _print_strict(report)
        elif not quiet:
            _summary(report)
        return 0

    def _options(InputError: type[Exception]) -> Any:
        from mxcli.emulate.study import MX_ARMS, PRESETS, SCOPES, StudyOptions

        if preset not in PRESETS:
            raise InputError(f"--preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
        for name, v in (("--steps", steps), ("--batch", batch)):
            if v is not None and v < 1:
                raise InputError(f"{name}: expected a positive integer, got {v}")
        if seeds is not None and seeds < 2:
            raise InputError(f"--seeds: expected at least 2 (an interval needs two), got {seeds}")
        if seq_len is not None and seq_len < 8:
            raise InputError(f"--seq-len: expected at least 8, got {seq_len}")
        if lr is not None and not (math.isfinite(lr) and lr > 0):
            raise InputError(f"--lr: expected a finite positive number, got {lr}")
        if seed < 0:
            raise InputError(f"--seed: expected a non-negative integer, got {seed}")
        if scope not in SCOPES:
            raise InputError(f"--scope: expected experts or experts+dense, got {scope!r}")
        chosen = tuple(a.strip().lower() for a in arms.split(",") if a.strip())
        bad = [a for a in chosen if a not in MX_ARMS + ("fp32", "bf16")]
        if bad or not chosen:
            raise InputError(
                f"--arms: expected a comma-separated subset of neuron, ocp, rceil, got {arms!r}"
            )
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise InputError(f"--device: expected cpu or cuda, got {device!r}")
        return StudyOptions.from_preset(
            preset, steps=steps, batch=batch, seq_len=seq_len, lr=lr, seeds=seeds,
            first_seed=seed, scope=scope, device=device,
            arms=tuple(a for a in MX_ARMS if a in chosen),
        )  # fmt: skip

    def _check_paths(InputError: type[Exception]) -> None:
        if model is not None:
            if not (model / "config.json").is_file():
                raise InputError(f"--model: {model}: expected a folder with config.json")
            try:
                cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError) as exc:
                raise InputError(
                    f"--model: {model}/config.json: not readable JSON ({exc})"
                ) from None
            q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
            if q:
                method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
                raise InputError(
                    f"--model: {model}: a quantized checkpoint (quantization_config "
                    f"quant_method {method!r}); expected bf16 or fp32 weights to train"
                )
        if data is not None:
            if not data.exists():
                raise InputError(f"--data: {data}: no such file")
            if data.is_dir():
                raise InputError(f"--data: {data}: expected a text file, got a folder")
            if not data.is_file():
                raise InputError(
                    f"--data: {data}: expected a regular text file, got a device, pipe or socket"
                )
            if data.stat().st_size == 0:
                raise InputError(f"--data: {data}: expected text, got an empty file")

    guarded(debug, _guard_model_errors(body, model), json_out=json_out)


def _guard_model_errors(body: Any, model: Path | None) -> Any:
    """Loading a checkpoint can fail deep in transformers (a missing optional package, a
    broken shard): one line naming --model, not a traceback."""

    def run() -> int:
        from mxcli.errors import InputError

        try:
            return int(body())
        except (ImportError, OSError) as exc:
            if model is None or isinstance(exc, FileNotFoundError | PermissionError):
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"--model: {model}: cannot be loaded: {first}") from None

    return run


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
