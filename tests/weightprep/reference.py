"""Plain, independent re-implementations used as test oracles (loops and slicing, no shared code
with mxcli.weightprep's layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def fp8_dequant_loop(
    w: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Block by block: out[block] = float(w[block]) * s[bi, bj]."""
    M, N = w.shape
    bm, bn = block
    out = torch.empty(M, N, dtype=torch.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            r, c = slice(bi * bm, min(M, (bi + 1) * bm)), slice(bj * bn, min(N, (bj + 1) * bn))
            out[r, c] = w[r, c].to(torch.float32) * float(s[bi, bj])
    return out.to(torch.bfloat16)


def mxfp4_decode_loop(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Byte by byte: low nibble then high nibble, times 2**(scale - 127)."""
    *lead, G, B = blocks.shape
    flat_b = blocks.reshape(-1, G, B).tolist()
    flat_s = scales.reshape(-1, G).tolist()
    rows = []
    for rb, rs in zip(flat_b, flat_s, strict=True):
        row = []
        for g in range(G):
            f = 2.0 ** (rs[g] - 127)
            for byte in rb[g]:
                row.append(FP4[byte & 0xF] * f)
                row.append(FP4[byte >> 4] * f)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(*lead, G * B * 2).to(torch.bfloat16)


class Source:
    """Reads a checkpoint folder with plain safetensors calls."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.config = json.loads((self.path / "config.json").read_text())
        idx = self.path / "model.safetensors.index.json"
        if idx.is_file():
            self.map = json.loads(idx.read_text())["weight_map"]
        else:
            with safe_open(str(self.path / "model.safetensors"), "pt") as f:
                self.map = {k: "model.safetensors" for k in f.keys()}

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.path / self.map[name]), "pt") as f:
            return f.get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.map

    def weight(self, name: str) -> torch.Tensor:
        """bf16 value of a weight, FP8 block weights dequantized by the plain loop."""
        t = self.get(name)
        if t.dtype == torch.float8_e4m3fn:
            return fp8_dequant_loop(t, self.get(name + "_scale_inv"))
        return t


def restack(src: Source, family: str, layer: int) -> dict[str, torch.Tensor]:
    """Source experts in kernel layouts: gate_up [E, H, 2, I], down [E, I, H] (+ shared, biases)."""
    out: dict[str, torch.Tensor] = {}
    if family in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"):
        p = f"model.layers.{layer}."
        if family == "mixtral":
            names = [
                p + "block_sparse_moe.experts.{e}." + n
                for n in ("w1.weight", "w3.weight", "w2.weight")
            ]
            E = src.config["num_local_experts"]
        else:
            names = [
                p + "mlp.experts.{e}." + n
                for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
            ]
            E = src.config.get("num_experts") or src.config["n_routed_experts"]
        gus, ds = [], []
        for e in range(E):
            g, u, d = (src.weight(n.format(e=e)) for n in names)
            gus.append(torch.stack([g.t(), u.t()], dim=1))
            ds.append(d.t())
        out["gate_up"] = torch.stack(gus).contiguous()
        out["down"] = torch.stack(ds).contiguous()
        sh = {"qwen2_moe": "mlp.shared_expert.", "deepseek_v3": "mlp.shared_experts."}.get(family)
        if sh:
            g, u, d = (
                src.weight(p + sh + n)
                for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
            )
            out["shared_gate_up"] = torch.stack([g.t(), u.t()], dim=1).unsqueeze(0).contiguous()
            out["shared_down"] = d.t().unsqueeze(0).contiguous()
    elif family == "gpt_oss":
        p = f"model.layers.{layer}.mlp.experts."
        if src.has(p + "gate_up_proj_blocks"):
            gu = mxfp4_decode_loop(
                src.get(p + "gate_up_proj_blocks"), src.get(p + "gate_up_proj_scales")
            ).transpose(1, 2)
            dn = mxfp4_decode_loop(
                src.get(p + "down_proj_blocks"), src.get(p + "down_proj_scales")
            ).transpose(1, 2)
        else:
            gu, dn = src.get(p + "gate_up_proj"), src.get(p + "down_proj")
        out["gate_up"] = torch.stack([gu[..., 0::2], gu[..., 1::2]], dim=2).contiguous()
        out["down"] = dn.contiguous()
        b = src.get(p + "gate_up_proj_bias")
        out["gate_up_bias"] = torch.stack([b[..., 0::2], b[..., 1::2]], dim=1).contiguous()
        out["down_bias"] = src.get(p + "down_proj_bias")
    elif family == "llama4":
        p = f"language_model.model.layers.{layer}.feed_forward."
        gu = src.get(p + "experts.gate_up_proj")
        I = gu.shape[-1] // 2  # noqa: E741
        out["gate_up"] = torch.stack([gu[..., :I], gu[..., I:]], dim=2).contiguous()
        out["down"] = src.get(p + "experts.down_proj")
        g, u, d = (
            src.weight(p + "shared_expert." + n)
            for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        )
        out["shared_gate_up"] = torch.stack([g.t(), u.t()], dim=1).unsqueeze(0).contiguous()
        out["shared_down"] = d.t().unsqueeze(0).contiguous()
    return out


ROUTER = {
    "qwen3_moe": ("model.layers.{L}.", "mlp.gate.weight", None),
    "qwen2_moe": ("model.layers.{L}.", "mlp.gate.weight", None),
    "mixtral": ("model.layers.{L}.", "block_sparse_moe.gate.weight", None),
    "deepseek_v3": ("model.layers.{L}.", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"),
    "gpt_oss": ("model.layers.{L}.", "mlp.router.weight", "mlp.router.bias"),
    "llama4": ("language_model.model.layers.{L}.", "feed_forward.router.weight", None),
}


def router_and_gamma(src: Source, family: str, layer: int) -> dict[str, torch.Tensor]:
    pre, w, b = ROUTER[family]
    pre = pre.format(L=layer)
    out = {
        "router_natural": src.get(pre + w).t().contiguous(),
        "gamma": src.get(pre + "post_attention_layernorm.weight"),
    }
    if b:
        out["router_bias"] = src.get(pre + b)
    return out
