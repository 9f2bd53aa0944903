"""Cost model and schedule (mxcli.nkisim.cost / schedule / trace) on hand-computable kernels.

Each expected time is worked out by hand from the documented figures (`FIGURES`, trn3): PE
2.4 GHz; Vector/Scalar 1.2 GHz, 100-cycle overhead, widths 512 (tensor_copy / tensor_scalar on
2-byte SBUF data) / 256 (every other op) and 256 (tensor_copy / tensor_scalar, 2-byte) / 128
elements per cycle over 128 lanes; DMA 33 B/ns per engine, 8 partitions per engine, a
descriptor overhead worth OV B per contiguous run (the fitted figure, read from `FIGURES`), 1300 ns
trigger-to-start latency.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from mxcli import nkisim
from mxcli.nkisim import cost, schedule, trace
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from tests.nkisim.conftest import DUMMY

OV = cost.hardware("trn3")["dma_descriptor_overhead_bytes"]  # fitted (issue 29 item 3)


def _profile(fn: Any, *args: Any) -> schedule.Profile:
    with trace.recording() as recs:
        nkisim.simulate(fn, lnc=1, check_only=True, uninit="ignore")(*args)
    return schedule.build_profile(recs, "trn3", cost.hardware("trn3"), 1)


def _events(p: schedule.Profile) -> list[schedule.Event]:
    return p.programs[0].events


def test_one_matmul_costs_max_of_moving_and_stationary_cycles() -> None:
    def k(_):
        s = nl.ndarray((128, 128), nl.bfloat16)
        m = nl.ndarray((128, 512), nl.bfloat16)
        d = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=s, moving=m)

    p = _profile(k, DUMMY)
    (e,) = _events(p)
    # max(min(64, 128), 512) = 512 PE cycles at 2.4 GHz
    assert e.track == "tensor" and e.op == "nc_matmul"
    assert e.end - e.start == pytest.approx(512 / 2.4)
    assert e.cost.flops_bf16 == 2 * 128 * 128 * 512
    # 16.8 MFLOP in 213.3 ns = 78.6 TFLOPS: the documented 79 TFLOPS BF16 peak (utilization 1)
    assert p.pe_utilization()["bf16"] == pytest.approx(2 * 128 * 128 * 512 * 2.4 / 512 / 79e3)
    assert e.source.endswith("test_cost.py:" + str(k.__code__.co_firstlineno + 4))


def test_mx_matmul_has_four_times_the_flops_in_the_same_cycles() -> None:
    def k(_):
        s = nl.ndarray((128, 128), nl.float8_e4m3fn_x4)
        m = nl.ndarray((128, 512), nl.float8_e4m3fn_x4)
        ss = nl.ndarray((128, 128), nl.uint8)
        ms = nl.ndarray((128, 512), nl.uint8)
        d = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=d, stationary=s, moving=m, stationary_scale=ss, moving_scale=ms)

    p = _profile(k, DUMMY)
    (e,) = _events(p)
    assert e.end - e.start == pytest.approx(512 / 2.4)
    assert e.cost.flops_mx == 2 * 512 * 128 * 512
    # 2*512*128*512 FLOP / (512 cycles / 2.4 GHz) = 314.6 TFLOPS of the documented 315
    assert p.pe_utilization()["mx"] == pytest.approx(2 * 512 * 128 * 2.4 / 315e3)


def test_one_elementwise_pass_costs_overhead_plus_elements_over_width() -> None:
    def k(_):
        x = nl.ndarray((128, 2048), nl.bfloat16)
        y = nl.ndarray((128, 2048), nl.bfloat16)
        nisa.tensor_scalar(dst=y, data=x, op0=nl.multiply, operand0=2.0)
        a = nl.ndarray((128, 1024), nl.float32)
        b = nl.ndarray((128, 1024), nl.float32)
        c = nl.ndarray((128, 1024), nl.float32)
        nisa.tensor_tensor(dst=c, data1=a, data2=b, op=nl.add)

    ts, tt = _events(_profile(k, DUMMY))
    # bf16 in SBUF: 512 elements/cycle = 4 per lane: 100 + 2048 / 4 = 612 cycles at 1.2 GHz
    assert ts.track == "vector" and ts.end - ts.start == pytest.approx(612 / 1.2)
    # fp32, two input tiles: 100 + 2 * 1024 / 2 = 1124 cycles
    assert tt.end - tt.start == pytest.approx(1124 / 1.2)


def test_one_dma_costs_bytes_plus_runs_over_the_engines_it_uses() -> None:
    def k(x):
        t = nl.ndarray((128, 1024), nl.bfloat16)
        nisa.dma_copy(dst=t, src=x)

    x = np.zeros((128, 1024), dtype=np.float32).astype(nl.bfloat16.np_dtype)
    (e,) = _events(_profile(k, x))
    # 256 KiB over 16 engines (8 partitions each): 16 KiB + 8 runs x OV B per engine at 33 B/ns,
    # after the 1300 ns trigger-to-start latency
    assert e.track == "dma.static"
    assert e.cost.descriptors == 128 and e.cost.dma_bytes == 128 * 1024 * 2
    assert e.start == pytest.approx(1300.0)
    assert e.end - e.start == pytest.approx((16384 + 8 * OV) / 33)


def test_scalar_offset_dma_costs_its_data_not_the_offset_tensor() -> None:
    """A weight-gradient tile addressed through ``scalar_offset`` (the expert id in a 1x1 SBUF
    tensor) moves its 128 x 512 bf16 rows; the offset tensor moves no data (it once made the
    transfer cost 2 bytes on one engine)."""

    def k(x, e):
        idx = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=e)
        t = nl.ndarray((128, 512), nl.bfloat16)
        src = x.ap([[512, 128], [1, 512]], offset=0, scalar_offset=idx, indirect_dim=0)
        nisa.dma_copy(dst=t, src=src)

    x = np.zeros((2, 128, 512), dtype=np.float32).astype(nl.bfloat16.np_dtype)
    e = np.ones((1, 1), dtype=np.int32)
    _, e2 = _events(_profile(k, x, e))
    assert e2.cost.dma_bytes == 128 * 512 * 2 and e2.cost.descriptors == 128
    # 16 engines x 8 rows: 8 x (1024 B + OV B run overhead) at 33 B/ns each
    assert max(e2.cost.dma_ns.values()) == pytest.approx(8 * (1024 + OV) / 33)
    assert len(e2.cost.dma_ns) == 16


def test_two_byte_strided_dma_pays_a_descriptor_per_element() -> None:
    def k(x):
        t = nl.ndarray((128, 256, 4), nl.bfloat16)
        nisa.dma_copy(dst=t[:, :, 0], src=x)

    x = np.zeros((128, 256), dtype=np.float32).astype(nl.bfloat16.np_dtype)
    (e,) = _events(_profile(k, x))
    assert e.cost.descriptors == 128 * 256 and e.cost.run_bytes == 2
    # per engine 8 x 512 B of data and 8 x 256 runs x OV B of overhead
    assert e.end - e.start == pytest.approx((8 * 512 + 8 * 256 * OV) / 33)


def test_independent_instructions_overlap_and_dependent_ones_wait() -> None:
    def k(_):
        a = nl.ndarray((128, 1024), nl.bfloat16)
        b = nl.ndarray((128, 1024), nl.bfloat16)
        c = nl.ndarray((128, 1024), nl.bfloat16)
        d = nl.ndarray((128, 1024), nl.bfloat16)
        nisa.tensor_scalar(dst=b, data=a, op0=nl.multiply, operand0=2.0)  # Vector
        nisa.activation(dst=d, op=nl.exp, data=c)  # Scalar, independent
        nisa.activation(dst=c, op=nl.exp, data=b)  # Scalar: reads b (RAW), writes c (WAR)

    p = _profile(k, DUMMY)
    v, s1, s2 = _events(p)
    assert (v.track, s1.track, s2.track) == ("vector", "scalar", "scalar")
    assert v.start == 0.0 and s1.start == 0.0  # two engines at once
    # activation has no performance mode: ScalarE 128 elements/cycle, 1 per lane
    assert s1.end - s1.start == pytest.approx((100 + 1024) / 1.2)
    assert s2.start == pytest.approx(max(v.end, s1.end))
    assert p.makespan_ns == pytest.approx(s2.end)
    busy = p.busy_ns()
    assert busy["vector"] == pytest.approx(v.end) and busy["scalar"] == pytest.approx(2 * s1.end)
    assert p.lower_bound_ns == pytest.approx(busy["scalar"]) and p.bottleneck == "scalar"


def test_chrome_trace_is_valid_json_with_one_track_per_engine_and_queue(tmp_path) -> None:
    def k(x):
        t = nl.ndarray((128, 512), nl.bfloat16)
        nisa.dma_copy(dst=t, src=x)
        u = nl.ndarray((128, 512), nl.bfloat16)
        nisa.tensor_copy(dst=u, src=t)
        ps = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=u[:, 0:128])
        out = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=u, dge_mode=nisa.dge_mode.hwdge)
        return out

    x = np.zeros((128, 512), dtype=np.float32).astype(nl.bfloat16.np_dtype)
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_profile(k, x).chrome_trace()))
    doc = json.loads(f.read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["dma.static", "dma.sync", "tensor", "vector"]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [names[e["tid"]] for e in xs] == ["dma.static", "vector", "tensor", "dma.sync"]
    assert [e["name"] for e in xs] == ["dma_copy", "tensor_copy", "nc_transpose", "dma_copy"]
    assert all("test_cost.py:" in e["args"]["source"] for e in xs)
    # in-order and dependent: each event starts when its producer has finished
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-9 for a, b in zip(xs, xs[1:], strict=False))


def test_figures_table_cites_a_source_for_every_figure() -> None:
    for f in cost.FIGURES:
        assert f.source and (".rst" in f.source or ".py" in f.source or "ASSUMED" in f.source)
    hw = cost.hardware("trn3")
    assert hw.hbm_bytes_per_ns == pytest.approx(4900 / 8)
    with pytest.raises(ValueError, match="trn2 or trn3"):
        cost.hardware("trn1")


def test_a_documented_figure_assumes_nothing_and_a_free_one_says_why() -> None:
    """Issue 29 item 3: each figure is documented (cited), fitted or assumed. A trn3 value taken
    over from trn2's docs is an assumption, so no documented figure may call itself assumed."""
    for f in cost.FIGURES:
        if f.kind == "documented":
            assert "assum" not in f.source.lower(), f.key
            assert f.low is None and f.high is None, f.key
        else:
            assert f.low is not None and f.high is not None and f.low <= f.trn3 <= f.high, f.key
            word = "FITTED" if f.kind == "fitted" else "ASSUMED"
            assert word in f.source, f.key
    kinds = {f.key: f.kind for f in cost.FIGURES}
    # trn2-only documentation: trn3's DMA transposes and hardware-DGE issue time are assumed
    for key in ("dma_transpose_eff_hbm", "dma_transpose_eff_sbuf", "hwdge_issue_ns"):
        assert kinds[key] == "assumed"


