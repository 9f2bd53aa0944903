"""Family table: config keys and aliases, MoE layer rules, router math -> kernel mode or
refusal, the (1 + w) fold, and the semantic checks behind --model-type."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mxcli.weightprep.families import (
    FAMILIES,
    REFUSED,
    ConfigError,
    RouterMath,
    RouterRefused,
    compare_routing,
    detect_family,
    fold_gamma,
    kernel_router,
    resolve_config,
    route_fp32,
)
from mxcli.weightprep.families.routing import check_kernel_kwargs


def _cfg(model_type: str, **kw: object) -> dict:
    base = {
        "model_type": model_type,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_experts_per_tok": 2,
    }
    return {**base, **kw}


def _resolve(cfg: dict, model_type: str | None = None) -> Any:
    return resolve_config(cfg, detect_family(cfg, model_type))


def test_every_family_detected_by_model_type() -> None:
    for fam in FAMILIES.values():
        for mt in fam.model_types:
            assert detect_family({"model_type": mt}) is fam
    assert detect_family({"model_type": "llama4_text"}).name == "llama4"
    assert not set(FAMILIES) & set(REFUSED)


# Released configs (the keys that decide routing), read from the models' config.json.
RELEASED: dict[str, tuple[dict[str, Any], str]] = {
    "Qwen/Qwen3-30B-A3B": (
        _cfg("qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        "SOFTMAX",
    ),
    "deepseek-ai/DeepSeek-V3": (
        _cfg("deepseek_v3", hidden_size=7168, num_hidden_layers=61, n_routed_experts=256,
             num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8, topk_group=4,
             routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True,
             scoring_func="sigmoid", topk_method="noaux_tc", n_shared_experts=1),
        "NOAUX_TC",
    ),
    "zai-org/GLM-4.5": (
        _cfg("glm4_moe", hidden_size=5120, num_hidden_layers=92, n_routed_experts=160,
             num_experts_per_tok=8, moe_intermediate_size=1536, n_group=1, topk_group=1,
             routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True,
             n_shared_experts=1),
        "NOAUX_TC",
    ),
    "moonshotai/Kimi-Linear-48B-A3B": (
        _cfg("kimi_linear", hidden_size=2304, num_hidden_layers=27, num_experts=256,
             num_experts_per_token=8, num_expert_group=1, moe_intermediate_size=1024,
             moe_renormalize=True, routed_scaling_factor=2.446, first_k_dense_replace=1,
             num_shared_experts=1),
        "NOAUX_TC",
    ),
    "MiniMaxAI/MiniMax-M2": (
        _cfg("minimax_m2", hidden_size=3072, num_hidden_layers=62, num_local_experts=256,
             num_experts_per_tok=8, intermediate_size=1536, scoring_func="sigmoid"),
        "NOAUX_TC",
    ),
    "openai/gpt-oss-20b": (
        _cfg("gpt_oss", hidden_size=2880, num_hidden_layers=24, num_local_experts=32,
             num_experts_per_tok=4, intermediate_size=2880),
        "SOFTMAX",
    ),
    "meta-llama/Llama-4-Scout-17B-16E": (
        {"model_type": "llama4", "text_config": {
            "hidden_size": 5120, "num_hidden_layers": 48, "num_local_experts": 16,
            "num_experts_per_tok": 1, "intermediate_size": 8192, "interleave_moe_layer_step": 1}},
        "SIGMOID",
    ),
    "tencent/Hunyuan-A13B": (
        _cfg("hunyuan_v1_moe", hidden_size=4096, num_hidden_layers=32, num_experts=64,
             moe_topk=8, intermediate_size=3072),
        "SOFTMAX",
    ),
    "Qwen/Qwen1.5-MoE-A2.7B": (
        _cfg("qwen2_moe", num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
             shared_expert_intermediate_size=5632, norm_topk_prob=False),
        "softmax over all E without renormalisation",
    ),
    "allenai/OLMoE-1B-7B": (
        _cfg("olmoe", num_experts=64, num_experts_per_tok=8, intermediate_size=1024,
             norm_topk_prob=False),
        "softmax over all E without renormalisation",
    ),
    "Qwen/Qwen3-Next-80B-A3B": (
        _cfg("qwen3_next", num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
             shared_expert_intermediate_size=512, norm_topk_prob=True),
        "top_k=10",
    ),
    "deepseek-ai/DeepSeek-V2-Lite": (_cfg("deepseek_v2"), "greedy routing"),
    "baidu/ERNIE-4.5-21B-A3B": (_cfg("ernie4_5_moe"), "bias added to the softmax probabilities"),
    "microsoft/Phi-3.5-MoE": (_cfg("phimoe"), "sparsemixer"),
    "databricks/dbrx-base": (_cfg("dbrx"), "LayerNorm"),
    "allenai/FlexOlmo-7x7B-1T": (_cfg("flex_olmo"), "post-norm"),
    "meituan-longcat/LongCat-Flash-Chat": (_cfg("longcat_flash"), "zero .identity. experts"),
}  # fmt: skip


@pytest.mark.parametrize("model", sorted(RELEASED))
def test_released_configs(model: str) -> None:
    cfg, expected = RELEASED[model]
    if expected.isupper():
        r = _resolve(cfg).router
        assert r.act_fn == expected and r.exact
    else:
        with pytest.raises(RouterRefused, match=expected) as e:
            _resolve(cfg)
        assert "\n" not in str(e.value)


def test_config_key_aliases_across_versions() -> None:
    """transformers 5 writes num_local_experts for Qwen3-MoE; older writes num_experts."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        cfg = _cfg("qwen3_moe", moe_intermediate_size=128, norm_topk_prob=True, **{key: 16})
        m = _resolve(cfg)
        assert m.E == 16 and m.used[key] == 16
    # Bailing/Kimi spellings of top-k, groups, renormalisation and shared experts
    k = _resolve(_cfg("bailing_hybrid", num_experts_per_tok=None, num_experts=16, num_experts_per_token=4,
                      num_expert_group=4, topk_group=2, moe_intermediate_size=128,
                      moe_renormalize=True, num_shared_experts=2, routed_scaling_factor=2.5))  # fmt: skip
    assert (k.router.top_k, k.router.n_group, k.router.topk_group, k.shared_I) == (4, 4, 2, 256)
    # a null value is a missing value
    with pytest.raises(ConfigError, match="missing key 'num_experts_per_tok'"):
        _resolve(
            _cfg("gpt_oss", num_local_experts=4, intermediate_size=128, num_experts_per_tok=None)
        )


