"""Latencies AWS measured on Trn3 hardware, carried over as facts with their source.

The cost model (`mxcli.nkisim.cost`) takes its figures from the Neuron documentation; these are
the measurements it is checked against (tests/nkisim/test_cost_calibration.py,
scripts/bench_nki.py). Nothing here feeds the model.

Sources (aws-neuron/nki-library, the files at the commits named):
- `MATMUL_BF16`: ``test/integration/nkilib/experimental/matmul_mxfp8/bf16_baseline_cache.json``
  at commit 092a49dcdffb3ee0d63dbb71abd65dc70ca80821: ``torch.matmul`` of bf16 ``[M, K] @ [K,
  N]`` on one Trn3 chip's logical core (``num_lnc`` 2), ``inference_time`` in seconds (we keep
  microseconds) and ``mfu_percent``, per ``"MxKxN"`` key.
- `BWD_MXFP8`: ``test/integration/nkilib/experimental/moe_mxfp8/tuned_blocking.py`` at commit
  e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07: AWS's MXFP8 MoE backward kernel at H 4096, I_TP 1536,
  one block of B = T = 4096 tokens of one expert, LNC 2, SHARD_ON_FREE: "N=1: 2.342ms DMA ->
  2.190ms NC" (phase-3/4 transposes on the DMA, the PE idle ~49% of the wall-clock; or on the
  PE).

No measured MX-matmul or elementwise latency is published there (the MX matmul tests hold
tolerance thresholds and autotune configurations, not times), so neither is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MatmulPoint", "MATMUL_BF16", "BwdPoint", "BWD_MXFP8", "MATMUL_SOURCE", "BWD_SOURCE",
    "PhaseBlocking", "BWD_TUNED_BLOCKING",
]  # fmt: skip

MATMUL_SOURCE = (
    "aws-neuron/nki-library@092a49dcdffb3ee0d63dbb71abd65dc70ca80821:"
    "test/integration/nkilib/experimental/matmul_mxfp8/bf16_baseline_cache.json"
)
BWD_SOURCE = (
    "aws-neuron/nki-library@e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07:"
    "test/integration/nkilib/experimental/moe_mxfp8/tuned_blocking.py"
)


@dataclass(frozen=True)
class MatmulPoint:
    """One measured bf16 ``torch.matmul``: ``[M, K] @ [K, N]`` at LNC 2."""

    M: int
    K: int
    N: int
    us: float  # inference_time
    mfu_percent: float
    name: str  # the file's shape_name


MATMUL_BF16: tuple[MatmulPoint, ...] = (
    MatmulPoint(4096, 4096, 4096, 999.124272, 87.45792268505045, "Qwen3-8B-TP1 - FWD-OProj"),
    MatmulPoint(4096, 4096, 1536, 403.826035, 81.14385195595425, "Qwen3-8B-TP4 - FWD-FuseQKV"),
    MatmulPoint(4096, 1024, 4096, 259.557928, 84.16361427162163, "Qwen3-8B-TP4 - FWD-OProj"),
    MatmulPoint(4096, 4096, 1024, 286.773719, 76.17620404515986, "Qwen3-8B-TP4 - BWD-OProj-IPGrad"),
    MatmulPoint(4096, 1536, 4096, 385.070231, 85.09616522394846,
                "Qwen3-8B-TP4 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(4096, 3072, 4096, 753.927156, 86.92616982747336, "Qwen3-8B-TP4 - FWD-MLP-Down"),
    MatmulPoint(4096, 4096, 3072, 761.023811, 86.11557096207598,
                "Qwen3-8B-TP4 - BWD-MLP-Down-IPGrad"),
    MatmulPoint(6144, 4096, 4096, 1458.066888, 89.78527093331259,
                "Qwen3-8B-TP4 - BWD-MLP-FuseGateUp-WTGrad"),
    MatmulPoint(4096, 4096, 6144, 1471.894367, 89.04986861737207,
                "Qwen3-8B-TP4 - FWD-MLP-FuseGateUp"),
    MatmulPoint(4096, 6144, 4096, 1491.734336, 87.86551119515158,
                "Qwen3-8B-TP4 - BWD-MLP-FuseGateUp-IPGrad"),
)  # fmt: skip


@dataclass(frozen=True)
class BwdPoint:
    """AWS's measured MXFP8 MoE backward (`BWD_SOURCE`)."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    block_size: int
    lnc: int
    us_pe_transposes: float
    us_dma_transposes: float


BWD_MXFP8 = BwdPoint(4096, 4096, 1536, 1, 4096, 2, 2190.0, 2342.0)


@dataclass(frozen=True)
class PhaseBlocking:
    """One phase's blocking in AWS's tuned table (`BWD_SOURCE`, its ``_phase_config``)."""

    TILES_IN_BLOCK_M: int
    TILES_IN_BLOCK_N: int
    TILES_IN_BLOCK_K: int
    tile_n: int
    TILES_IN_LOAD_M: int
    TILES_IN_LOAD_N: int


BWD_TUNED_BLOCKING: tuple[PhaseBlocking, ...] = (
    PhaseBlocking(16, 2, 4, 512, 8, 2),
    PhaseBlocking(16, 2, 6, 512, 8, 2),
    PhaseBlocking(6, 4, 2, 512, 6, 2),
    PhaseBlocking(8, 2, 2, 512, 8, 2),
)
"""Phases 1-4 of AWS's ``SHAPE_TUNED_CONFIGS`` entry for `BWD_MXFP8`'s shape (B 4096, H 4096,
I_TP 1536, LNC 2, SHARD_ON_FREE, AFFINITY_ON_I, bf16, no spill / scale packing / bias; quant
scheme WRAPX): TILES_IN_BLOCK_* and tile_n as written there, TILES_IN_LOAD_* as its
``derive_load_tiles`` gives them (the largest divisor of the block within 8 tiles and 1024
elements: 128-row M tiles 8 / 8 / 6 / 8, 512-column N tiles 2). The entry's transpose mode is
NC (PE) for phases 3 and 4: the 2.190 ms run; 2.342 ms is the same blocking with DMA."""
