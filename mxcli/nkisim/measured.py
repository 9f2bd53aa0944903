"""Latencies AWS measured on Trn3 hardware, carried over as facts with their source.

The cost model (`mxcli.nkisim.cost`) takes its figures from the Neuron documentation; these are
the measurements it is checked against (tests/nkisim/test_cost_calibration.py,
scripts/bench_nki.py). Nothing here feeds the model.

Sources (aws-neuron/nki-library, the files at the commits named):
- `MATMUL_BF16_TABLE`: ``test/integration/nkilib/experimental/matmul_mxfp8/bf16_baseline_cache.json``
  at commit 092a49dcdffb3ee0d63dbb71abd65dc70ca80821: ``torch.matmul`` of bf16 ``[M, K] @ [K,
  N]`` on one Trn3 chip's logical core (``num_lnc`` 2), ``inference_time`` in seconds (we keep
  microseconds) and ``mfu_percent``, per ``"MxKxN"`` key: every one of its 162 shapes
  (`MATMUL_BF16_TABLE`); `MATMUL_BF16` is the 10 chosen first (`MATMUL_BF16_CHOSEN`).
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
    "MatmulPoint", "MATMUL_BF16", "MATMUL_BF16_TABLE", "MATMUL_BF16_CHOSEN", "matmul_point",
    "BwdPoint", "BWD_MXFP8", "MATMUL_SOURCE", "BWD_SOURCE",
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

    @property
    def key(self) -> str:
        """The file's key, ``"MxKxN"``."""
        return f"{self.M}x{self.K}x{self.N}"


