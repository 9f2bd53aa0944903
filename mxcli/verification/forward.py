"""``verify --checkpoint OUT --against SRC --forward``: run the exported model through the real
consumer libraries beside its source and report the logit error (issue 30).

OUT (a compressed-tensors export) is first offered to transformers as a consumer would load it
(``AutoModelForCausalLM.from_pretrained``). transformers 5.23 cannot load an MXFP8 export: its
fused-experts FP8 branch (transformers 5.23 ``integrations/compressed_tensors.py:98-115``) folds
each expert's scale into its weight as ``codes * scale`` elementwise, with the raw uint8 E8M0
scale ``[out, in/32]`` against the ``[out, in]`` codes, so the load fails on the shape (it does
the same for a checkpoint written by compressed_tensors' own compressor; 4.57 loads it). The
report then says so and why, and OUT is decompressed by compressed_tensors' own offline
dequantizer (`CompressedTensorsDequantizer`, every tensor, float32) and that state dict is loaded
into the transformers model built from OUT's config (written as a plain folder, so transformers
applies its own checkpoint-to-model conversion). SRC is loaded by transformers, or decompressed
the same way when it is itself a compressed-tensors checkpoint.

Both models run in float32 on the same fixed tokens; the report gives the logits' SQNR, their
largest absolute error and how often the top-1 token agrees. The check fails below
`MIN_LOGIT_SQNR_DB`. The whole model is held in memory twice: a check for small models.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError

# MXFP8 experts keep a tiny model's logits near 40 dB (measured: 42.3 qwen3_moe, 38.4 mixtral,
# tests/weightprep/test_verify_forward.py);
# a wrong expert (one scale byte off by 4 multiplies its weights by 16) falls far below.
MIN_LOGIT_SQNR_DB = 20.0
TOKENS = 16
SEED = 30


def fixed_tokens(vocab: int, n: int = TOKENS, seed: int = SEED) -> torch.Tensor:
    """``[1, n]`` token ids, the same on every run (a seeded CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, max(2, vocab), (1, n), generator=g)


