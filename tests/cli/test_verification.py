"""Tensor comparison, tolerances, the exact-math checks, the case matrix and the reports."""

from __future__ import annotations

import dataclasses
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from mxcli.kernels.blockwise_moe import SPEC as BWD_SPEC
from mxcli.kernels.blockwise_moe.inputs import make_bwd_inputs
from mxcli.kernels.blockwise_moe.verification import check_bwd
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL_SPEC
from mxcli.kernels.rmsnorm_mx_prefill.inputs import make_prefill_inputs
from mxcli.kernels.rmsnorm_mx_prefill.verification import check_prefill
from mxcli.runs import run_case, run_kernel, run_suite
from mxcli.verification.cases import CASES, select
from mxcli.verification.compare import Tolerance, compare_tensors
from mxcli.verification.policy import compare_outputs
from mxcli.verification.report import CaseResult, junit_xml, render_table, to_json

PREFILL = PREFILL_SPEC.name


def test_exact_comparison_counts_differing_bits() -> None:
    a = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    b = torch.tensor([1, 2, 5, 4], dtype=torch.int32)
    rep = compare_tensors("idx", a, b, Tolerance("exact"))
    assert not rep.passed and rep.mismatches == 1 and not rep.bit_exact
    assert rep.max_abs == 2.0
    assert compare_tensors("idx", a, a.clone(), Tolerance("exact")).bit_exact
    # -0.0 and +0.0 are equal values but different bits
    z = compare_tensors("z", torch.tensor([0.0]), torch.tensor([-0.0]), Tolerance("exact"))
    assert not z.passed and z.max_abs == 0.0
    loose = compare_tensors("idx", a, b, Tolerance("exact", max_mismatch_frac=0.25))
    assert loose.passed and loose.mismatches == 1


def test_close_comparison_statistics() -> None:
    b = torch.tensor([1.0, 2.0, -4.0, 0.0])
    a = torch.tensor([1.01, 2.0, -4.0, 0.0])
    rep = compare_tensors("x", a, b, Tolerance("close", rtol=0.02))
    assert rep.passed and rep.mismatches == 0
    assert math.isclose(rep.max_abs, 0.01, rel_tol=1e-4)
    assert math.isclose(rep.max_rel, 0.01, rel_tol=1e-4)
    assert rep.cosine > 0.9999
    tight = compare_tensors("x", a, b, Tolerance("close", rtol=0.001))
    assert not tight.passed and tight.mismatches == 1 and "out of tolerance" in tight.message
    cos = compare_tensors("x", -b, b, Tolerance("close", atol_of_max=10.0, min_cosine=0.9))
    assert not cos.passed and "cosine" in cos.message
    shape = compare_tensors("x", a[:3], b, Tolerance("close"))
    assert not shape.passed and "shape" in shape.message


def test_nonfinite_values_must_match() -> None:
    b = torch.tensor([1.0, float("nan"), float("inf")])
    assert compare_tensors("x", b.clone(), b, Tolerance("close", rtol=0.1)).passed
    a = torch.tensor([1.0, 2.0, float("inf")])
    rep = compare_tensors("x", a, b, Tolerance("close", rtol=0.1))
    assert not rep.passed and "NaN/Inf" in rep.message


def test_masked_comparison() -> None:
    a = torch.tensor([[1, 2], [3, 4]])
    b = torch.tensor([[1, 2], [9, 9]])
    rep = compare_tensors("i", a, b, Tolerance("exact"), mask=torch.tensor([[True], [False]]))
    assert rep.passed and rep.numel == 2


def _prefill_case(**kw):
    made = make_prefill_inputs(**kw)
    kwargs = PREFILL_SPEC.resolve_kwargs(made.kwargs)
    return made, kwargs, run_kernel(PREFILL, made.tensors, kwargs).outputs


