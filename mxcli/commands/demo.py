"""``mxcli demo``: the whole journey on built-in tiny checkpoints, in under a minute.

For a Qwen3-style (softmax router) and a DeepSeek-V3-style (noaux_tc router, FP8 source) tiny
MoE checkpoint generated deterministically in Hugging Face layout: prep-weights -> make-inputs
-> run-prefill -> run-bwd -> verify (against a reference golden and against exact math).
Each step is the library call behind the command it names; the summary shows that command.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Debug,
    Force,
    Json,
    Quiet,
    Steps,
    aligned_rows,
    complete_backend,
    guarded,
    print_json,
    stdout_console,
)

MODELS = ("qwen3_moe", "deepseek_v3")
# small enough for a laptop CPU, large enough for real kernel shapes (H multiple of 512)
_CHECKPOINT = {"hidden_size": 512, "intermediate_size": 256, "num_experts": 8}


def demo(
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Folder for everything the demo writes, kept (default: a temporary folder, "
            "removed at the end unless --keep).",
            show_default=False,
        ),
    ] = None,
    keep: Annotated[
        bool,
        typer.Option("--keep", help="Keep the temporary folder (without --out) to look at it."),
    ] = False,
    models: Annotated[
        str, typer.Option("--models", help="Comma list of tiny models: qwen3_moe, deepseek_v3.")
    ] = ",".join(MODELS),
    tokens: Annotated[
        int, typer.Option("--tokens", help="Tokens per kernel run: a multiple of 128.")
    ] = 256,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            "-b",
            help="Backend of the runs (auto, reference, ...); verified against the reference.",
            autocompletion=complete_backend,
        ),
    ] = "auto",
    force: Force = False,
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Run the whole journey on tiny built-in models.

    It lists every file written: prep-weights -> make-inputs -> run-prefill -> run-bwd -> verify, for a Qwen3-style (softmax)
    and a DeepSeek-V3-style (noaux_tc) model. Without --out it works in a temporary folder and
    removes it at the end (--keep keeps it); the summary says where it was.
    """

    def body() -> int:
        from mxcli.errors import InputError

        chosen = [m.strip() for m in models.split(",") if m.strip()]
        bad = [m for m in chosen if m not in MODELS]
        if bad or not chosen:
            raise InputError(
                f"models: expected a comma list of {', '.join(MODELS)}, got {models!r}"
            )
        if tokens < 128 or tokens % 128:
            raise InputError(f"tokens: expected a positive multiple of 128, got {tokens}")
        root = _out_dir(out, force)
        temporary = out is None and not keep
        try:
            with Steps(quiet) as steps:
                total = len(chosen) * len(_STEPS)
                with steps.counted("mxcli demo", total) as advance:
                    rows = []
                    for model in chosen:
                        rows += _journey(model, root / model, tokens, backend, advance, force)
            files = sorted(str(p) for p in root.rglob("*") if p.is_file())
        finally:
            if temporary:  # also on an error or an interrupt
                shutil.rmtree(root, ignore_errors=True)
        passed = all(r["passed"] for r in rows)
        if json_out:
            print_json(
                {"out": str(root), "removed": temporary, "passed": passed, "steps": rows,
                 "files": files}
            )  # fmt: skip
        elif not quiet:
            _print(root, rows, files, passed, removed=temporary)
        return 0 if passed else 1

    code = guarded(
        debug,
        body,
        json_out=json_out,
        interrupt_hint="the steps done so far stay in --out; a temporary folder is removed",
    )
    if code:
        raise typer.Exit(code)


def _out_dir(out: Path | None, force: bool) -> Path:
    import tempfile

    from mxcli.errors import OutputExistsError

    if out is None:
        return Path(tempfile.mkdtemp(prefix="mxcli-demo-"))
    if out.exists() and any(out.iterdir()) and not force:
        raise OutputExistsError(f"{out}: folder is not empty (use --force to write into it)")
    out.mkdir(parents=True, exist_ok=True)
    return out


_STEPS = (
    "checkpoint",
    "prep-weights",
    "make-inputs prefill",
    "run-prefill",
    "make-inputs bwd",
    "run-bwd",
    "verify prefill",
    "verify bwd",
)