# fmt: off
MATMUL_BF16_TABLE: tuple[MatmulPoint, ...] = (
    MatmulPoint(4096, 4096, 1536, 403.826035, 81.14385195595425, "Qwen3-8B-TP4 - FWD-FuseQKV"),
    MatmulPoint(4096, 1536, 4096, 385.070231, 85.09616522394846, "Qwen3-8B-TP4 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(4096, 4096, 1024, 286.773719, 76.17620404515986, "Qwen3-8B-TP4 - BWD-OProj-IPGrad"),
    MatmulPoint(4096, 4096, 6144, 1471.894367, 89.04986861737207, "Qwen3-8B-TP4 - FWD-MLP-FuseGateUp"),
    MatmulPoint(4096, 6144, 4096, 1491.734336, 87.86551119515158, "Qwen3-8B-TP4 - BWD-MLP-FuseGateUp-IPGrad"),
    MatmulPoint(6144, 4096, 4096, 1458.066888, 89.78527093331259, "Qwen3-8B-TP4 - BWD-MLP-FuseGateUp-WTGrad"),
    MatmulPoint(4096, 3072, 4096, 753.927156, 86.92616982747336, "Qwen3-8B-TP4 - FWD-MLP-Down"),
    MatmulPoint(4096, 4096, 3072, 761.023811, 86.11557096207598, "Qwen3-8B-TP4 - BWD-MLP-Down-IPGrad"),
    MatmulPoint(1536, 4096, 4096, 427.030166, 76.73462581563851, "Qwen3-8B-TP4 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 128, 4096, 58.642409, 46.56470825860286, "Qwen3-8B-TP4 - FWD-Attn-QKt"),
    MatmulPoint(4096, 4096, 128, 80.123208, 34.080845423296914, "Qwen3-8B-TP4 - FWD-Attn-AV"),
    MatmulPoint(4096, 1024, 4096, 259.557928, 84.16361427162163, "Qwen3-8B-TP4 - FWD-OProj"),
    MatmulPoint(4096, 4096, 4096, 999.124272, 87.45792268505045, "Qwen3-8B-TP1 - FWD-OProj"),
    MatmulPoint(4096, 4096, 24576, 5727.864384, 91.53289338772166, "Qwen3-8B-TP1 - FWD-MLP-FuseGateUp"),
    MatmulPoint(4096, 24576, 4096, 8610.864878, 60.72673477715224, "Qwen3-8B-TP1 - BWD-MLP-FuseGateUp-IPGrad"),
    MatmulPoint(24576, 4096, 4096, 5577.152119, 94.0064012623716, "Qwen3-8B-TP1 - BWD-MLP-FuseGateUp-WTGrad"),
    MatmulPoint(4096, 12288, 4096, 3043.065245, 85.94915113936162, "Qwen3-8B-TP1 - FWD-MLP-Down"),
    MatmulPoint(4096, 4096, 12288, 2890.577983, 90.68912914362289, "Qwen3-8B-TP1 - BWD-MLP-Down-IPGrad"),
    MatmulPoint(4096, 5120, 10240, 3097.504327, 88.12780662260666, "Qwen3-32B-TP1 - FWD-FuseQKV"),
    MatmulPoint(4096, 10240, 5120, 3105.025982, 87.79607807288534, "Qwen3-32B-TP1 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(10240, 4096, 5120, 2950.331224, 92.50820031556398, "Qwen3-32B-TP1 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 8192, 5120, 2469.334475, 88.45898882146273, "Qwen3-32B-TP1 - FWD-OProj"),
    MatmulPoint(4096, 5120, 8192, 2486.165282, 87.8513574935033, "Qwen3-32B-TP1 - BWD-OProj-IPGrad"),
    MatmulPoint(5120, 4096, 8192, 2392.734595, 91.29860611779776, "Qwen3-32B-TP1 - BWD-OProj-WTGrad"),
    MatmulPoint(4096, 5120, 51200, 15271.897805, 89.40168083670157, "Qwen3-32B-TP1 - FWD-MLP-FuseGateUp"),
    MatmulPoint(4096, 51200, 5120, 15335.208539, 88.87457698064259, "Qwen3-32B-TP1 - BWD-MLP-FuseGateUp-IPGrad"),
    MatmulPoint(51200, 4096, 5120, 14300.04099, 95.46533714825061, "Qwen3-32B-TP1 - BWD-MLP-FuseGateUp-WTGrad"),
    MatmulPoint(4096, 25600, 5120, 10361.340477, 65.61910794409052, "Qwen3-32B-TP1 - FWD-MLP-Down"),
    MatmulPoint(4096, 5120, 25600, 7674.768841, 88.94947597896865, "Qwen3-32B-TP1 - BWD-MLP-Down-IPGrad"),
    MatmulPoint(5120, 4096, 25600, 7356.802671, 92.77651054849392, "Qwen3-32B-TP1 - BWD-MLP-Down-WTGrad"),
    MatmulPoint(4096, 5120, 2560, 806.669573, 84.60183698042371, "Qwen3-32B-TP4 - FWD-FuseQKV"),
    MatmulPoint(4096, 2560, 5120, 778.208784, 87.72281689725398, "Qwen3-32B-TP4 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(2560, 4096, 5120, 808.603737, 84.42536627389674, "Qwen3-32B-TP4 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 2048, 5120, 626.064021, 87.23154797252447, "Qwen3-32B-TP4 - FWD-OProj"),
    MatmulPoint(4096, 5120, 2048, 655.784809, 83.27935106733058, "Qwen3-32B-TP4 - BWD-OProj-IPGrad"),
    MatmulPoint(5120, 4096, 2048, 641.937331, 85.07580210089594, "Qwen3-32B-TP4 - BWD-OProj-WTGrad"),
    MatmulPoint(4096, 5120, 12800, 3852.028148, 88.59361957467567, "Qwen3-32B-TP4 - FWD-MLP-FuseGateUp"),
    MatmulPoint(4096, 12800, 5120, 3876.417277, 88.0309552009604, "Qwen3-32B-TP4 - BWD-MLP-FuseGateUp-IPGrad"),
    MatmulPoint(12800, 4096, 5120, 3795.930735, 89.77729304445518, "Qwen3-32B-TP4 - BWD-MLP-FuseGateUp-WTGrad"),
    MatmulPoint(4096, 6400, 5120, 1934.444477, 88.16579277705789, "Qwen3-32B-TP4 - FWD-MLP-Down"),
    MatmulPoint(4096, 5120, 6400, 1944.796961, 87.63543033701822, "Qwen3-32B-TP4 - BWD-MLP-Down-IPGrad"),
    MatmulPoint(5120, 4096, 6400, 1881.400394, 90.71257091841912, "Qwen3-32B-TP4 - BWD-MLP-Down-WTGrad"),
    MatmulPoint(256, 4096, 2304, 71.259056, 43.11031007764122, "Qwen3-235B-CP16-TP4 - FWD-FuseQKV"),
    MatmulPoint(256, 2304, 4096, 68.678226, 44.73033418189923, "Qwen3-235B-CP16-TP4 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(2304, 256, 4096, 54.412415, 56.45770363252578, "Qwen3-235B-CP16-TP4 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(256, 128, 256, 17.765805, 0.600404353569493, "Qwen3-235B-CP16-TP4 - FWD-Attn-QKt"),
    MatmulPoint(256, 256, 128, 17.008307, 0.6271445280630615, "Qwen3-235B-CP16-TP4 - FWD-Attn-AV"),
    MatmulPoint(256, 2048, 4096, 64.862399, 42.09937820318159, "Qwen3-235B-CP16-TP4 - FWD-OProj"),
    MatmulPoint(256, 4096, 2048, 67.188228, 40.64204024947148, "Qwen3-235B-CP16-TP4 - BWD-OProj-IPGrad"),
    MatmulPoint(4096, 256, 2048, 49.909922, 54.711900104084854, "Qwen3-235B-CP16-TP4 - BWD-OProj-WTGrad"),
    MatmulPoint(256, 4096, 6144, 154.695592, 52.95561362860295, "Qwen3-235B-CP16-TP4 - FWD-MLP-FuseGateUp"),
    MatmulPoint(256, 6144, 4096, 158.28392, 51.713171455240904, "Qwen3-235B-CP16-TP4 - BWD-MLP-FuseGateUp-IPGrad"),
    MatmulPoint(6144, 256, 4096, 109.343163, 74.92009354073652, "Qwen3-235B-CP16-TP4 - BWD-MLP-FuseGateUp-WTGrad"),
    MatmulPoint(256, 3072, 4096, 83.654869, 48.96307948315596, "Qwen3-235B-CP16-TP4 - FWD-MLP-Down"),
    MatmulPoint(256, 4096, 3072, 88.510695, 45.935661767468346, "Qwen3-235B-CP16-TP4 - BWD-MLP-Down-IPGrad"),
    MatmulPoint(4096, 256, 3072, 64.939898, 63.073705474560505, "Qwen3-235B-CP16-TP4 - BWD-MLP-Down-WTGrad"),
    MatmulPoint(4096, 2880, 1280, 250.418775, 76.67156745735218, "GPT-OSS-20B-TP4 - FWD-FuseQKV"),
    MatmulPoint(4096, 1280, 2880, 230.222973, 83.39741143035278, "GPT-OSS-20B-TP4 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(1280, 4096, 2880, 259.248762, 74.06014150995252, "GPT-OSS-20B-TP4 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 64, 4096, 58.359076, 23.395389833336864, "GPT-OSS-20B-TP4 - FWD-Attn-QKt"),
    MatmulPoint(4096, 4096, 64, 68.497393, 19.93263208328722, "GPT-OSS-20B-TP4 - FWD-Attn-AV"),
    MatmulPoint(4096, 1024, 2880, 188.198039, 81.61615329052393, "GPT-OSS-20B-TP4 - FWD-OProj"),
    MatmulPoint(4096, 2880, 1024, 207.817175, 73.91111923256584, "GPT-OSS-20B-TP4 - BWD-OProj-IPGrad"),
    MatmulPoint(2880, 4096, 1024, 222.713819, 68.90040184499667, "GPT-OSS-20B-TP4 - BWD-OProj-WTGrad"),
    MatmulPoint(128, 2880, 1440, 36.585776, 18.449793165518752, "GPT-OSS-20B-TP4 - FWD-MoE-GateUp(cap=128)"),
    MatmulPoint(128, 720, 2880, 26.844125, 12.565172291036344, "GPT-OSS-20B-TP4 - FWD-MoE-Down(cap=128)"),
    MatmulPoint(128, 1440, 2880, 35.269945, 19.138107530363317, "GPT-OSS-20B-TP4 - BWD-MoE-GateUp-IPGrad(cap=128)"),
    MatmulPoint(2880, 128, 720, 26.828291, 12.580003698334718, "GPT-OSS-20B-TP4 - BWD-MoE-GateUp-WTGrad(cap=128)"),
    MatmulPoint(128, 2880, 720, 30.764952, 10.970275526514715, "GPT-OSS-20B-TP4 - BWD-MoE-Down-IPGrad(cap=128)"),
    MatmulPoint(720, 128, 2880, 25.01496, 13.491926431223556, "GPT-OSS-20B-TP4 - BWD-MoE-Down-WTGrad(cap=128)"),
    MatmulPoint(256, 2880, 1440, 44.490763, 30.343377118526828, "GPT-OSS-20B-TP4 - FWD-MoE-GateUp(cap=256)"),
    MatmulPoint(256, 720, 2880, 32.574949, 20.721444567725953, "GPT-OSS-20B-TP4 - FWD-MoE-Down(cap=256)"),
    MatmulPoint(256, 1440, 2880, 44.604931, 30.26571210254758, "GPT-OSS-20B-TP4 - BWD-MoE-GateUp-IPGrad(cap=256)"),
    MatmulPoint(2880, 256, 720, 29.430787, 22.935166497586355, "GPT-OSS-20B-TP4 - BWD-MoE-GateUp-WTGrad(cap=256)"),
    MatmulPoint(256, 2880, 720, 34.019947, 19.841300752173424, "GPT-OSS-20B-TP4 - BWD-MoE-Down-IPGrad(cap=256)"),
    MatmulPoint(720, 256, 2880, 29.469121, 22.905331991408904, "GPT-OSS-20B-TP4 - BWD-MoE-Down-WTGrad(cap=256)"),
    MatmulPoint(512, 2880, 1440, 62.604902, 43.12761323386466, "GPT-OSS-20B-TP4 - FWD-MoE-GateUp(cap=512)"),
    MatmulPoint(512, 720, 2880, 39.279106, 34.36941767462834, "GPT-OSS-20B-TP4 - FWD-MoE-Down(cap=512)"),
    MatmulPoint(512, 1440, 2880, 61.285737, 44.05592772752328, "GPT-OSS-20B-TP4 - BWD-MoE-GateUp-IPGrad(cap=512)"),
    MatmulPoint(2880, 512, 720, 35.675777, 37.84080161729905, "GPT-OSS-20B-TP4 - BWD-MoE-GateUp-WTGrad(cap=512)"),
    MatmulPoint(512, 2880, 720, 43.369099, 31.128154172628765, "GPT-OSS-20B-TP4 - BWD-MoE-Down-IPGrad(cap=512)"),
    MatmulPoint(720, 512, 2880, 37.174941, 36.25789028765264, "GPT-OSS-20B-TP4 - BWD-MoE-Down-WTGrad(cap=512)"),
    MatmulPoint(4096, 4096, 2304, 581.693258, 84.4981428338989, "Qwen3-235B-TP4 - FWD-FuseQKV"),
    MatmulPoint(4096, 2304, 4096, 565.448283, 86.92572155179751, "Qwen3-235B-TP4 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(2304, 4096, 4096, 596.314901, 82.4262481409969, "Qwen3-235B-TP4 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 2048, 4096, 507.675874, 86.06015945257754, "Qwen3-235B-TP4 - FWD-OProj"),
    MatmulPoint(4096, 4096, 2048, 523.386682, 83.47684067869855, "Qwen3-235B-TP4 - BWD-OProj-IPGrad"),
    MatmulPoint(128, 4096, 768, 32.09745, 15.951422932351326, "Qwen3-235B-TP4 - FWD-MoE-GateUp(cap=128)"),
    MatmulPoint(128, 384, 4096, 25.53996, 10.023508259214188, "Qwen3-235B-TP4 - FWD-MoE-Down(cap=128)"),
    MatmulPoint(128, 768, 4096, 30.769952, 16.63960996754236, "Qwen3-235B-TP4 - BWD-MoE-GateUp-IPGrad(cap=128)"),
    MatmulPoint(4096, 128, 384, 23.830797, 10.74240194316623, "Qwen3-235B-TP4 - BWD-MoE-GateUp-WTGrad(cap=128)"),
    MatmulPoint(128, 4096, 384, 26.126626, 9.798433215218836, "Qwen3-235B-TP4 - BWD-MoE-Down-IPGrad(cap=128)"),
    MatmulPoint(384, 128, 4096, 25.176628, 10.16816072430351, "Qwen3-235B-TP4 - BWD-MoE-Down-WTGrad(cap=128)"),
    MatmulPoint(256, 4096, 768, 39.704104, 25.79078475111792, "Qwen3-235B-TP4 - FWD-MoE-GateUp(cap=256)"),
    MatmulPoint(256, 384, 4096, 27.73579, 18.459903251358625, "Qwen3-235B-TP4 - FWD-MoE-Down(cap=256)"),
    MatmulPoint(256, 768, 4096, 35.549111, 28.805221036329147, "Qwen3-235B-TP4 - BWD-MoE-GateUp-IPGrad(cap=256)"),
    MatmulPoint(4096, 256, 384, 26.679125, 19.191034188714962, "Qwen3-235B-TP4 - BWD-MoE-GateUp-WTGrad(cap=256)"),
    MatmulPoint(256, 4096, 384, 30.740785, 16.65539770698764, "Qwen3-235B-TP4 - BWD-MoE-Down-IPGrad(cap=256)"),
    MatmulPoint(384, 256, 4096, 26.077459, 19.633814782337495, "Qwen3-235B-TP4 - BWD-MoE-Down-WTGrad(cap=256)"),
    MatmulPoint(512, 4096, 768, 53.099083, 38.56940429649227, "Qwen3-235B-TP4 - FWD-MoE-GateUp(cap=512)"),
    MatmulPoint(512, 384, 4096, 33.144115, 30.895379164596793, "Qwen3-235B-TP4 - FWD-MoE-Down(cap=512)"),
    MatmulPoint(512, 768, 4096, 46.862427, 43.70238869617231, "Qwen3-235B-TP4 - BWD-MoE-GateUp-IPGrad(cap=512)"),
    MatmulPoint(4096, 512, 384, 31.088285, 32.938452539276454, "Qwen3-235B-TP4 - BWD-MoE-GateUp-WTGrad(cap=512)"),
    MatmulPoint(512, 4096, 384, 39.072439, 26.207731746666745, "Qwen3-235B-TP4 - BWD-MoE-Down-IPGrad(cap=512)"),
    MatmulPoint(384, 512, 4096, 34.124946, 30.00737349152142, "Qwen3-235B-TP4 - BWD-MoE-Down-WTGrad(cap=512)"),
    MatmulPoint(4096, 2880, 2560, 463.370943, 82.87097104403459, "GPT-OSS-20B-TP2 - FWD-FuseQKV"),
    MatmulPoint(4096, 2560, 2880, 450.238463, 85.28813763296807, "GPT-OSS-20B-TP2 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(2560, 4096, 2880, 471.131764, 81.50586085297361, "GPT-OSS-20B-TP2 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 2048, 2880, 366.97026, 83.71250574910349, "GPT-OSS-20B-TP2 - FWD-OProj"),
    MatmulPoint(4096, 2880, 2048, 381.206071, 80.58633462844298, "GPT-OSS-20B-TP2 - BWD-OProj-IPGrad"),
    MatmulPoint(2880, 4096, 2048, 404.438535, 75.92914922559856, "GPT-OSS-20B-TP2 - BWD-OProj-WTGrad"),
    MatmulPoint(128, 2880, 2880, 50.368254, 26.80259673086941, "GPT-OSS-20B-TP2 - FWD-MoE-GateUp(cap=128)"),
    MatmulPoint(2880, 128, 1440, 29.574954, 22.82336601436472, "GPT-OSS-20B-TP2 - BWD-MoE-GateUp-WTGrad(cap=128)"),
    MatmulPoint(1440, 128, 2880, 29.98912, 22.50816296043365, "GPT-OSS-20B-TP2 - BWD-MoE-Down-WTGrad(cap=128)"),
    MatmulPoint(256, 2880, 2880, 66.102397, 40.84572001224101, "GPT-OSS-20B-TP2 - FWD-MoE-GateUp(cap=256)"),
    MatmulPoint(2880, 256, 1440, 38.575774, 34.996057370099685, "GPT-OSS-20B-TP2 - BWD-MoE-GateUp-WTGrad(cap=256)"),
    MatmulPoint(1440, 256, 2880, 38.253273, 35.29109783625574, "GPT-OSS-20B-TP2 - BWD-MoE-Down-WTGrad(cap=256)"),
    MatmulPoint(512, 2880, 2880, 97.122349, 55.59997318433886, "GPT-OSS-20B-TP2 - FWD-MoE-GateUp(cap=512)"),
    MatmulPoint(2880, 512, 1440, 52.732418, 51.20190012906293, "GPT-OSS-20B-TP2 - BWD-MoE-GateUp-WTGrad(cap=512)"),
    MatmulPoint(1440, 512, 2880, 52.343252, 51.58258031044765, "GPT-OSS-20B-TP2 - BWD-MoE-Down-WTGrad(cap=512)"),
    MatmulPoint(512, 4096, 1536, 79.387375, 51.59510564494669, "Qwen3-235B-TP2 - FWD-MoE-GateUp(B=512)"),
    MatmulPoint(512, 1536, 4096, 73.614885, 55.64092099036764, "Qwen3-235B-TP2 - BWD-MoE-GateUp-IPGrad(B=512)"),
    MatmulPoint(4096, 512, 768, 44.297431, 46.23292939944983, "Qwen3-235B-TP2 - BWD-MoE-GateUp-WTGrad-Unfused(B=512)"),
    MatmulPoint(768, 512, 4096, 44.271598, 46.259906859472295, "Qwen3-235B-TP2 - BWD-MoE-Down-WTGrad(B=512)"),
    MatmulPoint(1024, 4096, 1536, 130.059796, 62.986412803538464, "Qwen3-235B-TP2 - FWD-MoE-GateUp(B=1024)"),
    MatmulPoint(1024, 768, 4096, 67.639894, 59.61585123190349, "Qwen3-235B-TP2 - FWD-MoE-Down(B=1024)"),
    MatmulPoint(1024, 1536, 4096, 117.50815, 69.71431343272786, "Qwen3-235B-TP2 - BWD-MoE-GateUp-IPGrad(B=1024)"),
    MatmulPoint(4096, 1024, 768, 70.497389, 58.10144259385266, "Qwen3-235B-TP2 - BWD-MoE-GateUp-WTGrad-Unfused(B=1024)"),
    MatmulPoint(1024, 4096, 768, 80.094042, 51.13988378810998, "Qwen3-235B-TP2 - BWD-MoE-Down-IPGrad(B=1024)"),
    MatmulPoint(768, 1024, 4096, 68.817392, 59.51983765964278, "Qwen3-235B-TP2 - BWD-MoE-Down-WTGrad(B=1024)"),
    MatmulPoint(2048, 4096, 1536, 223.342984, 73.35802408729347, "Qwen3-235B-TP2 - FWD-MoE-GateUp(B=2048)"),
    MatmulPoint(2048, 768, 4096, 114.998987, 71.23541009974288, "Qwen3-235B-TP2 - FWD-MoE-Down(B=2048)"),
    MatmulPoint(2048, 1536, 4096, 211.093837, 77.61477186091416, "Qwen3-235B-TP2 - BWD-MoE-GateUp-IPGrad(B=2048)"),
    MatmulPoint(4096, 2048, 768, 121.102311, 67.64528217797594, "Qwen3-235B-TP2 - BWD-MoE-GateUp-WTGrad-Unfused(B=2048)"),
    MatmulPoint(2048, 4096, 768, 130.753129, 62.6524203485792, "Qwen3-235B-TP2 - BWD-MoE-Down-IPGrad(B=2048)"),
    MatmulPoint(768, 2048, 4096, 125.324804, 65.36615050281667, "Qwen3-235B-TP2 - BWD-MoE-Down-WTGrad(B=2048)"),
    MatmulPoint(4096, 768, 4096, 199.517188, 82.11823835448202, "Qwen3-235B-TP2 - FWD-MoE-Down(B=4096)"),
    MatmulPoint(4096, 4096, 768, 227.077145, 72.15169100351336, "Qwen3-235B-TP2 - BWD-MoE-Down-IPGrad(B=4096)"),
    MatmulPoint(768, 4096, 4096, 228.707143, 71.63746521025799, "Qwen3-235B-TP2 - BWD-MoE-Down-WTGrad(B=4096)"),
    MatmulPoint(4096, 4096, 4608, 1114.389092, 88.2133544788861, "Qwen3-235B-TP2 - FWD-FuseQKV"),
    MatmulPoint(4096, 4608, 4096, 1119.139918, 87.83888271600371, "Qwen3-235B-TP2 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(4608, 4096, 4096, 1109.6066, 88.59356099720388, "Qwen3-235B-TP2 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 512, 1536, 64.706566, 63.301149376401774, "Qwen3-235B-TP2 - BWD-MoE-GateUp-WTGrad-Fused(B=512)"),
    MatmulPoint(4096, 1024, 1536, 116.674818, 70.21223722843091, "Qwen3-235B-TP2 - BWD-MoE-GateUp-WTGrad-Fused(B=1024)"),
    MatmulPoint(4096, 2048, 1536, 210.458838, 77.84895210720492, "Qwen3-235B-TP2 - BWD-MoE-GateUp-WTGrad-Fused(B=2048)"),
    MatmulPoint(4096, 4096, 9216, 2182.213257, 90.09568582233207, "Qwen3-235B-TP1 - FWD-FuseQKV"),
    MatmulPoint(4096, 9216, 4096, 2231.369014, 88.06570780047824, "Qwen3-235B-TP1 - BWD-FuseQKV-IPGrad"),
    MatmulPoint(9216, 4096, 4096, 2151.954137, 91.36254189603112, "Qwen3-235B-TP1 - BWD-FuseQKV-WTGrad"),
    MatmulPoint(4096, 4096, 8192, 1942.483632, 89.96866886684103, "Qwen3-235B-TP1 - BWD-OProj-IPGrad"),
    MatmulPoint(512, 4096, 3072, 132.434793, 61.856856604140276, "Qwen3-235B-TP1 - FWD-MoE-GateUp(B=512)"),
    MatmulPoint(512, 3072, 4096, 126.980635, 64.51377408846632, "Qwen3-235B-TP1 - BWD-MoE-GateUp-IPGrad(B=512)"),
    MatmulPoint(4096, 512, 3072, 109.183163, 75.02988349952821, "Qwen3-235B-TP1 - BWD-MoE-GateUp-WTGrad-Fused(B=512)"),
    MatmulPoint(1536, 512, 4096, 65.764064, 62.28325548737378, "Qwen3-235B-TP1 - BWD-MoE-Down-WTGrad(B=512)"),
    MatmulPoint(1024, 4096, 3072, 223.342151, 73.35829769097191, "Qwen3-235B-TP1 - FWD-MoE-GateUp(B=1024)"),
    MatmulPoint(2048, 4096, 3072, 413.63102, 79.22036408197819, "Qwen3-235B-TP1 - FWD-MoE-GateUp(B=2048)"),
    MatmulPoint(2048, 3072, 4096, 404.825201, 80.94357742318518, "Qwen3-235B-TP1 - BWD-MoE-GateUp-IPGrad(B=2048)"),
    MatmulPoint(4096, 2048, 3072, 387.131062, 84.64316924277185, "Qwen3-235B-TP1 - BWD-MoE-GateUp-WTGrad-Fused(B=2048)"),
    MatmulPoint(1536, 2048, 4096, 220.614656, 73.8965068326508, "Qwen3-235B-TP1 - BWD-MoE-Down-WTGrad(B=2048)"),
    MatmulPoint(1024, 3072, 4096, 216.884661, 75.54245618135253, "Qwen3-235B-TP1 - BWD-MoE-GateUp-IPGrad(B=1024)"),
    MatmulPoint(1536, 1024, 4096, 113.765655, 72.00767226277563, "Qwen3-235B-TP1 - BWD-MoE-Down-WTGrad(B=1024)"),
    MatmulPoint(4096, 1024, 3072, 197.186358, 83.0889122664358, "Qwen3-235B-TP1 - BWD-MoE-GateUp-WTGrad-Fused(B=1024)"),
    MatmulPoint(4096, 8192, 4096, 1984.901898, 87.9842351867636, "Qwen3-235B-TP1 - BWD-OProj-IPGrad"),
)
# fmt: on
"""Every shape of `MATMUL_SOURCE` (162 keys), in the file's order: ``inference_time`` x 1e6 and
``mfu_percent`` as written there (``active_inference_time`` and ``mbu_percent`` are not carried).
The file's MFU is ``2*M*K*N / inference_time`` over the BF16 peak of two cores (2 x 2 x 128 x 128
x 2.4 GHz) within 1.6% on every row (exactly on most: it was evidently computed from a slightly
different time on the others)."""

MATMUL_BF16_CHOSEN = (
    "4096x4096x4096", "4096x4096x1536", "4096x1024x4096", "4096x4096x1024", "4096x1536x4096",
    "4096x3072x4096", "4096x4096x3072", "6144x4096x4096", "4096x4096x6144", "4096x6144x4096",
)  # fmt: skip
"""The 10 shapes checked first (large Qwen3-8B shapes, every dimension a multiple of 512 per core):
`MATMUL_BF16`, the subset scripts/bench_nki.py and README's earlier figures name."""


def matmul_point(key: str) -> MatmulPoint:
    """The `MATMUL_BF16_TABLE` row of ``"MxKxN"`` (KeyError when the file has no such shape)."""
    for p in MATMUL_BF16_TABLE:
        if p.key == key:
            return p
    raise KeyError(key)


MATMUL_BF16: tuple[MatmulPoint, ...] = tuple(matmul_point(k) for k in MATMUL_BF16_CHOSEN)


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
