"""rmsnorm_mx_prefill contract: return list (spec §2.2), validation (§2.3), row geometry (§2.4),
router-weight arrangement (§6.1), backend dispatch."""

from __future__ import annotations

import itertools

import pytest
import torch

from mxcli.errors import InputError
from mxcli.kernels import backends
from mxcli.kernels.rmsnorm_mx_prefill import (
    PrefillValidationError,
    RouterActFnType,
    arrange_router_weights,
    rmsnorm_mx_prefill,
    rmsnorm_mx_prefill_reference,
    row_geometry,
    unarrange_router_weights,
)
from mxcli.mx import swizzle_h_index

SIG, SOFT, NOAUX = RouterActFnType.SIGMOID, RouterActFnType.SOFTMAX, RouterActFnType.NOAUX_TC


def _inputs(B=1, S=5, H=512, E=16, seed=0, wdtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, H, generator=g) * 0.5).to(torch.bfloat16)
    gamma = (torch.randn(1, H, generator=g) * 0.2 + 1).to(torch.bfloat16)
    w = (torch.randn(H, E, generator=g) * 0.1).to(wdtype)
    bias = torch.randn(1, E, generator=g) * 0.1
    res = (torch.randn(B, S, H, generator=g) * 0.5).to(torch.bfloat16)
    return x, gamma, w, bias, res


# ----------------------------------------------------------------------------- §2.2 return list


