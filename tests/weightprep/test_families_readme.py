"""The README's family table is true: every family and refusal is listed, with the kernel mode
and backward exactness the table (`mxcli.weightprep.families`) actually resolves to."""

from __future__ import annotations

import re
from pathlib import Path

from mxcli.weightprep.families import FAMILIES, REFUSED, resolve_config

README = Path(__file__).resolve().parents[2] / "README.md"


def _rows() -> dict[str, list[str]]:
    text = README.read_text()
    table = text[text.index("| family (`model_type`)") :].split("\n\n")[0]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            for mt in re.findall(r"`(\w+)`", cells[0]):
                rows[mt] = cells
    return rows


def _minimal(model_type: str) -> dict:
    v = {
        "hidden_size": 256, "num_hidden_layers": 2, "num_experts": 16, "num_local_experts": 16,
        "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "intermediate_size": 128, "norm_topk_prob": True, "shared_expert_intermediate_size": 128,
        "swiglu_limits": [0.0, 7.0],
    }  # fmt: skip
    if FAMILIES[_family(model_type)].text_config:
        return {"model_type": model_type, "text_config": v}
    return {"model_type": model_type, **v}


def _family(model_type: str) -> str:
    return next(f.name for f in FAMILIES.values() if model_type in f.model_types)


def test_readme_lists_every_family_with_its_mode_and_backward() -> None:
    rows = _rows()
    listed = {mt for f in FAMILIES.values() for mt in f.model_types} - {"llama4_text"}
    assert set(rows) == listed
    for mt, cells in rows.items():
        fam = FAMILIES[_family(mt)]
        r = resolve_config(_minimal(mt), fam).router
        assert cells[1].split("->")[-1].split()[0] == r.act_fn or (
            "same" in cells[1]  # "same, (1 + w) ...": the previous row's mode
        ), (mt, cells[1], r.act_fn)
        assert cells[3].startswith("not exact") is (not r.backward_exact), (mt, cells[3])
        row_models = {
            FAMILIES[_family(m)].real_model.split(" ")[0] for m in re.findall(r"`(\w+)`", cells[0])
        }
        named = [c.strip().split(" ")[0] for c in cells[4].split(",") if c.strip() != "..."]
        assert named and set(named) <= row_models, (mt, named, row_models)


def test_readme_lists_every_refusal() -> None:
    text = README.read_text()
    para = text[text.index("Refused: ") :].split("(top_k > 8).")[0]
    assert set(re.findall(r"`(\w+)`", para)) == set(REFUSED)
