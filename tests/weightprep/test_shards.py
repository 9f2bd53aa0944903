"""Multi-process prep (`mxcli.weightprep.shards`): the byte-balanced split, the launchers'
environments, and N real `mxcli prep-weights` processes sharing one folder (one SIGKILLed and
rerun with --resume), whose result is byte-identical to a single-process run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mxcli.errors import InputError
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.shards import Shard, describe, from_env, parse_shard, partition
from mxcli.weightprep.synthetic import build_checkpoint
from tests import procs

# -- the split ----------------------------------------------------------------------------------


def _check_split(layers: list[int], sizes: dict[int, int], n: int) -> list[list[int]]:
    parts = partition(layers, sizes, n)
    assert len(parts) == n
    assert [L for p in parts for L in p] == layers  # every layer once, in order: contiguous
    total, biggest = sum(sizes[L] for L in layers), max(sizes[L] for L in layers)
    for p in parts:  # within one layer of the fair share
        assert abs(sum(sizes[L] for L in p) - total / n) <= biggest
    assert partition(layers, sizes, n) == parts  # deterministic
    return parts


def test_equal_layers_split_by_count_within_one() -> None:
    layers = list(range(3, 61))  # DeepSeek-V3: 58 MoE layers
    sizes = dict.fromkeys(layers, 1000)
    for n in (1, 2, 3, 7, 8, 16, 58):
        counts = [len(p) for p in _check_split(layers, sizes, n)]
        assert max(counts) - min(counts) <= 1, (n, counts)
    assert partition(layers, sizes, 8)[0] == [3, 4, 5, 6, 7, 8, 9]  # 58/8 = 7.25: 7 or 8 each


def test_split_is_by_bytes_not_count() -> None:
    """A worked example: one layer is as big as the other four together."""
    sizes = {0: 400, 1: 100, 2: 100, 3: 100, 4: 100}
    assert _check_split(list(sizes), sizes, 2) == [[0], [1, 2, 3, 4]]
    # by count it would be [0, 1, 2] / [3, 4]: 600 vs 200 bytes
    sizes = {0: 10, 1: 10, 2: 10, 3: 70}
    assert _check_split(list(sizes), sizes, 2) == [[0, 1, 2], [3]]


def test_more_shards_than_layers_and_empty() -> None:
    parts = partition([5, 6], {5: 1, 6: 1}, 4)
    assert sorted(map(len, parts)) == [0, 0, 1, 1] and [L for p in parts for L in p] == [5, 6]
    assert partition([1, 2, 3], {}, 2) == [[1], [2, 3]]  # sizes unknown: by count
    with pytest.raises(InputError):
        partition([1], {1: 1}, 0)


def test_describe() -> None:
    assert describe([3, 4, 5, 9, 11, 12]) == "3-5,9,11-12"
    assert describe([]) == "none"


# -- where a shard comes from -------------------------------------------------------------------


def test_parse_shard() -> None:
    assert parse_shard("2/8") == Shard(2, 8) and str(parse_shard(" 0 / 1 ")) == "0/1"
    for bad in ("8/8", "1", "a/b", "-1/4", "1/0"):
        with pytest.raises(InputError, match="--shard"):
            parse_shard(bad)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16"}, (5, 16)),
        ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "8"}, (2, 8)),
        # array --array=10-24:2 -> 8 tasks, id 14 is the third
        (
            {
                "SLURM_ARRAY_TASK_ID": "14",
                "SLURM_ARRAY_TASK_COUNT": "8",
                "SLURM_ARRAY_TASK_MIN": "10",
                "SLURM_ARRAY_TASK_STEP": "2",
            },
            (2, 8),
        ),  # fmt: skip
        # 4 array tasks of 2 srun tasks each: array index 1, procid 1 -> 3 of 8
        (
            {
                "SLURM_ARRAY_TASK_ID": "1",
                "SLURM_ARRAY_TASK_COUNT": "4",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
            },
            (3, 8),
        ),  # fmt: skip
        # torchrun inside a Slurm job: torchrun's ranks
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (1, 2)),
    ],
)
def test_from_env(env: dict[str, str], expected: tuple[int, int] | None) -> None:
    got = from_env(env)
    assert (None if got is None else (got.index, got.count)) == expected


def test_from_env_errors_name_the_variables() -> None:
    with pytest.raises(InputError, match="RANK/WORLD_SIZE"):
        from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(InputError, match="SLURM_NTASKS: expected an integer"):
        from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"})


# -- N processes, one folder --------------------------------------------------------------------


def _hashes(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*.safetensors")) if not p.name.startswith(".")
    } | {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*.index.json"))
    }  # fmt: skip


def _mxcli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MXCLI_", "SLURM_"))}
    e.pop("RANK", None), e.pop("WORLD_SIZE", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)], capture_output=True, text=True, env=e,
        timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 6-layer qwen3_moe checkpoint and its single-process conversion (tp 2)."""
    root = tmp_path_factory.mktemp("shards")
    src = build_checkpoint("qwen3_moe", root / "src", num_layers=6, intermediate_size=256).path
    single = root / "single"
    prepare_weights(src, single, PrepOptions(tp=2))
    return src, single


