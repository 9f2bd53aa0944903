"""The loss study behind ``mxcli emulate`` (issue 23 item 3): pure functions, no printing.

One model, one seed, identical batches, trained N steps per run: ``bf16`` (the kernel chain with
its bf16 rounding points, no MX quantization), ``neuron`` (MXFP8, Trn3's scale rule) and ``ocp``
(MXFP8, OCP / torchao FLOOR rule), plus ``bf16_seed2`` (bf16 with the next seed: other batches
and, for the built-in model, another init) as the seed-to-seed spread the gaps are read against.
Reported: training-loss curves, the held-out loss after training (same held-out batches for all
runs), gaps to bf16, expert-gradient SQNR per layer against bf16 on the first step (identical
weights and batch, so only the numerics differ) and the fraction of forward MX operand values
that saturate or flush to zero under each rule (on the last step's layer inputs and weights).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxcli.emulate.layer import MxExperts
from mxcli.emulate.patch import patch, set_mode
from mxcli.mx import QuantScheme, ScaleRule, e8m0_decode, group_index, quantize_mx

__all__ = [
    "RUNS",
    "StudyOptions",
    "default_corpus",
    "default_model",
    "mx_saturation",
    "run_study",
    "sqnr_db",
]

RUNS = ("bf16", "neuron", "ocp", "bf16_seed2")
# The stdlib modules of the default corpus, in this order: present in every CPython 3.10+.
_CORPUS_MODULES = (
    "argparse", "dataclasses", "functools", "inspect", "json.decoder", "json.encoder",
    "textwrap", "typing", "fractions", "statistics", "heapq", "bisect", "random",
    "shlex", "string", "calendar", "difflib", "pprint",
)  # fmt: skip
# Default built-in model: a tiny qwen3_moe with byte tokens (vocab 256), see `default_model`.
_TINY_QWEN3: dict[str, Any] = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
    pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
)  # fmt: skip


@dataclass(frozen=True)
class StudyOptions:
    steps: int = 40
    batch: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    eval_batches: int = 4
    device: str = "cpu"
    block_size: int = 128


def default_corpus() -> tuple[bytes, str]:
    """The source text of fixed stdlib modules (`_CORPUS_MODULES`) and a description. The bytes
    depend on the Python version (the modules' sources change between releases)."""
    import importlib.util

    parts = []
    for name in _CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        parts.append(Path(spec.origin).read_bytes())
    v = sys.version_info
    return b"\n".join(parts), f"Python {v.major}.{v.minor} stdlib source ({len(parts)} modules)"


def default_model(seed: int) -> Any:
    """A tiny qwen3_moe (2 layers, H=128, E=8, top-2, I=128, byte vocabulary) from its config."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**_TINY_QWEN3)).float()


def tokenize(data: bytes, tokenizer: Any) -> torch.Tensor:
    """Token ids of `data`: the model's tokenizer, or its bytes when it has none."""
    if tokenizer is None:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    text = data.decode("utf-8", errors="replace")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)


def batches(
    tokens: torch.Tensor, count: int, batch: int, seq_len: int, seed: int, region: tuple[int, int]
) -> list[torch.Tensor]:
    """`count` batches ``[batch, seq_len + 1]`` of windows drawn (seeded) from ``tokens[a:b]``."""
    a, b = region
    if b - a < seq_len + 2:
        raise ValueError(
            f"data: expected at least {seq_len + 2} tokens per split, got {b - a} "
            "(use a longer --data file or a shorter --seq-len)"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(a, b - seq_len - 1, (count, batch), generator=g)
    offs = torch.arange(seq_len + 1)
    return [tokens[s[:, None] + offs] for s in starts]


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """``10·log10(|ref|² / |ref − got|²)`` in dB (inf when equal)."""
    r, d = ref.double(), (ref.double() - got.double())
    noise = float((d * d).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(float((r * r).sum()) / noise)


def mx_saturation(x: torch.Tensor, rule: ScaleRule) -> tuple[int, int, int]:
    """``(saturated, flushed, nonzero)`` counts of bf16(x) MX-quantized along its last axis
    (wrapX, tile 512, E4M3FN: the forward's operands). Saturated: ``|x|/X`` at or above 464, the
    midpoint past E4M3FN's 448 (it would round beyond the largest finite); flushed: a nonzero
    value with ``|x|/X <= 2^-10`` (half the smallest subnormal 2^-9: rounds to zero)."""
    xb = x.detach().to(torch.bfloat16).reshape(-1, x.shape[-1]).float()
    _, scales = quantize_mx(xb, -1, rule=rule, scheme=QuantScheme.WRAPX, tile_k=512)
    gidx = group_index(xb.shape[-1], QuantScheme.WRAPX, 512).to(xb.device)
    X = e8m0_decode(scales).index_select(-1, gidx)
    y = xb.abs() / X
    nz = xb != 0
    return int((y >= 464).sum()), int((nz & (y <= 2.0**-10)).sum()), int(nz.sum())


def _loss(model: Any, b: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=b[:, :-1]).logits  # next-token loss on the window
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), b[:, 1:].reshape(-1)
    )


def _experts(model: Any) -> list[tuple[str, MxExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MxExperts)]


