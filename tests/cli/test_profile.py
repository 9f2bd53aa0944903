"""``mxcli profile prefill|bwd``: report, JSON, Perfetto trace, and one-line errors."""

from __future__ import annotations

import json
import re

SMALL_PREFILL = ["--tokens", "32", "--hidden", "512", "--experts", "16", "--top-k", "2",
                 "--n-group", "4", "--topk-group", "2", "--lnc", "1"]  # fmt: skip


def test_profile_prefill_from_shape_flags_json_and_trace(cli, tmp_path) -> None:
    out = tmp_path / "trace.json"
    r = cli("profile", "prefill", *SMALL_PREFILL, "--json", "--trace", out)
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["kernel"] == "rmsnorm_mx_prefill" and s["target"] == "trn3" and s["lnc"] == 1
    busy = s["busy_us"]
    assert set(busy) == {"tensor", "vector", "scalar", "gpsimd", "dma", "hbm"}
    assert s["bottleneck"] == max(busy, key=lambda k: busy[k])
    assert s["lower_bound_us"] == max(busy.values())
    assert s["schedule_us"] >= s["lower_bound_us"] > 0
    assert 0 < s["pe_utilization"]["total"] <= s["pe_utilization_at_lower_bound"]["total"] <= 1
    assert s["top_lines"][0]["source"].startswith("mxcli/kernels/rmsnorm_mx_prefill/nki_kernel.py:")
    doc = json.loads(out.read_text())
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"tensor", "vector", "scalar", "gpsimd"} <= tracks
    assert any(t.startswith("dma.") for t in tracks)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sum(s["instructions"].values()) >= len(xs) > 0
    assert all("nki_kernel.py:" in e["args"]["source"] for e in xs)


def test_profile_bwd_from_file_reports_plan_padding(cli, files) -> None:
    r = cli("profile", "bwd", files["bwd"], "--lnc", "1")
    assert r.exit_code == 0, r.stderr
    assert "bottleneck:" in r.stdout and "plan padding:" in r.stdout
    # the kernel is a package: its folder, or blockwise_moe/ with nki_kernel/ on each row
    assert re.search(r"in mxcli/kernels/blockwise_moe/(nki_kernel/)?:", r.stdout), r.stdout
    assert re.search(
        r"  (nki_kernel/)?(kernel|phase\w*|quant|weights|indices|alloc)\.py:", r.stdout
    )


def test_profile_bad_input_is_one_line_exit_2(cli, files, tmp_path) -> None:
    cases = [
        (["prefill", "--tokens", "32", "--hidden", "512"], "experts: --experts is required"),
        (["prefill", files["noaux"], "--tokens", "8"], "input: give a file or shape flags"),
        (["prefill", *SMALL_PREFILL, "--target", "trn2"], "target: both kernels use MX"),
        (["prefill", *SMALL_PREFILL, "--router-act", "relu"], "router_act: expected one of"),
        (["bwd", files["prefill"]], "is for rmsnorm_mx_prefill, not blockwise_mm_bwd_mxfp8"),
        (["bwd", "--tokens", "0", "--hidden", "256", "--intermediate", "128", "--experts", "2"],
         "tokens: expected a positive integer"),
    ]  # fmt: skip
    for args, msg in cases:
        r = cli("profile", *args)
        assert r.exit_code == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], (args, r.stderr)
    existing = tmp_path / "t.json"
    existing.write_text("{}")
    r = cli("profile", "prefill", *SMALL_PREFILL, "--trace", existing)
    assert r.exit_code == 2 and "output exists" in r.stderr
    assert existing.read_text() == "{}"
