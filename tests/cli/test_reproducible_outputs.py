"""The same command with the same arguments writes the same bytes: ``make-inputs`` and
``run-prefill`` twice, as fresh processes, into two folders under the same output name.

safetensors keeps ``__metadata__`` in a Rust ``HashMap`` seeded per process, so before the
header was rewritten with sorted keys (`mxcli.io.files._canonical_header`) two runs wrote the
keys in different orders (5 keys: 1 chance in 120 per file of the same order); run outputs also
carried the run's wall time (``elapsed_s``), which now stays in the command's summary."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mxcli.io.files import write_file


def _mxcli(*args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    return subprocess.run([sys.executable, "-m", "mxcli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _header(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, raw[8 : 8 + n]


@pytest.mark.parametrize("kernel", ["prefill", "bwd"])
def test_make_inputs_twice_is_byte_identical(tmp_path: Path, kernel: str) -> None:
    """The defaults (a small case) and a seed, twice; the metadata keys come sorted."""
    outs = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        out = tmp_path / run / "in.safetensors"
        r = _mxcli("make-inputs", kernel, "-o", out, "--tokens", "32", "--seed", "3", "-q")
        assert r.returncode == 0, r.stderr
        outs.append(out)
    assert _sha(outs[0]) == _sha(outs[1])
    _, head = _header(outs[0])
    keys = list(json.loads(head)["__metadata__"])
    assert keys == sorted(keys) == ["format", "generator", "kernel", "kwargs", "mxcli_version"]


def test_run_prefill_twice_is_byte_identical(tmp_path: Path) -> None:
    """The reference backend's outputs (exact math) with their metadata: no time in them."""
    inp = tmp_path / "in.safetensors"
    r = _mxcli("make-inputs", "prefill", "-o", inp, "--tokens", "32", "-q")
    assert r.returncode == 0, r.stderr
    outs = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        out = tmp_path / run / "out.safetensors"
        r = _mxcli("run-prefill", inp, "-o", out, "--backend", "reference", "--json")
        assert r.returncode == 0, r.stderr
        assert "run" in json.loads(r.stdout)["timing_s"]  # the time is the summary's
        outs.append(out)
    assert _sha(outs[0]) == _sha(outs[1])
    with safe_open(str(outs[0]), "pt") as f:
        assert "elapsed_s" not in (f.metadata() or {})


def test_sorted_header_keeps_every_value_and_the_data_offset(tmp_path: Path) -> None:
    """Values that JSON escapes (quotes, backslashes, control characters) and non-ASCII text:
    the rewritten header is as long as safetensors' own (same escaping as serde_json, so the
    padding stays under 8 bytes and the data where safetensors put it), and reads back."""
    meta = {"z": 'q"uo\\te', "a": "tab\there\nnl\x01\x1f\x7f", "m": "é ü \u2028 \U0001f600",
            "b": {"nested": [1, 2.5, None]}}  # fmt: skip
    t = {"x": torch.arange(6, dtype=torch.int32).reshape(2, 3), "w": torch.ones(3).bfloat16()}
    path = write_file(tmp_path / "m.safetensors", t, meta)
    n, head = _header(path)
    body = head.rstrip(b" ")
    assert n - len(body) < 8 and (8 + n) % 8 == 0
    doc = json.loads(body)
    assert list(doc["__metadata__"]) == ["a", "b", "m", "z"]
    with safe_open(str(path), "pt") as f:
        got = f.metadata()
        assert got == {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True)
                       for k, v in meta.items()}  # fmt: skip
        assert torch.equal(f.get_tensor("x"), t["x"]) and torch.equal(f.get_tensor("w"), t["w"])
