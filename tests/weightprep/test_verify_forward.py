"""``verify --checkpoint OUT --against SRC --forward`` (issue 30): the exported model run through
transformers and compressed_tensors beside its source, on fixed tokens.

The tiny checkpoints are written by transformers 5.23 itself (`hf_tiny`); the export is
mxcli's compressed-tensors MXFP8 export. transformers 5.23 cannot load it (its fused-experts FP8
branch multiplies codes by raw uint8 scales), so the export is decompressed by the library.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from tests.weightprep.hf_tiny import build_tiny  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fwd")
    out: dict[str, Path] = {}
    for mt in ("qwen3_moe", "mixtral"):
        src = build_tiny(mt, root / mt)
        prepare_weights(src, root / f"{mt}-ct", PrepOptions(output_format="compressed-tensors"))
        out[mt], out[f"{mt}-ct"] = src, root / f"{mt}-ct"
    return out


@pytest.mark.parametrize("mt", ["qwen3_moe", "mixtral"])
def test_forward_reports_the_logit_error(pair: dict[str, Path], mt: str) -> None:
    from mxcli.verification.forward import MIN_LOGIT_SQNR_DB, forward_check

    res = forward_check(pair[f"{mt}-ct"], pair[mt])
    assert res["passed"], res
    # measured: qwen3_moe 42.3 dB, mixtral 38.4 dB (MXFP8 experts, 16 tokens)
    assert MIN_LOGIT_SQNR_DB + 10 < res["logits_sqnr_db"] < 80
    assert not res["logits_exact"] and res["top1_agreement"] >= 0.9
    assert res["export_loaded_by"] == "compressed_tensors decompression"
    assert res["source_loaded_by"] == "transformers from_pretrained"
    assert any("integrations/compressed_tensors.py" in n for n in res["notes"])


def test_forward_fails_on_a_corrupted_expert(pair: dict[str, Path], tmp_path: Path) -> None:
    """One expert's scale bytes 4 too large (its weights x16): the logits fall apart."""
    from mxcli.verification.forward import forward_check

    bad = tmp_path / "bad"
    shutil.copytree(pair["qwen3_moe-ct"], bad)
    shard = next(bad.glob("*.safetensors"))
    t = load_file(str(shard))
    for p in ("gate", "up", "down"):
        k = f"model.layers.1.mlp.experts.3.{p}_proj.weight_scale"
        t[k] = t[k] + 4
    save_file(t, str(shard), metadata={"format": "pt"})
    res = forward_check(bad, pair["qwen3_moe"])
    assert not res["passed"] and res["logits_sqnr_db"] < 20, res
    assert "logits" in res["failures"][0]


@pytest.mark.slow
def test_forward_through_the_cli(pair: dict[str, Path], tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mxcli", "verify", "--checkpoint", str(pair["mixtral-ct"]),
         "--against", str(pair["mixtral"]), "--forward", "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["passed"] and rep["forward"]["passed"] and rep["forward"]["logits_sqnr_db"] > 30
    r = subprocess.run(
        [sys.executable, "-m", "mxcli", "verify", "--forward"], capture_output=True, text=True
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--forward" in r.stderr and "Traceback" not in r.stderr


def test_fixed_tokens_are_fixed() -> None:
    from mxcli.verification.forward import fixed_tokens

    a, b = fixed_tokens(64), fixed_tokens(64)
    assert torch.equal(a, b) and a.shape == (1, 16) and int(a.min()) >= 1


def test_bf16_export_loads_in_transformers_itself(pair: dict[str, Path], tmp_path: Path) -> None:
    """``--formats bf16``: a plain HF folder transformers 5.23 loads directly; the logits equal
    the source's exactly (the experts are the source's bf16 bytes)."""
    from mxcli.verification.forward import forward_check

    out = tmp_path / "bf16"
    prepare_weights(
        pair["mixtral"], out, PrepOptions(output_format="compressed-tensors", formats=("bf16",))
    )
    res = forward_check(out, pair["mixtral"])
    assert res["passed"] and res["logits_exact"] and res["notes"] == []
    assert res["export_loaded_by"] == "transformers from_pretrained"


def test_library_written_mxfp8_fails_in_transformers_too(
    pair: dict[str, Path], tmp_path: Path
) -> None:
    """The transformers limitation is not mxcli's: a checkpoint written by compressed_tensors'
    own MXFP8 compressor (`ct_tiny`) does not load either; its passthrough export is then
    bit-exact against it through the library's decompression."""
    from mxcli.verification.forward import forward_check
    from tests.weightprep.ct_tiny import compress_experts

    lib = compress_experts(pair["qwen3_moe"], tmp_path / "lib", "MXFP8")
    out = tmp_path / "ct"
    prepare_weights(lib, out, PrepOptions(output_format="compressed-tensors"))
    res = forward_check(out, lib)
    assert res["passed"] and res["logits_exact"]
    assert res["source_loaded_by"] == res["export_loaded_by"] == "compressed_tensors decompression"
    assert [n.split(":")[0] for n in res["notes"]] == ["the source", "the export"]
