"""The NKI kernel of ``rmsnorm_mx_prefill`` on the interpreter (``sim`` backend) vs the reference.

Contract (issue 8): MX codes, scale bytes and expert indices bit-exact; every other output within
a relative L2 of 1e-3 — the fp32 accumulation-order / transcendental tolerance (sum of squares,
router logits, rsqrt/sigmoid/exp evaluated differently), far tighter than the MXFP8 error itself
(~3e-2, checked below). Where the kernel's arithmetic is the same single rounding as the
reference's (residual add, all packed bytes before the affinity tail, holes written as 0x00)
the tests demand bit equality.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mxcli import nkisim
from mxcli.kernels import backends, launcher, nki_runtime
from mxcli.kernels.backends import BackendUnavailableError
from mxcli.kernels.rmsnorm_mx_prefill import (
    PrefillValidationError,
    RouterActFnType,
    arrange_router_weights,
    decode_packed_rows,
    rmsnorm_mx_prefill,
    row_geometry,
    validate,
)
from mxcli.kernels.rmsnorm_mx_prefill.kernel_types import RouterMode
from mxcli.kernels.rmsnorm_mx_prefill.nki_backend import KERNEL, kernel_config
from mxcli.mx import fake_quantize_mx
from mxcli.nkisim import kernel as nkisim_kernel
from mxcli.nkisim.dtypes import DType
from mxcli.nkisim.nki import language
from tests.kernels._nki_helpers import kernel_source_usage, rel_l2

# the one launcher (`mxcli.kernels.launcher`) with this kernel's hooks
launch_sim = functools.partial(launcher.launch_sim, rmsnorm_mx_prefill.__name__)
run_sim = functools.partial(launcher.run_sim, rmsnorm_mx_prefill.__name__)

A = RouterActFnType
REL_L2 = 1e-3  # fp32 accumulation order / transcendental approximations (module docstring)
KERNEL_FILE = Path(__file__).parents[2] / "mxcli/kernels/rmsnorm_mx_prefill/nki_kernel.py"


def make_case(
    T: int,
    H: int,
    *,
    E: int | None = None,
    K: int = 1,
    act: RouterActFnType = A.SOFTMAX,
    bias_dtype: torch.dtype | None = None,
    w_dtype: torch.dtype = torch.bfloat16,
    residual_dtype: torch.dtype | None = None,
    seed: int = 5,
    **options: Any,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Inputs drawn as in the upstream tests (prefill spec §7): hidden N(0,1)*0.5 bf16,
    gamma N(0,1)*0.2+1, router N(0,1)*0.1 arranged for the act fn, bias N(0,1)*0.1."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(torch.bfloat16)  # [B, S, H]
    gamma = (torch.randn(1, H, generator=g) * 0.2 + 1).to(torch.bfloat16)  # [1, H]
    kwargs: dict[str, Any] = dict(options)
    if residual_dtype is not None:
        kwargs["residual"] = (torch.randn(1, T, H, generator=g) * 0.5).to(residual_dtype)
    if E is not None:
        w_nat = (torch.randn(H, E, generator=g) * 0.1).to(w_dtype)  # [H, E] natural rows
        kwargs.update(router_weights=arrange_router_weights(w_nat, act), top_k=K, router_act_fn=act)
        if bias_dtype is not None:
            kwargs["router_bias"] = (torch.randn(E, generator=g) * 0.1).to(bias_dtype)
    return [x, gamma], kwargs


def check_against_reference(args: list[torch.Tensor], kwargs: dict[str, Any], **sim: Any) -> None:
    """Run the kernel on the interpreter and the reference; apply the contract above."""
    out = run_sim(*args, **kwargs, engine="mxcli.nkisim", **sim)
    ref = rmsnorm_mx_prefill(*args, **kwargs)  # the reference backend
    assert len(out) == len(ref)
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
    H = args[0].shape[-1]
    E = kwargs["router_weights"].shape[1] if "router_weights" in kwargs else None
    act = kwargs.get("router_act_fn", A.SIGMOID)
    packed_aff = bool(kwargs.get("pack_affinities")) and E is not None
    geo = row_geometry(
        H,
        pack_scales=kwargs.get("pack_scales", True),
        num_experts=E,
        router_act_fn=act,
        pack_affinities=packed_aff,
    )
    raw_o, raw_r = out[0].view(torch.uint8), ref[0].view(torch.uint8)
    # codes, scale bytes and holes (0x00 in both): bit-exact
    assert torch.equal(raw_o[:, : geo.affin_off], raw_r[:, : geo.affin_off])
    dec = dict(
        pack_scales=kwargs.get("pack_scales", True),
        num_experts=E if packed_aff else None,
        router_act_fn=act,
        qmx_output_dtype=kwargs.get("qmx_output_dtype", "float8_e4m3fn_x4"),
    )
    do, dr = decode_packed_rows(out[0], H, **dec), decode_packed_rows(ref[0], H, **dec)
    assert torch.equal(do.codes, dr.codes) and torch.equal(do.scales, dr.scales)
    if packed_aff:
        assert do.affinities is not None and dr.affinities is not None
        assert rel_l2(do.affinities, dr.affinities) <= REL_L2
        end = geo.affin_off + geo.num_experts * geo.aff_bytes
        assert torch.equal(raw_o[:, end:], raw_r[:, end:])  # row pad: 0x00 in both
    rest_o, rest_r = out[1:], ref[1:]
    if E is not None and act is not A.NOAUX_TC:
        assert torch.equal(rest_o[0], rest_r[0]), "expert_index must be bit-exact"
        rest_o, rest_r = rest_o[1:], rest_r[1:]
    if E is not None and not packed_aff:
        assert rel_l2(rest_o[0], rest_r[0]) <= REL_L2, "expert_affinities"
        rest_o, rest_r = rest_o[1:], rest_r[1:]
    if "residual" in kwargs:
        assert torch.equal(rest_o[0], rest_r[0]), "output_residual: one DMA add, one rounding"
        rest_o, rest_r = rest_o[1:], rest_r[1:]
    if kwargs.get("emit_norm_bf16"):
        assert rel_l2(rest_o[0], rest_r[0]) <= REL_L2, "norm_bf16"
        rest_o, rest_r = rest_o[1:], rest_r[1:]
    assert not rest_o


# -- numerics against the reference (fast shapes) ------------------------------------------------


def test_no_router_bytes_identical() -> None:
    args, kw = make_case(256, 1024)
    out = run_sim(*args, engine="mxcli.nkisim")
    ref = rmsnorm_mx_prefill(*args)
    assert len(out) == 1 and out[0].dtype == torch.float8_e4m3fn and out[0].shape == (256, 1152)
    assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8))


def test_public_function_dispatches_sim() -> None:
    args, kw = make_case(64, 512, E=16, K=2)
    out = rmsnorm_mx_prefill(*args, **kw, backend="sim")
    ref = rmsnorm_mx_prefill(*args, **kw)
    assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8))
    assert torch.equal(out[1], ref[1])


def test_softmax_router_partial_tile() -> None:
    check_against_reference(*make_case(200, 1024, E=16, K=2, act=A.SOFTMAX))


def test_sigmoid_bias_packed_affinities_odd_experts() -> None:
    # E = 17: the bf16 tail leaves a 2-byte pad (prefill spec §4.4)
    check_against_reference(
        *make_case(
            130, 1024, E=17, K=3, act=A.SIGMOID, bias_dtype=torch.float16, pack_affinities=True
        )
    )


@pytest.mark.parametrize("pack_affinities", [False, True])
def test_noaux_tc_groups(pack_affinities: bool) -> None:
    check_against_reference(
        *make_case(
            96,
            1024,
            E=32,
            K=4,
            act=A.NOAUX_TC,
            bias_dtype=torch.float32,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            pack_affinities=pack_affinities,
            seed=7,
        )
    )


@pytest.mark.parametrize(
    "act, extra",
    [
        (A.NOAUX_TC, dict(n_group=8, topk_group=4, routed_scaling_factor=2.5)),
        (A.SOFTMAX, dict(pack_affinities=True)),
    ],
)
def test_pipelined_tiles_match_reference(act: RouterActFnType, extra: dict[str, Any]) -> None:
    """Six tiles on one core, the last one short: every stage of the kernel's tile pipeline
    (prefetched load and sum of squares, router logits one tile behind, selection, NOAUX_TC
    affinities three tiles behind, the drain) runs, and no tile's results leak into another's."""
    check_against_reference(
        *make_case(5 * 128 + 37, 512, E=64, K=8, act=act, bias_dtype=torch.float32, **extra),
        lnc=1,
    )


def test_noaux_tc_deepseek_routing() -> None:
    # E = 256, 8 groups of 32, 4 kept, K = 8 (the DeepSeek-V3 configuration)
    check_against_reference(
        *make_case(
            64,
            512,
            E=256,
            K=8,
            act=A.NOAUX_TC,
            bias_dtype=torch.float32,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        )
    )


def test_residual_norm_unpadded_unfolded_fp16_router() -> None:
    check_against_reference(
        *make_case(
            100,
            3072,
            E=8,
            K=4,
            act=A.SOFTMAX,
            w_dtype=torch.float16,  # cd = fp16: the three roundings go to fp16 (§3.3)
            residual_dtype=torch.bfloat16,
            emit_norm_bf16=True,
            unpadded_hidden_size=2880,
            pack_scales=False,
        )
    )


def test_fp32_residual_and_small_expert_count() -> None:
    # E = 5 < 8: logits padded with -FLT_MAX for max8; fp32 residual: output in fp32
    check_against_reference(*make_case(70, 512, E=5, K=2, residual_dtype=torch.float32))


def test_hidden_interleaved() -> None:
    check_against_reference(
        *make_case(
            64, 1024, residual_dtype=torch.bfloat16, emit_norm_bf16=True, hidden_interleaved=True
        )
    )


@pytest.mark.parametrize("gamma_dtype", [torch.float32, torch.float16])
def test_gamma_dtypes_and_swizzle_words_with_zero_halves(gamma_dtype: torch.dtype) -> None:
    """The swizzle copies x out of PSUM as fp32 words (two bf16 each) on ScalarE; words whose
    high half is +-0 are fp32 zeros/subnormals and must still arrive bit-exact. gamma in fp32
    (kept fp32 on chip) or fp16 (kept in its own dtype): a = R_cd(x * gamma) as the reference."""
    (x, gamma), kw = make_case(40, 1024, E=16, K=2, act=A.SIGMOID, bias_dtype=torch.float32)
    x = x.clone()
    x[..., 1::2] = 0.0  # odd elements = high halves of the fp32 words: subnormal / zero words
    x[..., 3::8] = -0.0  # and negative zeros (sign bit only)
    x[0, :8, 1::2] = x[0, :8, 0::2]  # a few full rows stay dense
    g = torch.Generator().manual_seed(7)
    gamma = (torch.randn(1, 1024, generator=g) * 0.2 + 1).to(gamma_dtype)
    check_against_reference([x, gamma], kw)


def test_e5m2_output_and_single_token() -> None:
    check_against_reference(*make_case(1, 512, E=8, K=1, act=A.SIGMOID, qmx_output_dtype="e5m2"))


@pytest.mark.parametrize("with_router", [False, True])
def test_lnc2_splits_tokens(with_router: bool) -> None:
    extra: dict[str, Any] = dict(E=16, K=2, residual_dtype=torch.bfloat16) if with_router else {}
    check_against_reference(*make_case(300, 1024, **extra), lnc=2)


def test_tolerance_is_far_below_the_mx_error() -> None:
    """The 1e-3 relative L2 catches a wrong quantization: MXFP8 itself moves values by ~3e-2."""
    args, _ = make_case(128, 1024)
    dec = decode_packed_rows(run_sim(*args, engine="mxcli.nkisim")[0], 1024)
    x = args[0].reshape(128, 1024).float()
    y = x * torch.rsqrt(x.square().mean(1, keepdim=True) + 1e-6) * args[1].float()
    err = rel_l2(dec.values, y)
    assert 5e-3 < err < 6e-2  # the MX error of e4m3 (3 mantissa bits)
    shifted = fake_quantize_mx(y.roll(16, dims=1)).roll(-16, dims=1)  # groups off by 16
    assert rel_l2(shifted, dec.values) > 10 * REL_L2


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(top_k=9), "top_k"),
        (dict(router_act_fn=A.NOAUX_TC, router_bias=None), "router_bias"),
        (dict(router_act_fn=A.NOAUX_TC, n_group=5), "n_group"),
        (dict(unpadded_hidden_size=1025), "unpadded_hidden_size"),
        (dict(gamma=torch.ones(1000, dtype=torch.bfloat16)), "gamma"),
    ],
)
def test_launcher_validates_before_any_launch(
    change: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation (prefill spec §2.3 + errata 2) runs once, in the launcher, before the kernel
    is loaded or traced (issue 11: the kernel itself holds no duplicate of it)."""
    (x, gamma), kw = make_case(8, 1024, E=24, K=2, bias_dtype=torch.float32)
    kw.update(change)
    g = kw.pop("gamma", gamma)

    def no_launch(*a: Any, **k: Any) -> None:
        raise AssertionError("the kernel was launched with invalid arguments")

    monkeypatch.setattr(nki_runtime, "run_sim", no_launch)
    with pytest.raises(PrefillValidationError, match=name):
        launch_sim(x, g, **kw, engine="mxcli.nkisim")
    with pytest.raises(PrefillValidationError, match=name):
        rmsnorm_mx_prefill(x, g, **kw, backend="sim")


