"""One training step (forward + backward) of the emulated MXFP8 experts layer vs the plain layer.

Shape: Qwen3-30B-A3B experts (H=2048, I=768) at the per-device share of an EP=8 run of T=4096
tokens, top-8 over 128 experts: 16 local experts and 4096 routed (token, expert) pairs, here as
T=2048 tokens, top-2 over E=16 (the full 128-expert layer needs ~7 GiB of fp32 weights + grads,
over this machine's per-process budget). ``--scale`` shrinks H and I for a quick look.

The baseline is the plain layer (the Hugging Face experts math, fp32 compute, torch autograd):
what a CPU run without emulation costs. bf16 matmuls are ~100x slower than fp32 on these CPUs,
so a bf16-dtype baseline would flatter the ratio. The fused CPU kernels (numba) are used when
installed. Same-run medians; prints the ratio last.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mxcli.emulate import experts_forward


def plain(x, idx, w, gu, dn):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(x)
    for e in range(gu.shape[0]):
        tok, k = (idx == e).nonzero(as_tuple=True)
        g, u = torch.nn.functional.linear(x[tok], gu[e]).chunk(2, -1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, dn[e])
        out = out.index_add(0, tok, h * w[tok, k, None])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    T, E, K, H, I = a.tokens, a.experts, a.top_k, a.hidden, a.intermediate  # noqa: E741
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16().float()
    w, idx = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, -1)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 0.02).requires_grad_()
    dn = (torch.randn(E, H, I, generator=g) * 0.02).requires_grad_()
    dy = torch.randn(T, H, generator=g)

    def step(fn):  # type: ignore[no-untyped-def]
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        gu.grad = dn.grad = None
        t0 = time.perf_counter()
        fn(xx, ww).backward(dy)
        return time.perf_counter() - t0

    cases = {
        "plain fp32 autograd": lambda xx, ww: plain(xx, idx, ww, gu, dn),
        "emulated bf16 chain": lambda xx, ww: experts_forward(xx, idx, ww, gu, dn, "bf16"),
        "emulated MXFP8 neuron": lambda xx, ww: experts_forward(xx, idx, ww, gu, dn, "neuron"),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        step(fn)  # warm-up (numba JIT, allocator)
    for _ in range(a.repeats):
        for k, fn in cases.items():
            times[k].append(step(fn))
    print(
        f"T={T} E={E} top-{K} H={H} I={I}, {torch.get_num_threads()} threads, median of {a.repeats}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:<24} {v:8.3f} s")
    print(
        f"ratio MXFP8-neuron / plain: {med['emulated MXFP8 neuron'] / med['plain fp32 autograd']:.2f}x"
    )


if __name__ == "__main__":
    main()
