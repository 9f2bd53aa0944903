"""The built-in case matrix of ``mxcli verify --suite quick|full``.

Each case is a seeded input generator call (`mxcli.inputs`). ``quick`` covers every output
and every feature path at small shapes (it runs in CI); ``full`` adds the upstream test shapes
that fit a CPU (prefill spec §7, bwd spec §11.4) and the remaining feature combinations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mxcli.errors import InputError
from mxcli.inputs import KernelInputs, make_inputs
from mxcli.kernels.blockwise_moe import SPEC as BWD
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL

SUITES = ("quick", "full")


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str
    params: dict[str, Any] = field(default_factory=dict)
    quick: bool = False  # also in the quick suite (the full suite runs every case)

    def make(self) -> KernelInputs:
        """The case's seeded inputs (`mxcli.inputs.make_inputs`)."""
        return make_inputs(self.kernel, **self.params)


def _p(name: str, quick: bool = False, **params: Any) -> Case:
    return Case(f"{PREFILL.short}/{name}", PREFILL.name, params, quick)


def _b(name: str, quick: bool = False, **params: Any) -> Case:
    return Case(f"{BWD.short}/{name}", BWD.name, params, quick)


_SOFTMAX: dict[str, Any] = {"router_act_fn": "SOFTMAX"}
_NOAUX: dict[str, Any] = {"router_act_fn": "NOAUX_TC", "routed_scaling_factor": 2.5}

