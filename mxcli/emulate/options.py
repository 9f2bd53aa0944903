"""What ``mxcli emulate`` is asked, checked before minutes of training: the flags as
`StudyOptions` (`study_options`), the ``--model`` and ``--data`` paths (`check_model`,
`check_data`), the device (`check_device`), and the study's own errors as one line naming the
flag they come from (`flag_errors`). Each refusal is an `InputError` (exit code 2)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mxcli.errors import InputError, MxcliError


def study_options(
    preset: str,
    *,
    steps: int | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
    lr: float | None = None,
    seeds: int | None = None,
    seed: int = 0,
    scope: str = "experts+dense",
    arms: str = "neuron,ocp,rceil",
    device: str = "cpu",
) -> Any:
    """The `StudyOptions` of preset `preset` with the flags given (None: the preset's)."""
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


def check_model(model: Path | None) -> None:
    """``--model``: a folder with a readable config.json of an unquantized checkpoint."""
    if model is None:
        return
    if not (model / "config.json").is_file():
        raise InputError(f"--model: {model}: expected a folder with config.json")
    try:
        cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"--model: {model}/config.json: not readable JSON ({exc})") from None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise InputError(
            f"--model: {model}: a quantized checkpoint (quantization_config "
            f"quant_method {method!r}); expected bf16 or fp32 weights to train"
        )


def check_data(data: Path | None) -> None:
    """``--data``: a regular, non-empty text file."""
    if data is None:
        return
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


def check_device(device: str) -> None:
    """``--device cuda``: refused at once where CUDA is not available."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine")


@contextlib.contextmanager
def flag_errors(model: Path | None) -> Iterator[None]:
    """The study's refusals as one line naming their flag: a model whose experts the kernels
    cannot express (``--model``), too little or unfit ``--data``, and a checkpoint that fails
    to load deep in transformers (a missing optional package, a broken shard)."""
    from mxcli.emulate.patch import PatchRefused

    try:
        yield
    except PatchRefused as exc:
        raise InputError(f"--model: {exc}") from None
    except MxcliError:
        raise
    except ValueError as exc:
        if str(exc).startswith("data:"):
            raise InputError(f"--{exc}") from None
        raise
    except (ImportError, OSError) as exc:
        if model is None or isinstance(exc, FileNotFoundError | PermissionError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"--model: {model}: cannot be loaded: {first}") from None