def test_kernel_asserts_its_plan_matches_the_tensors() -> None:
    """The kernel re-asserts (``assert``, as upstream's kernel_assert) only what its addressing
    relies on: a plan made for other tensors is refused at trace time."""
    (x, gamma), kw = make_case(8, 1024, E=16, K=2)
    cfg = validate(x, gamma, **kw)
    other = validate(x[:, :, :512], gamma[:, :512], **{**kw, "router_weights": None})
    args = [x, gamma, kernel_config(other), kw["router_weights"], None, None]
    with pytest.raises(AssertionError, match="cfg.H"):
        nki_runtime.run_sim(KERNEL, args, engine="mxcli.nkisim")
    args[2] = kernel_config(cfg)
    out = nki_runtime.run_sim(KERNEL, args, engine="mxcli.nkisim").outputs
    ref = rmsnorm_mx_prefill(x, gamma, **kw)
    assert torch.equal(out[0], ref[0].view(torch.uint8)) and torch.equal(out[1], ref[1])


def test_kernel_config_holds_only_front_end_values() -> None:
    """The plan crosses to the kernel as an NKIObject of ints, floats, bools, the basic
    `RouterMode` enum and nki dtypes (issue 11: no torch dtypes, no host enums)."""
    (x, gamma), kw = make_case(8, 1024, E=32, K=4, act=A.NOAUX_TC, bias_dtype=torch.float32)
    obj = kernel_config(validate(x, gamma, **kw, n_group=4, topk_group=2))
    kern_mod = nki_runtime.load_kernel_module(KERNEL.partition(":")[0], "mxcli.nkisim")
    built = nki_runtime._convert_arg(
        obj, language, nki_runtime.to_numpy, nki_runtime.SimEngine.INTERPRETER
    )
    assert type(built) is kern_mod.PrefillKernelConfig
    assert isinstance(built, language.NKIObject)
    assert built.router_mode == RouterMode.NOAUX_TC and built.compute_dtype == language.bfloat16
    assert built.qmx_dtype == language.float8_e4m3fn_x4
    for name, value in vars(built).items():
        assert isinstance(value, (int, float, bool, RouterMode, DType)), name
    assert (built.T, built.H, built.NB, built.E, built.K, built.row) == (8, 1024, 2, 32, 4, 1152)


