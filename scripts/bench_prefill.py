"""Wall time of the ``rmsnorm_mx_prefill`` torch reference against a same-run floor.

Cases (T = 4096 tokens, H = 7168): NOAUX_TC router with E = 256, K = 8 (n_group 8, topk_group 4,
routed_scaling_factor 2.5) and ``pack_affinities=True``; and the same without a router.
Floor, measured in the same run: one fp32 ``(T x H) @ (H x E)`` matmul plus one ``clone()`` of
the bf16 input. Target (issue #14): reference time <= 1.3x the floor. The last line is the worst
ratio.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from mxcli.kernels.rmsnorm_mx_prefill import (
    RouterActFnType,
    arrange_router_weights,
    rmsnorm_mx_prefill,
)


def best_times(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Best wall time of each function; the functions alternate within every repeat so that
    all of them see the same machine load (the CPUs may be shared)."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # a loaded, shared machine times better on 1
    T, H, E, K = args.tokens, args.hidden, args.experts, args.top_k
    torch.manual_seed(0)
    x = (torch.randn(1, T, H) * 0.5).to(torch.bfloat16)  # [B, S, H]
    gamma = (torch.randn(H) * 0.2 + 1).to(torch.bfloat16)  # [H]
    w_nat = (torch.randn(H, E) * 0.1).to(torch.bfloat16)  # [H, E] natural rows
    w_in = arrange_router_weights(w_nat, RouterActFnType.NOAUX_TC)
    bias = torch.randn(E) * 0.1  # fp32 e_score_correction_bias
    x32 = x.reshape(T, H).float()  # floor operands
    w32 = w_nat.float()

    def floor() -> object:
        return x32 @ w32, x.clone()

    def with_router() -> object:
        return rmsnorm_mx_prefill(
            x,
            gamma,
            w_in,
            bias,
            top_k=K,
            router_act_fn=RouterActFnType.NOAUX_TC,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            pack_affinities=True,
        )

    def without_router() -> object:
        return rmsnorm_mx_prefill(x, gamma)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, T={T} H={H} E={E} K={K}")
    ratios = []
    for name, fn in (("NOAUX_TC + pack_affinities", with_router), ("no router", without_router)):
        t_floor, t_ref = best_times([floor, fn], args.repeats)
        ratio = t_ref / t_floor
        ratios.append(ratio)
        print(
            f"{name}: reference {t_ref * 1e3:7.1f} ms | floor (fp32 matmul + clone) "
            f"{t_floor * 1e3:7.1f} ms | ratio {ratio:.2f}"
        )
    print(f"ratio (reference / floor, worst case; target <= 1.3): {max(ratios):.2f}")


if __name__ == "__main__":
    main()
