"""Roofline estimate of mxcli's two NKI kernels from the interpreter's check-only counters.

No hardware is involved: each kernel runs once in check-only mode on `mxcli.nkisim` (every
hardware rule and the SBUF/PSUM capacity checked, arithmetic skipped) at a production shape,
and its counters — MX-matmul and other matmul FLOPs, HBM bytes moved by DMA, instructions per
engine — are turned into a roofline time with Trn3's documented peaks. This is an ESTIMATE,
not a measurement: it ignores engine overlap limits, DMA efficiency, instruction overheads and
the Vector/Scalar/GpSimd engines' own throughput.

Trn3 figures used (AWS Neuron documentation):
- NeuronCore-v4 Tensor Engine: 315 MXFP8/MXFP4 TFLOPS per core ("NeuronCore-v4 Architecture",
  awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/neuron-core-v4.html).
- Trainium3 chip (8 NeuronCore-v4): 671 BF16/FP16/TF32 TFLOPS and 144 GiB HBM at 4.9 TB/s
  ("Trainium3 Architecture", about-neuron/arch/neuron-hardware/trainium3.rst); per core 1/8.
A launch with LNC=2 uses two physical cores: peaks are scaled by the LNC degree.

Compulsory work: the FLOPs the math requires (prefill: the router matmul 2*T*H*E in bf16;
backward: 12*H*I per routed (token, expert) pair in MXFP8 — four GEMMs of 2*H*I, 2*H*2I,
2*H*2I, 2*I*H) and the bytes of every input read once and every output written once. Issued
work: the counters. The ratio printed last is roofline(compulsory) / roofline(issued) for each
kernel (1.0 = the kernel issues no more than the math needs), the last line their minimum.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from mxcli.kernels import nki_runtime

# -- Trn3 peaks (module docstring for the sources) ----------------------------------------------
MXFP8_TFLOPS_PER_CORE = 315.0
BF16_TFLOPS_PER_CORE = 671.0 / 8
HBM_TBPS_PER_CORE = 4.9 / 8

BWD_KERNEL = "mxcli.kernels.blockwise_moe.nki_kernel:blockwise_mm_bwd_mxfp8_jit"


@dataclass
class Work:
    """FLOPs and HBM bytes of one launch."""

    mx_flops: float
    other_flops: float
    hbm_bytes: float

    def roofline_s(self, cores: int) -> tuple[float, float, float]:
        """(total, compute, memory) seconds: compute and memory overlap perfectly."""
        compute = self.mx_flops / (MXFP8_TFLOPS_PER_CORE * 1e12 * cores) + self.other_flops / (
            BF16_TFLOPS_PER_CORE * 1e12 * cores
        )
        memory = self.hbm_bytes / (HBM_TBPS_PER_CORE * 1e12 * cores)
        return max(compute, memory), compute, memory


def _nbytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _report(
    name: str, shape: str, res: nki_runtime.SimResult, need: Work, lnc: int, secs: float
) -> float:
    c = res.report.counters
    issued = Work(c.mx_matmul_flops, c.matmul_flops, c.hbm_read_bytes + c.hbm_write_bytes)
    t_i, comp_i, mem_i = issued.roofline_s(lnc)
    t_n, comp_n, mem_n = need.roofline_s(lnc)
    ratio = t_n / t_i if t_i > 0 else 1.0
    engines = ", ".join(f"{k} {v}" for k, v in sorted(c.instructions.items()))
    print(f"== {name} ({shape}, LNC={lnc}; check-only run took {secs:.1f} s on the CPU)")
    print(f"   instructions per engine: {engines}  (total {c.total_instructions})")
    print(
        f"   issued:     MX-matmul {c.mx_matmul_flops / 1e9:10.2f} GFLOP, other matmul "
        f"{c.matmul_flops / 1e9:8.2f} GFLOP, DMA {c.dma_bytes / 1e6:9.1f} MB "
        f"(HBM read {c.hbm_read_bytes / 1e6:.1f} MB, write {c.hbm_write_bytes / 1e6:.1f} MB), "
        f"PE transposes {c.transpose_elements / 1e6:.1f} M elements"
    )
    print(
        f"   compulsory: MX-matmul {need.mx_flops / 1e9:10.2f} GFLOP, other matmul "
        f"{need.other_flops / 1e9:8.2f} GFLOP, HBM {need.hbm_bytes / 1e6:9.1f} MB"
    )
    print(
        f"   roofline (estimate): issued {t_i * 1e6:9.1f} us (compute {comp_i * 1e6:.1f}, memory "
        f"{mem_i * 1e6:.1f}); compulsory {t_n * 1e6:9.1f} us (compute {comp_n * 1e6:.1f}, memory "
        f"{mem_n * 1e6:.1f}); peak SBUF {c.peak_sbuf_bytes} B/partition, PSUM "
        f"{c.peak_psum_bytes} B/partition"
    )
    print(f"   {name}: compulsory/issued roofline ratio {ratio:.3f}")
    return ratio


def bench_prefill(T: int, H: int, E: int, K: int, lnc: int) -> float:
    """NOAUX_TC router (DeepSeek-V3 style: 8 groups, 4 kept) with packed affinities."""
    from mxcli.kernels.rmsnorm_mx_prefill import RouterActFnType, row_geometry
    from mxcli.kernels.rmsnorm_mx_prefill.nki_backend import launch_sim

    x = torch.zeros(1, T, H, dtype=torch.bfloat16)  # [B, S, H]
    gamma = torch.ones(H, dtype=torch.bfloat16)  # [H]
    w = torch.zeros(H, E, dtype=torch.bfloat16)  # [H, E] arranged
    bias = torch.zeros(E, dtype=torch.float32)  # [E]
    t0 = time.perf_counter()
    res = launch_sim(
        x, gamma, w, bias, top_k=K, router_act_fn=RouterActFnType.NOAUX_TC, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, pack_affinities=True, check_only=True, lnc=lnc,
    )  # fmt: skip
    secs = time.perf_counter() - t0
    geo = row_geometry(
        H, num_experts=E, router_act_fn=RouterActFnType.NOAUX_TC, pack_affinities=True
    )
    need = Work(0.0, 2.0 * T * H * E, _nbytes([x, gamma, w, bias]) + T * geo.row_region)
    return _report("rmsnorm_mx_prefill", f"T={T} H={H} E={E} K={K} NOAUX_TC", res, need, lnc, secs)


def bench_bwd(T: int, H: int, I: int, E: int, B: int, K: int, lnc: int) -> float | None:  # noqa: E741
    """Routed backward with `K` distinct experts per token (round-robin routing)."""
    try:
        nki_runtime.resolve_kernel(BWD_KERNEL, nki_runtime.SimEngine.INTERPRETER)
    except Exception as exc:  # the backward kernel is optional for this script
        print(
            f"== blockwise_mm_bwd_mxfp8: skipped (kernel not importable: {type(exc).__name__}: {exc})"
        )
        return None
    from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig, build_block_plan

    tok = torch.arange(T).unsqueeze(1)
    choices = (tok + torch.arange(K).unsqueeze(0) * max(1, E // K)) % E  # [T, K] distinct
    tpi, b2e = build_block_plan(choices, E, B)  # [N*B], [N, 1]
    N = b2e.shape[0]
    bf = torch.bfloat16
    inputs: dict[str, Any] = dict(
        hidden_states=torch.zeros(T, H, dtype=bf),
        expert_affinities_masked=torch.zeros(T * E, 1, dtype=bf),
        gate_up_proj_weight=torch.zeros(E, H, 2, I, dtype=bf),
        down_proj_weight=torch.zeros(E, I, H, dtype=bf),
        token_position_to_id=tpi,
        block_to_expert=b2e,
        output_hidden_states_grad=torch.zeros(T, H, dtype=bf),
        block_size=B,
        gate_up_proj_act_checkpoint_T=torch.zeros(N, 2, I, B, dtype=bf),
        config=MXFP8MOEBwdConfig.routed(top_k=K),
    )
    t0 = time.perf_counter()
    try:
        from mxcli.kernels.blockwise_moe.nki_backend import launch_sim

        # through the launcher: it validates, plans and builds the kernel's config
        res = launch_sim(**inputs, lnc=lnc, check_only=True)
    except Exception as exc:
        print(
            f"== blockwise_mm_bwd_mxfp8: skipped (check-only run failed: {type(exc).__name__}: {exc})"
        )
        return None
    secs = time.perf_counter() - t0
    need = Work(
        12.0 * H * I * T * K,
        0.0,
        _nbytes([v for v in inputs.values()]) + _nbytes(res.outputs),
    )
    shape = f"T={T} H={H} I={I} E={E} B={B} K={K}, N={N} blocks"
    return _report("blockwise_mm_bwd_mxfp8", shape, res, need, lnc, secs)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lnc", type=int, default=2, help="LNC degree of both launches (1 or 2)")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--bwd-tokens", type=int, default=4096)
    ap.add_argument("--bwd-top-k", type=int, default=4)
    ap.add_argument("--skip-bwd", action="store_true")
    args = ap.parse_args()
    ratios = [bench_prefill(args.prefill_tokens, 7168, 256, 8, args.lnc)]
    if not args.skip_bwd:
        r = bench_bwd(args.bwd_tokens, 4096, 1536, 16, 4096, args.bwd_top_k, args.lnc)
        if r is not None:
            ratios.append(r)
    print(f"compulsory/issued roofline ratio (min over kernels, estimate): {min(ratios):.3f}")


if __name__ == "__main__":
    main()
