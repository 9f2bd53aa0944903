"""``--output-format nxdi --formats mxfp8``: NxD's MX layout, checked against an independent
decoding built from the facts in `tests/weightprep/nxdi_oracle.py` (each with its file:line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.mx import dequantize_mx, quantize_mx
from mxcli.weightprep.checkpoint import Checkpoint
from mxcli.weightprep.export.nxdi import (
    mx_down,
    mx_down_codes,
    mx_gate_up,
    mx_gate_up_codes,
    rank_file,
)
from mxcli.weightprep.families import load_weight
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint
from tests.weightprep import nxdi_oracle as NX

E, H, I = 4, 512, 1024  # noqa: E741  (per-rank I 1024 at tp 1: two 512 tiles; 512 at tp 2)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nxmx")
    return build_checkpoint(
        "qwen3_moe", root / "q", intermediate_size=I, hidden_size=H, num_experts=E
    ).path


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _decode(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Oracle decoding: byte j of a little-endian word is code j (E4M3FN), times 2^(byte-127)."""
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(w >> (8 * j)) & 0xFF for j in range(4)], dim=-1).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
    exp = scales.to(torch.int32) - 127
    return vals, torch.ldexp(torch.ones(exp.shape), exp)


def _oracle_gate_up(w: torch.Tensor, s: torch.Tensor, i_tp: int) -> torch.Tensor:
    """``[c, H, 2, I_tp]`` float32 values of a written gate_up, placed by the oracle's positions."""
    hp = [NX.gate_up_word_position(h, 0, i_tp) for h in range(H)]
    cols = torch.tensor([NX.gate_up_word_position(0, i, i_tp)[2] for i in range(i_tp)])
    p = torch.tensor([x[0] for x in hp])
    t = torch.tensor([x[1] for x in hp])
    j = torch.tensor([x[3] for x in hp])
    vals, scale = _decode(w, s)  # [c, 128, 2, H/512, I_tp, 4], [c, 16, 2, H/512, I_tp]
    v = vals[:, p[:, None], :, t[:, None], cols[None, :], j[:, None]]  # [H, I_tp, c, 2]
    sc = scale[:, (p // 8)[:, None], :, t[:, None], cols[None, :]]  # H block 16t + p // 8
    return (v * sc).permute(2, 0, 3, 1)


def _oracle_down(w: torch.Tensor, s: torch.Tensor, i_tp: int) -> torch.Tensor:
    """``[c, I_tp, H]`` float32 values of a written down_proj."""
    pos = [NX.down_word_position(i, 0, i_tp) for i in range(i_tp)]
    k = torch.tensor([x[0] for x in pos])
    t = torch.tensor([x[1] for x in pos])
    j = torch.tensor([x[3] for x in pos])
    vals, scale = _decode(w, s)  # [c, T/4, n, H, 4], [c, T/32, n, H]
    hs = torch.arange(H)
    v = vals[:, k[:, None], t[:, None], hs[None, :], j[:, None]]  # [c, I_tp, H]
    return v * scale[:, (k // 8)[:, None], t[:, None], hs[None, :]]


def _mxcli_mxfp8(x: torch.Tensor, rule: str) -> torch.Tensor:
    """mxcli's own MXFP8 of `x` along dim 1 (32-groups), dequantized."""
    codes, scales = quantize_mx(x, axis=1, rule=rule, scheme="1x32")
    return dequantize_mx(codes, scales, axis=1, scheme="1x32")


@pytest.mark.parametrize("tp,ep,formats", [(1, 1, ("mxfp8",)), (2, 2, ("bf16", "mxfp8"))])
def test_mx_layout_matches_the_oracle(
    src: Path, tmp_path: Path, tp: int, ep: int, formats: tuple[str, ...]
) -> None:
    out = tmp_path / "nx"
    res = prepare_weights(
        src, out, PrepOptions(output_format="nxdi", formats=formats, tp=tp, ep=ep)
    )
    assert res["experts_format"] == "mxfp8" and res["ranks"] == tp * ep
    it, et = I // tp, E // ep
    tile = NX.mx_i_tile(it)
    files = sorted(p.relative_to(out).as_posix() for p in (out / "weights").iterdir())
    assert files == sorted(rank_file(r) for r in range(tp * ep))
    with Checkpoint(src).reader() as rd:
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                t = _tensors(out / rank_file(NX.world_rank(ep_rank, tp_rank, tp)))
                i0 = tp_rank * it
                for L in (0, 1):
                    pre = f"model.layers.{L}.mlp."
                    gu = NX.GATE_UP_KEY.format(l=L)
                    dn = NX.DOWN_KEY.format(l=L)
                    gus = NX.MX_SCALE_KEY.format(l=L, proj="gate_up_proj")
                    dns = NX.MX_SCALE_KEY.format(l=L, proj="down_proj")
                    router = NX.ROUTER_KEY.format(l=L)
                    assert set(t) >= {gu, dn, gus, dns, router}
                    assert t[gu].dtype == torch.uint32 and t[dn].dtype == torch.uint32
                    assert t[gus].dtype == torch.uint8 and t[dns].dtype == torch.uint8
                    nh = H // NX.MX_H_TILE
                    assert t[gu].shape == (et, NX.MX_ROWS_PER_H_TILE, 2, nh, it)
                    assert t[gus].shape == (et, NX.MX_ROWS_PER_H_TILE // 8, 2, nh, it)
                    assert t[dn].shape == (et, tile // 4, it // tile, H)
                    assert t[dns].shape == (et, tile // 32, it // tile, H)
                    # router: the source's [E, H] in shuffle_hidden_dim order
                    src_router = rd.get(pre + "gate.weight")
                    for h in range(H):
                        assert torch.equal(
                            t[router][:, NX.shuffled_position(h, H)], src_router[:, h]
                        )
                    experts = range(ep_rank * et, (ep_rank + 1) * et)
                    w = {
                        n: torch.stack(
                            [load_weight(rd, f"{pre}experts.{e}.{n}_proj.weight", None)
                             for e in experts]
                        )
                        for n in ("gate", "up", "down")
                    }  # fmt: skip
                    sl = slice(i0, i0 + it)
                    want_gu = torch.stack(
                        [w["gate"].transpose(1, 2)[..., sl], w["up"].transpose(1, 2)[..., sl]],
                        dim=2,
                    )  # [c, H, 2, I_tp], gate first
                    want = _mxcli_mxfp8(want_gu.flatten(2), "neuron").view(et, H, 2, it)
                    got = _oracle_gate_up(t[gu], t[gus], it)
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
                    want_dn = _mxcli_mxfp8(
                        w["down"].transpose(1, 2)[:, sl, :].contiguous(), "neuron"
                    )
                    got_dn = _oracle_down(t[dn], t[dns], it)
                    assert torch.equal(got_dn.view(torch.int32), want_dn.view(torch.int32))
    side = json.loads((out / "mxcli-export.json").read_text())
    nx = side["result"]["nxdi"]
    assert nx["nxd_commit"] == NX.NXD.split("@")[1] and nx["nxdi_commit"] == NX.COMMIT
    assert side["result"]["fp8"]["scale_rule"] == "neuron"
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(out), "--against", str(src)])
    assert r.exit_code == 0, r.stdout


@pytest.mark.parametrize("h,i_tp", [(1024, 1536), (512, 96)])
def test_mx_layout_functions_place_codes_per_the_oracle(h: int, i_tp: int) -> None:
    """Several H and I tiles: every code and scale where the oracle says, and back."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (2, h, 2 * i_tp), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (2, h // 32, 2 * i_tp), dtype=torch.uint8, generator=g)
    w, s = mx_gate_up(codes, scales)
    b = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for hh, ii in [(0, 0), (5, 7), (h - 1, i_tp - 1), (517 % h, 300 % i_tp), (33, i_tp // 2 + 3)]:
        p, t, col, j = NX.gate_up_word_position(hh, ii, i_tp)
        for gi in (0, 1):
            assert (int(b[1, p, gi, t, col]) >> (8 * j)) & 0xFF == int(codes[1, hh, gi * i_tp + ii])
            assert int(s[1, p // 8, gi, t, col]) == int(scales[1, hh // 32, gi * i_tp + ii])
    assert all(
        torch.equal(x, y) for x, y in zip(mx_gate_up_codes(w, s), (codes, scales), strict=True)
    )
    dc = torch.randint(0, 256, (2, i_tp, h), dtype=torch.uint8, generator=g)
    ds = torch.randint(0, 256, (2, i_tp // 32, h), dtype=torch.uint8, generator=g)
    w, s = mx_down(dc, ds)
    b = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for ii, hh in [(0, 0), (i_tp - 1, h - 1), (i_tp // 2 + 5, 77)]:
        k, t, hx, j = NX.down_word_position(ii, hh, i_tp)
        assert (int(b[0, k, t, hx]) >> (8 * j)) & 0xFF == int(dc[0, ii, hh])
        assert int(s[0, k // 8, t, hx]) == int(ds[0, ii // 32, hh])
    assert all(torch.equal(x, y) for x, y in zip(mx_down_codes(w, s), (dc, ds), strict=True))


def test_mx_divisibility_refused_by_the_cli(tmp_path: Path) -> None:
    """A fresh process: exit 2, one line naming the rule, no output folder."""
    bad = build_checkpoint(
        "qwen3_moe", tmp_path / "q", intermediate_size=768, hidden_size=512, num_experts=4
    ).path
    out = tmp_path / "o"
    r = subprocess.run(
        [sys.executable, "-m", "mxcli", "prep-weights", str(bad), str(out),
         "--output-format", "nxdi", "--formats", "mxfp8", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "per-rank I (768) above 512 a multiple of 512" in lines[0], lines
    assert "Traceback" not in r.stderr and not out.exists()


def test_verify_catches_a_missing_scale_key_and_a_wrong_scale(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "nx"
    prepare_weights(src, out, PrepOptions(output_format="nxdi", formats=("mxfp8",), tp=2))
    f = out / rank_file(1)
    t = _tensors(f)
    key = NX.MX_SCALE_KEY.format(l=1, proj="down_proj")
    del t[key]
    save_file(t, str(f))
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(out), "--against", str(src)])
    assert r.exit_code == 1
    assert f"missing: {rank_file(1)}: {key}" in r.stdout
    f0 = out / rank_file(0)
    t = _tensors(f0)
    skey = NX.MX_SCALE_KEY.format(l=0, proj="gate_up_proj")
    t[skey][0, 0, 0, 0, 0] += 1  # one group's values doubled
    save_file(t, str(f0))
    r = CliRunner().invoke(app, ["verify", "--checkpoint", str(out), "--against", str(src)])
    assert r.exit_code == 1
    gu = NX.GATE_UP_KEY.format(l=0)
    assert f"wrong: {rank_file(0)}: {gu}: codes or scales differ" in r.stdout


@pytest.mark.parametrize(
    "fmt,extra",
    [("nxdi", ["--formats", "mxfp8", "--tp", "2", "--ep", "2"]), ("compressed-tensors", [])],
)
def test_dry_run_shows_the_exports_tensors_and_bytes(
    src: Path, tmp_path: Path, fmt: str, extra: list[str]
) -> None:
    """``--dry-run`` of an export lists the export's own tensors (not mxcli's layout), and its
    write total is what the real export then writes (the tensors it rewrites)."""
    args = ["prep-weights", str(src), str(tmp_path / "out"), "--output-format", fmt, *extra]
    cmd = [sys.executable, "-m", "mxcli", *args, "--dry-run"]
    text = subprocess.run(cmd, capture_output=True, text=True, env={"COLUMNS": "80"})
    assert text.returncode == 0, text.stderr
    assert "_weight_mxfp8" not in text.stdout and "gate_up_weight_scales" not in text.stdout
    assert max(len(line) for line in text.stdout.splitlines()) <= 80
    if fmt == "nxdi":
        assert (
            "gate_up_proj.scale" in text.stdout and "[2, 128, 2, 1, 512]" in text.stdout
        )  # E/ep experts, I/tp
    else:
        assert "gate_proj.weight_scale" in text.stdout and "F8_E4M3" in text.stdout
    plan = json.loads(
        subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout
    )  # --dry-run --json prints the plan
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    written = 0
    for f in sorted((tmp_path / "out").rglob("*.safetensors")):
        for name, t in _tensors(f).items():
            if fmt == "nxdi" or ".mlp.experts." in name:
                written += t.numel() * t.element_size()
    assert plan["output_bytes"] == written
