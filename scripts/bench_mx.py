"""Throughput of MX quantization + x4 packing against a same-run baseline (clone()).

Prints GB/s of bf16 input for quantize_mx + pack_x4 and for clone() of the same tensor, on a
[4096, 7168] activation and a [16, 2048, 1536] expert stack; the last line is the worst ratio
(quantize throughput / clone throughput).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mxcli.mx import pack_x4, quantize_mx


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = {"activation [4096, 7168]": (4096, 7168), "experts [16, 2048, 1536]": (16, 2048, 1536)}
    ratios = []
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for name, shape in shapes.items():
        x = (torch.randn(shape) * 0.5).to(torch.bfloat16)
        gb = x.numel() * x.element_size() / 1e9

        def quant(x: torch.Tensor = x) -> object:
            codes, scales = quantize_mx(x, axis=-1)
            return pack_x4(codes), scales

        t_q = best_time(quant, args.repeats)
        t_c = best_time(x.clone, args.repeats)
        ratio = (gb / t_q) / (gb / t_c)
        ratios.append(ratio)
        print(
            f"{name}: quantize_mx+pack_x4 {gb / t_q:6.2f} GB/s ({t_q * 1e3:7.1f} ms) | "
            f"clone {gb / t_c:6.2f} GB/s ({t_c * 1e3:7.1f} ms) | ratio {ratio:.2f}"
        )
    print(f"ratio (quantize / clone throughput, worst case): {min(ratios):.2f}")


if __name__ == "__main__":
    main()
