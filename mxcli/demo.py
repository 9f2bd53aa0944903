"""The demo journey (``mxcli demo``): built-in tiny checkpoints through every step.

For a Qwen3-style (softmax router) and a DeepSeek-V3-style (noaux_tc router, FP8 source) tiny
MoE checkpoint generated deterministically in Hugging Face layout: prep-weights -> make-inputs
-> run-prefill -> run-bwd -> verify (against a reference golden and against exact math).
Each step is the library call behind the command it names; each row of the summary shows that
command. `run_demo` runs it; the command (`mxcli.commands.demo`) parses, calls and prints.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxcli.errors import InputError

MODELS = ("qwen3_moe", "deepseek_v3")
# small enough for a laptop CPU, large enough for real kernel shapes (H multiple of 512)
_CHECKPOINT = {"hidden_size": 512, "intermediate_size": 256, "num_experts": 8}
# what an interrupted demo tells the user
INTERRUPT_HINT = "the steps done so far stay in --out; a temporary folder is removed"


def parse_models(text: str) -> list[str]:
    """``--models``: a comma list of `MODELS`."""
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in chosen if m not in MODELS]
    if bad or not chosen:
        raise InputError(f"models: expected a comma list of {', '.join(MODELS)}, got {text!r}")
    return chosen


def check_tokens(tokens: int) -> int:
    """``--tokens``: tokens per kernel run, a positive multiple of 128."""
    if tokens < 128 or tokens % 128:
        raise InputError(f"tokens: expected a positive multiple of 128, got {tokens}")
    return tokens


def step_count(models: list[str]) -> int:
    """How many steps `run_demo` takes for `models` (for a progress bar)."""
    return len(models) * len(_STEPS)


def run_demo(
    models: list[str],
    *,
    tokens: int,
    backend: str,
    out: Path | None = None,
    keep: bool = False,
    force: bool = False,
    advance: Callable[..., None] = lambda *a, **k: None,
) -> dict[str, Any]:
    """The journey of each of `models` in `out` (default: a temporary folder, removed at the
    end, after an error or an interrupt too, unless `keep`). ``advance(label)`` names the step
    now running, ``advance(done=True)`` counts it. Returns the summary: ``out``, ``removed``,
    ``passed``, one row per step (``steps``) and the files written."""
    root = out_dir(out, force)
    temporary = out is None and not keep
    try:
        rows: list[dict[str, Any]] = []
        for model in models:
            rows += journey(model, root / model, tokens, backend, advance, force)
        files = sorted(str(p) for p in root.rglob("*") if p.is_file())
    finally:
        if temporary:  # also on an error or an interrupt
            shutil.rmtree(root, ignore_errors=True)
    passed = all(r["passed"] for r in rows)
    return {"out": str(root), "removed": temporary, "passed": passed, "steps": rows,
            "files": files}  # fmt: skip


def out_dir(out: Path | None, force: bool) -> Path:
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


def journey(
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
