"""Bad numbers that used to pass silently (issue 13 §2): invalid router kwargs in make-inputs, a NaN
E8M0 scale byte in pre-quantized weights, NaN in a checkpoint's expert weight, and non-finite
kernel outputs that the inputs do not explain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxcli.io.files import write_file
from mxcli.kernels.rmsnorm_mx_prefill import PrefillValidationError
from mxcli.kernels.rmsnorm_mx_prefill.contract import validate
from mxcli.kernels.spec import read_kernel_file
from mxcli.weightprep.synthetic import build_checkpoint
from tests.cli.test_user_errors import _assert_user_error


# -- make-inputs validates the router kwargs as the kernel contract does ---------------------
@pytest.mark.parametrize(
    "args,words",
    [
        (["--top-k", "9"], ["top_k", "<= 8", "9"]),
        (["--experts", "4", "--top-k", "5"], ["top_k", "<= E=4", "5"]),
        (["--router-act", "noaux_tc", "--n-group", "3"], ["n_group", "divisor of E=16", "3"]),
        (["--router-act", "noaux_tc", "--n-group", "4", "--topk-group", "5"],
         ["topk_group", "<= n_group=4", "5"]),
        (["--router-act", "noaux_tc", "--n-group", "8", "--topk-group", "1", "--top-k", "3"],
         ["top_k", "topk_group * E / n_group = 2", "3"]),
    ],
    ids=["top-k-9", "top-k-gt-E", "n-group-not-divisor", "topk-group-gt-n-group", "noaux-k-gt-kept"],
)  # fmt: skip
def test_make_inputs_prefill_validates_like_the_kernel(
    cli, tmp_path: Path, args: list[str], words: list[str]
) -> None:
    out = tmp_path / "out" / "in.safetensors"
    out.parent.mkdir()
    r = cli("make-inputs", "prefill", "--tokens", "128", "--hidden", "512", "-o", out, *args)
    _assert_user_error(r, words, out)


def test_contract_rejects_noaux_top_k_beyond_the_kept_groups() -> None:
    """Prefill spec §5.3: with K > topk_group * E / n_group the kernel selects -30000-shifted
    experts outside the kept groups."""
    x = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    g = torch.ones(512, dtype=torch.bfloat16)
    w = torch.zeros(512, 16, dtype=torch.bfloat16)
    b = torch.zeros(16)
    kw = {"router_act_fn": "noaux_tc", "n_group": 4, "topk_group": 2}
    validate(x, g, w, b, top_k=8, **kw)  # 2 kept groups of 4 experts: 8 fit
    with pytest.raises(
        PrefillValidationError, match=r"top_k: expected <= topk_group \* E / n_group = 4 .*got 5"
    ):
        validate(x, g, w, b, top_k=5, **{**kw, "topk_group": 1})  # 1 kept group of 4


# -- an E8M0 scale byte of 255 (NaN) in pre-quantized weights ---------------------------------
@pytest.mark.parametrize("name", ["gate_up_weight_scales", "down_weight_scales"])
def test_nan_scale_byte_is_rejected_with_its_position(
    cli, tmp_path: Path, files: dict[str, Path], name: str
) -> None:
    f = read_kernel_file(files["bwd_pq"])
    s = f.tensors[name].clone()
    s[1, 33, 5] = 255  # row 33 = compact group 5 in both layouts: (5 // 4) * 32 + 5 % 4
    bad = tmp_path / "bad.safetensors"
    write_file(bad, {**f.tensors, name: s}, f.metadata)
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    r = cli("run-bwd", bad, "-o", out)
    _assert_user_error(r, [name, "255 (NaN)", "[1, 33, 5]", "expert 1, MX group 5"], out)
    # a byte in a layout hole is never read: not an error
    holes = f.tensors[name].clone()
    holes[0, 20, 0] = 255  # rows 4..31 of each quadrant are holes
    ok = tmp_path / "ok.safetensors"
    write_file(ok, {**f.tensors, name: holes}, f.metadata)
    assert cli("run-bwd", ok, "-o", tmp_path / "ok-out.safetensors").exit_code == 0


# -- NaN in a checkpoint's expert weight -------------------------------------------------------
@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = build_checkpoint(
        "qwen3_moe", tmp_path_factory.mktemp("nan") / "q", intermediate_size=256
    ).path
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name][3, 7] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return src


def test_prep_weights_rejects_nonfinite_source_weights(
    cli, tmp_path: Path, nan_checkpoint: Path
) -> None:
    out = tmp_path / "prepared"
    r = cli("prep-weights", nan_checkpoint, out, "--quiet")
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert "\n" not in err and "Traceback" not in r.output
    for w in ("layer 1 expert weights", "1 NaN", "expert 2 up_proj at (i=3, h=7)",
              "--allow-nonfinite"):  # fmt: skip
        assert w in err, (w, err)


def test_prep_weights_allow_nonfinite_never_reports_exact(
    cli, tmp_path: Path, nan_checkpoint: Path
) -> None:
    out = tmp_path / "prepared"
    r = cli(
        "prep-weights", nan_checkpoint, out, "--allow-nonfinite", "--check", "--json", "--quiet"
    )
    assert r.exit_code == 0, r.output
    check = json.loads(r.stdout)["check"]
    bad = check["1"]["gate_up_proj_weight"]
    assert not bad["exact"] and bad.get("sqnr_db") is None, bad
    assert check["1"]["down_proj_weight"]["exact"] and check["0"]["gate_up_proj_weight"]["exact"]
    # make-inputs bwd refuses the NaN weights of layer 1 (layer 0 is fine)
    mi = tmp_path / "mi" / "bwd.safetensors"
    mi.parent.mkdir()
    r = cli("make-inputs", "bwd", "--weights", out, "--layer", "1", "--tokens", "128", "-o", mi)
    _assert_user_error(r, ["gate_up_proj_weight", "1 NaN"], mi)
    r = cli("make-inputs", "bwd", "--weights", out, "--layer", "0", "--tokens", "128", "-o", mi)
    assert r.exit_code == 0, r.output


# -- prefill overflow: the IEEE chain of prefill spec §3.2-§3.4, and the CLI's output check ------
def _overflow_inputs(w_dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 512, generator=g).to(torch.bfloat16)
    x[0, 1] = 1e30  # finite bf16; x^2 = 1e60 overflows fp32
    gamma = torch.ones(512, dtype=torch.bfloat16)
    w = (torch.randn(512, 16, generator=g) * 0.1).to(w_dtype)
    from mxcli.kernels import arrange_router_weights

    kw = {"router_weights": arrange_router_weights(w, "softmax"), "top_k": 2}
    return [x, gamma], {**kw, "router_act_fn": "softmax", "emit_norm_bf16": True}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow notes in the interpreter
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_overflowing_row_follows_the_ieee_chain_in_reference_and_sim(w_dtype) -> None:
    """ss = inf (fp32 overflow), inv_rms = rsqrt(inf) = 0. With a bf16 compute dtype
    a = R_cd(x*g) stays finite and y = R_cd(a*0) = 0: zero codes, scale byte 0, norm 0. With fp16
    cd, a = R_fp16(1e30) = inf and y = inf*0 = NaN: NaN codes (0x7F) under scale byte 248."""
    from mxcli.kernels import decode_packed_rows, rmsnorm_mx_prefill

    args, kw = _overflow_inputs(w_dtype)
    ref = rmsnorm_mx_prefill(*args, **kw)
    sim = rmsnorm_mx_prefill(*args, **kw, backend="sim")
    dr, ds = decode_packed_rows(ref[0], 512), decode_packed_rows(sim[0], 512)
    assert torch.equal(dr.codes, ds.codes) and torch.equal(dr.scales, ds.scales)
    assert torch.equal(ref[-1], sim[-1])  # norm_bf16 = R(x * 0 * g) = 0 on the row
    assert torch.all(ref[-1][1] == 0)
    if w_dtype == torch.bfloat16:
        assert torch.all(dr.codes[1] == 0) and torch.all(dr.scales[1] == 0)
        # the logits are raw * 0: an exact tie of all E experts, which both decide as max8 +
        # nc_find_index8 do (successive occurrences, api spec §8.14): experts 0 and 1 at 1/2
        assert ref[1][1].tolist() == sim[1][1].tolist() == [0, 1]
        assert torch.equal(ref[2].view(torch.int16), sim[2].view(torch.int16))
        assert ref[2][1, :2].tolist() == [0.5, 0.5]
    else:
        assert torch.all(dr.codes[1] & 0x7F == 0x7F) and torch.all(dr.scales[1] == 248)
        # logits NaN (inf * 0): max8 puts NaN first, find_index8 never matches it (index -1),
        # and 0 * NaN makes the whole dense affinity row NaN, in both
        assert ref[1][1].tolist() == sim[1][1].tolist() == [-1, -1]
        assert torch.isnan(ref[2][1].float()).all() and torch.isnan(sim[2][1].float()).all()
        assert torch.equal(ref[1][[0, 2, 3]], sim[1][[0, 2, 3]])
    # the other tokens are untouched
    assert torch.all(torch.isfinite(dr.values[[0, 2, 3]]))


def test_run_prefill_warns_about_unexplained_nonfinite_outputs(cli, tmp_path: Path) -> None:
    args, kw = _overflow_inputs(torch.float16)
    kwargs = {k: v for k, v in kw.items() if k != "router_weights"}
    meta = {"kernel": "rmsnorm_mx_prefill", "kwargs": json.dumps(kwargs)}
    src = tmp_path / "in.safetensors"
    write_file(
        src,
        {"hidden_states": args[0], "gamma": args[1], "router_weights": kw["router_weights"]},
        meta,
    )
    r = cli("run-prefill", src, "-o", tmp_path / "a.safetensors", "--quiet")
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert "warning: norm_quant_packed: 512 NaN/Inf" in err and "expert_affinities" in err
    r = cli("run-prefill", src, "-o", tmp_path / "b.safetensors", "--quiet", "--strict")
    assert r.exit_code == 1 and "norm_quant_packed" in r.stderr
    # the same row as NaN in the input explains its outputs: no warning, even with --strict
    x = args[0].clone()
    x[0, 1] = float("nan")
    nan_in = tmp_path / "nan.safetensors"
    write_file(nan_in, {"hidden_states": x, "gamma": args[1],
                        "router_weights": kw["router_weights"]}, meta)  # fmt: skip
    r = cli("run-prefill", nan_in, "-o", tmp_path / "c.safetensors", "--allow-nonfinite",
            "--strict", "--quiet")  # fmt: skip
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr


def test_nan_token_on_sim_stays_in_its_row(cli, tmp_path: Path) -> None:
    """One NaN token in a tile of four, on the interpreter with --allow-nonfinite: only its own
    row is NaN, as in the reference (the kernel broadcasts inv_rms with a bit-exact PE transpose,
    api spec §7.4; a matmul against the identity spread NaN * 0 over the tile), so nothing is
    unexplained and --strict passes."""
    from mxcli.kernels import decode_packed_rows

    args, kw = _overflow_inputs(torch.bfloat16)
    x = args[0].clone()
    x[0, 1, 7] = float("nan")
    kwargs = {k: v for k, v in kw.items() if k != "router_weights"}
    meta = {"kernel": "rmsnorm_mx_prefill", "kwargs": json.dumps(kwargs)}
    src = tmp_path / "nan.safetensors"
    write_file(src, {"hidden_states": x, "gamma": args[1],
                     "router_weights": kw["router_weights"]}, meta)  # fmt: skip
    outs = {}
    for backend in ("reference", "sim"):
        out = tmp_path / f"{backend}.safetensors"
        r = cli("run-prefill", src, "-o", out, "--backend", backend, "--allow-nonfinite",
                "--strict", "--quiet")  # fmt: skip
        assert r.exit_code == 0 and "warning" not in r.stderr, (backend, r.stderr)
        outs[backend] = read_kernel_file(out).tensors
    ref, sim = outs["reference"], outs["sim"]
    dr = decode_packed_rows(ref["norm_quant_packed"], 512)
    ds = decode_packed_rows(sim["norm_quant_packed"], 512)
    # the NaN code's sign bit is the fp32 -> bf16 cast's (torch's CPU kernel may write 0xFFFF,
    # ml_dtypes keeps the sign): compare NaN codes by position
    nan_r, nan_s = (dr.codes & 0x7F) == 0x7F, (ds.codes & 0x7F) == 0x7F
    assert torch.equal(nan_r, nan_s) and torch.equal(dr.codes[~nan_r], ds.codes[~nan_s])
    assert torch.equal(dr.scales, ds.scales)
    nan_rows = nan_s.any(dim=1)
    assert nan_rows.tolist() == [False, True, False, False]
    assert torch.all(ds.codes[1] & 0x7F == 0x7F) and torch.all(ds.scales[1] == 248)
    assert torch.equal(ref["expert_index"], sim["expert_index"])
    assert sim["expert_index"][1].tolist() == [-1, -1]  # NaN logits: never found (§8.14)
    assert (
        torch.isnan(sim["norm_bf16"][1]).all() and torch.isfinite(sim["norm_bf16"][[0, 2, 3]]).all()
    )


def test_run_bwd_strict_on_overflow(cli, tmp_path: Path, files: dict[str, Path]) -> None:
    f = read_kernel_file(files["bwd"])
    dy = f.tensors["output_hidden_states_grad"].clone()
    dy[5] = 3e38  # finite bf16; dY @ W_d overflows fp32
    src = tmp_path / "in.safetensors"
    write_file(src, {**f.tensors, "output_hidden_states_grad": dy}, f.metadata)
    r = cli("run-bwd", src, "-o", tmp_path / "a.safetensors", "--quiet")
    assert r.exit_code == 0 and "warning: hidden_states_grad" in r.stderr, r.stderr
    r = cli("run-bwd", src, "-o", tmp_path / "b.safetensors", "--quiet", "--strict")
    assert r.exit_code == 1
    r = cli("run-bwd", files["bwd"], "-o", tmp_path / "c.safetensors", "--quiet", "--strict")
    assert r.exit_code == 0 and r.stderr == ""


def test_router_nan_logits_follow_max8_find_index8() -> None:
    """A NaN logit sorts first (max8) and is never found (find_index8: index -1); the dense row
    sum_k (iota == idx_k) * s_k is then NaN in every column. A +inf logit under SOFTMAX gives
    exp(inf - inf) = NaN: the same. Finite rows are unaffected."""
    from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType
    from mxcli.kernels.rmsnorm_mx_prefill.router import topk_affinities

    lg = torch.tensor(
        [[0.5, float("nan"), 2.0, -1.0, 0.0, 0.1, 0.2, 0.3],
         [0.5, float("inf"), 2.0, -1.0, 0.0, 0.1, 0.2, 0.3],
         [0.5, 1.5, 2.0, -1.0, 0.0, 0.1, 0.2, 0.3]]
    )  # fmt: skip
    for act in (RouterActFnType.SIGMOID, RouterActFnType.SOFTMAX):
        idx, aff = topk_affinities(lg, 2, act)
        assert idx[0].tolist() == [-1, 2] and torch.isnan(aff[0].float()).all()
        assert idx[1].tolist() == [1, 2] and idx[2].tolist() == [2, 1]
        assert torch.isfinite(aff[2].float()).all() and int((aff[2] != 0).sum()) == 2
    _, soft = topk_affinities(lg, 2, RouterActFnType.SOFTMAX)
    assert torch.isnan(soft[1].float()).all()
    _, sig = topk_affinities(lg, 2, RouterActFnType.SIGMOID)
    assert float(sig[1, 1]) == 1.0 and float(sig[1, 0]) == 0.0  # sigmoid(inf) = 1: finite


def test_nan_code_in_prequantized_weight_is_a_nonfinite_input(
    cli, tmp_path: Path, files: dict[str, Path]
) -> None:
    """An E4M3 NaN code (0x7F) in an x4 weight word counts as a NaN input: rejected without
    --allow-nonfinite, and with it the NaN gradients are explained (no warning)."""
    f = read_kernel_file(files["bwd_pq"])
    w = f.tensors["down_proj_weight"].clone()
    w.view(torch.uint8).view(-1)[9] = 0x7F
    bad = tmp_path / "bad.safetensors"
    write_file(bad, {**f.tensors, "down_proj_weight": w}, f.metadata)
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    _assert_user_error(cli("run-bwd", bad, "-o", out), ["down_proj_weight", "1 NaN"], out)
    r = cli("run-bwd", bad, "-o", out, "--allow-nonfinite", "--strict", "--quiet")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr
    assert torch.isnan(read_kernel_file(out).tensors["hidden_states_grad"].float()).any()