@pytest.mark.parametrize(
    "router,pack_aff,with_res,emit",
    list(itertools.product([None, SIG, SOFT, NOAUX], [False, True], [False, True], [False, True])),
)
def test_return_list_every_combination(router, pack_aff, with_res, emit):
    B, S, H, E, K = 2, 3, 1024, 17 if router is not NOAUX else 16, 2
    T = B * S
    x, gamma, w, bias, res = _inputs(B, S, H, E)
    kwargs = dict(pack_affinities=pack_aff, emit_norm_bf16=emit, residual=res if with_res else None)
    if router is not None:
        kwargs.update(
            router_weights=arrange_router_weights(w, router),
            router_bias=bias,
            top_k=K,
            router_act_fn=router,
            n_group=4,
            topk_group=2,
        )
    out = rmsnorm_mx_prefill(x, gamma, **kwargs)
    geo = row_geometry(
        H,
        num_experts=E if router is not None else None,
        router_act_fn=SIG if router is None else router,
        pack_affinities=pack_aff,
    )
    expected: list[tuple[tuple[int, ...], torch.dtype]] = [
        ((T, geo.row_region), torch.float8_e4m3fn)
    ]
    if router in (SIG, SOFT):
        expected.append(((T, K), torch.int32))
    if router is not None and not pack_aff:
        expected.append(((T, E), torch.float32 if router is NOAUX else torch.bfloat16))
    if with_res:
        expected.append(((T, H), res.dtype))
    if emit:
        expected.append(((T, H), torch.bfloat16))
    assert [(tuple(o.shape), o.dtype) for o in out] == expected
    if router is not None and pack_aff:
        # affinities live in the row tail; E odd (bf16) pads the row by 2 bytes to a multiple of 4
        tail_end = geo.affin_off + E * geo.aff_bytes
        assert geo.row_region == -(-tail_end // 4) * 4


def test_output_residual_keeps_residual_dtype():
    x, gamma, _, _, res = _inputs()
    out = rmsnorm_mx_prefill(x, gamma, residual=res.float())
    assert out[1].dtype == torch.float32
    # §3.1: the sum is rounded to the input dtype (bf16) before the dtype conversion
    expected = (x.float() + res.float()).to(torch.bfloat16).float().reshape(-1, 512)
    assert torch.equal(out[1], expected)


def test_pack_affinities_ignored_without_router():
    x, gamma, *_ = _inputs()
    a = rmsnorm_mx_prefill(x, gamma, pack_affinities=True)
    b = rmsnorm_mx_prefill(x, gamma)
    assert (
        len(a) == 1
        and a[0].shape == (5, 640)
        and torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    )


def test_empty_token_count():
    x = torch.zeros(1, 0, 512, dtype=torch.bfloat16)
    out = rmsnorm_mx_prefill(x, torch.ones(512), emit_norm_bf16=True)
    assert out[0].shape == (0, 640) and out[1].shape == (0, 512)


# ----------------------------------------------------------------------------- §2.4 geometry


@pytest.mark.parametrize(
    "H,pack_scales,E,act,pack_aff,scale_region,row",
    [
        (512, True, None, SIG, False, 128, 640),
        (512, False, None, SIG, False, 128, 640),
        (1024, True, None, SIG, False, 128, 1152),
        (1024, False, None, SIG, False, 256, 1280),
        (3072, True, None, SIG, False, 256, 3328),
        (7168, True, None, SIG, False, 512, 7680),
        (7168, False, None, SIG, False, 1792, 8960),
        (3072, True, 128, SOFT, True, 256, 3584),  # §4.4: bf16 view [T, 1792]
        (2048, True, 17, SOFT, True, 128, 2212),  # odd E: 2 pad bytes
        (2048, True, 256, NOAUX, True, 128, 3200),  # fp32 view [T, 800]
        (2048, True, 256, NOAUX, False, 128, 2176),
    ],
)
def test_row_geometry_examples(H, pack_scales, E, act, pack_aff, scale_region, row):
    geo = row_geometry(
        H, pack_scales=pack_scales, num_experts=E, router_act_fn=act, pack_affinities=pack_aff
    )
    assert (geo.scale_region, geo.row_region, geo.affin_off) == (
        scale_region,
        row,
        H + scale_region,
    )
    if pack_aff:
        assert geo.affinity_col == {(3072, 128): 1664, (2048, 17): 1088, (2048, 256): 544}[(H, E)]


# ----------------------------------------------------------------------------- §2.3 validation


def _call(**overrides):
    x, gamma, w, bias, res = _inputs(H=512, E=16)
    args = dict(hidden_states=x, gamma=gamma)
    args.update(overrides)
    return rmsnorm_mx_prefill(**args)


W16 = (torch.randn(512, 16, generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.bfloat16)
B16 = torch.zeros(16)
X = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
NOAUX_OK = dict(
    router_weights=W16, router_bias=B16, router_act_fn=NOAUX, top_k=2, n_group=4, topk_group=2
)


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        # the kernel's own checks (§2.3)
        (
            dict(hidden_states=torch.zeros(4, 512, dtype=torch.bfloat16)),
            ["hidden_states", "rank 3", "(4, 512)"],
        ),
        (
            dict(hidden_states=torch.zeros(1, 4, 640, dtype=torch.bfloat16), gamma=torch.ones(640)),
            ["hidden_states", "multiple of 512", "H=640"],
        ),
        (dict(unpadded_hidden_size=0), ["unpadded_hidden_size", "(0, H=512]", "got 0"]),
        (dict(unpadded_hidden_size=513), ["unpadded_hidden_size", "(0, H=512]", "got 513"]),
        (
            dict(residual=torch.zeros(1, 3, 512, dtype=torch.bfloat16)),
            ["residual", "(1, 5, 512)", "(1, 3, 512)"],
        ),
        (
            dict(router_weights=torch.zeros(512, 513, dtype=torch.bfloat16)),
            ["router_weights", "[1, 512]", "E=513"],
        ),
        (dict(router_weights=W16, top_k=9), ["top_k", "<= 8", "got 9"]),
        (
            dict(router_weights=W16, router_act_fn=NOAUX, top_k=2),
            ["router_bias", "NOAUX_TC requires", "None"],
        ),
        ({**NOAUX_OK, "topk_group": 9, "n_group": 16}, ["topk_group", "<= 8", "got 9"]),
        ({**NOAUX_OK, "n_group": 16}, ["n_group", "<= 8", "got 16"]),
        ({**NOAUX_OK, "n_group": 3}, ["n_group", "divisor of E=16", "got 3"]),
        # checks the kernel leaves out
        (
            dict(hidden_states=torch.zeros(1, 4, 512)),
            ["hidden_states", "bfloat16 or float16", "float32"],
        ),
        (dict(gamma=torch.ones(256)), ["gamma", "(512,) or (1, 512)", "(256,)"]),
        (dict(gamma=torch.ones(512, dtype=torch.int32)), ["gamma", "floating-point", "int32"]),
        (
            dict(router_weights=torch.zeros(1024, 16, dtype=torch.bfloat16)),
            ["router_weights", "512 rows", "got 1024"],
        ),
        (
            dict(router_weights=torch.zeros(512, 16)),
            ["router_weights", "bfloat16 or float16", "float32"],
        ),
        (dict(router_weights=W16, top_k=0), ["top_k", ">= 1", "got 0"]),
        (dict(router_weights=W16[:, :4], top_k=5), ["top_k", "<= E=4", "got 5"]),
        (
            dict(router_weights=W16, router_bias=torch.zeros(8)),
            ["router_bias", "(16,) or (1, 16)", "(8,)"],
        ),
        ({**NOAUX_OK, "topk_group": 5}, ["topk_group", "<= n_group=4", "got 5"]),
        ({**NOAUX_OK, "topk_group": 0}, ["topk_group", ">= 1", "got 0"]),
        (
            {
                **NOAUX_OK,
                "router_weights": W16[:, :4],
                "router_bias": B16[:4],
                "n_group": 2,
                "topk_group": 1,
            },
            ["router_weights", "E >= 8", "E=4"],
        ),
        (dict(router_weights=W16, router_act_fn="relu"), ["router_act_fn", "SIGMOID", "'relu'"]),
        (
            dict(qmx_output_dtype="float8_e3m4_x4"),
            ["qmx_output_dtype", "float8_e4m3fn_x4", "float8_e3m4_x4"],
        ),
        (dict(eps=float("nan")), ["eps", "finite", "nan"]),
        (dict(gamma=[1.0] * 512), ["gamma", "torch.Tensor", "list"]),
        (dict(top_k=1.5, router_weights=W16), ["top_k", "an int", "1.5"]),
    ],
)
def test_validation_errors(overrides, fragments):
    with pytest.raises(PrefillValidationError) as info:
        _call(**overrides)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InputError)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_validation_order_follows_kernel():
    # rank is checked before anything else; E before top_k; NOAUX bias before group checks
    with pytest.raises(PrefillValidationError, match="^hidden_states"):
        rmsnorm_mx_prefill(torch.zeros(512), torch.ones(7))
    with pytest.raises(PrefillValidationError, match="^router_weights"):
        _call(router_weights=torch.zeros(512, 600, dtype=torch.bfloat16), top_k=9)
    with pytest.raises(PrefillValidationError, match="^router_bias"):
        _call(router_weights=W16, router_act_fn=NOAUX, n_group=3)