def _auto_model(path: Path) -> Any:
    import contextlib
    import io

    from transformers import AutoModelForCausalLM

    # the libraries' bars and match warnings go to stderr/stdout; mxcli's report says what counts
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _decompressed_model(path: Path, workdir: Path) -> Any:
    """compressed_tensors' own decompression of `path`, loaded by transformers from a plain
    copy (config without quantization_config, float32 tensors, the other files unchanged)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from safetensors.torch import load_file, save_file

    deq = CompressedTensorsDequantizer(str(path), dtype=torch.float32)
    plain = workdir / path.name
    plain.mkdir(parents=True)
    for f in path.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy2(f, plain / f.name)
    for shard in sorted(path.glob("*.safetensors")):
        tensors = deq.validate(load_file(str(shard)))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(plain / shard.name))
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (plain / "config.json").write_text(json.dumps(cfg))
    return _auto_model(plain)


def _is_ct(path: Path) -> bool:
    q = json.loads((path / "config.json").read_text()).get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "compressed-tensors"


def _load(path: Path, workdir: Path, notes: list[str], what: str) -> tuple[Any, str]:
    """(model, how it was loaded): transformers directly, else the library's decompression."""
    try:
        return _auto_model(path), "transformers from_pretrained"
    except Exception as exc:  # noqa: BLE001 - the consumer's failure is the finding
        if not _is_ct(path):
            raise InputError(
                f"--forward: transformers cannot load {what} {path} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from exc
        first = str(exc).splitlines()[0] if str(exc) else ""
        notes.append(
            f"{what}: transformers cannot load it ({type(exc).__name__}: {first[:200]}); "
            "transformers 5.23's fused-experts FP8 branch multiplies the codes by the raw uint8 "
            "E8M0 scales (integrations/compressed_tensors.py:98-115); decompressed with "
            "compressed_tensors' CompressedTensorsDequantizer instead"
        )
        return _decompressed_model(path, workdir), "compressed_tensors decompression"


def _quiet_libraries() -> None:
    """The libraries' load reports and bars would bury the report (the failure is kept in it)."""
    import logging

    from transformers.utils import logging as tlog

    warnings.filterwarnings("ignore")
    tlog.set_verbosity(logging.CRITICAL + 1)
    tlog.disable_progress_bar()
    try:
        from loguru import logger

        logger.disable("compressed_tensors")
    except ImportError:
        pass


def forward_check(out: str | Path, against: str | Path) -> dict[str, Any]:
    """Logits of OUT's model against SRC's on `fixed_tokens` (see the module doc)."""
    try:
        import compressed_tensors  # noqa: F401
        import transformers
    except ImportError as exc:
        raise InputError(
            f"--forward needs transformers and compressed-tensors installed ({exc})"
        ) from exc
    o, a = Path(out), Path(against)
    from mxcli.verification.checkpoints import detect_kind
    from mxcli.weightprep import export

    kind = detect_kind(o)
    exporter = export.find(kind)
    if exporter is None or not exporter.hf_loadable:
        loadable = " or ".join(n for n in export.names() if export.get(n).hf_loadable)
        raise InputError(
            f"--forward: runs {loadable} exports (a Hugging Face folder); {o} is {kind}"
        )
    notes: list[str] = []
    _quiet_libraries()
    with tempfile.TemporaryDirectory(prefix="mxcli-forward-") as tmp:
        src_model, src_how = _load(a, Path(tmp) / "src", notes, "the source")
        out_model, out_how = _load(o, Path(tmp) / "out", notes, "the export")
        vocab = int(getattr(src_model.config, "vocab_size", None) or 2)
        ids = fixed_tokens(vocab)
        with torch.no_grad():
            ref = src_model(input_ids=ids).logits.double()
            got = out_model(input_ids=ids).logits.double()
    noise = float((got - ref).pow(2).sum())
    signal = float(ref.pow(2).sum())
    finite = math.isfinite(noise)
    sqnr = (
        round(10 * math.log10(signal / noise), 3)
        if finite and noise > 0 and signal > 0
        else (math.inf if finite and noise == 0 else None)
    )
    top1 = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
    passed = sqnr is not None and sqnr >= MIN_LOGIT_SQNR_DB
    failures = (
        []
        if passed
        else [
            f"logits: SQNR {sqnr if sqnr is not None else 'nan'} dB < {MIN_LOGIT_SQNR_DB:g} dB "
            "against the source model"
        ]
    )
    return {
        "passed": passed,
        "tokens": ids.tolist()[0],
        "logits_sqnr_db": sqnr if sqnr != math.inf else None,
        "logits_exact": noise == 0,
        "logits_max_abs_error": float((got - ref).abs().max()) if finite else None,
        "top1_agreement": round(top1, 4),
        "source_loaded_by": src_how,
        "export_loaded_by": out_how,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "notes": notes,
        "failures": failures,
    }


def format_forward(res: dict[str, Any]) -> str:
    sq = res["logits_sqnr_db"]
    lines = [
        f"  forward ({len(res['tokens'])} tokens, transformers {res['transformers']}, "
        f"compressed-tensors {res['compressed_tensors']}): logits "
        + ("bit-exact" if res["logits_exact"] else f"SQNR {sq} dB")
        + f", max |err| {res['logits_max_abs_error'] or 0:.4g}, top-1 agreement "
        f"{res['top1_agreement']:.0%}: {'PASS' if res['passed'] else 'FAIL'}",
        f"    export loaded by {res['export_loaded_by']}; source by {res['source_loaded_by']}",
    ]
    lines += [f"    note: {n}" for n in res["notes"]]
    lines += [f"    failure: {f}" for f in res["failures"]]
    return "\n".join(lines)
