"""``--output-format nxdi --nxdi-base DIR`` (issue 30): complete rank checkpoints NxD Inference
loads, against the facts in `nxdi_oracle` (each with its file:line at NxDI 4bcdc54).

NxDI reads ``weights/tp{r}_sharded_checkpoint.safetensors`` as a rank's complete weights, so an
export without a base is written under a name NxDI does not read. With a base (NxDI's own
sharded checkpoint of the same model, emulated here from the cited facts: its conversion's key
names and NxD's sharding), every rank file holds exactly the base's tensors: the MoE ones are
mxcli's (with NxDI's shard-on-I padding where the base has it) and the rest are the base's bytes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mxcli.weightprep.checkpoint import Checkpoint
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint
from tests.weightprep import nxdi_oracle as NX

E, H = 8, 256
I = 384  # noqa: E741 - I / tp 2 = 192: shard-on-I pads it to 256, like Qwen3-30B-A3B at tp 4
COMPLETE = "weights/tp{rank}_sharded_checkpoint.safetensors"


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nb")
    return build_checkpoint("qwen3_moe", root / "q", intermediate_size=I, hidden_size=H).path


def _nxdi_moe(src: Path, L: int, tp: int, ep: int, tp_rank: int, ep_rank: int, pad: bool):
    """The oracle's MoE tensors of a rank: NxDI's conversion (+ padding) and NxD's sharding."""
    ck = Checkpoint(src)
    Ip = NX.padded_i(I, tp) if pad else I
    with ck.reader() as rd:
        p = f"model.layers.{L}.mlp."
        gu = torch.zeros(E, H, 2, Ip, dtype=torch.bfloat16)
        dn = torch.zeros(E, Ip, H, dtype=torch.bfloat16)
        for e in range(E):
            gu[e, :, 0, :I] = rd.get(p + f"experts.{e}.gate_proj.weight").T
            gu[e, :, 1, :I] = rd.get(p + f"experts.{e}.up_proj.weight").T
            dn[e, :I] = rd.get(p + f"experts.{e}.down_proj.weight").T
        router = rd.get(p + "gate.weight")
    gu = gu.reshape(E, H, 2 * Ip)
    e0, e1 = ep_rank * E // ep, (ep_rank + 1) * E // ep
    gsl = NX.local_slice(2 * Ip, tp, tp_rank, NX.GATE_UP_STRIDE)
    gu_r = torch.cat([gu[e0:e1, :, a:b] for a, b in gsl], dim=2)
    ((a, b),) = NX.local_slice(Ip, tp, tp_rank, 1)
    return router, gu_r, dn[e0:e1, a:b]