# -- the NKI 0.6 front end (issue 11) ---------------------------------------------------------------

# every configuration this file runs (shapes shrunk: the front end sees structure, not sizes)
_FRONT_END_CASES = {
    "no_router": (256, 1024, {}),
    "softmax": (200, 1024, dict(E=16, K=2)),
    "sigmoid_bias_packed_e17": (
        130, 1024, dict(E=17, K=3, act=A.SIGMOID, bias_dtype=torch.float16, pack_affinities=True)
    ),
    "noaux_packed": (
        96, 1024, dict(E=32, K=4, act=A.NOAUX_TC, bias_dtype=torch.float32, n_group=4,
                       topk_group=2, routed_scaling_factor=2.5, pack_affinities=True)
    ),
    "noaux_deepseek": (
        64, 512, dict(E=256, K=8, act=A.NOAUX_TC, bias_dtype=torch.float32, n_group=8,
                      topk_group=4)
    ),
    "residual_norm_unpadded_unfolded_fp16": (
        100, 3072, dict(E=8, K=4, w_dtype=torch.float16, residual_dtype=torch.bfloat16,
                        emit_norm_bf16=True, unpadded_hidden_size=2880, pack_scales=False)
    ),
    "fp32_residual_e5": (70, 512, dict(E=5, K=2, residual_dtype=torch.float32)),
    "interleaved": (
        64, 1024, dict(residual_dtype=torch.bfloat16, emit_norm_bf16=True, hidden_interleaved=True)
    ),
    "e5m2_single_token": (1, 512, dict(E=8, K=1, act=A.SIGMOID, qmx_output_dtype="e5m2")),
}  # fmt: skip


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("case", sorted(_FRONT_END_CASES))
def test_front_end_check_passes(case: str, lnc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch runs `nkisim.assert_frontend` on the kernel and its actual arguments (the
    plan object included) before tracing; for each tested configuration and LNC it finds
    nothing outside the NKI 0.6 subset."""
    T, H, opts = _FRONT_END_CASES[case]
    args, kw = make_case(T, H, **opts)
    checked: list[tuple[Any, ...]] = []
    real = nkisim_kernel.assert_frontend

    def spy(fn: Any, a: Any, k: Any) -> None:
        checked.append(nkisim.check_frontend(fn, a, k))
        real(fn, a, k)

    monkeypatch.setattr(nkisim_kernel, "assert_frontend", spy)
    launch_sim(*args, **kw, lnc=lnc, check_only=True)
    assert checked == [()]


def test_front_end_check_sees_the_plan() -> None:
    """The check reaches into the argument objects: a plan carrying a torch dtype (what the
    pre-issue-11 kernel received) is refused, naming the rule; the launcher's plan passes."""
    (x, gamma), kw = make_case(8, 512, E=8, K=2)
    kern = nki_runtime.resolve_kernel(KERNEL, "mxcli.nkisim")
    built = nki_runtime._convert_arg(
        kernel_config(validate(x, gamma, **kw)),
        language,
        nki_runtime.to_numpy,
        nki_runtime.SimEngine.INTERPRETER,
    )
    tensors = [nki_runtime.to_numpy(t) for t in (x, gamma, kw["router_weights"])]
    assert nkisim.check_frontend(kern, [tensors[0], tensors[1], built, tensors[2]]) == ()
    bad = dataclasses.replace(built, compute_dtype=torch.bfloat16)
    found = nkisim.check_frontend(kern, [tensors[0], tensors[1], bad, tensors[2]])
    assert [v.rule for v in found] == [nkisim.Rule.TORCH_NUMPY]


def test_check_only_rejects_the_real_simulator() -> None:
    args, _ = make_case(8, 512)
    with pytest.raises(ValueError, match="check-only"):
        launch_sim(*args, check_only=True, engine="nki.simulate")


# -- check-only mode at the production shape ------------------------------------------------------


def _production_inputs(act: RouterActFnType) -> tuple[list[torch.Tensor], dict[str, Any]]:
    T, H, E = 2048, 7168, 256  # prefill spec §7: (1, 2048, 7168, 7168, 256, ...)
    x = torch.zeros(1, T, H, dtype=torch.bfloat16)
    gamma = torch.ones(H, dtype=torch.bfloat16)
    w = torch.zeros(H, E, dtype=torch.bfloat16)
    bias = torch.zeros(E, dtype=torch.float32)
    kw: dict[str, Any] = dict(router_weights=w, router_bias=bias, router_act_fn=act, top_k=8)
    return [x, gamma], kw


@pytest.mark.parametrize("variant", ["noaux_packed", "softmax_residual_norm_unfolded"])
def test_check_only_production_shape(variant: str) -> None:
    act = A.NOAUX_TC if variant == "noaux_packed" else A.SOFTMAX
    args, kw = _production_inputs(act)
    T, H, E, K = 2048, 7168, 256, 8
    if act is A.NOAUX_TC:
        kw.update(n_group=8, topk_group=4, routed_scaling_factor=2.5, pack_affinities=True)
    else:
        kw.update(residual=torch.zeros_like(args[0]), emit_norm_bf16=True, pack_scales=False)
    res = launch_sim(*args, **kw, check_only=True)
    assert res.engine is nki_runtime.SimEngine.INTERPRETER
    c = res.report.counters
    NB, tiles = H // 512, T // 128
    # router: one matmul per (h512, lane) and tile; the inv_rms broadcast is a transpose
    assert c.ops["nc_matmul"] == tiles * NB * 4
    assert c.matmul_flops == 2 * T * H * E
    assert c.ops["quantize_mx"] == tiles * NB
    assert c.ops["max8"] == tiles * (1 if act is A.SOFTMAX else 8 + 2)
    geo = row_geometry(
        H, pack_scales=kw.get("pack_scales", True), num_experts=E, router_act_fn=act,
        pack_affinities=bool(kw.get("pack_affinities")),
    )  # fmt: skip
    written = T * geo.row_region
    if act is A.SOFTMAX:
        written += T * K * 4 + T * E * 2 + 2 * T * H * 2  # index, affinities, residual, norm
    assert c.hbm_write_bytes == written
    budget = res.report.config.target.sbuf_fmax_bytes
    assert 0 < c.peak_sbuf_bytes <= budget
    assert 0 < c.peak_psum_bytes <= 16 * 1024


def test_check_only_production_shape_lnc2() -> None:
    """LNC 2: two programs of 1024 tokens each (8 tiles of 128), same total work."""
    args, kw = _production_inputs(A.NOAUX_TC)
    kw.update(n_group=8, topk_group=4, pack_affinities=True)
    res = launch_sim(*args, **kw, check_only=True, lnc=2)
    assert [p.ops["quantize_mx"] for p in res.report.programs] == [8 * 14, 8 * 14]
    assert res.report.counters.matmul_flops == 2 * 2048 * 7168 * 256


# -- runtime plumbing ------------------------------------------------------------------------------


def test_boundary_conversions_are_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (3, 8), dtype=torch.uint8, generator=g)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = bits.view(dt)
        back = nki_runtime.to_torch(nki_runtime.to_numpy(t))
        assert back.dtype == dt and torch.equal(back.view(torch.uint8), bits)
    bf = torch.randint(-(2**15), 2**15, (4, 4), dtype=torch.int16, generator=g).view(torch.bfloat16)
    back = nki_runtime.to_torch(nki_runtime.to_numpy(bf))
    assert back.dtype == torch.bfloat16 and torch.equal(
        back.view(torch.int16), bf.view(torch.int16)
    )
    words = torch.tensor([0, 1, 0xFFFFFFFF, 0x7F800001], dtype=torch.uint32)
    assert torch.equal(nki_runtime.to_torch(nki_runtime.to_numpy(words)), words)
    e8m0 = bits.view(torch.float8_e8m0fnu)
    assert torch.equal(nki_runtime.to_torch(nki_runtime.to_numpy(e8m0)), bits)  # scales: uint8
    with pytest.raises(TypeError, match="int64"):
        nki_runtime.to_numpy(torch.zeros(2, dtype=torch.int64))


