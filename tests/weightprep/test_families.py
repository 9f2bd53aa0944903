"""Family table: config resolution, MoE layer rules, router modes and their exactness."""

from __future__ import annotations

import pytest

from mxcli.weightprep.families import FAMILIES, ConfigError, detect_family, resolve_config


def _cfg(model_type: str, **kw: object) -> dict:
    base = {
        "model_type": model_type,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_experts_per_tok": 2,
    }
    return {**base, **kw}


def test_every_family_detected_by_model_type() -> None:
    for fam in FAMILIES.values():
        for mt in fam.model_types:
            assert detect_family({"model_type": mt}) is fam
    assert detect_family({"model_type": "llama4_text"}).name == "llama4"


def test_qwen_layer_rule_and_router() -> None:
    cfg = _cfg("qwen2_moe", num_experts=8, moe_intermediate_size=128, shared_expert_intermediate_size=256,
               decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    m = resolve_config(cfg, detect_family(cfg))
    assert m.moe_layers() == [1, 5]  # (L+1) % 2 == 0, minus mlp_only_layers
    assert m.router.act_fn == "SOFTMAX" and not m.router.exact  # norm_topk_prob defaults to false
    assert m.shared_I == 256
    cfg["norm_topk_prob"] = True
    assert resolve_config(cfg, detect_family(cfg)).router.exact


def test_deepseek_layers_router_and_limits() -> None:
    cfg = _cfg("deepseek_v3", n_routed_experts=16, moe_intermediate_size=128, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, first_k_dense_replace=2, n_shared_experts=2)  # fmt: skip
    m = resolve_config(cfg, detect_family(cfg))
    assert m.moe_layers() == [2, 3, 4, 5]
    r = m.router
    assert (r.act_fn, r.n_group, r.topk_group, r.routed_scaling_factor, r.exact) == (
        "NOAUX_TC",
        4,
        2,
        2.5,
        True,
    )
    assert m.shared_I == 256  # n_shared_experts * moe_intermediate_size
    big = resolve_config({**cfg, "n_routed_experts": 1024, "n_group": 16}, detect_family(cfg))
    assert (
        not big.router.exact
        and "E=1024 > 512" in big.router.notes[-1]
        and "n_group=16 > 8" in big.router.notes[-1]
    )
    with pytest.raises(ConfigError, match="not divisible by n_group"):
        resolve_config({**cfg, "n_group": 3}, detect_family(cfg))
    with pytest.raises(ConfigError, match="missing key 'routed_scaling_factor'"):
        resolve_config(
            {k: v for k, v in cfg.items() if k != "routed_scaling_factor"}, detect_family(cfg)
        )
    assert not resolve_config({**cfg, "norm_topk_prob": False}, detect_family(cfg)).router.exact


def test_llama4_text_config_and_layers() -> None:
    text = {"hidden_size": 256, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
            "intermediate_size": 128, "interleave_moe_layer_step": 2}  # fmt: skip
    m = resolve_config({"model_type": "llama4", "text_config": text}, FAMILIES["llama4"])
    assert m.moe_layers() == [1, 3] and m.router.act_fn == "SIGMOID" and m.shared_I == 128
    m = resolve_config(
        {"model_type": "llama4", "text_config": {**text, "moe_layers": [0, 2]}}, FAMILIES["llama4"]
    )
    assert m.moe_layers() == [0, 2]
    with pytest.raises(ConfigError, match="text_config: missing key 'num_local_experts'"):
        resolve_config(
            {
                "model_type": "llama4",
                "text_config": {k: v for k, v in text.items() if k != "num_local_experts"},
            },
            FAMILIES["llama4"],
        )


def test_gpt_oss_and_mixtral() -> None:
    with pytest.raises(
        ConfigError, match="num_experts_per_tok must be a positive integer, got None"
    ):
        resolve_config(
            _cfg("gpt_oss", num_local_experts=4, intermediate_size=128, num_experts_per_tok=None),
            FAMILIES["gpt_oss"],
        )
    # the alias experts_per_token is read when num_experts_per_tok is absent
    g = resolve_config(
        {
            k: v
            for k, v in _cfg(
                "gpt_oss", num_local_experts=4, intermediate_size=128, experts_per_token=3
            ).items()
            if k != "num_experts_per_tok"
        },
        FAMILIES["gpt_oss"],
    )
    assert g.router.top_k == 3 and g.router.act_fn == "SOFTMAX" and g.router.bwd_notes
    mx = resolve_config(
        _cfg("mixtral", num_local_experts=8, intermediate_size=128), FAMILIES["mixtral"]
    )
    assert mx.moe_layers() == list(range(6)) and mx.router.exact and mx.values["eps"] == 1e-5


def test_bad_values() -> None:
    with pytest.raises(ConfigError, match="hidden_size must be a positive integer"):
        resolve_config(
            _cfg("mixtral", num_local_experts=8, intermediate_size=128, hidden_size="256"),
            FAMILIES["mixtral"],
        )