def _start(src: Path, out: Path, env: dict[str, str], mode: str = "plain") -> subprocess.Popen:
    """`procs.start` (it passes this process's environment on) with only `env`'s launcher variables."""
    launcher = [k for k in os.environ if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE")]
    saved = {k: os.environ.get(k) for k in [*env, *launcher]}
    for k in launcher:
        del os.environ[k]
    os.environ.update(env)
    try:
        return procs.start(["prep-weights", src, out, "--tp", "2", "--quiet", "--json"], mode=mode)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_shards_in_one_folder_then_finalize(six_layers: tuple[Path, Path], tmp_path: Path) -> None:
    """Three shards one after the other (in process): no index until the last; --finalize
    before it refuses naming the missing shard; the result equals the single-process run."""
    src, single = six_layers
    out, opts = tmp_path / "out", PrepOptions(tp=2)
    r2 = prepare_weights(src, out, opts, shard=Shard(2, 3))
    r0 = prepare_weights(src, out, opts, shard=Shard(0, 3))
    assert (r2["layers_written"], r0["layers_written"]) == ([4, 5], [0, 1])
    assert r0["shard"]["missing_shards"] == [{"shard": "1/3", "layers": [2, 3]}]
    assert not r0["shard"]["finalized"] and not list(out.glob("rank*/*.index.json"))
    assert json.loads((out / "manifest.json").read_text())["shards"]["complete"] is False
    with pytest.raises(
        InputError, match=r"cannot finalize, shards not finished: 1/3 \(layers 2-3\)"
    ):
        prepare_weights(src, out, opts, finalize=True)
    r1 = prepare_weights(src, out, opts, shard=Shard(1, 3))
    assert r1["shard"]["finalized"] and r1["shard"]["missing_shards"] == []
    assert _hashes(out) == _hashes(single)
    assert prepare_weights(src, out, opts, finalize=True)["finalized"] is True
    assert _hashes(out) == _hashes(single)
    # a resumed shard skips its finished layers
    again = prepare_weights(src, out, opts, shard=Shard(1, 3))
    assert again["layers_written"] == [] and again["layers_skipped"] == [2, 3]


def test_shard_refusals(six_layers: tuple[Path, Path], tmp_path: Path) -> None:
    src, _ = six_layers
    out, opts = tmp_path / "out", PrepOptions(tp=2, layers="0-1")
    with pytest.raises(InputError, match="--force with shard 0/2"):
        prepare_weights(src, out, opts, shard=Shard(0, 2), force=True)
    with pytest.raises(InputError, match="no manifest.json to finalize"):
        prepare_weights(src, out, opts, finalize=True)
    res = prepare_weights(src, out, opts, shard=Shard(2, 3))
    assert res["layers_written"] == [1]  # shard 2/3 of 2 layers: layer 1 (1/3 is empty)
    with pytest.raises(InputError, match="prepared in 3 shards, this run asks 2"):
        prepare_weights(src, out, opts, shard=Shard(0, 2))
    with pytest.raises(InputError, match="the output was written with tp=2, this run asks tp=1"):
        prepare_weights(src, out, PrepOptions(layers="0-1"), finalize=True)


@pytest.mark.slow
def test_three_processes_share_one_folder(six_layers: tuple[Path, Path], tmp_path: Path) -> None:
    """Three concurrent processes, given their shard by --shard, torchrun's and Slurm's
    variables: the last one writes the indexes; the folder equals the single-process one."""
    src, single = six_layers
    out = tmp_path / "out"
    launch = [
        {"RANK": "0", "WORLD_SIZE": "3"},
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "3"},
        {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"},
    ]
    ps = [_start(src, out, env) for env in launch]
    results = []
    for p in ps:
        o, e = p.communicate(timeout=300)
        assert p.returncode == 0, e
        results.append(json.loads(o))
    shards = sorted((r["shard"]["index"], r["shard"]["layers"]) for r in results)
    assert shards == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])]
    assert sum(r["shard"]["finalized"] for r in results) >= 1  # the last to finish (or more)
    assert _hashes(out) == _hashes(single)
    m = json.loads((out / "manifest.json").read_text())
    assert m["shards"] == {"count": 3, "complete": True, "layers": [0, 1, 2, 3, 4, 5]}
    ref = json.loads((single / "manifest.json").read_text())
    assert m["source"]["files"] == ref["source"]["files"]  # every shard's source files, hashed
    for L, entry in ref["layers"].items():
        assert m["layers"][L]["ranks"] == entry["ranks"]
    assert not procs.temporaries(out)