def test_pe_start_is_when_the_tensor_engine_first_runs() -> None:
    """The PE waits for its operand's DMA: it starts when the load has arrived (AWS reports
    this wait for its backward, `measured.BWD_SOURCE`)."""

    def k(x):
        s = nl.ndarray((128, 128), nl.bfloat16)
        nisa.dma_copy(dst=s, src=x)
        d = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=s, moving=s)

    x = np.zeros((128, 128), dtype=np.float32).astype(nl.bfloat16.np_dtype)
    p = _profile(k, x)
    dma, mm = _events(p)
    assert dma.cost.kind == "dma" and mm.track == "tensor"
    # 128 rows of 256 B over 16 engines (8 rows each): 8 * (256 + OV) / 33 ns, after 1300 ns
    load = 1300 + 8 * (256 + OV) / 33
    assert mm.start == pytest.approx(load)
    assert p.pe_start() == {"us": pytest.approx(load / 1e3),
                            "share": pytest.approx(load / p.makespan_ns)}  # fmt: skip
    assert p.summary()["pe_start"] == p.pe_start()

    def no_pe(_):
        a = nl.ndarray((128, 64), nl.bfloat16)
        nisa.memset(dst=a, value=0.0)

    assert _profile(no_pe, DUMMY).pe_start() is None
