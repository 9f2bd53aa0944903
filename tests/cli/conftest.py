"""Fixtures of the CLI tests: a runner, small input files, and a deliberately wrong backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from mxcli.cli import app
from mxcli.inputs import write_inputs
from mxcli.kernels import backends
from mxcli.kernels.blockwise_moe import SPEC as BWD_SPEC
from mxcli.kernels.blockwise_moe.inputs import make_bwd_inputs
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL_SPEC
from mxcli.kernels.rmsnorm_mx_prefill.inputs import make_prefill_inputs
from mxcli.runs import run_file

PREFILL, BWD = PREFILL_SPEC.name, BWD_SPEC.name


class Cli:
    """`CliRunner` around the mxcli app; stdout and stderr kept apart."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.runner.invoke(app, [str(a) for a in args], **kw)


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="session")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small input files (and their reference outputs) shared by the tests; never modified."""
    d = tmp_path_factory.mktemp("inputs")
    out: dict[str, Path] = {}
    out["prefill"] = d / "prefill.safetensors"
    write_inputs(
        make_prefill_inputs(
            seq=64,
            hidden=512,
            experts=8,
            top_k=2,
            residual=True,
            router_act_fn="SOFTMAX",
            emit_norm_bf16=True,
            seed=1,
        ),
        out["prefill"],
    )
    out["noaux"] = d / "noaux.safetensors"
    write_inputs(
        make_prefill_inputs(
            seq=32,
            hidden=512,
            experts=16,
            top_k=2,
            n_group=4,
            topk_group=2,
            router_act_fn="NOAUX_TC",
            routed_scaling_factor=2.5,
            pack_affinities=True,
            seed=2,
        ),
        out["noaux"],
    )
    out["bwd"] = d / "bwd.safetensors"
    write_inputs(
        make_bwd_inputs(
            tokens=128, hidden=256, intermediate=128, experts=2, top_k=2, block_size=128, seed=3
        ),
        out["bwd"],
    )
    out["bwd_pq"] = d / "bwd_pq.safetensors"
    write_inputs(
        make_bwd_inputs(
            tokens=128,
            hidden=256,
            intermediate=128,
            experts=2,
            top_k=1,
            block_size=128,
            prequantize=True,
            seed=4,
        ),
        out["bwd_pq"],
    )
    for name, kernel in (("prefill", PREFILL), ("noaux", PREFILL), ("bwd", BWD), ("bwd_pq", BWD)):
        out[f"{name}_out"] = d / f"{name}_out.safetensors"
        run_file(kernel, out[name], out[f"{name}_out"], backend="reference")
    return out


def _corrupting(kernel: str) -> Any:
    ref = backends.get(kernel, "reference")

    def run(*args: Any, **kwargs: Any) -> Any:
        outs = list(ref(*args, **kwargs))
        first = outs[0]
        if first.dtype == torch.float8_e4m3fn:  # flip the sign bit of some codes
            b = first.view(torch.uint8).clone()
            b[:, :64] ^= 0x80
            outs[0] = b.view(torch.float8_e4m3fn)
        else:  # a gradient off by 10%
            outs[0] = (first.float() * 1.1).to(first.dtype)
        return outs

    return run


@pytest.fixture
def corrupt_backend() -> Iterator[str]:
    """A registered backend named ``corrupt`` whose outputs are deliberately wrong."""
    for kernel in (PREFILL, BWD):
        backends.register(kernel, "corrupt", _corrupting(kernel))
    yield "corrupt"
    for kernel in (PREFILL, BWD):
        backends._REGISTRY[kernel].pop("corrupt", None)
