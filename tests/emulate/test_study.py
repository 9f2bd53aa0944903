"""The paired design of `run_study`: every arm of a seed starts from the same weights and sees
the same batches; the same inputs give the same report; a diverged run is a status, not NaN."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch

from mxcli.emulate import study
from mxcli.emulate.study import StudyOptions, run_study

pytest.importorskip("transformers")


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_paired_arms_see_identical_init_and_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int, str, str, str]] = []

    def fake_train(model: Any, arm: str, opts: Any, train: Any, held_out: Any, dense: Any,
                   on_step: Any, seed: int) -> dict[str, Any]:  # fmt: skip
        study._set_arm(model, arm, opts.scope)
        seen.append((arm, seed, _digest(list(model.state_dict().values())), _digest(train),
                     _digest(held_out)))  # fmt: skip
        # train a little so that a missing reset between arms would show
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        return {"seed": seed, "status": "ok", "eval_loss": 1.0 + 0.01 * seed,
                "losses": [1.0] * len(train), "_grads": {}, "_stats": {}}  # fmt: skip

    monkeypatch.setattr(study, "_train", fake_train)
    opts = StudyOptions.from_preset("tiny", steps=3, seeds=3)
    r = run_study(opts)
    assert [a for a, *_ in seen] == list(study.ARMS) * 3
    by_seed: dict[int, set[tuple[str, str]]] = {}
    for _, seed, init, train, _ in seen:
        by_seed.setdefault(seed, set()).add((init, train))
    assert sorted(by_seed) == [0, 1, 2]
    assert all(len(v) == 1 for v in by_seed.values())  # one init and one batch list per seed
    assert len({next(iter(v)) for v in by_seed.values()}) == 3  # seeds differ in both
    assert len({h for *_, h in seen}) == 1  # one held-out set for every run
    assert r["gap_to_bf16"]["neuron"]["per_seed"] == [0.0, 0.0, 0.0]
    assert r["data"]["sha256"] == "323190785a07fe7b88011d3eacac599c2fe2c936db4c769ef7eaa54506e1400e"


def _tiny(**kw: Any) -> dict[str, Any]:
    opts = StudyOptions.from_preset("tiny", **{"steps": 1, "seeds": 2, "arms": ("neuron",), **kw})
    r = run_study(opts)
    r.pop("timing")
    return r


def test_same_inputs_same_report() -> None:
    a, b = _tiny(), _tiny()
    assert json.dumps(a, allow_nan=False) == json.dumps(b, allow_nan=False)
    assert a["arms"] == ["fp32", "bf16", "neuron"]
    g = a["gap_to_bf16"]["neuron"]
    assert len(g["per_seed"]) == 2 and g["low"] <= g["mean"] <= g["high"]
    # step 1: same weights and batch on every arm, so MX differs only by its numerics
    first = [a["runs"][k][0]["losses"][0] for k in ("fp32", "bf16", "neuron")]
    assert max(first) - min(first) < 0.05 and len(set(first)) == 3
    sq = a["grad_sqnr_db_vs_fp32"]
    assert sq["bf16"]["experts"]["mean"] > sq["neuron"]["experts"]["mean"] > 5
    assert a["mx_value_stats"]["neuron"]["saturated_fraction"]["mean"] == 0.0


def test_divergence_is_a_status_with_nulls() -> None:
    r = _tiny(lr=1e30, steps=3)
    assert r["status"] == "diverged" and r["verdict"].startswith("diverged")
    bad = [x for a in r["arms"] for x in r["runs"][a] if x["status"] != "ok"]
    assert bad and all(x["eval_loss"] is None and None in x["losses"] for x in bad)
    json.dumps(r, allow_nan=False)  # strict JSON: raises on NaN / Infinity