def _train(
    model: Any,
    mode: str,
    train: list[torch.Tensor],
    held_out: list[torch.Tensor],
    opts: StudyOptions,
    on_step: Callable[[str, int, float], None],
    run: str,
    want_stats: bool,
) -> dict[str, Any]:
    set_mode(model, mode)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    losses: list[float] = []
    first_grads: dict[str, dict[str, torch.Tensor]] = {}
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    if want_stats:
        for n, m in _experts(model):

            def grab(mod: Any, args: tuple[Any, ...], n: str = n) -> None:
                inputs[n] = args[0].detach()

            hooks.append(m.register_forward_pre_hook(grab))
    for step, b in enumerate(train):
        b = b.to(opts.device)
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, b)
        loss.backward()
        if step == 0:
            for n, m in _experts(model):
                assert m.gate_up_proj.grad is not None and m.down_proj.grad is not None
                first_grads[n] = {
                    "gate_up_proj": m.gate_up_proj.grad.detach().cpu().clone(),
                    "down_proj": m.down_proj.grad.detach().cpu().clone(),
                }
        opt.step()
        losses.append(float(loss.detach()))
        on_step(run, step, losses[-1])
    for h in hooks:
        h.remove()
    model.eval()
    with torch.no_grad():
        ev = [float(_loss(model, b.to(opts.device))) for b in held_out]
    stats: dict[str, Any] = {}
    if want_stats:
        stats = _saturation(model, inputs)
    return {
        "losses": losses,
        "eval_loss": sum(ev) / len(ev),
        "_grads": first_grads,
        "mx_stats": stats,
    }


def _saturation(model: Any, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rule in (ScaleRule.NEURON, ScaleRule.OCP):
        sat = flu = nz = 0
        for n, m in _experts(model):
            ops = [m.gate_up_proj, m.down_proj] + ([inputs[n]] if n in inputs else [])
            for t in ops:
                s, f, z = mx_saturation(t, rule)
                sat, flu, nz = sat + s, flu + f, nz + z
        out[rule.value] = {
            "saturated_fraction": sat / max(nz, 1),
            "flushed_fraction": flu / max(nz, 1),
            "values": nz,
        }
    return out


def run_study(
    opts: StudyOptions,
    model_dir: Path | None = None,
    data_file: Path | None = None,
    on_step: Callable[[str, int, float], None] | None = None,
) -> dict[str, Any]:
    """Run the four trainings (`RUNS`) and return the JSON-ready report (see the module doc)."""
    cb = on_step or (lambda run, step, loss: None)
    tokenizer = None
    if model_dir is not None:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception:  # no tokenizer files: train on bytes (needs vocab >= 256)
            tokenizer = None
        model_desc = str(model_dir)
    else:
        base = default_model(opts.seed)
        model_desc = "built-in tiny qwen3_moe (2 layers, H=128, E=8, top-2, I=128, bytes)"
    if data_file is not None:
        data, data_desc = data_file.read_bytes(), str(data_file)
    else:
        data, data_desc = default_corpus()
    tokens = tokenize(data, tokenizer)
    vocab = int(base.config.vocab_size)
    if tokens.numel() and int(tokens.max()) >= vocab:
        raise ValueError(f"data: token id {int(tokens.max())} >= the model's vocab_size {vocab}")
    split = int(tokens.numel() * 0.9)
    held_out = batches(
        tokens, opts.eval_batches, opts.batch, opts.seq_len, 10_000, (split, tokens.numel())
    )
    patched = patch(base, "bf16", opts.block_size)
    init = copy.deepcopy(base.state_dict())
    runs: dict[str, Any] = {}
    for run in RUNS:
        seed = opts.seed + (1 if run == "bf16_seed2" else 0)
        if run == "bf16_seed2" and model_dir is None:
            model = default_model(seed)
            patch(model, "bf16", opts.block_size)
        else:
            model = base
            model.load_state_dict(init)
        model.to(opts.device)
        train = batches(tokens, opts.steps, opts.batch, opts.seq_len, seed, (0, split))
        mode = "bf16" if run.startswith("bf16") else run
        torch.manual_seed(seed)
        runs[run] = _train(model, mode, train, held_out, opts, cb, run, run == "neuron")
    ref = runs["bf16"]["_grads"]
    sq: dict[str, Any] = {}
    for run in ("neuron", "ocp"):
        sq[run] = {
            layer: {k: sqnr_db(ref[layer][k], g[k]) for k in g}
            for layer, g in runs[run]["_grads"].items()
        }
    stats = runs["neuron"].pop("mx_stats")
    for r in runs.values():
        r.pop("_grads")
        r.pop("mx_stats", None)
    bf = runs["bf16"]["eval_loss"]
    spread = abs(runs["bf16_seed2"]["eval_loss"] - bf)
    gaps = {r: runs[r]["eval_loss"] - bf for r in ("neuron", "ocp")}
    return {
        "model": model_desc,
        "data": data_desc,
        "tokens": int(tokens.numel()),
        "patched_layers": patched,
        "options": {k: getattr(opts, k) for k in opts.__dataclass_fields__},
        "runs": runs,
        "final_loss_gap": gaps,
        "seed_spread": spread,
        "within_seed_spread": {r: abs(g) <= spread for r, g in gaps.items()},
        "expert_grad_sqnr_db": sq,
        "mx_value_stats": stats,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Loss curves of every run to a PNG at `path` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=80)
    style = {"bf16": "-", "neuron": "-", "ocp": "--", "bf16_seed2": ":"}
    for run, r in report["runs"].items():
        ax.plot(r["losses"], style.get(run, "-"), label=f"{run} (held-out {r['eval_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("MXFP8 emulation: bf16 vs NEURON vs OCP scale rule")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