def test_prefill_exact_check_passes_and_catches_corruption() -> None:
    made, kwargs, out = _prefill_case(
        seq=64,
        hidden=1024,
        experts=16,
        top_k=2,
        router_act_fn="SOFTMAX",
        residual=True,
        emit_norm_bf16=True,
    )
    reports = check_prefill(made.tensors, kwargs, out)
    assert {r.name for r in reports} == {
        "norm_quant_packed.values",
        "norm_quant_packed.scales",
        "expert_index",
        "expert_affinities",
        "norm_bf16",
        "output_residual",
    }
    assert all(r.passed for r in reports), [(r.name, r.message) for r in reports]
    # one flipped code bit, one wrong scale byte, swapped experts: each caught
    bad = dict(out)
    packed = out["norm_quant_packed"].view(torch.uint8).clone()
    packed[3, 10] ^= 0x08
    bad["norm_quant_packed"] = packed.view(torch.float8_e4m3fn)
    failed = {r.name for r in check_prefill(made.tensors, kwargs, bad) if not r.passed}
    assert failed == {"norm_quant_packed.values"}
    bad = dict(out)
    packed = out["norm_quant_packed"].view(torch.uint8).clone()
    packed[:, 1024] += 1  # scale of group 0 of every token one binade up
    bad["norm_quant_packed"] = packed.view(torch.float8_e4m3fn)
    failed = {r.name for r in check_prefill(made.tensors, kwargs, bad) if not r.passed}
    assert "norm_quant_packed.scales" in failed and "norm_quant_packed.values" in failed
    bad = dict(out, expert_index=out["expert_index"].flip(1))
    failed = {r.name for r in check_prefill(made.tensors, kwargs, bad) if not r.passed}
    assert failed == {"expert_index"}


def test_noaux_exact_check() -> None:
    made, kwargs, out = _prefill_case(
        seq=64,
        hidden=512,
        experts=32,
        top_k=2,
        n_group=4,
        topk_group=2,
        router_act_fn="NOAUX_TC",
        routed_scaling_factor=2.5,
    )
    reports = check_prefill(made.tensors, kwargs, out)
    assert all(r.passed for r in reports)
    aff = out["expert_affinities"].clone()
    aff[:, :] = aff.roll(1, dims=1)  # affinities on the wrong experts
    bad = check_prefill(made.tensors, kwargs, dict(out, expert_affinities=aff))
    assert [r.name for r in bad if not r.passed] == ["expert_affinities"]


def test_bwd_exact_check_passes_and_catches_a_scale_error() -> None:
    made = make_bwd_inputs(
        tokens=128,
        hidden=256,
        intermediate=128,
        experts=2,
        top_k=2,
        block_size=128,
        bias=True,
        clamp=(-1.0, 1.0, None, 0.75),
        seed=9,
    )
    kwargs = BWD_SPEC.resolve_kwargs(made.kwargs)
    out = run_kernel("blockwise_mm_bwd_mxfp8", made.tensors, kwargs).outputs
    reports = check_bwd(made.tensors, kwargs, out, made.extras["weights"])
    assert len(reports) == 6 and all(r.passed for r in reports), [
        (r.name, r.message) for r in reports
    ]
    for name in out:
        bad = dict(out)
        bad[name] = (out[name].float() * 1.1).to(out[name].dtype)
        failed = [
            r.name
            for r in check_bwd(made.tensors, kwargs, bad, made.extras["weights"])
            if not r.passed
        ]
        assert failed == [name]


def test_golden_policy_decodes_packed_rows() -> None:
    made, kwargs, out = _prefill_case(
        seq=16, hidden=512, experts=8, top_k=2, router_act_fn="SOFTMAX", pack_affinities=True
    )
    same = compare_outputs(PREFILL, out, out, kwargs, hidden=512, num_experts=8)
    assert [r.name for r in same] == [
        "norm_quant_packed.codes",
        "norm_quant_packed.scales",
        "norm_quant_packed.values",
        "norm_quant_packed.affinities",
        "expert_index",
    ]
    assert all(r.passed and r.bit_exact for r in same)
    # holes of the scale region are not compared
    holes = out["norm_quant_packed"].view(torch.uint8).clone()
    holes[:, 512 + 16] = 0xAB
    alt = dict(out, norm_quant_packed=holes.view(torch.float8_e4m3fn))
    assert all(
        r.passed for r in compare_outputs(PREFILL, alt, out, kwargs, hidden=512, num_experts=8)
    )


def test_case_matrix() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    quick = select("quick")
    assert {c.kernel for c in quick} == {PREFILL, "blockwise_mm_bwd_mxfp8"}
    full = [c.name for c in select("full")]
    assert set(c.name for c in quick) < set(full)
    assert [c.name for c in select("quick", "noaux")] == [
        "prefill/noaux-e32-g4-tg2-k2",
        "prefill/noaux-e32-g4-tg2-k2-packaff",
    ]
    with pytest.raises(Exception, match="no quick case"):
        select("quick", "does-not-exist")


def test_suite_reports_backend_errors_as_failed_cases(corrupt_backend: str) -> None:
    cases = select("quick", "norm-only") + select("quick", "dense-e1")
    results = run_suite(cases, corrupt_backend)
    assert [r.passed for r in results] == [False, False]
    for r in results:
        bad = [x for x in r.reports if not x.passed]
        assert bad and all(x.check == "corrupt vs reference" for x in bad)
    broken = dataclasses.replace(cases[0], params={**cases[0].params, "hidden": 100})
    res = run_case(broken, "reference")
    assert res.error is not None and "hidden" in res.error and not res.passed