@pytest.mark.slow
def test_killed_shard_rerun_with_resume(six_layers: tuple[Path, Path], tmp_path: Path) -> None:
    """Shard 1/2 is SIGKILLed mid-layer: shard 0/2 finishes without writing indexes, --finalize
    refuses naming shard 1/2 (exit 2, one line), the rerun with --resume finishes and
    finalizes; the result equals the single-process run."""
    src, single = six_layers
    out = tmp_path / "out"
    victim = _start(src, out, {"RANK": "1", "WORLD_SIZE": "2"}, mode="slow-pieces=0.2")
    procs.wait_for(lambda: bool(procs.temporaries(out)), victim)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert victim.returncode == -signal.SIGKILL

    r = _mxcli("prep-weights", src, out, "--tp", "2", "--shard", "0/2", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["shard"]
    assert res["finalized"] is False and res["missing_shards"] == [
        {"shard": "1/2", "layers": [3, 4, 5]}
    ]
    assert not list(out.glob("rank*/model.safetensors.index.json"))

    fin = _mxcli("prep-weights", src, out, "--tp", "2", "--finalize")
    assert fin.returncode == 2
    assert fin.stderr.strip().count("\n") == 0 and "1/2 (layers 3-5)" in fin.stderr
    assert "Traceback" not in fin.stderr

    bad = _mxcli("prep-weights", src, out, "--tp", "2", "--shard", "2/2")
    assert bad.returncode == 2 and "--shard: expected a shard I/N" in bad.stderr

    again = _mxcli("prep-weights", src, out, "--tp", "2", "--shard", "1/2", "--resume", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["shard"]["finalized"] is True
    assert _hashes(out) == _hashes(single)
    assert not procs.temporaries(out)
    fin = _mxcli("prep-weights", src, out, "--tp", "2", "--finalize")  # idempotent
    assert fin.returncode == 0 and "finalized" in fin.stdout and "from 2 shard(s)" in fin.stdout
    assert _hashes(out) == _hashes(single)