CASES: tuple[Case, ...] = (
    # ---- rmsnorm_mx_prefill ----
    _p("norm-only-h512", True, seq=128, hidden=512, experts=None, seed=42),
    _p(
        "softmax-e16-k2-residual-norm",
        True,
        seq=96,
        hidden=1024,
        experts=16,
        top_k=2,
        residual=True,
        emit_norm_bf16=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "sigmoid-e8-k1-bias-unfolded-unpadded",
        True,
        batch=2,
        seq=32,
        hidden=1024,
        experts=8,
        top_k=1,
        router_act_fn="SIGMOID",
        router_bias=True,
        pack_scales=False,
        unpadded_hidden_size=960,
        seed=6,
    ),
    _p(
        "softmax-e17-k2-packaff",
        True,
        seq=64,
        hidden=2048,
        experts=17,
        top_k=2,
        pack_affinities=True,
        seed=7,
        **_SOFTMAX,
    ),
    _p(
        "noaux-e32-g4-tg2-k2",
        True,
        seq=64,
        hidden=512,
        experts=32,
        n_group=4,
        topk_group=2,
        top_k=2,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "noaux-e32-g4-tg2-k2-packaff",
        True,
        seq=64,
        hidden=512,
        experts=32,
        n_group=4,
        topk_group=2,
        top_k=2,
        pack_affinities=True,
        seed=8,
        **_NOAUX,
    ),
    # full only: upstream shapes (prefill spec §7), trimmed in T to fit a CPU run
    _p("norm-only-h3072", seq=256, hidden=3072, experts=None, seed=42),
    _p("norm-only-h2048-b3", batch=3, seq=128, hidden=2048, experts=None, seed=43),
    _p("softmax-e16-k1-h2048", seq=512, hidden=2048, experts=16, top_k=1, seed=5, **_SOFTMAX),
    _p(
        "softmax-e128-k4-h3072-unpadded-residual-packaff",
        seq=256,
        hidden=3072,
        unpadded_hidden_size=2880,
        experts=128,
        top_k=4,
        residual=True,
        pack_affinities=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "softmax-e128-k4-b16-s1",
        batch=16,
        seq=1,
        hidden=3072,
        unpadded_hidden_size=2880,
        experts=128,
        top_k=4,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "softmax-e256-k4-h7168-residual",
        seq=64,
        hidden=7168,
        experts=256,
        top_k=4,
        residual=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "sigmoid-e64-k8-fp16-residual",
        seq=128,
        hidden=1024,
        experts=64,
        top_k=8,
        router_act_fn="SIGMOID",
        residual=True,
        seed=9,
    ),
    _p(
        "noaux-e256-g8-tg4-k8",
        seq=256,
        hidden=2048,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "noaux-e256-g8-tg4-k8-packaff",
        seq=128,
        hidden=2048,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        pack_affinities=True,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "noaux-e256-h7168",
        seq=64,
        hidden=7168,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "norm-bf16-h7168-residual",
        seq=64,
        hidden=7168,
        experts=None,
        residual=True,
        emit_norm_bf16=True,
        seed=11,
    ),
    # ---- blockwise_mm_bwd_mxfp8 ----
    _b(
        "routed-e2-k1",
        True,
        tokens=256,
        hidden=256,
        intermediate=128,
        experts=2,
        top_k=1,
        block_size=128,
        seed=1,
    ),
    _b(
        "routed-e4-k2-bias",
        True,
        tokens=128,
        hidden=512,
        intermediate=256,
        experts=4,
        top_k=2,
        block_size=128,
        bias=True,
        seed=2,
    ),
    _b(
        "dense-e1",
        True,
        tokens=256,
        hidden=256,
        intermediate=128,
        experts=1,
        top_k=1,
        block_size=128,
        dense=True,
        seed=3,
    ),
    _b(
        "routed-e2-k2-clamp-prequant",
        True,
        tokens=128,
        hidden=384,
        intermediate=256,
        experts=2,
        top_k=2,
        block_size=128,
        clamp=(-1.0, 1.0, -0.5, 0.5),
        prequantize=True,
        seed=4,
    ),
    # full only: bwd spec §11.4 shapes and feature paths at small T
    _b(
        "routed-h1024-e4-k4-i256",
        tokens=256,
        hidden=1024,
        intermediate=256,
        experts=4,
        top_k=4,
        block_size=128,
        seed=11,
    ),
    _b(
        "routed-h2048-e2-k2-i256",
        tokens=256,
        hidden=2048,
        intermediate=256,
        experts=2,
        top_k=2,
        block_size=128,
        seed=12,
    ),
    _b(
        "routed-h384-e4-k2-i512",
        tokens=256,
        hidden=384,
        intermediate=512,
        experts=4,
        top_k=2,
        block_size=128,
        seed=13,
    ),
    _b(
        "routed-h512-e2-k2-b256-i256-bias",
        tokens=512,
        hidden=512,
        intermediate=256,
        experts=2,
        top_k=2,
        block_size=256,
        bias=True,
        seed=14,
    ),
    _b(
        "dense-h512-b512-i256",
        tokens=512,
        hidden=512,
        intermediate=256,
        experts=1,
        top_k=1,
        block_size=512,
        dense=True,
        seed=15,
    ),
    _b(
        "routed-block-larger-than-tokens",
        tokens=128,
        hidden=512,
        intermediate=256,
        experts=1,
        top_k=1,
        block_size=256,
        seed=16,
    ),
    _b(
        "routed-e8-k2-prequant-unpacked",
        tokens=256,
        hidden=512,
        intermediate=384,
        experts=8,
        top_k=2,
        block_size=128,
        prequantize=True,
        scale_layout="unpacked",
        seed=17,
    ),
    _b(
        "routed-prefill-router-e8-k2",
        tokens=256,
        hidden=512,
        intermediate=256,
        experts=8,
        top_k=2,
        block_size=128,
        router="prefill",
        seed=18,
    ),
    # full only: upstream sizes (prefill spec §7, bwd spec §11.4 baseline and blocking tables)
    _p(
        "upstream-softmax-e256-k4-h7168-t2048-residual",
        seq=2048,
        hidden=7168,
        experts=256,
        top_k=4,
        residual=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "upstream-softmax-e128-k4-h3072-t2048-packaff",
        seq=2048,
        hidden=3072,
        unpadded_hidden_size=2880,
        experts=128,
        top_k=4,
        residual=True,
        pack_affinities=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "upstream-noaux-e256-h7168-t128",
        seq=128,
        hidden=7168,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        seed=7,
        **_NOAUX,
    ),
    _b(
        "upstream-h2048-t1024-e2-b128-k1-i512",
        tokens=1024,
        hidden=2048,
        intermediate=512,
        experts=2,
        top_k=1,
        block_size=128,
        seed=21,
    ),
    _b(
        "upstream-h1024-t1024-e4-b512-k4-i256",
        tokens=1024,
        hidden=1024,
        intermediate=256,
        experts=4,
        top_k=4,
        block_size=512,
        seed=22,
    ),
    _b(
        "upstream-h384-t1024-e4-b128-k2-i512",
        tokens=1024,
        hidden=384,
        intermediate=512,
        experts=4,
        top_k=2,
        block_size=128,
        seed=23,
    ),
    _b(
        "upstream-h2048-t1024-e4-b256-k2-i384-prequant",
        tokens=1024,
        hidden=2048,
        intermediate=384,
        experts=4,
        top_k=2,
        block_size=256,
        prequantize=True,
        seed=24,
    ),
    _b(
        "upstream-dense-h2048-t1024-b512-i768",
        tokens=1024,
        hidden=2048,
        intermediate=768,
        experts=1,
        top_k=1,
        block_size=512,
        dense=True,
        seed=25,
    ),
)


def select(
    suite: str, pattern: str | None = None, kernel: str | None = None, cases: Iterable[Case] = CASES
) -> list[Case]:
    """Cases of ``suite`` (``quick`` or ``full``), optionally filtered by a name substring or
    glob and by kernel."""
    import fnmatch

    if suite not in SUITES:
        raise InputError(f"suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    out = [c for c in cases if suite == "full" or c.quick]
    if kernel is not None:
        out = [c for c in out if c.kernel == kernel or c.name.startswith(kernel + "/")]
    if pattern:
        pat = pattern if any(ch in pattern for ch in "*?[") else f"*{pattern}*"
        out = [c for c in out if fnmatch.fnmatch(c.name, pat)]
        if not out:
            raise InputError(f"case: no {suite} case matches {pattern!r}")
    return out
