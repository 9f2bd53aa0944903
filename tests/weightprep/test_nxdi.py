"""``--output-format nxdi`` against the facts drawn from NxD Inference's source
(`tests/weightprep/nxdi_oracle.py`, each with its file:line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.errors import InputError
from mxcli.weightprep.checkpoint import Checkpoint
from mxcli.weightprep.export import check_export
from mxcli.weightprep.export.nxdi import mx_path_problems, rank_file, shuffle_hidden
from mxcli.weightprep.families import load_weight
from mxcli.weightprep.plan import PrepOptions, build_plan
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint
from tests.weightprep import nxdi_oracle as NX

E, H, I = 8, 256, 256  # noqa: E741


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nx")
    return build_checkpoint("qwen3_moe", root / "q", intermediate_size=I, hidden_size=H).path


def _rank_tensors(out: Path, r: int) -> dict[str, torch.Tensor]:
    with safe_open(str(out / rank_file(r)), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_layout_matches_the_oracle(src: Path, tmp_path: Path, tp: int, ep: int) -> None:
    out = tmp_path / "nx"
    res = prepare_weights(
        src, out, PrepOptions(output_format="nxdi", formats=("bf16",), tp=tp, ep=ep)
    )
    ckpt = Checkpoint(src)
    assert res["ranks"] == tp * ep
    it, et = I // tp, E // ep
    with ckpt.reader() as rd:
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                r = NX.world_rank(ep_rank, tp_rank, tp)
                t = _rank_tensors(out, r)
                i0 = tp_rank * it
                for L in (0, 1):
                    p = f"model.layers.{L}."
                    router = t[NX.ROUTER_KEY.format(l=L)]
                    assert torch.equal(router, rd.get(p + "mlp.gate.weight"))  # unchanged [E, H]
                    gu = t[NX.GATE_UP_KEY.format(l=L)]
                    dn = t[NX.DOWN_KEY.format(l=L)]
                    assert gu.shape == (et, H, 2 * it) and dn.shape == (et, it, H)
                    for j in range(et):
                        e = ep_rank * et + j
                        w = {
                            n: load_weight(rd, f"{p}mlp.experts.{e}.{n}_proj.weight", None)
                            for n in ("gate", "up", "down")
                        }
                        # gate half first (oracle GATE_FIRST), each the rank's slice of I
                        assert torch.equal(gu[j, :, :it], w["gate"].T[:, i0 : i0 + it])
                        assert torch.equal(gu[j, :, it:], w["up"].T[:, i0 : i0 + it])
                        assert torch.equal(dn[j], w["down"].T[i0 : i0 + it, :])
    side = json.loads((out / "mxcli-export.json").read_text())
    assert side["output_format"] == "nxdi" and side["settings"]["tp"] == tp
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(out), "--against", str(src)])
    assert r.exit_code == 0, r.stdout


def test_tp_slices_follow_nxd_strided_partitioning(src: Path, tmp_path: Path) -> None:
    """Each rank's gate_up is NxD's stride-2 column-parallel piece of the full NxDI tensor
    ``[E, H, 2I]`` (oracle: the full tensor from modeling_qwen3_moe's facts, the pieces from
    create_local_weight's), and down its row-parallel piece of ``[E, I, H]``."""
    tp = 2
    out = tmp_path / "nx"
    prepare_weights(src, out, PrepOptions(output_format="nxdi", formats=("bf16",), tp=tp))
    ckpt = Checkpoint(src)
    with ckpt.reader() as rd:
        w = {
            n: [load_weight(rd, f"model.layers.1.mlp.experts.{e}.{n}_proj.weight", None)
                for e in range(E)]
            for n in ("gate", "up", "down")
        }  # fmt: skip
    full_gu = torch.stack(
        [torch.cat([g.T, u.T], dim=-1) for g, u in zip(w["gate"], w["up"], strict=True)]
    )
    full_dn = torch.stack([d.T for d in w["down"]])
    assert full_gu.shape == (E, H, 2 * I)  # oracle GATE_UP_SHAPE, gate half first
    for r in range(tp):
        t = _rank_tensors(out, r)
        pieces = NX.local_slice(2 * I, tp, r, NX.GATE_UP_STRIDE)
        want = torch.cat([full_gu[..., a:b] for a, b in pieces], dim=-1)
        assert torch.equal(t[NX.GATE_UP_KEY.format(l=1)], want)
        ((a, b),) = NX.local_slice(I, tp, r, 1)
        assert torch.equal(t[NX.DOWN_KEY.format(l=1)], full_dn[:, a:b, :])


def test_verify_names_a_missing_rank_file(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "nx"
    prepare_weights(src, out, PrepOptions(output_format="nxdi", formats=("bf16",), ep=2))
    (out / rank_file(1)).unlink()
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(out), "--against", str(src)])
    assert r.exit_code == 1
    assert f"missing: {rank_file(1)} (experts 4-7, I 0-{I - 1})" in r.stdout