def test_router_act_fn_accepts_names_and_values():
    assert RouterActFnType.coerce("noaux_tc") is NOAUX
    assert RouterActFnType.coerce("RouterActFnType.SOFTMAX") is SOFT
    assert RouterActFnType.coerce(0) is SIG
    assert int(NOAUX) == 2


def test_reference_validates_when_called_directly():
    with pytest.raises(PrefillValidationError, match="top_k"):
        rmsnorm_mx_prefill_reference(X, torch.ones(512), W16, None, 1e-6, 9)


# ----------------------------------------------------------------------------- §6.1 arrangement


@pytest.mark.parametrize("H", [512, 1024, 3072])
def test_arrange_sigmoid_softmax_is_swizzle_gather(H):
    w = torch.arange(H * 3, dtype=torch.float32).view(H, 3)
    idx = swizzle_h_index(H)
    for act in (SIG, SOFT):
        arranged = arrange_router_weights(w, act)
        assert torch.equal(arranged, w[idx])
        # slot s = h512*512 + q*128 + p holds natural row h512*512 + 4p + q
        s = 512 * (H // 512 - 1) + 2 * 128 + 5
        assert arranged[s, 0] == w[512 * (H // 512 - 1) + 4 * 5 + 2, 0]
        assert torch.equal(unarrange_router_weights(arranged, act), w)


@pytest.mark.parametrize("H", [512, 2048, 7168])
def test_arrange_noaux_partition_transpose(H):
    E = 4
    w = torch.randn(H, E, generator=torch.Generator().manual_seed(H)).to(torch.bfloat16)
    arranged = arrange_router_weights(w, NOAUX)
    # §6.1: row r = p*(H/128) + t holds natural h = (t//4)*512 + 4p + (t%4)
    nt = H // 128
    for p, t in [(0, 0), (1, 0), (0, 1), (127, nt - 1), (37, 5 % nt)]:
        h = (t // 4) * 512 + 4 * p + (t % 4)
        assert torch.equal(arranged[p * nt + t], w[h])
    assert torch.equal(unarrange_router_weights(arranged, "noaux_tc"), w)
    # the two arrangements differ (unless H == 128, impossible here)
    assert not torch.equal(arranged, arrange_router_weights(w, SIG))


def test_arrange_validation():
    with pytest.raises(PrefillValidationError, match="w_natural"):
        arrange_router_weights(torch.zeros(500, 4), SIG)
    with pytest.raises(PrefillValidationError, match="act_fn"):
        arrange_router_weights(torch.zeros(512, 4), "gelu")


# ----------------------------------------------------------------------------- dispatch


def test_backend_registry_and_lazy_export():
    assert "reference" in backends.backend_names("rmsnorm_mx_prefill")
    import mxcli.kernels as k

    x, gamma, *_ = _inputs()
    # the package-level export is callable with the same signature (the subpackage shares its name)
    out = k.rmsnorm_mx_prefill(x, gamma)
    assert torch.equal(out[0].view(torch.uint8), rmsnorm_mx_prefill(x, gamma)[0].view(torch.uint8))
    assert k.RouterActFnType is RouterActFnType
    with pytest.raises(backends.UnknownBackendError, match="backend"):
        rmsnorm_mx_prefill(x, gamma, backend="nope")
