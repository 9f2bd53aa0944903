"""Capacity, check-only mode, counters, targets, removed APIs, module activation."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

import mxcli.nkisim as nkisim
from mxcli.nkisim import NkiCapacityError, NkiValidationError
from mxcli.nkisim.kernel import jit
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from tests.nkisim.conftest import DUMMY, run, run_report


def test_sbuf_capacity_live_bytes_per_partition() -> None:
    def k(_, n):
        tiles = []
        for i in range(n):
            tiles.append(nl.ndarray((128, 16384), nl.float32, name=f"t{i}"))  # 64 KiB each
        for t in tiles:
            nisa.memset(t, 0.0)
        for t in tiles:  # all live together
            nisa.tensor_copy(dst=t, src=t)

    _, rep = run_report(k, DUMMY, 3)
    assert rep.counters.peak_sbuf_bytes == 3 * 65536
    with pytest.raises(
        NkiCapacityError, match=r"SBUF bytes per partition exceed the trn3 budget \(got 262144"
    ):
        run(k, DUMMY, 4)
    run(k, DUMMY, 4, check_capacity=False)

    def sequential(_):  # dead tiles do not count: liveness ends at the last use
        for _i in range(10):
            t = nl.ndarray((128, 16384), nl.float32)
            nisa.memset(t, 0.0)

    _, rep = run_report(sequential, DUMMY)
    assert rep.counters.peak_sbuf_bytes == 65536


def test_tiles_declared_together_but_used_in_turn_fit() -> None:
    """A tile is live from its first write to its last use, not from the line declaring it
    (nki.compiler.Allocation: an address "at its first write", released "after its last read"):
    four 64 KiB tiles declared at the top of a phase and used one after another need 64 KiB, as
    AWS's backward declares its phase buffers up front. The old sweep charged them from their
    declaration: 262144 > 245752, rejected."""

    def k(_):
        tiles = []
        for i in range(4):
            tiles.append(nl.ndarray((128, 16384), nl.float32, name=f"t{i}"))
        for t in tiles:
            nisa.memset(t, 0.0)
            nisa.tensor_copy(dst=t, src=t)

    _, rep = run_report(k, DUMMY)
    assert rep.counters.peak_sbuf_bytes == 65536


def test_loop_scoped_tile_reused_across_iterations_fits() -> None:
    """One tile declared in a loop body and written then read in each iteration: one tile's
    bytes at any time, however many iterations (180 KiB x 8 would be 1.4 MiB)."""

    def k(_):
        for _i in range(8):
            t = nl.ndarray((128, 46080), nl.float32, name="body")  # 180 KiB
            nisa.memset(t, 0.0)
            nisa.tensor_copy(dst=t, src=t)

    _, rep = run_report(k, DUMMY)
    assert rep.counters.peak_sbuf_bytes == 184320


def test_two_live_tiles_over_the_budget_are_rejected_naming_peak_and_budget() -> None:
    """Two 120 KiB tiles read by one instruction are live together: 245760 > 245752 (Trn3),
    rejected; the message gives the peak, the budget and both tiles."""

    def k(_):
        a = nl.ndarray((128, 30720), nl.float32, name="a")
        b = nl.ndarray((128, 30720), nl.float32, name="b")
        nisa.memset(a, 0.0)
        nisa.memset(b, 0.0)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)

    with pytest.raises(NkiCapacityError) as err:
        run(k, DUMMY)
    msg = str(err.value)
    assert "(got 245760, expected <= 245752)" in msg
    assert "a=122880B" in msg and "b=122880B" in msg


def test_untouched_tile_takes_no_room_and_filled_tile_is_live_from_its_fill() -> None:
    """A tile no instruction touches gets no address; ``nl.zeros`` writes its tile where it is
    declared, so that tile is live from there."""

    def unused(_):
        nl.ndarray((128, 51200), nl.float32, name="never")  # 200 KiB, never touched
        t = nl.ndarray((128, 16384), nl.float32, name="used")
        nisa.memset(t, 0.0)

    _, rep = run_report(unused, DUMMY)
    assert rep.counters.peak_sbuf_bytes == 65536

    def zeros(_):
        z = nl.zeros((128, 16384), nl.float32, name="z")  # written here
        t = nl.ndarray((128, 8192), nl.float32, name="t")
        nisa.memset(t, 0.0)
        nisa.tensor_copy(dst=t, src=z[:, :8192])

    _, rep = run_report(zeros, DUMMY)
    assert rep.counters.peak_sbuf_bytes == 65536 + 32768


def _gather_kernel(x, idx, big_bytes, indirect):
    P, F = x.shape
    big = nl.ndarray((P, big_bytes), nl.uint8, name="big")
    nisa.memset(big, 0)
    it = nl.ndarray((P, 1), nl.int32, name="idx")
    nisa.dma_copy(dst=it, src=idx)
    rows = nl.ndarray((P, F), nl.float32, name="rows")
    src = x
    if indirect:
        src = x.ap([[F, P], [1, F]], offset=0, vector_offset=it, indirect_dim=0)
    nisa.dma_copy(dst=rows, src=src)
    nisa.tensor_copy(dst=big[:, :4], src=big[:, :4])  # big stays live past the gather
    out = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    return out


def test_software_dge_descriptors_count_against_sbuf() -> None:
    """A vector_offset gather is software DGE (nki-dge.rst): its descriptor storage is charged
    (`SWDGE_DESCRIPTOR_BYTES`, an assumed 256 B) from the first such DMA to the last. The same
    kernel with a static load charges none; 4 B short of the budget without the descriptors is
    over it with them."""
    from mxcli.nkisim.machine import SWDGE_DESCRIPTOR_BYTES

    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    idx = np.arange(128, dtype=np.int32).reshape(128, 1)[::-1].copy()
    tiles = 4 + 256  # idx (int32, read by the gather) + rows (64 fp32)
    _, rep = run_report(_gather_kernel, x, idx, 1024, False)
    assert rep.counters.peak_sbuf_bytes == 1024 + 256  # idx is dead once written here
    out, rep = run_report(_gather_kernel, x, idx, 1024, True)
    np.testing.assert_array_equal(out, x[::-1])
    assert SWDGE_DESCRIPTOR_BYTES == 256
    assert rep.counters.peak_sbuf_bytes == 1024 + tiles + 256
    big = 245752 - tiles - 256 + 4  # fits without the descriptors, 4 B over with them
    _, rep = run_report(_gather_kernel, x, idx, big, False)
    assert rep.counters.peak_sbuf_bytes == big + 256
    with pytest.raises(NkiCapacityError) as err:
        run(_gather_kernel, x, idx, big, True)
    assert "(got 245756, expected <= 245752)" in str(err.value)
    assert "<swdge descriptors>=256B" in str(err.value)


def test_psum_banks_and_explicit_address() -> None:
    def k(_, n):
        ps = []
        for _ in range(n):
            ps.append(nl.ndarray((128, 8), nl.float32, buffer=nl.psum))  # 1 bank each
        for p in ps:
            nisa.memset(p, 0.0)
        for p in ps:
            nisa.tensor_copy(dst=p, src=p)

    _, rep = run_report(k, DUMMY, 8)
    assert rep.counters.peak_psum_bytes == 8 * 2048
    with pytest.raises(NkiCapacityError, match="PSUM"):
        run(k, DUMMY, 9)

    def addr(_):
        nl.ndarray((128, 1024), nl.float32, address=(0, 245752 - 1024))

    with pytest.raises(NkiValidationError, match="address bytes"):
        run(addr, DUMMY)


def _mixed_kernel(x, idx):
    # float math (skipped in check-only mode) + index math and a gather (always executed)
    P, F = x.shape
    t = nl.ndarray((P, F), nl.float32)
    nisa.dma_copy(dst=t, src=x)
    e = nl.ndarray((P, F), nl.float32)
    nisa.activation(dst=e, op=nl.exp, data=t)
    ps = nl.ndarray((P, F), nl.float32, buffer=nl.psum)
    ident = nl.shared_identity_matrix(P, dtype=nl.float32)
    nisa.nc_matmul(dst=ps, stationary=ident, moving=e)
    it = nl.ndarray((P, 1), nl.int32)
    nisa.dma_copy(dst=it, src=idx)
    i2 = nl.ndarray((P, 1), nl.int32)
    nisa.tensor_tensor(dst=i2, data1=it, data2=it, op=nl.add)  # exact int path
    rows = nl.ndarray((P, F), nl.float32)
    nisa.dma_copy(dst=rows, src=x.ap([[F, P], [1, F]], offset=0, vector_offset=i2, indirect_dim=0))
    out = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    o = nl.ndarray((P, F), nl.float32)
    nisa.tensor_copy(dst=o, src=ps)
    nisa.dma_copy(dst=out, src=o)
    out2 = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out2, src=rows)
    return out, out2


def test_check_only_mode_counts_the_same_and_keeps_index_math(rng) -> None:
    x = rng.standard_normal((128, 64)).astype(np.float32)
    idx = (np.arange(128) // 2).reshape(128, 1).astype(np.int32)
    (full, g_full), rep_full = run_report(_mixed_kernel, x, idx)
    (fake, g_fake), rep_fake = run_report(_mixed_kernel, x, idx, check_only=True)
    np.testing.assert_allclose(full, np.exp(x), rtol=1e-6)
    assert (fake == 0).all()  # float arithmetic skipped
    np.testing.assert_array_equal(g_fake, x[2 * (np.arange(128) // 2)])  # gathers still real
    np.testing.assert_array_equal(g_full, g_fake)
    assert rep_full.counters.as_dict() == rep_fake.counters.as_dict()
    c = rep_full.counters
    assert c.instructions == {"dma": 5, "scalar": 1, "tensor": 1, "gpsimd": 1, "vector": 1}
    assert c.matmul_flops == 2 * 128 * 128 * 64
    assert c.hbm_read_bytes == x.nbytes + idx.nbytes + x.nbytes
    assert c.hbm_write_bytes == 2 * x.nbytes
    # rules are still enforced in check-only mode
    with pytest.raises(NkiValidationError, match="PSUM bank"):
        run(_bank_violation, DUMMY, check_only=True, target="trn2")


def _bank_violation(_):
    d = nl.ndarray((8, 1024), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(
        dst=d[:, 256:768],
        stationary=nl.zeros((128, 8), nl.bfloat16),
        moving=nl.zeros((128, 512), nl.bfloat16),
    )


def test_target_selection(monkeypatch) -> None:
    seen = []

    def k(_):
        seen.append(
            (
                nisa.get_nc_version(),
                nl.tile_size.sbuf_fmax_bytes,
                nl.tile_size.total_available_sbuf_size,
            )
        )

    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    run(k, DUMMY)
    with pytest.warns(DeprecationWarning):
        jk = jit(platform_target="trn2")(k)
    jk(DUMMY)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen3")
    run(k, DUMMY)
    run(k, DUMMY, target="trn3")
    assert seen == [
        (nisa.nc_version.gen4, 245752, 245752),
        (nisa.nc_version.gen3, 212984, 212984),
        (nisa.nc_version.gen3, 212984, 212984),
        (nisa.nc_version.gen4, 245752, 245752),
    ]
    assert nisa.nc_version.gen4 > nisa.nc_version.gen3


def test_removed_apis_raise() -> None:
    for name in ("arange", "mgrid", "par_dim"):
        with pytest.raises(AttributeError, match="removed"):
            getattr(nl, name)
    with pytest.raises(AttributeError, match="removed in NKI 0.4"):
        nisa.tensor_copy_dynamic_src  # noqa: B018

    def mask_kw(_):
        t = nl.zeros((4, 4), nl.float32)
        nisa.tensor_copy(dst=t, src=t, mask=None)

    with pytest.raises(TypeError, match="mask"):
        run(mask_kw, DUMMY)

    def imm_kw(_):
        nisa.register_move(nisa.register_alloc(0), imm=3)

    with pytest.raises(TypeError, match="renamed to src"):
        run(imm_kw, DUMMY)

    def string_buffer(_):
        nl.ndarray((4, 4), nl.float32, buffer="sbuf")

    with pytest.raises(TypeError, match="string buffer"):
        run(string_buffer, DUMMY)


def test_outside_a_kernel_is_an_error() -> None:
    with pytest.raises(nkisim.NkiNotActiveError):
        nl.ndarray((4, 4), nl.float32)


@pytest.fixture
def clean_nki(monkeypatch, tmp_path):
    """Isolate sys.modules['nki*'] and the detection cache."""
    saved = {k: v for k, v in sys.modules.items() if k == "nki" or k.startswith("nki.")}
    for k in saved:
        del sys.modules[k]
    nkisim._real_cache.clear()
    yield tmp_path
    for k in [k for k in sys.modules if k == "nki" or k.startswith("nki.")]:
        del sys.modules[k]
    sys.modules.update(saved)
    nkisim._real_cache.clear()


def test_placeholder_nki_is_detected_and_shim_installs(clean_nki, monkeypatch) -> None:
    pkg = clean_nki / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise SystemError('placeholder package: install from the Neuron repository')\n"
    )
    monkeypatch.syspath_prepend(str(clean_nki))
    assert nkisim.real_nki_available() is False
    assert "nki" not in sys.modules
    with nkisim.installed() as active:
        assert active
        import nki
        import nki.isa as nisa2
        import nki.language as nl2
        from nki.dtype import float8_e4m3fn_x4
        from nki.isa.constants import dge_mode, oob_mode

        assert nki.__mxcli_nkisim__ and nl2 is nl and nisa2 is nisa
        assert float8_e4m3fn_x4 is nl.float8_e4m3fn_x4 and dge_mode is nisa.dge_mode
        assert oob_mode is nisa.oob_mode and nki.dtype.float32 is nl.float32
    assert "nki" not in sys.modules  # restored


def test_real_nki_is_never_shadowed(clean_nki, monkeypatch) -> None:
    pkg = clean_nki / "nki"
    (pkg / "language").mkdir(parents=True)
    (pkg / "isa").mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
        REAL = True
        def jit(fn=None, **kw): return fn
        def simulate(kernel): return kernel
        """
        )
    )
    (pkg / "language" / "__init__.py").write_text("")
    (pkg / "isa" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(clean_nki))
    assert nkisim.real_nki_available() is True
    assert nkisim.activate() is False
    import nki

    assert getattr(nki, "REAL", False) and not nkisim.is_active()