def test_shuffle_matches_the_oracle() -> None:
    x = torch.arange(3 * 16).view(3, 16)
    y = shuffle_hidden(x, dim=-1)
    for h in range(16):
        assert torch.equal(y[:, NX.shuffled_position(h, 16)], x[:, h])


@pytest.mark.parametrize("i_tp", [32, 96, 384, 512, 544, 640, 1024, 1536, 2880])
def test_mx_path_i_rule_matches_the_oracle(i_tp: int) -> None:
    assert (not any("per-rank I" in p for p in mx_path_problems(512, i_tp))) == NX.mx_i_ok(i_tp)
    assert mx_path_problems(2880, 512) == [f"H (2880) a multiple of {NX.MX_H_TILE}"]


def test_mx_divisibility_refused_before_writing(tmp_path: Path) -> None:
    src = build_checkpoint("qwen3_moe", tmp_path / "q", intermediate_size=768, hidden_size=512).path
    with pytest.raises(InputError, match=r"per-rank I \(768\) above 512 a multiple of 512"):
        prepare_weights(src, tmp_path / "o", PrepOptions(output_format="nxdi", formats=("mxfp8",)))
    assert not (tmp_path / "o").exists()
    opts = PrepOptions(output_format="nxdi", formats=("bf16", "mxfp8"), tp=6)  # I_TP 128: fine
    check_export(build_plan(src, opts))


def test_existing_output_needs_force(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "nx"
    prepare_weights(src, out, PrepOptions(output_format="nxdi", formats=("bf16",)))
    r = CliRunner().invoke(
        app, ["prep-weights", str(src), str(out), "--output-format", "nxdi", "--formats", "bf16"]
    )
    assert r.exit_code == 2 and "--force" in r.stderr
    r = CliRunner().invoke(
        app,
        ["prep-weights", str(src), str(out), "--output-format", "nxdi", "--formats", "bf16",
         "--force", "-q"],
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr


def test_exports_refuse_what_they_cannot_write(tmp_path: Path) -> None:
    """One line, exit 2, nothing written: DeepSeek-V3's FP8 dense and shared-expert weights
    (compressed-tensors), its shared experts and correction bias (nxdi), fused experts."""
    ds = build_checkpoint("deepseek_v3", tmp_path / "ds").path
    oss = build_checkpoint("gpt_oss", tmp_path / "oss").path
    cases = [
        (ds, "compressed-tensors", "FP8 outside the routed experts"),
        (ds, "nxdi", "has shared experts"),
        (oss, "compressed-tensors", "stores its experts fused"),
    ]
    for src_, fmt, what in cases:
        for extra in ([], ["--dry-run"]):
            r = CliRunner().invoke(
                app,
                ["prep-weights", str(src_), str(tmp_path / "o"), "--output-format", fmt, *extra],
            )
            assert r.exit_code == 2, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and what in r.stderr, r.stderr
            assert not (tmp_path / "o").exists()
