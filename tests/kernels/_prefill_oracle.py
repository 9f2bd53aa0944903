"""Independent oracles for the rmsnorm_mx_prefill tests, written from the spec in numpy + ml_dtypes.

Nothing here imports mxcli: the byte layout, the three-rounding chain, the MX encoder and the
upstream-style goldens are restated plainly so that the reference is checked against a second,
separately written model.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2


def to_np32(t: torch.Tensor) -> np.ndarray:
    """fp32 numpy copy of a torch tensor (exact for bf16/fp16)."""
    return t.detach().to(torch.float32).cpu().numpy()


def np_cd(dtype: torch.dtype) -> type:
    return {torch.bfloat16: BF16, torch.float16: np.float16}[dtype]


def round_to(v: np.ndarray, cd: type) -> np.ndarray:
    """R_cd: RNE to bf16/fp16, back as fp32."""
    return np.asarray(v, dtype=np.float32).astype(cd).astype(np.float32)


def spec_scale_offset(g: int, H: int, pack_scales: bool) -> int:
    """Prefill spec §4.2, restated: relative byte offset of group g's scale."""
    h512, b = divmod(g, 16)
    if pack_scales:
        return (h512 // 4) * 128 + (b // 4) * 32 + (h512 % 4) * 4 + (b % 4)
    return h512 * 128 + (b // 4) * 32 + (b % 4)


def spec_scale_region(H: int, pack_scales: bool) -> int:
    nb = H // 512
    return 128 * (-(-nb // 4) if pack_scales else nb)


def exponent_field(v: np.ndarray) -> np.ndarray:
    """Biased fp32 exponent field (0 for zero / fp32 subnormals)."""
    bits = np.asarray(v, dtype=np.float32).view(np.uint32)
    return ((bits >> 23) & 0xFF).astype(np.int64)


def mx_encode(
    y: np.ndarray, elem: str = "e4m3fn", offset: int = 7
) -> tuple[np.ndarray, np.ndarray]:
    """MX-encode fp32 ``y [T, H]`` in contiguous groups of 32: (codes uint8 [T,H], bytes [T,H/32])."""
    T, H = y.shape
    g = y.reshape(T, H // 32, 32)
    amax = np.abs(g).max(axis=2)
    byte = np.clip(exponent_field(amax) - offset, 0, 255)
    X = np.ldexp(np.float64(1.0), byte - 127)[..., None]  # exact powers of two
    fmt, mx = (E4M3, 448.0) if elem == "e4m3fn" else (E5M2, 57344.0)
    scaled = np.clip(g.astype(np.float64) / X, -mx, mx).astype(np.float32)
    codes = scaled.astype(fmt).view(np.uint8).reshape(T, H)
    return codes, byte.astype(np.uint8)


def faithful_chain(
    x: np.ndarray, gamma: np.ndarray, inv_rms: np.ndarray, cd: type
) -> tuple[np.ndarray, np.ndarray]:
    """Spec §3.3: a = R(x*g), y = R(a*R(inv)). Returns (a, y) as fp32."""
    a = round_to(x * gamma[None, :], cd)
    r = round_to(inv_rms, cd)
    y = round_to(a * r[:, None], cd)
    return a, y


def inv_rms_f64(x: np.ndarray, N: int, eps: float) -> np.ndarray:
    ss = np.sum(x.astype(np.float64) ** 2, axis=1)
    return 1.0 / np.sqrt(ss / N + eps)


def ambiguous_tokens(inv64: np.ndarray, cd: type, rel: float = 1e-6) -> np.ndarray:
    """Tokens whose R_cd(inv_rms) could flip with a last-ulp change of the fp32 rsqrt / sum."""
    lo = round_to((inv64 * (1 - rel)).astype(np.float32), cd)
    hi = round_to((inv64 * (1 + rel)).astype(np.float32), cd)
    return lo != hi


def assemble_rows(
    codes: np.ndarray, scales: np.ndarray, H: int, pack_scales: bool, row_region: int
) -> np.ndarray:
    """Spec §4: codes at [0, H), scale of group g at H + offset(g), holes zero."""
    T = codes.shape[0]
    rows = np.zeros((T, row_region), dtype=np.uint8)
    rows[:, :H] = codes
    for g in range(H // 32):
        rows[:, H + spec_scale_offset(g, H, pack_scales)] = scales[:, g]
    return rows


def upstream_mx_golden(norm32: np.ndarray, round_dtype: type) -> np.ndarray:
    """Spec §6.3 ``reference_mx_dequant``: round, emax-7 scale, clip to ±448, e4m3, dequantize."""
    v = round_to(norm32, round_dtype)
    codes, byte = mx_encode(v, "e4m3fn", 7)
    q = codes.view(E4M3).astype(np.float32).reshape(v.shape[0], -1, 32)
    X = np.ldexp(np.float32(1.0), byte.astype(np.int64) - 127).astype(np.float32)[..., None]
    return (q * X).reshape(v.shape)


def max_allclose_rate(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> float:
    """Spec §7 ``maxAllClose`` in max mode: fraction with |a-b| <= atol + rtol*max|b|."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert np.isfinite(a).all() == np.isfinite(b).all()
    tol = atol + rtol * np.abs(b).max()
    return float(np.mean(np.abs(a - b) <= tol))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def hardware_topk_loop(row: list[float], k: int, pad: float) -> list[int]:
    """max8 + nc_find_index8 on one row, plainly as api spec §8.13/§8.14 word them: the 8
    largest values in descending order; each to the position of its r-th occurrence in the row,
    where r counts the equal values before it in the 8 (the k-th duplicate gets the k-th match)."""
    vals = list(row) + [pad] * max(0, 8 - len(row))
    top = sorted(vals, reverse=True)[:8]
    out = []
    for i, v in enumerate(top[:k]):
        r = sum(1 for u in top[:i] if u == v)
        out.append([j for j, x in enumerate(vals) if x == v][r])
    return out


def noaux_loop(
    logits: np.ndarray,
    bias: np.ndarray,
    score: np.ndarray,
    G: int,
    TG: int,
    K: int,
    rsf: float,
) -> np.ndarray:
    """Spec §5.3 per token in fp32 numpy, plainly (score = sigmoid supplied by the caller)."""
    f = np.float32
    T, E = logits.shape
    epg = E // G
    out = np.zeros((T, E), dtype=np.float32)
    for t in range(T):
        sfc = [f(score[t, e]) + f(bias[e]) for e in range(E)]
        gs = []
        for g in range(G):
            vals = sorted(
                sfc[g * epg : (g + 1) * epg] + [f(-30000.0)] * max(0, 8 - epg), reverse=True
            )
            gs.append(f(vals[0]) + f(vals[1]))
        kept = hardware_topk_loop(gs, TG, f(-30000.0))
        masked = []
        for e in range(E):
            m = sum(1 for j in kept if j == e // epg)
            masked.append(f(sfc[e]) + f(f(m - 1) * f(30000.0)))
        sel = hardware_topk_loop(masked, K, f(-3.4028234663852886e38))
        w = [f(score[t, e]) * f(sum(1 for s in sel if s == e)) for e in range(E)]
        den = f(0.0)
        for e in range(E):
            den = f(den + w[e])
        den = f(den + f(1e-20))
        c = f(f(rsf) * f(f(1.0) / den))
        out[t] = [f(w[e] * c) for e in range(E)]
    return out


def split3_bf16(v: float) -> list[float]:
    """Three bf16 values whose exact sum is fp32(v) (for crafting exact router logits)."""
    x = np.float32(v)
    parts = []
    for _ in range(3):
        p = np.float32(x).astype(BF16).astype(np.float32)
        parts.append(float(p))
        x = np.float32(x - p)
    assert x == 0.0
    return parts
