"""Issue 28 item 5: a key config.json lacks is read as the family's transformers config class
defaults it: from the installed class when there is one, else from the family table, whose
defaults must be the transformers release's it names (checked here against the installed one)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from mxcli.weightprep.families import FAMILIES, FAMILY_LIST, REQUIRED, resolve_config
from mxcli.weightprep.families.table import TRANSFORMERS_DEFAULTS_VERSION, Family

# Keys whose transformers default is derived from other keys in __post_init__ (a list per
# layer), not a constant the table can hold: the family's layer rule derives them.
_DERIVED = ("mlp_layer_types", "moe_layers")


def _transformers_instance(fam: Family) -> Any:
    mapping = pytest.importorskip("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    if fam.name not in mapping:
        pytest.skip(f"{fam.name} is not a transformers model type")
    inst = mapping[fam.name]()
    return inst.get_text_config() if fam.text_config else inst


def test_installed_transformers_is_the_tables_release() -> None:
    transformers = pytest.importorskip("transformers")
    assert transformers.__version__ == TRANSFORMERS_DEFAULTS_VERSION


@pytest.mark.parametrize("name", [f.name for f in FAMILY_LIST])
def test_table_defaults_are_the_transformers_defaults(name: str) -> None:
    """Every constant default of the table equals the config class's (when the class reads the
    key): the fallback without transformers reads a config as transformers would."""
    fam = FAMILIES[name]
    inst = _transformers_instance(fam)
    required_keys = {
        (k if isinstance(k, str) else k[0]) for k, d in fam.keys.values() if d is REQUIRED
    }
    compared = 0
    for role, (key, default) in fam.keys.items():
        k = key if isinstance(key, str) else key[0]
        if default is REQUIRED or role in _DERIVED or k in required_keys:
            continue
        theirs = getattr(inst, k, None)
        if theirs is None:
            continue  # transformers does not read this key (mxcli's reading stands)
        assert default == theirs, f"{name}.{k}: table {default!r}, transformers {theirs!r}"
        compared += 1
    assert compared or name == "llama4", f"{name}: nothing compared"


def _deepseek_config_without_router_keys() -> dict[str, Any]:
    from mxcli.weightprep.synthetic import _deepseek

    cfg, _, _ = _deepseek(
        {"hidden_size": 256, "intermediate_size": 128, "num_experts": 8, "num_layers": 3,
         "top_k": 2, "quantized": False, "overrides": {}}
    )  # fmt: skip
    for k in ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        cfg.pop(k)
    return cfg


def test_missing_keys_from_the_installed_class() -> None:
    pytest.importorskip("transformers")
    m = resolve_config(_deepseek_config_without_router_keys(), FAMILIES["deepseek_v3"])
    r = m.router
    assert (r.n_group, r.topk_group, r.routed_scaling_factor) == (8, 4, 2.5)
    got = {d.key: (d.value, d.source) for d in m.defaulted}
    assert got["n_group"][0] == 8 and got["first_k_dense_replace"][0] == 3
    assert got["n_group"][1].startswith("transformers ") and "DeepseekV3Config" in got["n_group"][1]
    assert m.moe_layers() == []  # 3 layers, first_k_dense_replace 3: all dense, as transformers
    note = m.defaults_note()
    assert note is not None and "routed_scaling_factor=2.5" in note


def test_missing_keys_from_the_table_without_transformers(monkeypatch) -> None:
    """transformers not importable (an optional dependency): the family table's defaults, and
    the manifest says so."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    m = resolve_config(_deepseek_config_without_router_keys(), FAMILIES["deepseek_v3"])
    r = m.router
    assert (r.n_group, r.topk_group, r.routed_scaling_factor) == (8, 4, 2.5)
    sources = {d.source for d in m.defaulted}
    assert sources == {f"mxcli's deepseek_v3 table (transformers {TRANSFORMERS_DEFAULTS_VERSION})"}


def test_a_class_that_refuses_the_config_falls_back_to_the_table(monkeypatch) -> None:
    """Any exception of the config class (its own strict checks) is not the user's message."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def boom(**_: Any) -> Any:
        raise RecursionError("the class's own trouble")

    monkeypatch.setitem(CONFIG_MAPPING._extra_content, "deepseek_v3", boom)
    m = resolve_config(_deepseek_config_without_router_keys(), FAMILIES["deepseek_v3"])
    assert m.router.n_group == 8
    assert all(d.source.startswith("mxcli's deepseek_v3 table") for d in m.defaulted)


def test_present_values_are_taken_as_given() -> None:
    cfg = _deepseek_config_without_router_keys()
    cfg.update(n_group=1, topk_group=1, routed_scaling_factor=0.0, first_k_dense_replace=1)
    m = resolve_config(cfg, FAMILIES["deepseek_v3"])
    r = m.router
    assert (r.n_group, r.topk_group, r.routed_scaling_factor) == (1, 1, 0.0)
    assert not any(d.key in ("n_group", "topk_group", "routed_scaling_factor") for d in m.defaulted)