def test_layer_rules() -> None:
    q = _resolve(_cfg("qwen2_moe", num_experts=8, moe_intermediate_size=128, norm_topk_prob=True,
                      shared_expert_intermediate_size=256, decoder_sparse_step=2,
                      mlp_only_layers=[3]))  # fmt: skip
    assert q.moe_layers() == [1, 5] and q.shared_I == 256
    ds = dict(n_routed_experts=16, moe_intermediate_size=128, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, first_k_dense_replace=2, n_shared_experts=2)  # fmt: skip
    assert _resolve(_cfg("deepseek_v3", **ds)).moe_layers() == [2, 3, 4, 5]
    assert _resolve(_cfg("deepseek_v3", **ds, moe_layer_freq=2)).moe_layers() == [2, 4]
    typed = _cfg("glm4_moe_lite", **ds, mlp_layer_types=["dense", "sparse"] * 3)
    assert _resolve(typed).moe_layers() == [1, 3, 5]  # mlp_layer_types wins
    af = _resolve(_cfg("afmoe", num_experts=8, moe_intermediate_size=128, num_dense_layers=2))
    assert af.moe_layers() == [2, 3, 4, 5]
    text = {"hidden_size": 256, "num_hidden_layers": 4, "num_local_experts": 4,
            "num_experts_per_tok": 1, "intermediate_size": 128, "interleave_moe_layer_step": 2}  # fmt: skip
    assert _resolve({"model_type": "llama4", "text_config": text}).moe_layers() == [1, 3]
    m = _resolve({"model_type": "llama4", "text_config": {**text, "moe_layers": [0, 2]}})
    assert m.moe_layers() == [0, 2]


