"""``mxcli profile --calibrate`` and ``--calibration`` (issue 29 item 7) and the estimate ranges
``profile`` prints (item 5). Bad input runs as a fresh process: one line naming the file and
key, exit 2, nothing written. The happy path runs in-process, with a figure table in which the
test marks a figure ``fitted`` (the table's own fitted figures are the model's to choose)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mxcli.kernels import calibrating as kc
from mxcli.kernels import profiling as prof
from mxcli.kernels.rmsnorm_mx_prefill import profile as prefill_profile
from mxcli.nkisim import cost

SMALL = ["--tokens", "32", "--hidden", "512", "--experts", "16", "--top-k", "2",
         "--router-act", "softmax", "--n-group", "4", "--topk-group", "2", "--lnc", "1"]  # fmt: skip
SHAPE = {"tokens": 32, "hidden": 512, "experts": 16, "top_k": 2, "router_act": "softmax",
         "n_group": 4, "topk_group": 2, "pack_affinities": False}  # fmt: skip


def _mxcli(*args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    return subprocess.run([sys.executable, "-m", "mxcli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def _entry(**kw: Any) -> dict[str, Any]:
    return {"kernel": "prefill", "shape": dict(SHAPE), "lnc": 1, "us": 10.0, **kw}


def _bad_cases() -> list[tuple[list[Any], str]]:
    no_us = _entry()
    del no_us["us"]
    no_experts = _entry()
    del no_experts["shape"]["experts"]
    return [
        ([no_us], "measurement 0: missing key 'us'"),
        ([_entry(), _entry(kernel="gemm")], "measurement 1: kernel: unknown kernel 'gemm'"),
        ([_entry(us=0)], "measurement 0: us: expected a positive latency"),
        ([_entry(us=-3.5)], "measurement 0: us: expected a positive latency"),
        ([_entry(us="12")], "measurement 0: us: expected a positive latency"),
        ([_entry(lnc=4)], "measurement 0: lnc: expected 1 or 2"),
        ([no_experts], "measurement 0: shape: missing key 'experts'"),
        ([_entry(config={})], "measurement 0: unknown key 'config'"),
        ([], "expected a non-empty list of measurements"),
        ([_entry(kwargs={"nope": 1})], "measurement 0: nope: not a kwarg of rmsnorm_mx_prefill"),
    ]


def test_bad_measurements_are_one_line_and_nothing_written(tmp_path: Path) -> None:
    """Fresh processes: a missing key, an unknown kernel, a non-positive latency."""
    meas = tmp_path / "m.json"
    out = tmp_path / "cal.json"
    for doc, msg in _bad_cases()[:3]:
        meas.write_text(json.dumps(doc))
        line = _one_line(_mxcli("profile", "--calibrate", meas, "-o", out))
        assert msg in line and str(meas) in line, (msg, line)
        assert not out.exists()


def test_every_bad_measurement_is_one_line(cli: Any, tmp_path: Path) -> None:
    """In-process, the whole list (the fresh-process test covers the reporting path)."""
    meas = tmp_path / "m.json"
    out = tmp_path / "cal.json"
    for doc, msg in _bad_cases():
        meas.write_text(json.dumps(doc))
        r = cli("profile", "--calibrate", meas, "-o", out)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1, (msg, r.stderr)
        assert msg in lines[0] and str(meas) in lines[0], (msg, lines)
        assert not out.exists()
    meas.write_text("{not json")
    r = cli("profile", "--calibrate", meas, "-o", out)
    assert r.exit_code == 2 and "not JSON" in r.stderr
    r = cli("profile", "--calibrate", meas, "-o", meas, "--force")
    assert r.exit_code == 2 and str(meas) in r.stderr and meas.read_text() == "{not json"


def test_output_kept_without_force_and_foreign_file_kept_with_it(tmp_path: Path) -> None:
    meas = tmp_path / "m.json"
    meas.write_text(json.dumps([_entry()]))
    out = tmp_path / "cal.json"
    out.write_text('{"mine": true}')
    line = _one_line(_mxcli("profile", "--calibrate", meas, "-o", out))
    assert "output exists" in line and str(out) in line
    line = _one_line(_mxcli("profile", "--calibrate", meas, "-o", out, "--force"))
    assert "not a calibration file mxcli wrote" in line
    assert out.read_text() == '{"mine": true}'


def test_bad_calibration_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"format": kc.FORMAT, "version": 1, "figures": {"nope": 1.0}}))
    line = _one_line(_mxcli("profile", "prefill", *SMALL, "--calibration", bad))
    assert str(bad) in line and "unknown figure key 'nope'" in line


def test_missing_calibration_file_is_one_line(cli: Any, tmp_path: Path) -> None:
    missing = tmp_path / "none.json"
    r = cli("profile", "bwd", "--tokens", "128", "--hidden", "256", "--intermediate", "128",
            "--experts", "2", "--calibration", missing)  # fmt: skip
    assert r.exit_code == 2 and str(missing) in r.stderr and "no such file" in r.stderr


def test_profile_prints_ranges(cli: Any) -> None:
    r = cli("profile", "prefill", *SMALL)
    assert r.exit_code == 0, r.stderr
    assert "range over the assumed/fitted figures: list schedule" in r.stdout
    r = cli("profile", "prefill", *SMALL, "--json")
    s = json.loads(r.stdout)
    rg = s["range"]["schedule_us"]
    assert s["schedule_us"] == pytest.approx(rg["nominal"], rel=1e-12)
    assert rg["low"] < rg["nominal"] < rg["high"]
    r = cli("profile", "prefill", *SMALL, "--kernel", "mxcli", "--kernel", "mxcli", "--json")
    cmp = json.loads(r.stdout)["comparison"]["kernels"][1]
    assert cmp["range"]["schedule_ratio"] == {"nominal": 1.0, "low": 1.0, "high": 1.0}
    assert cmp["verdict"] == "not distinguishable under the model's uncertainty"


@pytest.fixture
def fitted_table(monkeypatch: pytest.MonkeyPatch) -> tuple[cost.Figure, ...]:
    table = tuple(  # one fitted figure, every other one fixed
        dataclasses.replace(f, kind="fitted", low=128, high=4096)
        if f.key == "dma_descriptor_overhead_bytes"
        else dataclasses.replace(f, kind="documented", low=None, high=None)
        for f in cost.FIGURES
    )
    monkeypatch.setattr(cost, "FIGURES", table)
    return table


def test_calibrate_then_profile_with_the_calibration(cli: Any, tmp_path: Path,
                                                    fitted_table: Any) -> None:  # fmt: skip
    """Latencies the model produced with the descriptor overhead at 800 B (3 tiny shapes) ->
    `profile --calibrate` writes 800; `profile --calibration` then estimates those latencies."""
    entries = []
    for T, H, E in ((32, 512, 16), (64, 512, 16), (32, 1024, 32)):
        shape = {**SHAPE, "tokens": T, "hidden": H, "experts": E}
        kp = prof.profile_kernel(
            "prefill", *prefill_profile.prefill_inputs(prefill_profile.PrefillShape(**shape)), lnc=1
        )
        us = kc._Evaluator(kp, kc.Calibration(), None).schedule_us(
            {"dma_descriptor_overhead_bytes": 800.0}
        )
        entries.append({"kernel": "prefill", "shape": shape, "lnc": 1, "us": us})
    meas = tmp_path / "measured.json"
    meas.write_text(json.dumps({"measurements": entries}))
    out = tmp_path / "cal.json"
    r = cli("profile", "--calibrate", meas, "-o", out, "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["format"] == kc.FORMAT and doc["mxcli"] and doc["target"] == "trn3"
    assert doc["figures"]["dma_descriptor_overhead_bytes"] == pytest.approx(800.0, rel=1e-6)
    start = next(f.trn3 for f in fitted_table if f.key == "dma_descriptor_overhead_bytes")
    assert doc["start"] == {"dma_descriptor_overhead_bytes": start}
    assert [m["us"] for m in doc["measurements"]] == [e["us"] for e in entries]
    assert all(abs(m["log_residual"]) < 1e-9 for m in doc["measurements"])
    assert json.loads(r.stdout)["figures"] == doc["figures"]
    r = cli("profile", "prefill", *SMALL, "--calibration", out, "--json")
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["schedule_us"] == pytest.approx(entries[0]["us"], rel=1e-6)
    lo, hi = doc["ranges"]["dma_descriptor_overhead_bytes"]
    assert s["range"]["figures"]["dma_descriptor_overhead_bytes"] == [lo, hi]
    assert s["range"]["calibration"] == str(out)
    r = cli("profile", "--calibrate", meas, "-o", out, "--force")  # replaces its own file
    assert r.exit_code == 0, r.stderr
    assert "dma_descriptor_overhead_bytes = 800" in r.stdout


def test_calibrate_flag_misuse_is_one_line_and_nothing_written(tmp_path: Path) -> None:
    """`profile --calibrate` is a flag of the group (the issue's spelling): fresh processes
    that give it a kernel too, no -o, -o or --force without it, or nothing at all."""
    meas = tmp_path / "m.json"
    meas.write_text(json.dumps([_entry()]))
    out = tmp_path / "cal.json"
    cases = [
        (["--calibrate", meas, "-o", out, "prefill", *SMALL], "give no kernel with it"),
        (["--calibrate", meas], "-o CAL.json is required with --calibrate"),
        (["-o", out, "prefill", *SMALL], "--output: only with --calibrate"),
        (["--force", "prefill", *SMALL], "--force: before a kernel's name only with --calibrate"),
        (["--json"], "Missing command (a kernel, or --calibrate MEASURED.json)"),
    ]
    for args, msg in cases:
        r = _mxcli("profile", *args)
        assert msg in _one_line(r), (args, r.stderr)
        assert not out.exists()
    r = _mxcli("profile", "--json")  # strict JSON on stdout for a usage error too
    assert json.loads(r.stdout)["exit_code"] == 2
    r = _mxcli("profile", "calibrate", meas, "-o", out)  # the unreleased subcommand is gone
    assert "No such command 'calibrate'" in _one_line(r) and not out.exists()


def test_calibrate_recovers_the_tables_fitted_figures_fresh_process(tmp_path: Path) -> None:
    """Issue 29 item 7 through the CLI as a fresh process, on the shipped figure table: the
    latencies the model itself gives with each fitted figure at 3/4 of its range (3 tiny
    prefill shapes) -> `mxcli profile --calibrate` writes those values back (exact model:
    residual 0). A fitted figure these launches do not use keeps its table value."""
    fitted = [f for f in cost.FIGURES if f.kind == "fitted"]
    if not fitted:
        pytest.skip("the figure table has no fitted figure")
    truth = {f.key: f.low + 0.75 * (f.high - f.low) for f in fitted}
    entries, moved = [], set()
    for T, H, E in ((32, 512, 16), (64, 512, 16), (32, 1024, 32)):
        shape = {**SHAPE, "tokens": T, "hidden": H, "experts": E}
        kp = prof.profile_kernel(
            "prefill", *prefill_profile.prefill_inputs(prefill_profile.PrefillShape(**shape)), lnc=1
        )
        ev = kc._Evaluator(kp, kc.Calibration(), None)
        moved |= {f.key for f in fitted if ev.schedule_us({f.key: f.low}) != ev.schedule_us({})}
        entries.append({"kernel": "prefill", "shape": shape, "lnc": 1,
                        "us": ev.schedule_us(truth)})  # fmt: skip
    assert moved, "no fitted figure moves these launches' estimate: the test proves nothing"
    meas = tmp_path / "measured.json"
    meas.write_text(json.dumps(entries))
    out = tmp_path / "cal.json"
    r = _mxcli("profile", "--calibrate", meas, "-o", out, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert json.loads(r.stdout) == {**doc, "output": str(out)}
    for f in fitted:
        want = truth[f.key] if f.key in moved else f.trn3
        assert doc["figures"][f.key] == pytest.approx(want, rel=1e-6), (f.key, doc["figures"])
    assert all(abs(m["log_residual"]) < 1e-9 for m in doc["measurements"])
