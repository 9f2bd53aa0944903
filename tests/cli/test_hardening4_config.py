"""Issue 28, items 3, 5, 6, 7, 9, 10 and 16, through the CLI as fresh processes: configs read as
transformers reads them, router kwargs the kernel refuses refused when the plan is made, one line
for a hostile config.json or JSON file, integer experts refused, a verify gate that fails on any
byte the source does not give, and messages naming the offending field or flag."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

DEEP = "[" * 100_000 + "]" * 100_000  # nested past any JSON parser's recursion


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}


def _mxcli(*args: object, timeout: float = 300) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
    )


def _one_error_line(r: Any) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 checkpoint (E = 8, n_group 4, topk_group 2, scale 2.5); never modified."""
    from mxcli.weightprep.synthetic import build_checkpoint

    return build_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds") / "ck").path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mxcli.weightprep.synthetic import build_checkpoint

    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qw") / "ck").path


def _edited(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of checkpoint `src` whose config.json `edit(cfg)` changed in place."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _dry_plan(ck: Path) -> dict[str, Any]:
    r = _mxcli("prep-weights", ck, "--dry-run", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    return json.loads(r.stdout)  # type: ignore[no-any-return]


# ---- 5. missing router keys read as transformers defaults them --------------------------------


def test_missing_deepseek_router_keys_take_transformers_defaults(deepseek, tmp_path) -> None:
    """transformers' DeepseekV3Config defaults n_group 8, topk_group 4, routed_scaling_factor
    2.5 (configuration_deepseek_v3.py); mxcli planned 1 / 1 / 1.0. The plan says which keys
    were defaulted, and from what."""
    from transformers import DeepseekV3Config

    ref = DeepseekV3Config()
    gone = ("n_group", "topk_group", "routed_scaling_factor")
    ck = _edited(deepseek, tmp_path / "ck", lambda c: [c.pop(k) for k in gone])
    plan = _dry_plan(ck)
    r = plan["router"]
    assert (
        (r["n_group"], r["topk_group"], r["routed_scaling_factor"])
        == (
            ref.n_group,
            ref.topk_group,
            ref.routed_scaling_factor,
        )
        == (8, 4, 2.5)
    )
    defaulted = {d["key"]: d for d in plan["config_defaults"]}
    assert set(gone) <= set(defaulted)
    assert defaulted["n_group"]["value"] == 8
    assert "DeepseekV3Config" in defaulted["n_group"]["from"]
    assert any("n_group=8" in n and "DeepseekV3Config" in n for n in plan["notes"])
    # the text plan says it too
    text = _mxcli("prep-weights", ck, "--dry-run")
    assert text.returncode == 0 and "n_group=8" in text.stdout, text.stdout


def test_zero_routed_scaling_factor_is_taken_as_given(deepseek, tmp_path) -> None:
    ck = _edited(deepseek, tmp_path / "ck", lambda c: c.update(routed_scaling_factor=0))
    plan = _dry_plan(ck)
    assert plan["router"]["routed_scaling_factor"] == 0.0  # was planned as 1.0
    assert "routed_scaling_factor" not in {d["key"] for d in plan["config_defaults"]}


def test_defaulted_keys_are_recorded_in_the_manifest(deepseek, tmp_path) -> None:
    ck = _edited(deepseek, tmp_path / "ck", lambda c: c.pop("routed_scaling_factor"))
    out = tmp_path / "out"
    r = _mxcli("prep-weights", ck, out, "--layers", "1", "--formats", "bf16", "-q")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["router"]["routed_scaling_factor"] == 2.5
    assert m["layers"]["1"]["prefill_kwargs"]["routed_scaling_factor"] == 2.5
    (d,) = [d for d in m["source"]["config_defaults"] if d["key"] == "routed_scaling_factor"]
    assert d["value"] == 2.5 and "transformers" in d["from"]


# ---- 7. router kwargs the kernel refuses: refused with the kernel's message at plan time ------


def _contract_message(**kwargs: Any) -> str:
    """What the prefill kernel contract says about these kwargs (E = 8, NOAUX_TC), computed
    through the contract itself: the very message make-inputs / run-prefill give."""
    import torch

    from mxcli.kernels.rmsnorm_mx_prefill import SPEC

    base = dict(router_act_fn="NOAUX_TC", top_k=2, n_group=4, topk_group=2)
    base.update(routed_scaling_factor=2.5, eps=1e-6)
    base.update(kwargs)
    try:
        parsed = SPEC.resolve_kwargs(base)
        SPEC.validate(
            torch.zeros(1, 1, 512, dtype=torch.bfloat16),
            torch.ones(512),
            torch.zeros(512, 8, dtype=torch.bfloat16),
            torch.zeros(8),
            **parsed,
        )
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"the contract accepts {kwargs}")


@pytest.mark.parametrize(
    ("config", "kernel", "key"),
    [
        ({"topk_group": 8, "n_group": 4}, {"topk_group": 8, "n_group": 4}, "topk_group"),
        ({"routed_scaling_factor": float("inf")}, {"routed_scaling_factor": float("inf")}, None),
        ({"routed_scaling_factor": float("nan")}, {"routed_scaling_factor": float("nan")}, None),
        ({"rms_norm_eps": -1e-6}, {"eps": -1e-6}, "rms_norm_eps"),
        ({"n_group": 3}, {"n_group": 3}, "n_group"),
        ({"n_group": 16}, {"n_group": 16}, "n_group"),
        ({"topk_group": 0}, {"topk_group": 0}, "topk_group"),
    ],
)
def test_router_kwargs_the_kernel_refuses_fail_the_dry_run(
    deepseek, tmp_path, config, kernel, key
) -> None:
    """Before: prep-weights and --dry-run passed; make-inputs / run-prefill refused later."""
    ck = _edited(deepseek, tmp_path / "ck", lambda c: c.update(config))
    expected = _contract_message(**kernel)
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run"))
    assert expected in line, (expected, line)
    assert f"config.json {key or next(iter(config))}" in line


def test_router_kwargs_the_kernel_refuses_fail_prep_weights(deepseek, tmp_path) -> None:
    ck = _edited(deepseek, tmp_path / "ck", lambda c: c.update(topk_group=8, n_group=4))
    out = tmp_path / "out"
    line = _one_error_line(_mxcli("prep-weights", ck, out, "-q"))
    assert _contract_message(topk_group=8, n_group=4) in line
    assert not out.exists()


# ---- 9. hostile config values: one line naming the key -----------------------------------------


_WRONG_TYPES = [
    ("deepseek", {"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq must be an integer >= 0"),
    ("qwen", {"mlp_only_layers": 1}, "mlp_only_layers must be a list of layer indices"),
    ("deepseek", {"n_group": "8"}, "n_group must be an integer, got '8'"),
    ("deepseek", {"first_k_dense_replace": "1"}, "first_k_dense_replace must be an integer"),
    ("qwen", {"decoder_sparse_step": "x"}, "decoder_sparse_step must be an integer >= 0"),
    ("qwen", {"hidden_size": "256"}, "hidden_size must be a positive integer, got '256'"),
    ("qwen", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
]


@pytest.mark.parametrize(("family", "config", "needle"), _WRONG_TYPES[:3])
def test_wrong_config_types_are_one_line_naming_the_key(
    request, tmp_path, family, config, needle
) -> None:
    """Before: a TypeError traceback (a list or an int where the other belongs) or "invalid
    literal for int()" without the key."""
    ck = _edited(request.getfixturevalue(family), tmp_path / "ck", lambda c: c.update(config))
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run"))
    assert needle in line and "config.json" in line, line


@pytest.mark.parametrize(("family", "config", "needle"), _WRONG_TYPES)
def test_wrong_config_types_name_the_key_in_the_plan(
    request, tmp_path, family, config, needle
) -> None:
    from mxcli.weightprep.families import ConfigError
    from mxcli.weightprep.plan import PrepOptions, build_plan

    ck = _edited(request.getfixturevalue(family), tmp_path / "ck", lambda c: c.update(config))
    with pytest.raises(ConfigError, match="config.json") as e:
        build_plan(ck, PrepOptions(), config_only_ok=True)
    assert needle in str(e.value)


def test_absurd_layer_count_is_refused_before_iterating(qwen, tmp_path) -> None:
    """``num_hidden_layers: 10**12`` hung --dry-run (a loop over every layer)."""
    ck = _edited(qwen, tmp_path / "ck", lambda c: c.update(num_hidden_layers=10**12))
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run", timeout=60))
    assert "num_hidden_layers must be an integer in [1, 4096], got 1000000000000" in line


_TERMINATED_PLAN = """
import sys
import mxcli.weightprep.runner as runner
from mxcli.errors import Terminated

def terminated(*a, **k):  # SIGTERM while planning, deterministically (no signal timing)
    raise Terminated(15)

runner.prepare_weights = terminated
sys.argv = ["mxcli", *sys.argv[1:]]
from mxcli.cli import main
main()
"""


@pytest.mark.parametrize("dry_run", [True, False])
def test_interrupted_dry_run_does_not_advise_resume(qwen, tmp_path, dry_run) -> None:
    """A SIGTERM during ``--dry-run`` advised ``--resume`` (a dry run writes nothing)."""
    args = [qwen, "--dry-run"] if dry_run else [qwen, tmp_path / "out"]
    r = subprocess.run(
        [sys.executable, "-c", _TERMINATED_PLAN, "prep-weights", *map(str, args)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert r.returncode == 128 + 15, (r.returncode, r.stderr)
    assert "interrupted (SIGTERM)" in r.stderr
    assert ("--resume" in r.stderr) is not dry_run, r.stderr
    if dry_run:
        assert "a dry run writes nothing" in r.stderr


# ---- 10. JSON nested 100,000 deep: one line naming the file ------------------------------------


def test_deep_config_json_is_one_line(qwen, tmp_path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(qwen, ck)
    (ck / "config.json").write_text(DEEP)
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run"))
    assert "config.json: not valid JSON (nested too deeply" in line


def test_deep_index_json_is_one_line(qwen, tmp_path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(qwen, ck)
    (ck / "model.safetensors.index.json").write_text(DEEP)
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run"))
    assert "model.safetensors.index.json: not valid JSON (nested too deeply" in line


def test_deep_manifest_is_one_line(tmp_path) -> None:
    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / "manifest.json").write_text(DEEP)
    out = tmp_path / "in.safetensors"
    for args in (
        ("inspect", folder),
        ("make-inputs", "prefill", "-o", out, "--weights", folder, "--layer", 0),
    ):
        line = _one_error_line(_mxcli(*args))
        assert "manifest.json: not valid JSON (nested too deeply" in line, line
    assert not out.exists()


def test_deep_bwd_config_file_is_one_line(files, tmp_path) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(DEEP)
    out = tmp_path / "out.safetensors"
    line = _one_error_line(_mxcli("run-bwd", files["bwd"], "-o", out, "--config", cfg))
    assert "cfg.json: not valid JSON (nested too deeply" in line
    assert not out.exists()


def test_deep_kwargs_metadata_is_one_line(files, tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(files["prefill"]), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    meta["kwargs"] = DEEP
    bad = tmp_path / "deep.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    out = tmp_path / "out.safetensors"
    line = _one_error_line(_mxcli("run-prefill", bad, "-o", out))
    assert "__metadata__['kwargs']: not valid JSON (nested too deeply" in line
    assert not out.exists()


@pytest.mark.parametrize("text", ["{", "[1, 2", "\xff\xfe", ""])
def test_malformed_json_is_one_line_naming_the_file(qwen, tmp_path, text) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(qwen, ck)
    (ck / "config.json").write_bytes(text.encode("latin-1"))
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run"))
    assert "config.json: not valid JSON" in line


# ---- 6. integer experts refused; F32 experts report their real bf16 rounding ------------------


def _retyped(src: Path, dst: Path, pick: Any, convert: Any) -> list[str]:
    """A copy of checkpoint `src` with every tensor whose name `pick` accepts stored as
    `convert(tensor)`; the names changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    changed = []
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        for k in tensors:
            if pick(k):
                tensors[k] = convert(tensors[k])
                changed.append(k)
        save_file(tensors, str(shard), metadata=meta)
    return changed


@pytest.mark.parametrize("dtype", ["int8", "int64", "bool", "uint8"])
def test_integer_expert_weights_without_a_config_are_refused(qwen, tmp_path, dtype) -> None:
    import torch

    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _retyped(qwen, tmp_path / "ck", lambda k: k == name, lambda t: t.to(getattr(torch, dtype)))
    out = tmp_path / "out"
    line = _one_error_line(_mxcli("prep-weights", tmp_path / "ck", out, "-q"))
    st = {"int8": "I8", "int64": "I64", "bool": "BOOL", "uint8": "U8"}[dtype]
    assert name in line and f"dtype {st}" in line and "no quantization_config" in line, line
    assert not out.exists()


def test_f32_experts_report_their_bf16_rounding(qwen, tmp_path) -> None:
    """F32 experts were reported bf16 ``exact`` with ``max_abs_diff 0``: the check compared the
    output with the source's own bf16 cast. Oracle: the largest |bf16(x) - x| over the layer's
    routed experts, computed here from the F32 source."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(28)

    def widen(t: Any) -> Any:  # values bf16 cannot hold: not a cast of the bf16 source
        return t.float() + torch.randn(t.shape, generator=g) * 1e-3

    ck = tmp_path / "ck"
    _retyped(qwen, ck, lambda k: ".mlp.experts." in k, widen)
    out = tmp_path / "out"
    r = _mxcli("prep-weights", ck, out, "--layers", "1", "--check", "-q")
    assert r.returncode == 0, r.stderr
    worst = 0.0
    for shard in ck.glob("*.safetensors"):
        for k, t in load_file(str(shard)).items():
            if k.startswith("model.layers.1.mlp.experts.") and k.endswith("proj.weight"):
                assert t.dtype == torch.float32
                worst = max(worst, float((t.to(torch.bfloat16).float() - t).abs().max()))
    assert worst > 0
    check = json.loads((out / "manifest.json").read_text())["layers"]["1"]["check"]["0"]
    got = max(check[k]["max_abs_diff"] for k in ("gate_up_proj_weight", "down_proj_weight"))
    assert not check["gate_up_proj_weight"]["exact"] and not check["down_proj_weight"]["exact"]
    assert got == pytest.approx(worst, rel=0, abs=0)  # the same max over the same numbers
    assert "changed_values" not in check["gate_up_proj_weight"]  # an MXFP8 figure only
    assert check["gate_up_proj_weight_mxfp8"]["sqnr_db"] is not None


# ---- 16. messages name the offending field or flag ---------------------------------------------


def _ct_config(**weights: Any) -> dict[str, Any]:
    w = {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 32}
    w["scale_dtype"] = "torch.uint8"
    w.update(weights)
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}},
    }


@pytest.mark.parametrize(
    ("weights", "named", "not_named"),
    [
        ({"strategy": "channel"}, "strategy='channel'", "group_size="),
        ({"scale_dtype": "torch.float32"}, "scale_dtype='torch.float32'", "group_size="),
        ({"group_size": 16}, "group_size=16", "strategy="),
    ],
)
def test_compressed_tensors_mxfp8_names_the_wrong_field(
    qwen, tmp_path, weights, named, not_named
) -> None:
    """Before: "needs group_size 32 and uint8 scales, got group_size=32" for a channel
    strategy or F32 scales (the field that was right)."""
    ck = _edited(
        qwen, tmp_path / "ck", lambda c: c.update(quantization_config=_ct_config(**weights))
    )
    line = _one_error_line(_mxcli("prep-weights", ck, "--dry-run"))
    assert "mxfp8-quantized needs" in line and named in line and not_named not in line, line


@pytest.mark.parametrize(("flag", "value"), [("--intermediate", 100), ("--hidden", 200)])
def test_make_inputs_bwd_size_names_the_flag(tmp_path, flag, value) -> None:
    """Before: "K: wrapX needs a positive multiple of 128, got 100" (no flag)."""
    out = tmp_path / "in.safetensors"
    line = _one_error_line(_mxcli("make-inputs", "bwd", "-o", out, flag, value, "-q"))
    assert f"({flag}): expected a positive multiple of 128" in line and f"got {value}" in line
    assert "wrapX" not in line
    assert not out.exists()


# ---- 3. verify --checkpoint: any byte the source does not give fails the gate ----------------


def _flip(path: Path, name: str, n: int, stride: int = 7) -> tuple[int, str]:
    """XOR bit 0 of `n` bytes (every `stride`-th) of tensor `name` in a safetensors file: `n`
    bytes differ afterwards. Returns (n, the tensor's new sha256)."""
    import hashlib
    import struct

    raw = bytearray(path.read_bytes())
    hlen = struct.unpack("<Q", raw[:8])[0]
    a, b = json.loads(raw[8 : 8 + hlen])[name]["data_offsets"]
    start = 8 + hlen + a
    assert n * stride <= b - a
    for i in range(n):
        raw[start + i * stride] ^= 0x01
    path.write_bytes(bytes(raw))
    return n, hashlib.sha256(bytes(raw[start : 8 + hlen + b])).hexdigest()


@pytest.fixture(scope="module")
def prepared(qwen, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen prepared with the defaults (bf16 + mxfp8, packed, neuron); never modified."""
    from mxcli.weightprep.plan import PrepOptions
    from mxcli.weightprep.runner import prepare_weights

    out = tmp_path_factory.mktemp("prep") / "p"
    prepare_weights(qwen, out, PrepOptions())
    return out


_MX = "layers.1.gate_up_proj_weight_mxfp8"


def _verify(out: Path, src: Path, *extra: object) -> Any:
    return _mxcli("verify", "--checkpoint", out, "--against", src, "--json", *extra)


def test_verify_checkpoint_fails_on_flipped_mxfp8_codes(qwen, prepared, tmp_path) -> None:
    """1,052 MXFP8 codes flipped in a layer passed ``verify --checkpoint`` (SQNR stays above
    the floor). Now both the recorded sha256 and the re-derived bytes catch it."""
    out = tmp_path / "p"
    shutil.copytree(prepared, out)
    n, _ = _flip(out / "rank0" / "layer_001.safetensors", _MX, 1052)
    r = _verify(out, qwen)
    assert r.returncode == 1, (r.stdout, r.stderr)
    rep = json.loads(r.stdout)
    assert not rep["passed"] and rep["rederived"] is True
    wrong = "\n".join(rep["wrong"])
    assert "gate_up_proj_weight_mxfp8: sha256 differs from the manifest's" in wrong
    assert f"{_MX} rank 0: {n} bytes differ from the MXFP8 of the source" in wrong
    # --hashes-only reads no source tensor and still fails on the recorded hash
    r = _verify(out, qwen, "--hashes-only")
    assert r.returncode == 1 and json.loads(r.stdout)["rederived"] is False, r.stdout
    assert "sha256 differs" in "\n".join(json.loads(r.stdout)["wrong"])


@pytest.mark.slow  # ~15 s: a second export/verify; the fast case is above
def test_verify_checkpoint_rederives_past_a_rewritten_manifest(qwen, prepared, tmp_path) -> None:
    """Flipped codes whose sha256 was rewritten in the manifest: the hashes agree, the bytes
    re-derived from the source do not. --hashes-only trusts the manifest (its documented
    limit) and passes."""
    out = tmp_path / "p"
    shutil.copytree(prepared, out)
    n, sha = _flip(out / "rank0" / "layer_001.safetensors", "layers.1.down_weight_scales", 33)
    mpath = out / "manifest.json"
    m = json.loads(mpath.read_text())
    m["layers"]["1"]["ranks"]["0"]["tensors"]["down_weight_scales"]["sha256"] = sha
    mpath.write_text(json.dumps(m))
    r = _verify(out, qwen)
    assert r.returncode == 1, (r.stdout, r.stderr)
    wrong = json.loads(r.stdout)["wrong"]
    assert wrong == [
        f"layers.1.down_weight_scales rank 0: {n} bytes differ from the MXFP8 of the source "
        "(scale rule neuron, +-448)"
    ]
    assert _verify(out, qwen, "--hashes-only").returncode == 0


@pytest.mark.parametrize("opts", [{}, {"tp": 2, "fp8_range": 240, "scale_layout": "unpacked"}])
def test_verify_checkpoint_passes_what_the_conversion_wrote(qwen, tmp_path, opts) -> None:
    """The re-derivation agrees byte for byte with the conversion (clipped +-240 codes, TP
    slices and unpacked scales included)."""
    from mxcli.verification.checkpoints import verify_checkpoint
    from mxcli.weightprep.plan import PrepOptions
    from mxcli.weightprep.runner import prepare_weights

    out = tmp_path / "p"
    prepare_weights(qwen, out, PrepOptions(**opts))
    rep = verify_checkpoint(out, qwen)
    assert rep["passed"], rep
    assert rep["rederived"] and not rep["wrong"]


@pytest.fixture(scope="module")
def ct_export(qwen, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ct") / "ct"
    r = _mxcli("prep-weights", qwen, out, "--output-format", "compressed-tensors", "-q")
    assert r.returncode == 0, r.stderr
    return out


def test_verify_compressed_tensors_fails_on_flipped_codes(qwen, ct_export, tmp_path) -> None:
    from mxcli.verification.checkpoints import verify_checkpoint

    assert verify_checkpoint(ct_export, qwen)["passed"]
    out = tmp_path / "ct"
    shutil.copytree(ct_export, out)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    shard = next(p for p in out.glob("*.safetensors") if name in json.loads(_header_bytes(p)))
    n, _ = _flip(shard, name, 40)
    r = _verify(out, qwen)
    assert r.returncode == 1, (r.stdout, r.stderr)
    wrong = json.loads(r.stdout)["wrong"]
    assert f"{name}: {n} code or scale bytes differ from the MXFP8 of the source " in "\n".join(
        wrong
    )
    line = _one_error_line(_verify(out, qwen, "--hashes-only"))
    assert "--hashes-only" in line and "records no hashes" in line


def _header_bytes(path: Path) -> bytes:
    import struct

    raw = path.read_bytes()
    return raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]]


def test_verify_help_documents_hashes_only() -> None:
    r = _mxcli("verify", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--hashes-only" in text and "skip re-deriving the weights" in text


@pytest.mark.slow  # ~15 s: a second export/verify; the fast case is above
def test_verify_nxdi_mx_fails_on_flipped_codes(tmp_path) -> None:
    """The nxdi export (MX experts, H = 512): codes re-derived under the recorded rule."""
    from mxcli.verification.checkpoints import verify_checkpoint
    from mxcli.weightprep.synthetic import build_checkpoint

    src = build_checkpoint("qwen3_moe", tmp_path / "ck", hidden_size=512).path
    out = tmp_path / "nx"
    r = _mxcli("prep-weights", src, out, "--output-format", "nxdi", "--formats", "mxfp8", "-q")
    assert r.returncode == 0, r.stderr
    assert verify_checkpoint(out, src)["passed"]
    name = "layers.1.mlp.expert_mlps.mlp_op.down_proj.weight"
    _flip(out / "weights" / "tp0_moe_only.safetensors", name, 20)
    r = _verify(out, src)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert any(
        name in w and "codes or scales differ from MXFP8 of the source" in w
        for w in json.loads(r.stdout)["wrong"]
    ), r.stdout