def _journey(
    model: str, d: Path, tokens: int, backend: str, advance: Callable[..., None], force: bool
) -> list[dict[str, Any]]:
    """The eight steps for one model; returns one summary row per step (``force``: replace what
    an earlier demo wrote in ``d``)."""
    from mxcli.inputs import inputs_from_weights, write_inputs
    from mxcli.kernels.spec import all_specs
    from mxcli.runs import run_file
    from mxcli.verification.golden import check_run, compare_files
    from mxcli.weightprep import PrepOptions, build_checkpoint, prepare_weights

    rows: list[dict[str, Any]] = []
    hf, prep = d / "hf-checkpoint", d / "prepared"
    files = {
        k: d / f"{k}.safetensors"
        for k in (
            "prefill-inputs",
            "prefill-outputs",
            "prefill-golden",
            "bwd-inputs",
            "bwd-outputs",
            "bwd-golden",
        )
    }
    state: dict[str, Any] = {}

    def step(name: str, command: str, fn: Callable[[], Any]) -> Any:
        advance(f"{model}: {name}")
        t0 = time.perf_counter()
        result = fn()
        advance(done=True)
        row = {
            "model": model,
            "step": name,
            "command": command,
            "seconds": round(time.perf_counter() - t0, 3),
            "passed": True,
            "detail": "",
        }
        if isinstance(result, dict):
            row.update(result)
        rows.append(row)
        return result

    def checkpoint() -> dict[str, Any]:
        ck = build_checkpoint(model, hf, **_CHECKPOINT)
        state["layer"] = ck.moe_layers[0]
        return {"detail": f"{len(ck.files)} shards, MoE layers {ck.moe_layers}"}

    step("checkpoint", f"(built-in tiny {model}, Hugging Face layout) -> {hf}", checkpoint)
    L = state["layer"]

    def prep_weights() -> dict[str, Any]:
        res = prepare_weights(hf, prep, PrepOptions(layers=str(L)), force=force)
        return {"detail": f"layer {L}, router {res['router_act_fn']}"}

    step("prep-weights", f"mxcli prep-weights {hf} {prep} --layers {L}", prep_weights)

    def make(kind: str) -> Callable[[], dict[str, Any]]:
        def fn() -> dict[str, Any]:
            made = inputs_from_weights(
                kind, prep, L, tokens=tokens, block_size=128, prequantize=kind == "bwd"
            )
            write_inputs(made, files[f"{kind}-inputs"], force=force)
            return {"detail": ", ".join(made.tensors)}

        return fn

    def run(kernel: str, kind: str) -> Callable[[], dict[str, Any]]:
        def fn() -> dict[str, Any]:
            inp = files[f"{kind}-inputs"]
            s = run_file(kernel, inp, files[f"{kind}-outputs"], backend=backend, force=force)
            run_file(kernel, inp, files[f"{kind}-golden"], backend="reference", force=force)
            return {
                "detail": f"{s['backend']} ({s['device']}) {s['timing_s']['run']:.3f} s; "
                f"outputs {', '.join(s['outputs'])}"
            }

        return fn

    def verify(kind: str) -> Callable[[], dict[str, Any]]:
        def fn() -> dict[str, Any]:
            results = [
                compare_files(files[f"{kind}-outputs"], files[f"{kind}-golden"]),
                check_run(files[f"{kind}-outputs"], files[f"{kind}-inputs"]),
            ]
            checks = [r for c in results for r in c.reports]
            failed = [f"{r.check}: {r.name} ({r.message})" for r in checks if not r.passed]
            errors = [c.error for c in results if c.error]
            detail = f"{len(checks) - len(failed)}/{len(checks)} checks passed"
            if failed or errors:
                detail += "; " + "; ".join(errors + failed)
            return {"passed": not failed and not errors, "detail": detail}

        return fn

    for kind, kernel in ((spec.short, spec.name) for spec in all_specs()):
        extra = f" --weights {prep} --layer {L} --tokens {tokens}" + (
            " --prequantize" if kind == "bwd" else ""
        )
        step(
            f"make-inputs {kind}",
            f"mxcli make-inputs {kind} -o {files[kind + '-inputs']}{extra}",
            make(kind),
        )
        step(
            f"run-{kind}",
            f"mxcli run-{kind} {files[kind + '-inputs']} -o "
            f"{files[kind + '-outputs']} --backend {backend}",
            run(kernel, kind),
        )
    for kind in ("prefill", "bwd"):
        step(
            f"verify {kind}",
            f"mxcli verify {files[kind + '-outputs']} --golden "
            f"{files[kind + '-golden']} --inputs {files[kind + '-inputs']}",
            verify(kind),
        )
    return rows


def _print(
    root: Path, rows: list[dict[str, Any]], files: list[str], passed: bool, *, removed: bool
) -> None:
    import textwrap

    from rich.text import Text

    con = stdout_console()
    con.print(Text("mxcli demo", style="bold"), soft_wrap=True)
    # a row per step, its command and detail below it, wrapped at spaces only (a path or a flag
    # is never split, as a table column folding at 80 columns would)
    cells = [[r["model"], r["step"], f"{r['seconds']:.2f} s", "ok" if r["passed"] else "FAIL"]
             for r in rows]  # fmt: skip
    for r, line in zip(rows, aligned_rows(cells, right=frozenset({2})), strict=True):
        con.print(Text("  " + line, style="" if r["passed"] else "red bold"), soft_wrap=True)
        for text, style in ((r["command"], ""), (r["detail"], "dim")):
            for part in textwrap.wrap(str(text), max(con.width, 40), initial_indent="      ",
                                      subsequent_indent="        ", break_long_words=False,
                                      break_on_hyphens=False):  # fmt: skip
                con.print(Text(part, style=style), soft_wrap=True)
    if removed:
        con.print(Text(f"{len(files)} files written under {root}, now removed", style="bold"),
                  soft_wrap=True)  # fmt: skip
        con.print(Text("  (keep them with --keep or --out DIR)"), soft_wrap=True)
    else:
        con.print(f"[bold]files written[/] under {root}:")
        for f in files:
            con.print(f"  {f}")
    con.print("[green bold]demo passed[/]" if passed else "[red bold]demo FAILED[/]")
