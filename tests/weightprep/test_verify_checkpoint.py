"""``mxcli verify --checkpoint OUT --against SRC`` (issue 22, item 6): it passes on an untouched
output and exits 1 naming the key for a missing expert, a missing scale key and a wrong shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint

EXPERT = "model.layers.{L}.mlp.experts.{e}.{p}_proj.weight"


def _verify(out: Path, src: Path) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(out), "--against", str(src)])
    return r.exit_code, r.stdout


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("src") / "q", num_shards=2).path


@pytest.fixture
def ct(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ct"
    prepare_weights(src, out, PrepOptions(output_format="compressed-tensors", scale_rule="ocp"))
    return out


def _edit(folder: Path, name: str, fn: object) -> None:
    """Rewrite the shard of `folder` holding `name` with ``fn(tensors)`` applied."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index[name]
    t = load_file(str(shard))
    fn(t)  # type: ignore[operator]
    save_file(t, str(shard))


def test_untouched_exports_pass(src: Path, ct: Path, tmp_path: Path) -> None:
    code, out = _verify(ct, src)
    assert code == 0, out
    assert "PASS" in out
    mx = tmp_path / "mx"
    prepare_weights(src, mx, PrepOptions(ep=2, layers="1"))
    code, out = _verify(mx, src)
    assert code == 1, out  # layer 0 was not prepared
    assert out.count("missing: ") == 1 and "missing: layer 0:" in out


def test_missing_expert_is_named(src: Path, ct: Path) -> None:
    name = EXPERT.format(L=1, e=5, p="up")

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[name], t[name + "_scale"]

    _edit(ct, name, drop)
    code, out = _verify(ct, src)
    assert code == 1
    assert f"missing: {name} (layer 1, expert 5)" in out
    assert f"missing: {name}_scale (layer 1, expert 5)" in out


def test_missing_scale_key_is_named(src: Path, ct: Path) -> None:
    name = EXPERT.format(L=0, e=2, p="down") + "_scale"
    _edit(ct, name, lambda t: t.pop(name))
    code, out = _verify(ct, src)
    assert code == 1
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("missing", "wrong"))]
    assert lines == [f"  missing: {name} (layer 0, expert 2)"]


def test_wrong_shape_is_named(src: Path, ct: Path) -> None:
    name = EXPERT.format(L=1, e=0, p="gate") + "_scale"

    def widen(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.cat([t[name], t[name]], dim=1)

    _edit(ct, name, widen)
    code, out = _verify(ct, src)
    assert code == 1
    assert f"wrong: {name} (layer 1, expert 0): expected U8" in out


def test_left_unquantized_and_unmapped(src: Path, ct: Path) -> None:
    name = EXPERT.format(L=0, e=1, p="gate")

    def dequant(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].to(torch.bfloat16)
        t["model.layers.0.mlp.experts.99.gate_proj.weight"] = t[name].clone()

    _edit(ct, name, dequant)
    code, out = _verify(ct, src)
    assert code == 1
    assert f"unquantized: {name} (layer 0, expert 1): BF16, expected F8_E4M3" in out
    assert "unexpected: model.layers.0.mlp.experts.99.gate_proj.weight" in out


def test_missing_rank_file_names_its_experts(src: Path, tmp_path: Path) -> None:
    mx = tmp_path / "mx"
    prepare_weights(src, mx, PrepOptions(ep=2, formats=("bf16",)))
    code, out = _verify(mx, src)
    assert code == 0 and "PASS" in out, out
    (mx / "rank1" / "layer_001.safetensors").unlink()
    code, out = _verify(mx, src)
    assert code == 1
    assert "missing: rank1/layer_001.safetensors (layer 1, experts 4-7)" in out


def test_needs_both_flags(src: Path) -> None:
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(src)])
    assert r.exit_code == 2 and "--against" in r.stderr


def test_codes_beyond_the_declared_range(src: Path, tmp_path: Path) -> None:
    """An export declaring +-240 whose codes reach past 240 is wrong (FP8 semantics enforced)."""
    out = tmp_path / "ct240"
    prepare_weights(
        src, out, PrepOptions(output_format="compressed-tensors", scale_rule="ocp", fp8_range=240)
    )
    assert _verify(out, src)[0] == 0
    name = EXPERT.format(L=0, e=0, p="gate")

    def bump(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.full_like(t[name], 448.0)

    _edit(out, name, bump)
    code, text = _verify(out, src)
    assert code == 1
    assert f"wrong: {name}: {128 * 256} FP8 codes beyond the declared +-240" in text
