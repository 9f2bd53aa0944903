"""`patch` on tiny transformers models of the supported families, and its refusals."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from mxcli.emulate import MxExperts
from mxcli.emulate.patch import PatchRefused, patch, set_mode
from mxcli.weightprep.families import REFUSED

pytest.importorskip("transformers")
from tests.weightprep import hf_tiny  # noqa: E402

FAST = ["qwen3_moe"]
SLOW = ["qwen2_moe", "olmoe", "mixtral", "hunyuan_v1_moe", "granitemoe"]


def _tiny(model_type: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    warnings.filterwarnings("ignore")
    kw = {**hf_tiny.TINY, **hf_tiny.OVERRIDES.get(model_type, {})}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**kw)).float()


def _check_family(model_type: str) -> None:
    model = _tiny(model_type)
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids).logits.detach()
    routers_before = {
        n: p
        for n, p in model.named_parameters()
        if ("gate" in n or "router" in n) and "experts" not in n
    }
    names = patch(model, "exact")
    assert names and all(isinstance(model.get_submodule(n), MxExperts) for n in names)
    # The router stays the model's own (same parameter objects).
    assert routers_before == {
        n: p
        for n, p in model.named_parameters()
        if ("gate" in n or "router" in n) and "experts" not in n
    }
    out = model(input_ids=ids).logits
    # exact mode = fp32 math of the same experts; only fp32 summation order differs.
    torch.testing.assert_close(out.detach(), ref, rtol=1e-4, atol=1e-4)
    set_mode(model, "neuron")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for n in names:
        mod = model.get_submodule(n)
        assert mod.mode.value == "neuron"
        assert mod.gate_up_proj.grad is not None and mod.gate_up_proj.grad.abs().sum() > 0
    router_grads = [p.grad for p in routers_before.values() if p.requires_grad]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads)


@pytest.mark.parametrize("model_type", FAST)
def test_patch_supported_family(model_type: str) -> None:
    _check_family(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW)
def test_patch_more_families(model_type: str) -> None:
    _check_family(model_type)


def test_refuses_backward_departure_with_table_reason() -> None:
    model = _tiny("gpt_oss")
    with pytest.raises(PatchRefused, match="clamped SwiGLU") as ei:
        patch(model)
    assert "\n" not in str(ei.value)
    assert not any(isinstance(m, MxExperts) for m in model.modules())


class _FakeConfig:
    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def to_dict(self) -> dict[str, Any]:
        return self.d


def test_refuses_refused_family_with_table_reason() -> None:
    model = torch.nn.Module()
    model.config = _FakeConfig({"model_type": "phimoe"})  # type: ignore[assignment]
    with pytest.raises(PatchRefused) as ei:
        patch(model)
    assert REFUSED["phimoe"].reason in str(ei.value)