def test_interpreter_never_installed_globally() -> None:
    """Running on the interpreter leaves ``sys.modules['nki']`` as it was (a real ``nki`` is
    never shadowed, and without one ``import nki`` keeps failing)."""
    before = {k: v for k, v in sys.modules.items() if k == "nki" or k.startswith("nki.")}
    args, _ = make_case(8, 512)
    run_sim(*args, engine="mxcli.nkisim")
    after = {k: v for k, v in sys.modules.items() if k == "nki" or k.startswith("nki.")}
    assert after == before
    assert nki_runtime.sim_unavailable_reason() is None
    assert backends.unavailable_reason("rmsnorm_mx_prefill", "sim") is None


def test_neuron_backend_reports_what_is_missing() -> None:
    reason = nki_runtime.neuron_unavailable_reason()
    if reason is None:
        pytest.skip("a Neuron device and SDK are present")
    assert reason.startswith("missing ") and "Neuron device" in reason
    args, _ = make_case(8, 512)
    with pytest.raises(BackendUnavailableError, match="Neuron device"):
        rmsnorm_mx_prefill(*args, backend="neuron")
    assert backends.resolve_name("rmsnorm_mx_prefill", "auto") == "reference"


# API spec §10 (the prefill kernel's ops) plus the enums and views it may name
_NISA_ALLOWED = {
    "activation", "dma_compute", "dma_copy", "iota", "max8", "memset", "nc_find_index8",
    "nc_matmul", "nc_transpose", "quantize_mx", "reciprocal", "scalar_tensor_tensor",
    "tensor_copy", "tensor_reduce", "tensor_scalar", "tensor_tensor", "dge_mode", "reduce_cmd",
    "engine",  # DMA trigger queue / copy engine selection (nki_api_subset §6.1, §10)
}  # fmt: skip