def test_kernel_router_mapping_and_refusals() -> None:
    def mode(**kw: Any) -> str:
        return kernel_router(RouterMath(top_k=kw.pop("top_k", 2), num_experts=16, **kw), "f").act_fn

    assert mode(scoring="softmax", renormalize=True) == "SOFTMAX"
    assert mode(scoring="softmax", renormalize=True, bias="logit") == "SOFTMAX"
    assert mode(scoring="sigmoid", renormalize=False) == "SIGMOID"
    assert mode(scoring="sigmoid", renormalize=True, bias="selection", scale=2.5, n_group=4,
                topk_group=2) == "NOAUX_TC"  # fmt: skip
    refused = {
        "softmax over all E without renormalisation": dict(scoring="softmax", renormalize=False),
        "bias added to the softmax probabilities": dict(scoring="softmax", renormalize=True,
                                                        bias="probability"),
        "sparsemixer": dict(scoring="sparsemixer", renormalize=False),
        "top_k=9": dict(scoring="softmax", renormalize=True, top_k=9),
        "selection bias without renormalisation": dict(scoring="sigmoid", renormalize=False,
                                                       bias="selection"),
        "without a selection bias": dict(scoring="sigmoid", renormalize=True),
    }  # fmt: skip
    for why, kw in refused.items():
        with pytest.raises(RouterRefused, match=why):
            mode(**kw)
    # n_group beyond the kernel's 8 groups: a router the modes express, whose kwargs the kernel
    # contract refuses, with the contract's own message (one place for the limit)
    spec = kernel_router(RouterMath(top_k=2, num_experts=16, scoring="sigmoid", renormalize=True,
                                    bias="selection", n_group=16), "f")  # fmt: skip
    with pytest.raises(ConfigError, match=r"config\.json n_group: the prefill kernel refuses it"):
        check_kernel_kwargs(spec, 1e-6, 16, "config.json", {"n_group": "n_group"})


def test_backward_exactness() -> None:
    g = _resolve(_cfg("gpt_oss", num_local_experts=4, intermediate_size=128)).router
    assert g.exact and not g.backward_exact and "clamped SwiGLU" in g.bwd_notes[0]
    j = _resolve(_cfg("jetmoe", num_local_experts=4, intermediate_size=128)).router
    assert j.exact and not j.backward_exact and "output bias" in j.bwd_notes[0]
    mx = _resolve(_cfg("mixtral", num_local_experts=8, intermediate_size=128)).router
    assert mx.exact and mx.backward_exact and mx.to_dict()["backward_exact"] is True


def test_fold_one_plus_w_is_fp32_and_exact() -> None:
    w = torch.tensor([0.0, -0.5, 0.0078125, 2.0**-20, 2.0**-30, -1.0], dtype=torch.bfloat16)
    g = fold_gamma(w, "rmsnorm(1+w)")
    assert g.dtype == torch.float32
    # exact down to |w| = 2**-23 (fp32's ulp at 1); 1 + 2**-30 rounds to 1, as in the model
    assert g.tolist() == [1.0, 0.5, 1.0078125, 1.0 + 2.0**-20, 1.0, 0.0]
    assert torch.equal(g, 1.0 + w.float())  # the models' own fp32 factor, bit for bit
    assert fold_gamma(w, "rmsnorm") is w


FORCED = [
    ("qwen3_next", "qwen2_moe", "norm rmsnorm\\(1\\+w\\) vs rmsnorm"),
    ("minimax_m2", "mixtral", "scoring sigmoid vs softmax"),
    ("phimoe", "mixtral", "sparsemixer"),
    ("deepseek_v3", "qwen3_moe", "scoring sigmoid vs softmax"),
]


@pytest.mark.parametrize(("own", "forced", "why"), FORCED)
def test_forced_model_type_checks_semantics(own: str, forced: str, why: str) -> None:
    cfg = _cfg(own, num_experts=16, num_local_experts=16, n_routed_experts=16,
               num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=128,
               norm_topk_prob=True, shared_expert_intermediate_size=128)  # fmt: skip
    with pytest.raises(RouterRefused, match=f"--model-type {forced}: .*{why}"):
        _resolve(cfg, forced)