def test_reports_json_junit_table() -> None:
    from rich.console import Console

    ok = run_suite(select("quick", "norm-only"), "reference")
    failing = CaseResult(case="x", kernel=PREFILL, error="boom")
    data = to_json([*ok, failing], suite="quick")
    json.dumps(data)
    assert data["passed"] is False and data["summary"]["cases_failed"] == 1
    assert data["cases"][0]["tensors"][0]["name"] == "norm_quant_packed.values"
    root = ET.fromstring(junit_xml([*ok, failing]))
    suite = root.find("testsuite")
    assert suite is not None and suite.get("errors") == "1" and suite.get("failures") == "0"
    assert int(suite.get("tests")) == len(ok[0].reports) + 1
    con = Console(record=True, width=200)
    render_table([*ok, failing], con)
    text = con.export_text()
    assert "norm_quant_packed.values" in text and "ERROR" in text and "FAILED" in text


def test_junit_written_atomically(tmp_path: Path) -> None:
    from mxcli.verification.report import write_junit

    p = tmp_path / "r.xml"
    write_junit([CaseResult(case="a", kernel=PREFILL)], p)
    write_junit([CaseResult(case="b", kernel=PREFILL, error="e")], p)  # replaces
    assert "mxcli.verify.b" in p.read_text() and "mxcli.verify.a" not in p.read_text()
    assert ET.parse(p).getroot().tag == "testsuites"
    assert [q.name for q in tmp_path.iterdir()] == ["r.xml"]


@pytest.mark.parametrize(
    "act,extra",
    [("SOFTMAX", {}), ("NOAUX_TC", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5})],
)
def test_verify_inputs_checks_exact_tie_tokens(act: str, extra: dict, tmp_path: Path, cli) -> None:
    """Padding tokens (all zero) tie every logit exactly: verify --inputs compares them (the
    hardware order: experts 0, 1 at 1/2 each, api spec §8.14) instead of skipping them as
    near-ties, so a duplicated index there (the old first-occurrence reference) fails."""
    from mxcli.inputs import write_inputs
    from mxcli.io.files import write_file
    from mxcli.kernels.spec import read_kernel_file

    made = make_prefill_inputs(seq=16, hidden=512, experts=16, top_k=2, router_act_fn=act, **extra)
    made.tensors["hidden_states"][:, 8:] = 0.0  # eight padding tokens
    if "router_bias" in made.tensors:
        made.tensors["router_bias"].zero_()  # NOAUX_TC: every padding score 0.5, groups tie
    inp, out, bad = tmp_path / "in.safetensors", tmp_path / "out.safetensors", tmp_path / "bad.st"
    write_inputs(made, inp)
    for backend in ("reference", "sim"):
        r = cli("run-prefill", inp, "-o", out, "--backend", backend, "--force")
        assert r.exit_code == 0, r.output
        r = cli("verify", out, "--inputs", inp, "--json")
        assert r.exit_code == 0, r.output
        reps = {t["name"]: t for t in json.loads(r.stdout)["cases"][0]["tensors"]}
        aff = next(v for k, v in reps.items() if "affinities" in k)
        assert "skipped" not in json.dumps(aff)  # no padding token skipped (the others: random)
    o = read_kernel_file(out)
    expect = torch.zeros(8, 16)
    expect[:, :2] = 0.5 if act == "SOFTMAX" else 1.25  # softmax 1/2; 2.5 * 0.5 / (0.5 + 0.5)
    tensors = dict(o.tensors)
    aff_name = "expert_affinities"
    assert torch.equal(tensors[aff_name][8:].float(), expect)
    dup = tensors[aff_name].clone()
    dup[8:] = 0
    dup[8:, 0] = 1.0 if act == "SOFTMAX" else 2.5  # what a duplicated index 0 gave
    tensors[aff_name] = dup
    if act == "SOFTMAX":
        assert tensors["expert_index"][8:].tolist() == [[0, 1]] * 8
        tensors["expert_index"] = tensors["expert_index"].clone()
        tensors["expert_index"][8:] = 0
    write_file(bad, tensors, o.metadata)
    r = cli("verify", bad, "--inputs", inp)
    assert r.exit_code == 1
    failed = {"expert_affinities"} | ({"expert_index"} if act == "SOFTMAX" else set())
    assert all(n in r.output for n in failed), r.output
