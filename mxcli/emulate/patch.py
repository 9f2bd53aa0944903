"""Swap the expert MLPs of a Hugging Face MoE model for `MxExperts` (issue 23 item 2).

Which families qualify is read from the prep-weights family table (`mxcli.weightprep.families`):
a model_type the table refuses is refused with the table's one-line reason, a family whose
experts depart from the backward kernel's MLP (``Family.backward``: GPT-OSS clamped SwiGLU with
biases, Llama-4 input pre-scaling, JetMoE output bias, Step-3.7 clamps) is refused with that
departure. The router stays the model's own: only the ``experts`` submodule (transformers 5's
fused ``forward(hidden, top_k_index, top_k_weights)``) is replaced, and the replacement holds
the same parameter objects.
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.emulate.layer import Mode, MxExperts, as_mode
from mxcli.weightprep.families import ConfigError, detect_family, resolve_config

__all__ = ["PatchRefused", "patch", "set_mode"]


class PatchRefused(ValueError):
    """The model's experts are not expressible by the kernels (one-line reason)."""


def _config_dict(model: Any) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise PatchRefused("model: expected a transformers model with a .config")
    return dict(cfg.to_dict())


def _check_experts(name: str, mod: Any) -> str | None:
    """Why `mod` is not the plain fused SwiGLU experts the kernel computes, or None."""
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor):
        return f"{name}: no fused gate_up_proj/down_proj parameters"
    if gu.dim() != 3 or dn.dim() != 3 or dn.shape[0] != gu.shape[0]:
        return f"{name}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I], got {tuple(gu.shape)}, {tuple(dn.shape)}"
    E, two_i, H = gu.shape
    if tuple(dn.shape) != (E, H, two_i // 2):
        return f"{name}: down_proj: expected shape {(E, H, two_i // 2)}, got {tuple(dn.shape)}"
    for b in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(mod, b, None) is not None:
            return f"{name}: expert biases ({b}) are outside the backward kernel"
    act = getattr(mod, "act_fn", None)
    if act is not None:
        probe = torch.tensor([-3.0, -0.5, 0.25, 2.0, 6.0])
        try:
            same = torch.equal(act(probe), torch.nn.functional.silu(probe))
        except Exception:  # an activation that cannot even run on a probe is not SiLU
            same = False
        if not same:
            return f"{name}: activation {type(act).__name__} is not SiLU (the kernel's gate)"
    return None


def patch(model: Any, mode: Mode | str = Mode.NEURON, block_size: int = 128) -> list[str]:
    """Replace every MoE layer's ``experts`` module of `model` in place; returns their names.

    Raises `PatchRefused` (one line) for families the kernels cannot express.
    """
    m = as_mode(mode)
    cfg = _config_dict(model)
    try:
        family = detect_family(cfg)
        mc = resolve_config(cfg, family)
    except (ConfigError, ValueError) as exc:  # RouterRefused is a ValueError subclass too
        raise PatchRefused(str(exc)) from None
    departures = family.backward(mc.values)
    if departures:
        raise PatchRefused(f"model_type {cfg.get('model_type')!r}: {departures[0]}")
    targets = [
        (n, mod)
        for n, mod in model.named_modules()
        if n.rsplit(".", 1)[-1] == "experts" and "vision" not in n
    ]
    if not targets:
        raise PatchRefused(
            f"model_type {cfg.get('model_type')!r}: no 'experts' modules found to replace"
        )
    done = []
    for name, mod in targets:
        if isinstance(mod, MxExperts):
            mod.mode, mod.block_size = m, block_size
            done.append(name)
            continue
        why = _check_experts(name, mod)
        if why is not None:
            raise PatchRefused(f"model_type {cfg.get('model_type')!r}: {why}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MxExperts(mod.gate_up_proj, mod.down_proj, m, block_size))
        done.append(name)
    return done


def set_mode(model: Any, mode: Mode | str) -> None:
    """Switch every patched experts module of `model` to `mode`."""
    m = as_mode(mode)
    for mod in model.modules():
        if isinstance(mod, MxExperts):
            mod.mode = m
