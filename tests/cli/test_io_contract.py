"""The safetensors I/O contract: names, kwargs from metadata, storage dtypes, output metadata."""

from __future__ import annotations

import inspect
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mxcli import __version__
from mxcli.errors import InputError
from mxcli.io.files import tensor_sha256, write_file
from mxcli.kernels import backends
from mxcli.kernels.blockwise_moe import SPEC as BWD_IO
from mxcli.kernels.blockwise_moe.inputs import make_bwd_inputs
from mxcli.kernels.blockwise_moe.spec import config_from_dict, config_to_dict
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL_IO
from mxcli.kernels.rmsnorm_mx_prefill.inputs import make_prefill_inputs
from mxcli.kernels.spec import read_kernel_file as read_file
from mxcli.runs import run_file, run_kernel

PREFILL, BWD = PREFILL_IO.name, BWD_IO.name


@pytest.mark.parametrize("io", [PREFILL_IO, BWD_IO], ids=["prefill", "bwd"])
def test_contract_names_are_the_kernel_signature(io) -> None:
    sig = inspect.signature(io.api).parameters
    # the API's positional-or-keyword parameters; keyword-only ones (backend, emulate) are extras
    params = [n for n, p in sig.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert sorted(params) == sorted(io.tensor_names + [s.name for s in io.scalars])
    defaults = inspect.signature(io.api).parameters
    for s in io.scalars:
        if s.name == "router_act_fn":
            assert s.parse(s.default) == defaults[s.name].default
        elif s.name != "qmx_output_dtype":
            assert s.parse(s.default) == defaults[s.name].default, s.name


@pytest.mark.parametrize(
    "act,residual,pack_aff,emit",
    list(
        itertools.product(
            ["SIGMOID", "SOFTMAX", "NOAUX_TC", None], [False, True], [False, True], [False, True]
        )
    ),
)
def test_prefill_output_names_match_the_reference(act, residual, pack_aff, emit) -> None:
    made = make_prefill_inputs(
        seq=8,
        hidden=512,
        experts=None if act is None else 8,
        top_k=2,
        router_act_fn=act or "SIGMOID",
        residual=residual,
        pack_affinities=pack_aff,
        emit_norm_bf16=emit,
        seed=0,
    )
    kwargs = PREFILL_IO.resolve_kwargs(made.kwargs)
    call = PREFILL_IO.call(made.tensors, kwargs)
    raw = backends.get(PREFILL, "reference")(call)
    named = PREFILL_IO.name_outputs(call, raw)
    expected = ["norm_quant_packed"]
    if act is not None:
        if act != "NOAUX_TC":
            expected.append("expert_index")
        if not pack_aff:
            expected.append("expert_affinities")
    if residual:
        expected.append("output_residual")
    if emit:
        expected.append("norm_bf16")
    assert list(named) == expected
    assert named["norm_quant_packed"].dtype == torch.float8_e4m3fn


def test_kwargs_precedence_defaults_file_keys_kwargs_flags() -> None:
    meta = {
        "top_k": "3",
        "eps": "1e-5",
        "kwargs": json.dumps({"top_k": 2, "router_act_fn": "SOFTMAX"}),
    }
    raw = PREFILL_IO.metadata_kwargs(meta)
    assert raw == {"top_k": 2, "eps": 1e-5, "router_act_fn": "SOFTMAX"}
    kw = PREFILL_IO.resolve_kwargs(raw, {"top_k": 1, "eps": None})
    assert kw["top_k"] == 1 and kw["eps"] == 1e-5 and kw["router_act_fn"].name == "SOFTMAX"
    assert kw["pack_scales"] is True  # default
    with pytest.raises(InputError, match="unknown kwarg"):
        PREFILL_IO.metadata_kwargs({"kwargs": json.dumps({"topk": 2})})
    with pytest.raises(InputError, match="router_act_fn"):
        PREFILL_IO.resolve_kwargs({"router_act_fn": "relu"})
    with pytest.raises(InputError, match="top_k: expected int"):
        PREFILL_IO.resolve_kwargs({"top_k": "two"})


def test_bwd_config_json_round_trip() -> None:
    from mxcli.kernels.blockwise_moe import ClampLimits, MXFP8MOEBwdConfig

    cfg = MXFP8MOEBwdConfig.routed(
        top_k=2, bias=True, clamp_limits=ClampLimits(-1.0, 1.0, None, 0.5)
    )
    cfg.phase1_config.enable_scale_packing = False
    d = config_to_dict(cfg)
    json.dumps(d)  # JSON-ready
    back = config_from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    partial = config_from_dict(
        {"single_expert_dense": False, "bias": True, "skip_dma": {"skip_token": True}}
    )
    assert partial.bias and partial.skip_dma.skip_token
    with pytest.raises(InputError, match="unknown field"):
        config_from_dict({"no_such_field": 1})
    with pytest.raises(InputError):
        config_from_dict({"affinity_option": "SIDEWAYS"})


def test_storage_of_x4_fp8_and_scales(tmp_path: Path) -> None:
    made = make_bwd_inputs(
        tokens=128,
        hidden=256,
        intermediate=128,
        experts=2,
        top_k=1,
        block_size=128,
        prequantize=True,
        seed=0,
    )
    path = tmp_path / "in.safetensors"
    from mxcli.inputs import write_inputs

    write_inputs(made, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["gate_up_proj_weight"] == "U32" and dtypes["down_proj_weight"] == "U32"
    assert dtypes["gate_up_weight_scales"] == "U8" and dtypes["down_weight_scales"] == "U8"
    assert dtypes["hidden_states"] == "BF16" and dtypes["token_position_to_id"] == "I32"
    assert meta["format"] == "mxcli.inputs/1" and meta["kernel"] == BWD
    kw = json.loads(meta["kwargs"])
    assert kw["block_size"] == 128 and kw["config"]["single_expert_dense"] is False
    out = tmp_path / "out.safetensors"
    run_file(BWD, path, out)
    # prefill: the packed rows are fp8 bytes
    pre = make_prefill_inputs(seq=4, hidden=512, experts=None, seed=0)
    res = run_kernel(PREFILL, pre.tensors, PREFILL_IO.resolve_kwargs(pre.kwargs))
    write_file(tmp_path / "p.safetensors", res.outputs, {"kernel": PREFILL})
    with safe_open(str(tmp_path / "p.safetensors"), "pt") as f:
        assert f.get_slice("norm_quant_packed").get_dtype() == "F8_E4M3"


def test_output_metadata_records_the_run(tmp_path: Path, files: dict[str, Path]) -> None:
    f = read_file(files["prefill_out"])
    inp = read_file(files["prefill"])
    m = f.metadata
    assert m["format"] == "mxcli.outputs/1"
    assert m["kernel"] == PREFILL and m["backend"] == "reference" and m["device"] == "cpu"
    assert m["mxcli_version"] == __version__
    kwargs = json.loads(m["kwargs"])
    assert set(kwargs) == {s.name for s in PREFILL_IO.scalars}
    assert kwargs["router_act_fn"] == "SOFTMAX" and kwargs["top_k"] == 2
    hashes = json.loads(m["input_sha256"])
    assert hashes == {k: tensor_sha256(t) for k, t in inp.tensors.items()}
    assert json.loads(m["geometry"]) == {"hidden_size": 512, "num_experts": 8}
    assert "elapsed_s" not in m  # no time in the file: the same run, the same bytes
    b = read_file(files["bwd_out"])
    assert list(b.tensors) == [
        "hidden_states_grad",
        "expert_affinities_masked_grad",
        "gate_up_proj_weight_grad",
        "down_proj_weight_grad",
    ]
    assert json.loads(b.metadata["kwargs"])["config"]["accumulate_hidden_states_grad"] is True


def test_read_file_rejects_corrupt_files(tmp_path: Path, files: dict[str, Path]) -> None:
    data = files["prefill"].read_bytes()
    cases = {
        "garbage": b"not a safetensors file at all",
        "empty": b"",
        "truncated": data[:-100],
        "header-only": data[:64],
    }
    for name, content in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(content)
        with pytest.raises(InputError, match=str(p.name)):
            read_file(p)
    with pytest.raises(InputError, match="no such file"):
        read_file(tmp_path / "missing.safetensors")


def test_write_file_is_atomic_and_needs_force(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    write_file(p, {"a": torch.zeros(2)}, {"k": {"v": 1}})
    assert json.loads(read_file(p).metadata["k"]) == {"v": 1}
    from mxcli.errors import OutputExistsError

    with pytest.raises(OutputExistsError):
        write_file(p, {"a": torch.ones(2)}, {})
    write_file(p, {"a": torch.ones(2)}, {}, force=True)
    assert read_file(p).tensors["a"].tolist() == [1.0, 1.0]
    assert [q.name for q in tmp_path.iterdir()] == ["x.safetensors"]


@pytest.mark.parametrize("io", [PREFILL_IO, BWD_IO], ids=["prefill", "bwd"])
def test_help_defaults_are_read_from_the_kernel_signature(cli, io) -> None:
    """run-prefill / run-bwd help texts show the defaults of the kernel's public signature: the
    flags are generated from the spec's scalar table, whose defaults are the signature's."""
    import enum

    r = cli(f"run-{io.short}", "--help")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    for s in io.scalars:
        d = inspect.signature(io.api).parameters[s.name].default
        assert s.default is d or s.default == d
        if s.file is not None:  # a JSON file of the value: no default to show
            assert f"{s.flag_name} <path>" in text
            continue
        shown = s.shown_default()
        if isinstance(d, bool):
            assert shown == ("on" if d else "off")
        elif isinstance(d, enum.Enum):
            assert shown == d.name.lower()
        elif isinstance(d, (int, float)):
            assert float(shown) == d
        elif d is not None:
            assert shown == str(d), s.name
        assert f"(kernel API: {shown})" in text, (s.name, shown)