def test_kernel_source_is_plain_nki() -> None:
    """The kernel imports only the real NKI modules (never the interpreter) and calls only ISA
    ops of the documented subset (api spec §10)."""
    imported, used = kernel_source_usage(KERNEL_FILE)
    assert {"nki", "nki.isa", "nki.language"} <= imported
    assert not any("nkisim" in m for m in imported)
    assert used <= _NISA_ALLOWED, used - _NISA_ALLOWED


# -- wider shapes (slow) ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "T, H, E, K, act, extra",
    [
        (512, 7168, 256, 8, A.NOAUX_TC,
         dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, pack_affinities=True)),
        (1024, 3072, 128, 4, A.SOFTMAX,
         dict(unpadded_hidden_size=2880, residual_dtype=torch.bfloat16, pack_affinities=True)),
        (512, 2048, 16, 1, A.SOFTMAX, dict(lnc=2)),
        (384, 7168, None, 1, A.SIGMOID, dict(emit_norm_bf16=True, residual_dtype=torch.bfloat16)),
        (256, 2048, 17, 2, A.SIGMOID, dict(pack_affinities=True, bias_dtype=torch.float16)),
        # the largest rows of the upstream tables (prefill spec §7), LNC 2
        (2048, 7168, 256, 4, A.SOFTMAX,
         dict(residual_dtype=torch.bfloat16, w_dtype=torch.float16, bias_dtype=torch.float16,
              lnc=2)),
        (2048, 7168, 256, 8, A.NOAUX_TC,
         dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, pack_affinities=True, lnc=2)),
    ],
)  # fmt: skip
def test_wide_shapes(
    T: int, H: int, E: int | None, K: int, act: RouterActFnType, extra: dict[str, Any]
) -> None:
    extra = dict(extra)
    lnc = extra.pop("lnc", 1)
    if act is A.NOAUX_TC:
        extra.setdefault("bias_dtype", torch.float32)
    check_against_reference(*make_case(T, H, E=E, K=K, act=act, **extra), lnc=lnc)