def test_forced_model_type_checks_explicit_keys() -> None:
    base = _cfg("custom_moe", num_local_experts=8, intermediate_size=128)
    assert _resolve(base, "mixtral").router.exact  # nothing contradicts
    with pytest.raises(RouterRefused, match="scoring_func='sigmoid'; mixtral uses softmax"):
        _resolve({**base, "scoring_func": "sigmoid"}, "mixtral")
    with pytest.raises(RouterRefused, match="norm_topk_prob=False; mixtral renormalises"):
        _resolve({**base, "norm_topk_prob": False}, "mixtral")
    with pytest.raises(RouterRefused, match="--model-type dbrx: not expressible"):
        detect_family(base, "dbrx")


def test_route_fp32_against_plain_loops() -> None:
    """The --check oracle on a grouped, biased case, token by token with Python lists."""
    g = torch.Generator().manual_seed(3)
    T, H, E = 16, 32, 8
    x, w = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * 0.3
    b, gamma = torch.randn(E, generator=g) * 0.1, 1 + 0.1 * torch.randn(H, generator=g)
    m = RouterMath("sigmoid", 2, E, renormalize=True, bias="selection", scale=2.5, n_group=4,
                   topk_group=2)  # fmt: skip
    idx, wt = route_fp32(x, gamma, 1e-6, w, b, m)
    for t in range(T):
        xt = x[t].tolist()
        rms = (sum(v * v for v in xt) / H + 1e-6) ** -0.5
        xn = [xt[h] * rms * float(gamma[h]) for h in range(H)]
        s = [1 / (1 + torch.exp(torch.tensor(-sum(xn[h] * float(w[e, h]) for h in range(H)))).item()) for e in range(E)]  # fmt: skip
        c = [s[e] + float(b[e]) for e in range(E)]
        groups = sorted(range(4), key=lambda gi: -sum(sorted(c[2 * gi : 2 * gi + 2])[-2:]))[:2]
        cand = sorted((e for e in range(E) if e // 2 in groups), key=lambda e: -c[e])[:2]
        assert sorted(idx[t].tolist()) == sorted(cand)
        tot = sum(s[e] for e in cand)
        want = {e: s[e] / tot * 2.5 for e in cand}
        for j in range(2):
            assert abs(float(wt[t, j]) - want[int(idx[t, j])]) < 1e-5


def test_compare_routing_counts_disagreeing_tokens() -> None:
    ref_i = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    ref_w = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1], [0.7, 0.3]])
    aff = torch.zeros(4, 8)
    aff[0, 0], aff[0, 1] = 0.61, 0.39  # agrees, error 0.01
    aff[1, 2], aff[1, 3] = 0.5, 0.5
    aff[2, 4], aff[2, 6] = 0.9, 0.1  # disagrees (6 instead of 5): error not counted
    aff[3, 6], aff[3, 7] = 0.7, 0.3
    r = compare_routing(aff, ref_i, ref_w, 2)
    assert r["topk_agreement"] == 0.75 and abs(r["max_weight_error"] - 0.01) < 1e-6


def test_route_fp32_breaks_exact_ties_as_the_kernel() -> None:
    """An all-zero router ties every logit (and every group score): the oracle picks experts in
    ascending index order, as max8 + nc_find_index8 do (api spec §8.14); torch.topk would pick
    an arbitrary pair (on CPU: [6, 5] for eight equal values)."""
    T, H, E = 3, 32, 8
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0))
    soft = RouterMath("softmax", 2, E, renormalize=True)
    idx, wt = route_fp32(x, torch.ones(H), 1e-6, torch.zeros(E, H), None, soft)
    assert idx.tolist() == [[0, 1]] * T and wt.tolist() == [[0.5, 0.5]] * T
    grouped = RouterMath("sigmoid", 2, E, renormalize=True, bias="selection", scale=2.5,
                         n_group=4, topk_group=2)  # fmt: skip
    idx, wt = route_fp32(x, torch.ones(H), 1e-6, torch.zeros(E, H), torch.zeros(E), grouped)
    assert idx.tolist() == [[0, 1]] * T and wt.tolist() == [[1.25, 1.25]] * T
    # the kernel's dense affinities of such a token name the same set
    aff = torch.zeros(T, E)
    aff[:, :2] = 0.5
    assert compare_routing(aff, idx, torch.full((T, 2), 0.5), 2)["topk_agreement"] == 1.0
