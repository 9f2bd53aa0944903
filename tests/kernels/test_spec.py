"""`mxcli.kernels.spec`: one KernelSpec per kernel, its tables read from the public signature,
one validation per call, and the registry of NKI implementations."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from mxcli.errors import InputError
from mxcli.kernels import backends, selection
from mxcli.kernels.blockwise_moe import SPEC as BWD
from mxcli.kernels.blockwise_moe import BwdCall, blockwise_mm_bwd_mxfp8
from mxcli.kernels.blockwise_moe.upstream_cases import make_upstream_case
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL
from mxcli.kernels.rmsnorm_mx_prefill import PrefillCall, rmsnorm_mx_prefill
from mxcli.kernels.rmsnorm_mx_prefill import contract as prefill_contract
from mxcli.kernels.selection import KernelLoadError
from mxcli.kernels.spec import Implementation, KernelSpec, ScalarArg, TensorArg, get_spec


def test_specs_by_name_and_short_name() -> None:
    assert get_spec("rmsnorm_mx_prefill") is PREFILL is get_spec("prefill")
    assert get_spec("blockwise_mm_bwd_mxfp8") is BWD is get_spec("bwd")
    with pytest.raises(
        InputError, match="unknown kernel 'relu'; expected one of rmsnorm_mx_prefill"
    ):
        get_spec("relu")


@pytest.mark.parametrize("spec", [PREFILL, BWD], ids=["prefill", "bwd"])
def test_tables_follow_the_signature(spec: KernelSpec) -> None:
    params = inspect.signature(spec.api).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [*spec.tensor_names, *spec.scalar_names] == sorted(
        positional, key=lambda n: (n not in spec.tensor_names, positional.index(n))
    )
    for t in spec.tensors:
        assert t.required == (params[t.name].default is inspect.Parameter.empty)
    for s in spec.scalars:
        assert s.default == params[s.name].default


def test_a_table_that_does_not_match_the_signature_is_refused() -> None:
    def toy(x: torch.Tensor, scale: float = 2.0) -> list[torch.Tensor]:
        return [x * scale]

    KernelSpec(toy, short="t", tensors=[TensorArg("x", "[N]", (torch.float32,))],
               scalars=[ScalarArg("scale", "a factor")], outputs=["y"], validate=lambda **a: a)  # fmt: skip
    assert KernelSpec(toy, short="t", tensors=[TensorArg("x", "[N]", (torch.float32,))],
                      scalars=[ScalarArg("scale", "")], outputs=["y"],
                      validate=lambda **a: a).scalars[0].default == 2.0  # fmt: skip
    with pytest.raises(TypeError, match="do not match the signature"):
        KernelSpec(toy, short="t", tensors=[TensorArg("x", "[N]", (torch.float32,))],
                   scalars=[ScalarArg("factor", "")], outputs=["y"], validate=lambda **a: a)  # fmt: skip


def test_the_public_function_validates_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = prefill_contract.validate

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prefill_contract, "validate", counting)
    x = torch.randn(1, 8, 512).to(torch.bfloat16)
    out = rmsnorm_mx_prefill(x, torch.ones(512, dtype=torch.bfloat16))
    assert (
        calls == [1]
        and len(out) == 1
        and out[0].shape == (8, prefill_contract.row_geometry(512).row_region)
    )


def test_call_objects_are_frozen_and_name_their_outputs() -> None:
    x = torch.randn(1, 4, 512).to(torch.bfloat16)
    w = torch.randn(512, 8).to(torch.bfloat16)
    call = PREFILL.validate(x, torch.ones(512), w, top_k=2, emit_norm_bf16=True)
    assert isinstance(call, PrefillCall) and call.top_k == 2
    assert call.output_names == (
        "norm_quant_packed",
        "expert_index",
        "expert_affinities",
        "norm_bf16",
    )
    with pytest.raises(AttributeError):
        call.top_k = 3  # type: ignore[misc]
    named = PREFILL.name_outputs(call, backends.get(PREFILL.name, "reference")(call))
    assert list(named) == list(call.output_names)
    assert named["expert_index"].shape == (4, 2)

    case = make_upstream_case(256, 128, 2, 128, 1, 128)
    from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig

    bcall = BWD.validate(**case.kwargs(), config=MXFP8MOEBwdConfig.routed(top_k=1, bias=True))
    assert isinstance(bcall, BwdCall) and (bcall.T, bcall.H, bcall.E, bcall.I) == (256, 128, 2, 128)
    assert bcall.output_names == BWD.outputs  # with config.bias: all six
    ref = blockwise_mm_bwd_mxfp8(
        **case.kwargs(), config=MXFP8MOEBwdConfig.routed(top_k=1, bias=True)
    )
    assert list(BWD.name_outputs(bcall, ref)) == list(BWD.outputs)
    with pytest.raises(Exception, match="returned 4 tensors, expected 6"):
        BWD.name_outputs(bcall, ref[:4])


def test_implementations_registry_is_lazy() -> None:
    mxcli_impl = PREFILL.implementation()  # mxcli's own kernel is registered
    assert mxcli_impl.name == "mxcli" and str(mxcli_impl.kernel).endswith(
        ":rmsnorm_mx_prefill_kernel"
    )
    adhoc = BWD.implementation("no_such_pkg.kernels:bwd")  # MODULE:FUNCTION: nothing imported yet
    assert adhoc.kernel == "no_such_pkg.kernels:bwd" and "no_such_pkg" not in sys.modules
    with pytest.raises(KernelLoadError, match="'no_such_pkg' is not importable"):
        selection.load(selection.parse_implementation("no_such_pkg.kernels:bwd", BWD))
    with pytest.raises(InputError, match="unknown implementation 'nkilibx'.*expected mxcli"):
        PREFILL.implementation("nkilibx")
    probe_calls: list[int] = []
    impl = Implementation("probe-test", "x:y", probe=lambda: probe_calls.append(1) or "not here")
    BWD.register_implementation(impl)
    try:
        assert BWD.implementation("probe-test").unavailable_reason() == "not here"
        assert probe_calls == [1]
        # the resolver asks the probe before importing anything: its reason is the error
        choice = selection.parse_implementation("probe-test", BWD)
        with pytest.raises(KernelLoadError, match=r"^kernel: probe-test: not here; put its"):
            selection.load(choice)
        assert probe_calls == [1, 1]
    finally:
        BWD.implementations.pop("probe-test")
