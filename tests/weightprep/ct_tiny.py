"""Tiny compressed-tensors checkpoints made by the compressed_tensors library itself (test-only).

`compress_experts(src, dst, preset)` takes a bf16 Hugging Face checkpoint folder and writes a copy
whose routed-expert Linear weights are quantized the way llm-compressor saves them: the scales come
from the library's own `calculate_qparams` (its MX scale rule for MXFP8, ``amax / 448`` for FP8),
the weights from the preset's registered compressor (`MXFP8QuantizationCompressor`,
`FloatQuantizationCompressor`), and ``config.json``'s quantization_config from
`ModelCompressor.update_config`. Everything else is copied unchanged.

llm-compressor itself is not used: its releases pin transformers <= 5.17 (the project pins 5.23)
and pull datasets, accelerate and auto-round.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EXPERT_RE = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
FORMATS = {
    "MXFP8": "mxfp8-quantized",
    "FP8_DYNAMIC": "float-quantized",
    "FP8_BLOCK": "float-quantized",
}


def _qparams(w: torch.Tensor, args: object, preset: str) -> torch.Tensor:
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    out, inn = w.shape
    if preset == "MXFP8":
        g = w.view(out, inn // 32, 32)
        mins, maxs = g.amin(-1), g.amax(-1)
    elif preset == "FP8_DYNAMIC":
        mins, maxs = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:  # 128 x 128 blocks
        b = w.view(out // 128, 128, inn // 128, 128)
        mins, maxs = b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
    scale, _ = calculate_qparams(mins, maxs, args)  # type: ignore[arg-type]
    return scale


def compress_experts(src: Path, dst: Path, preset: str = "MXFP8") -> Path:
    """Write `dst`: `src` with its expert weights compressed by compressed_tensors (`preset`)."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, [EXPERT_RE])
    compressor = BaseCompressor.get_value_from_registry(FORMATS[preset])
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy(f, dst / f.name)
    pattern = re.compile(EXPERT_RE[3:])
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            module = name.rpartition(".")[0]
            if name.endswith(".weight") and pattern.fullmatch(module):
                scale = _qparams(t, scheme.weights, preset)
                sd = compressor.compress({"weight": t, "weight_scale": scale}, scheme)
                out[name] = sd["weight"].contiguous()
                out[name + "_scale"] = sd["weight_scale"].contiguous()
            else:
                out[name] = t
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
    qc = QuantizationConfig(
        config_groups={"group_0": scheme}, format=FORMATS[preset], quantization_status="compressed"
    )
    ModelCompressor(quantization_config=qc).update_config(str(dst))
    return dst