def _base(root: Path, src: Path, tp: int, ep: int, pad: bool) -> Path:
    """An NxDI-like sharded checkpoint: the non-MoE keys NxDI's conversion makes (random
    values, sharding of attention irrelevant here) and MoE keys of NxDI's shapes (zeros)."""
    g = torch.Generator().manual_seed(7)
    Ip = NX.padded_i(I, tp) if pad else I
    (root / "weights").mkdir(parents=True)
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            r = NX.world_rank(ep_rank, tp_rank, tp)
            t: dict[str, torch.Tensor] = {
                "rank_util.rank": torch.arange(tp * ep, dtype=torch.int32),
                "embed_tokens.weight": torch.randn(64, H, generator=g).bfloat16(),
                "norm.weight": torch.randn(H, generator=g).bfloat16(),
                "lm_head.weight": torch.randn(64 // (tp * ep), H, generator=g).bfloat16(),
            }
            for L in (0, 1):
                t[NX.RANK_UTIL_KEYS[1].format(l=L)] = torch.arange(tp * ep, dtype=torch.int32)
                for k in NX.QK_NORM_KEYS:
                    t[k.format(l=L)] = torch.randn(64, generator=g).bfloat16()
                t[f"layers.{L}.self_attn.qkv_proj.q_proj.weight"] = torch.randn(
                    128 // tp, H, generator=g
                ).bfloat16()
                t[NX.ROUTER_KEY.format(l=L)] = torch.zeros(E, H, dtype=torch.bfloat16)
                t[NX.GATE_UP_KEY.format(l=L)] = torch.zeros(E // ep, H, 2 * Ip // tp).bfloat16()
                t[NX.DOWN_KEY.format(l=L)] = torch.zeros(E // ep, Ip // tp, H).bfloat16()
            save_file(t, str(root / COMPLETE.format(rank=r)))
    return root


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("tp,ep,pad", [(2, 1, True), (2, 2, False)])
def test_complete_rank_files_as_nxdi_reads_them(
    src: Path, tmp_path: Path, tp: int, ep: int, pad: bool
) -> None:
    base = _base(tmp_path / "base", src, tp, ep, pad)
    out = tmp_path / "nx"
    res = prepare_weights(
        src,
        out,
        PrepOptions(
            output_format="nxdi", formats=("bf16",), tp=tp, ep=ep, nxdi_base=str(base)
        ),  # fmt: skip
    )
    assert res["complete"] and res["i_per_rank"] == (256 if pad else I // tp)
    assert sorted(res["files"]) == sorted(COMPLETE.format(rank=r) for r in range(tp * ep))
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            r = NX.world_rank(ep_rank, tp_rank, tp)
            # what application_base.py:389-400 loads for this rank: the whole file
            got, want = (
                _tensors(out / COMPLETE.format(rank=r)),
                _tensors(base / COMPLETE.format(rank=r)),
            )
            assert {k: (v.dtype, v.shape) for k, v in got.items()} == {
                k: (v.dtype, v.shape) for k, v in want.items()
            }
            moe = set()
            for L in (0, 1):
                router, gu, dn = _nxdi_moe(src, L, tp, ep, tp_rank, ep_rank, pad)
                for key, ref in ((NX.ROUTER_KEY, router), (NX.GATE_UP_KEY, gu), (NX.DOWN_KEY, dn)):
                    k = key.format(l=L)
                    moe.add(k)
                    assert torch.equal(_bits(got[k]), _bits(ref)), (r, k)
            for k in set(want) - moe:
                assert torch.equal(_bits(got[k]), _bits(want[k])), (r, k)
            if pad and tp_rank == tp - 1:  # the padding sits at the end of the whole I
                gu = got[NX.GATE_UP_KEY.format(l=1)]
                real = I - tp_rank * 256
                assert bool((gu[..., real:256] == 0).all()) and bool(
                    (gu[..., 256 + real :] == 0).all()
                )
    from mxcli.verification.checkpoints import verify_checkpoint

    rep = verify_checkpoint(out, src)
    assert rep["passed"], rep
    if pad:  # a base tensor changed in the output: verify names it
        f = out / COMPLETE.format(rank=1)
        t = _tensors(f)
        t["norm.weight"] = t["norm.weight"] + 1
        save_file(t, str(f))
        rep = verify_checkpoint(out, src)
        assert not rep["passed"]
        assert f"{COMPLETE.format(rank=1)}: norm.weight differs from --nxdi-base" in rep["wrong"]


def test_without_base_nxdi_does_not_read_the_files(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "nx"
    res = prepare_weights(src, out, PrepOptions(output_format="nxdi", formats=("bf16",), tp=2))
    assert not res["complete"]
    assert not list(out.glob("weights/*_sharded_checkpoint.safetensors"))
    assert sorted(p.name for p in (out / "weights").iterdir()) == [
        "tp0_moe_only.safetensors",
        "tp1_moe_only.safetensors",
    ]


def _cli(*args: object) -> tuple[int, str]:
    """The CLI in this process (CliRunner): exit code and stderr."""
    from typer.testing import CliRunner

    from mxcli.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stderr


WRONG = [("--tp", "4"), ("--tp", "2", "--formats", "mxfp8"), ("--tp", "1")]


def test_a_wrong_base_is_refused(src: Path, tmp_path: Path) -> None:
    base = _base(tmp_path / "base", src, 2, 1, True)
    for extra in WRONG:
        code, err = _cli("prep-weights", src, tmp_path / "o", "--output-format", "nxdi",
                         "--nxdi-base", base, *extra)  # fmt: skip
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "--nxdi-base" in err, err
        assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_wrong_base_is_refused_as_a_fresh_process(src: Path, tmp_path: Path) -> None:
    base = _base(tmp_path / "base", src, 2, 1, True)
    r = subprocess.run(
        [sys.executable, "-m", "mxcli", "prep-weights", str(src), str(tmp_path / "o"),
         "--output-format", "nxdi", "--nxdi-base", str(base), *WRONG[0]],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()
