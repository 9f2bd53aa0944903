"""Hub repo ids as prep-weights sources, against a Hugging Face cache built here (no network:
HF_HUB_OFFLINE=1 throughout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.errors import MxcliError
from mxcli.weightprep.hub import looks_like_repo_id
from mxcli.weightprep.manifest import load_manifest
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint

hub = pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """models--Org--Tiny-MoE in the cache's own layout: refs/main -> COMMIT, refs/v2 -> OTHER;
    each snapshot a tiny Qwen3-MoE (3 layers over 3 shards; v2 with other values)."""
    root = tmp_path / "hf-cache"
    repo = root / "models--Org--Tiny-MoE"
    for ref, commit, seed in (("main", COMMIT, 0), ("v2", OTHER, 1)):
        build_checkpoint(
            "qwen3_moe", repo / "snapshots" / commit, num_layers=3, num_shards=3, seed=seed
        )
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return repo


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file names prep-weights asks huggingface_hub for."""
    asked: list[str] = []
    real = hub.hf_hub_download

    def spy(repo_id: str, filename: str, **kw: object) -> str:
        asked.append(filename)
        return str(real(repo_id, filename, **kw))

    monkeypatch.setattr(hub, "hf_hub_download", spy)
    return asked


def test_repo_id_detection(tmp_path: Path) -> None:
    assert looks_like_repo_id("Qwen/Qwen3-30B-A3B") and looks_like_repo_id("openai/gpt-oss-20b")
    assert not looks_like_repo_id("/models/x") and not looks_like_repo_id("a/b/c")
    assert not looks_like_repo_id(str(tmp_path))


def test_hub_source_fetches_only_the_selected_layers(
    cache: Path, fetched: list[str], tmp_path: Path
) -> None:
    snap = cache / "snapshots" / COMMIT
    index = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]
    read = ("model.layers.2.mlp.", "model.layers.2.post_attention_layernorm.")
    need = sorted({f for n, f in index.items() if n.startswith(read)})  # what layer 2's MoE reads
    out = tmp_path / "out"
    res = prepare_weights("Org/Tiny-MoE", out, PrepOptions(layers="2"))
    assert res["layers_written"] == [2]
    assert fetched[:2] == ["config.json", "model.safetensors.index.json"]
    assert sorted(fetched[2:]) == need and len(need) < len(set(index.values()))
    m = load_manifest(out)
    assert m.data["source"]["hub"] == {"repo_id": "Org/Tiny-MoE", "revision": None,
                                       "commit": COMMIT}  # fmt: skip
    assert set(m.data["source"]["files"]) == {"config.json", "model.safetensors.index.json", *need}
    # the same as converting the snapshot folder directly
    direct = tmp_path / "direct"
    prepare_weights(snap, direct, PrepOptions(layers="2"))
    t = m.layer(2)["ranks"]["0"]["tensors"]
    assert t == load_manifest(direct).layer(2)["ranks"]["0"]["tensors"]


def test_revision_and_dry_run(cache: Path, fetched: list[str], tmp_path: Path) -> None:
    by_commit = prepare_weights(
        "Org/Tiny-MoE", tmp_path / "o", PrepOptions(layers="0"), revision=OTHER
    )
    assert load_manifest(by_commit["output"]).data["source"]["hub"]["commit"] == OTHER
    for shard in (cache / "snapshots" / OTHER).glob("*.safetensors"):
        shard.unlink()  # a cache holding config and index only
    fetched.clear()
    plan = prepare_weights("Org/Tiny-MoE", None, PrepOptions(), dry_run=True, revision="v2")["plan"]
    assert fetched == ["config.json", "model.safetensors.index.json"]  # no shard for a plan
    assert plan["hub"] == {"repo_id": "Org/Tiny-MoE", "revision": "v2", "commit": OTHER}
    assert plan["planned_from_config"] is True and plan["layers"] == [0, 1, 2]
    assert all(e["source_shards"] for e in plan["per_layer"])  # from the index


def test_offline_cache_miss_and_unknown_revision(cache: Path, tmp_path: Path) -> None:
    (cache / "snapshots" / COMMIT / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(MxcliError, match=r"Org/Tiny-MoE: model-00002-of-00003.safetensors is "
                                          r"not in the Hugging Face cache and HF_HUB_OFFLINE"):  # fmt: skip
        prepare_weights("Org/Tiny-MoE", tmp_path / "o", PrepOptions())
    assert not (tmp_path / "o").exists()  # nothing written
    with pytest.raises(MxcliError, match=r"Org/Tiny-MoE@v9: config.json is not in the"):
        prepare_weights("Org/Tiny-MoE", None, PrepOptions(), dry_run=True, revision="v9")


def test_cli_hub_errors_are_one_line(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = CliRunner().invoke(app, ["prep-weights", "Org/Nope", "--dry-run"])
    assert r.exit_code == 2 and "Org/Nope: config.json is not in the Hugging Face cache" in r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, ["prep-weights", str(tmp_path), "--dry-run", "--revision", "v2"])
    assert r.exit_code == 2 and "--revision applies to Hugging Face repo ids" in r.output
    r = CliRunner().invoke(app, ["prep-weights", "Org/Tiny-MoE", "--dry-run", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["hub"]["commit"] == COMMIT
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    r = CliRunner().invoke(app, ["prep-weights", "Org/Tiny-MoE", "--dry-run"])
    assert r.exit_code == 2 and "pip install 'mxcli[hub]'" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_cli_fresh_process_cached_and_uncached(cache: Path, tmp_path: Path) -> None:
    """A fresh interpreter (nothing has imported ``huggingface_hub.errors`` yet): a cached repo
    plans, an uncached one is one line and exit 2 (once an AttributeError traceback, exit 1)."""
    from tests import procs

    cached = procs.start(["prep-weights", "Org/Tiny-MoE", "--dry-run", "--json"])
    missing = procs.start(["prep-weights", "Org/Nope", "--dry-run"])  # both at once: ~3 s
    out, err = cached.communicate(timeout=120)
    assert cached.returncode == 0, err
    plan = json.loads(out)
    assert plan["hub"] == {"repo_id": "Org/Tiny-MoE", "revision": None, "commit": COMMIT}
    assert plan["layers"] == [0, 1, 2]
    out, err = missing.communicate(timeout=120)
    assert missing.returncode == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: Org/Nope: config.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set"
    ]
