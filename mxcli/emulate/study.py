"""The loss study behind ``mxcli emulate`` (issue 31): pure functions, no printing.

Design (paired): for each seed, every arm starts from the same initial weights and trains on
the same batches in the same order, then is scored on one fixed held-out set. Arms (`ARMS`):
``fp32`` (no rounding at all: the exact reference), ``bf16`` (the same GEMM chains with their
bf16 rounding points and no MX: the baseline), and MXFP8 under three `ScaleRule`s: ``neuron``
(Trn3's ``quantize_mx``), ``ocp`` (the OCP floor rule, torchao's FLOOR) and ``rceil`` (torchao
MoE training's default, cuBLAS's round-up). Scope: the routed experts (`mxcli.emulate.layer`,
the MXFP8 kernels' numerics), or experts and every dense linear of the recipe
(`mxcli.emulate.dense`).

Reported per arm against bf16: the paired held-out gap (nats per token) with its 95% t-interval
over seeds and a verdict decided by the interval (`mxcli.emulate.stats`); the per-step paired
gap of the training loss (same batch on both sides) with its band; step-1 gradient SQNR against
fp32 (experts and dense weights; same weights and batch: only numerics differ) and the fraction
of forward MX operand values that saturate, flush to zero, or sit in a group whose scale
underflowed, on the last step, each with its interval over seeds.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mxcli.emulate.corpus import corpus_sha256, default_corpus
from mxcli.emulate.dense import MxLinear, dense_targets, patch_dense, set_dense_rule
from mxcli.emulate.layer import MxExperts
from mxcli.emulate.patch import patch, set_mode
from mxcli.emulate.stats import interval, verdict
from mxcli.mx import QuantScheme, ScaleRule, group_index, quantize_mx

__all__ = [
    "ARMS",
    "PRESETS",
    "SCOPES",
    "StudyOptions",
    "default_model",
    "finite",
    "mx_value_counts",
    "run_study",
    "sqnr_db",
]

ARMS = ("fp32", "bf16", "neuron", "ocp", "rceil")
MX_ARMS = ("neuron", "ocp", "rceil")
RULES: dict[str, ScaleRule] = {
    "neuron": ScaleRule.NEURON,
    "ocp": ScaleRule.OCP,
    "rceil": ScaleRule.RCEIL,
}
SCOPES = ("experts", "experts+dense")
EMA_ALPHA = 0.1  # smoothing of the per-step curves (training loss and paired gap)
HELD_OUT_SEED = 10_000

# qwen3_moe with byte tokens (vocab 256), layer 0 a dense SwiGLU MLP (``mlp_only_layers``), the
# others MoE; filled in by the presets below.
_BASE: dict[str, Any] = dict(
    vocab_size=256, num_key_value_heads=1, norm_topk_prob=True, max_position_embeddings=2048,
    pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
    mlp_only_layers=[0],
)  # fmt: skip


@dataclass(frozen=True)
class Preset:
    model: dict[str, Any]
    steps: int
    batch: int
    seq_len: int
    lr: float
    seeds: int
    eval_batches: int
    note: str


def _cfg(H: int, L: int, E: int, I: int, heads: int, topk: int) -> dict[str, Any]:  # noqa: E741
    return dict(_BASE, hidden_size=H, num_hidden_layers=L, num_experts=E,
                moe_intermediate_size=I, intermediate_size=2 * I, num_attention_heads=heads,
                head_dim=H // heads, num_experts_per_tok=topk)  # fmt: skip


PRESETS: dict[str, Preset] = {
    # for tests and CI: seconds on one CPU core
    "tiny": Preset(_cfg(128, 2, 4, 128, 2, 2), 4, 2, 32, 3e-3, 2, 1, "tests and CI"),
    # about 10 minutes on 2 CPU cores (README: measured)
    "default": Preset(_cfg(128, 3, 8, 128, 2, 2), 60, 8, 128, 2e-3, 5, 8, "2 CPU cores"),
    # about 100M parameters, tens of millions of tokens per run: one GPU (--device cuda)
    "cuda-small": Preset(
        _cfg(512, 8, 16, 512, 8, 4), 2000, 32, 512, 6e-4, 5, 16, "one GPU, --device cuda"
    ),
}


@dataclass(frozen=True)
class StudyOptions:
    preset: str = "default"
    steps: int = PRESETS["default"].steps
    batch: int = PRESETS["default"].batch
    seq_len: int = PRESETS["default"].seq_len
    lr: float = PRESETS["default"].lr
    seeds: int = PRESETS["default"].seeds
    first_seed: int = 0
    eval_batches: int = PRESETS["default"].eval_batches
    scope: str = "experts+dense"
    arms: tuple[str, ...] = ARMS
    device: str = "cpu"
    block_size: int = 128
    model_config: dict[str, Any] = field(default_factory=lambda: dict(PRESETS["default"].model))

    @staticmethod
    def from_preset(name: str, **overrides: Any) -> StudyOptions:
        p = PRESETS[name]
        base = StudyOptions(
            preset=name, steps=p.steps, batch=p.batch, seq_len=p.seq_len, lr=p.lr,
            seeds=p.seeds, eval_batches=p.eval_batches, model_config=dict(p.model),
        )  # fmt: skip
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def default_model(config: dict[str, Any], seed: int) -> Any:
    """The built-in qwen3_moe of `config`, initialized from `seed` (fp32 master weights)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config)).float()


def tokenize(data: bytes, tokenizer: Any) -> torch.Tensor:
    """Token ids of `data`: the model's tokenizer, or its bytes when it has none."""
    if tokenizer is None:
        if not data:
            return torch.zeros(0, dtype=torch.int64)
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
            f"data: expected at least {seq_len + 2} tokens per split (10% held out), got "
            f"{max(b - a, 0)} (use a longer --data file or a shorter --seq-len)"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(a, b - seq_len - 1, (count, batch), generator=g)
    offs = torch.arange(seq_len + 1)
    return [tokens[s[:, None] + offs] for s in starts]


def sqnr_db(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float | None:
    """``10·log10(Σ|ref|² / Σ|ref − got|²)`` over tensor pairs, in dB (None when equal)."""
    sig = noise = 0.0
    for r, g in zip(ref, got, strict=True):
        rd, d = r.double(), r.double() - g.double()
        sig += float((rd * rd).sum())
        noise += float((d * d).sum())
    if noise == 0.0 or not math.isfinite(noise) or sig == 0.0:
        return None
    return 10.0 * math.log10(sig / noise)


def mx_value_counts(x: torch.Tensor, rule: ScaleRule, wrapx: bool) -> tuple[int, int, int, int]:
    """``(saturated, flushed, in_underflowed_group, nonzero)`` counts of bf16(x) MX-quantized
    (E4M3FN) along its last axis: the experts' wrapX tile-512 scheme, or 1x32 for dense GEMMs.

    Saturated: ``|x|/X`` at or above 464, the midpoint past E4M3FN's 448 (it would round beyond
    the largest finite); flushed: a nonzero value with ``|x|/X <= 2^-10`` (half the smallest
    subnormal 2^-9: rounds to zero); underflowed: a nonzero value whose group's scale byte is 0
    (the smallest scale, 2^-127: the group maximum was too small for its rule's exponent)."""
    xb = x.detach().to(torch.bfloat16).reshape(-1, x.shape[-1]).float()
    scheme = QuantScheme.WRAPX if wrapx else QuantScheme.MX1X32
    _, scales = quantize_mx(xb, -1, rule=rule, scheme=scheme, tile_k=512)
    gidx = group_index(xb.shape[-1], scheme, 512).to(xb.device)
    per_value = scales.index_select(-1, gidx)
    X = torch.where(
        per_value == 0,
        torch.full_like(xb, 2.0**-127),
        (per_value.to(torch.int32) << 23).view(torch.float32),
    )
    y = xb.abs() / X
    nz = xb != 0
    return (
        int((y >= 464).sum()),
        int((nz & (y <= 2.0**-10)).sum()),
        int((nz & (per_value == 0)).sum()),
        int(nz.sum()),
    )


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def ema(xs: list[float | None], alpha: float = EMA_ALPHA) -> list[float | None]:
    """Exponential moving average ``m_t = m_{t-1} + α (x_t − m_{t-1})``, ``m_0 = x_0``; None
    from the first None on (a diverged run)."""
    out: list[float | None] = []
    m: float | None = None
    for x in xs:
        if x is None or (out and out[-1] is None):
            out.append(None)
            continue
        m = x if m is None else m + alpha * (x - m)
        out.append(m)
    return out


def ema_two_way(xs: list[float | None], alpha: float = EMA_ALPHA) -> list[float | None]:
    """`ema` run forward, then backward over its result: the same smoothing without the lag a
    one-way EMA shows on a falling loss (for the plot); None from the first None on."""
    n = next((i for i, x in enumerate(xs) if x is None), len(xs))
    fwd = ema(xs[:n], alpha)
    back = ema(fwd[::-1], alpha)[::-1]
    return back + [None] * (len(xs) - n)


def _loss(model: Any, b: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=b[:, :-1]).logits  # next-token loss on the window
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), b[:, 1:].reshape(-1)
    )


def _set_arm(model: Any, arm: str, scope: str) -> None:
    set_mode(model, {"fp32": "exact"}.get(arm, arm))
    if scope == "experts+dense":
        set_dense_rule(model, RULES.get(arm), exact=arm == "fp32")


def _grad_groups(model: Any, dense_names: list[str]) -> dict[str, list[torch.Tensor]]:
    experts = [p for m in model.modules() if isinstance(m, MxExperts) for p in m.parameters()]
    dense = [model.get_submodule(n).weight for n in dense_names]
    return {"experts": experts, "dense": dense}


def _schedule(step: int, steps: int) -> float:
    """LR factor: linear warm-up over the first 10% of steps, then cosine decay to 10%."""
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))


def _train(
    model: Any,
    arm: str,
    opts: StudyOptions,
    train: list[torch.Tensor],
    held_out: list[torch.Tensor],
    dense_names: list[str],
    on_step: Callable[[str, int, int, float | None], None],
    seed: int,
) -> dict[str, Any]:
    _set_arm(model, arm, opts.scope)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, len(train)))
    losses: list[float | None] = []
    first: dict[str, list[torch.Tensor]] = {}
    operands: dict[str, tuple[torch.Tensor, bool]] = {}
    hooks = []
    last = len(train) - 1
    for name, m in model.named_modules():
        if isinstance(m, MxExperts | MxLinear) and arm in MX_ARMS:

            def grab(mod: Any, args: tuple[Any, ...], n: str = name) -> None:
                if mod.training and len(losses) == last:
                    operands[n] = (args[0].detach(), isinstance(mod, MxExperts))

            hooks.append(m.register_forward_pre_hook(grab))
    status = "ok"
    for step, b in enumerate(train):
        b = b.to(opts.device)
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, b)
        value = float(loss.detach())
        if not math.isfinite(value):
            status = f"diverged at step {step + 1} (loss {value})"
            losses.append(None)
            on_step(arm, seed, step, None)
            break
        loss.backward()
        if step == 0:
            first = {
                k: [p.grad.detach().cpu().clone() for p in ps if p.grad is not None]
                for k, ps in _grad_groups(model, dense_names).items()
            }
        opt.step()
        sched.step()
        losses.append(value)
        on_step(arm, seed, step, value)
    for h in hooks:
        h.remove()
    losses += [None] * (len(train) - len(losses))
    eval_loss: float | None = None
    if status == "ok":
        model.eval()
        with torch.no_grad():
            ev = [float(_loss(model, b.to(opts.device))) for b in held_out]
        eval_loss = math.fsum(ev) / len(ev)
        if not math.isfinite(eval_loss):
            status, eval_loss = "diverged (held-out loss not finite)", None
    stats: dict[str, float | None] = {}
    if arm in MX_ARMS and status == "ok":
        stats = _operand_stats(model, operands, RULES[arm])
    return {
        "seed": seed,
        "status": status,
        "eval_loss": eval_loss,
        "losses": losses,
        "_grads": first,
        "_stats": stats,
    }


def _operand_stats(
    model: Any, operands: dict[str, tuple[torch.Tensor, bool]], rule: ScaleRule
) -> dict[str, float | None]:
    """Fractions over the last step's forward MX operands (layer inputs and weights)."""
    sat = flu = und = nz = 0
    for name, (x, is_experts) in operands.items():
        mod = model.get_submodule(name)
        ws = [mod.gate_up_proj, mod.down_proj] if is_experts else [mod.weight]
        for t in [x, *ws]:
            s, f, u, z = mx_value_counts(t, rule, wrapx=is_experts)
            sat, flu, und, nz = sat + s, flu + f, und + u, nz + z
    if nz == 0:
        return {}
    return {
        "saturated_fraction": sat / nz,
        "flushed_fraction": flu / nz,
        "underflowed_scale_fraction": und / nz,
    }


def _load_model(model_dir: Path | None, opts: StudyOptions, seed: int) -> tuple[Any, Any, str]:
    if model_dir is None:
        c = opts.model_config
        desc = (
            f"built-in qwen3_moe ({c['num_hidden_layers']} layers, layer 0 dense MLP, "
            f"H={c['hidden_size']}, E={c['num_experts']}, top-{c['num_experts_per_tok']}, "
            f"I={c['moe_intermediate_size']}, byte tokens)"
        )
        return default_model(c, seed), None, desc
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:  # no tokenizer files: train on bytes (needs vocab >= 256)
        tokenizer = None
    return model, tokenizer, str(model_dir)


def run_study(
    opts: StudyOptions,
    model_dir: Path | None = None,
    data_file: Path | None = None,
    on_step: Callable[[str, int, int, float | None], None] | None = None,
) -> dict[str, Any]:
    """Run every arm for every seed (see the module doc); returns the JSON-ready report
    (strict: non-finite values are None), the wall time under ``timing`` (the one key that
    differs between two runs of the same inputs on the same machine)."""
    t0 = time.perf_counter()
    cb = on_step or (lambda arm, seed, step, loss: None)
    arms = [a for a in ARMS if a in opts.arms or a in ("fp32", "bf16")]
    model, tokenizer, model_desc = _load_model(model_dir, opts, opts.first_seed)
    if data_file is not None:
        data, data_desc = data_file.read_bytes(), str(data_file)
    else:
        data, data_desc = default_corpus(), "built-in synthetic corpus (mxcli.emulate.corpus)"
    tokens = tokenize(data, tokenizer)
    vocab = int(model.config.vocab_size)
    if tokens.numel() and int(tokens.max()) >= vocab:
        raise ValueError(f"data: token id {int(tokens.max())} >= the model's vocab_size {vocab}")
    need = 10 * (opts.seq_len + 3)  # the held-out tenth must hold one window of seq_len + 2
    if tokens.numel() < need:
        raise ValueError(
            f"data: expected at least {need} tokens for --seq-len {opts.seq_len} (a tenth is "
            f"held out), got {tokens.numel()} (use a longer --data file or a shorter --seq-len)"
        )
    split = int(tokens.numel() * 0.9)
    held_out = batches(
        tokens, opts.eval_batches, opts.batch, opts.seq_len, HELD_OUT_SEED, (split, tokens.numel())
    )
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    patched: dict[str, Any] = {}
    n_params = sum(p.numel() for p in model.parameters())
    seeds = list(range(opts.first_seed, opts.first_seed + opts.seeds))
    for i, seed in enumerate(seeds):
        if i > 0 and model_dir is None:
            model = default_model(opts.model_config, seed)  # a checkpoint keeps its weights
        if i == 0 or model_dir is None:
            experts = patch(model, "bf16", opts.block_size)
            if opts.scope == "experts+dense":
                dense, kept = patch_dense(model)
            else:
                dense, kept = dense_targets(model)
            patched = {"experts": experts, "dense_mxfp8": dense if opts.scope != "experts"
                       else [], "high_precision": kept}  # fmt: skip
            model.to(opts.device)
            init = copy.deepcopy(model.state_dict())
        train = batches(tokens, opts.steps, opts.batch, opts.seq_len, seed, (0, split))
        for arm in arms:
            model.load_state_dict(init)
            torch.manual_seed(seed)
            runs[arm].append(_train(model, arm, opts, train, held_out, dense, cb, seed))
    report = _summarize(runs, arms, opts)
    report.update(
        question="What does MXFP8 (Trn3's NEURON rule, OCP floor, RCEIL) do to the training "
        "loss, against bf16?",
        model=model_desc,
        parameters=n_params,
        data={
            "source": data_desc,
            "sha256": corpus_sha256(data),
            "bytes": len(data),
            "tokens": int(tokens.numel()),
        },
        options={k: v for k, v in asdict(opts).items()},
        seeds=seeds,
        patched=patched,
        tokens_per_run=opts.steps * opts.batch * opts.seq_len,
        timing={"wall_s": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads()},
    )
    return finite(report)


def _summarize(
    runs: dict[str, list[dict[str, Any]]], arms: list[str], opts: StudyOptions
) -> dict[str, Any]:
    base = runs["bf16"]
    gaps: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    for arm in arms:
        if arm == "bf16":
            continue
        per_seed = [
            None if r["eval_loss"] is None or b["eval_loss"] is None
            else r["eval_loss"] - b["eval_loss"]
            for r, b in zip(runs[arm], base, strict=True)
        ]  # fmt: skip
        iv = interval(per_seed)
        gaps[arm] = {**iv, "per_seed": per_seed, "verdict": verdict(iv)}
        smoothed = [
            ema([None if x is None or y is None else x - y
                 for x, y in zip(r["losses"], b["losses"], strict=True)])
            for r, b in zip(runs[arm], base, strict=True)
        ]  # fmt: skip
        step_iv = [interval([s[t] for s in smoothed]) for t in range(opts.steps)]
        curves[arm] = {k: [iv_t[k] for iv_t in step_iv] for k in ("mean", "low", "high")}
    sqnr: dict[str, Any] = {}
    ref = runs["fp32"]
    for arm in arms:
        if arm == "fp32":
            continue
        sqnr[arm] = {
            kind: interval(
                [sqnr_db(f["_grads"].get(kind, []), r["_grads"].get(kind, []))
                 if r["_grads"] and f["_grads"] else None
                 for f, r in zip(ref, runs[arm], strict=True)]
            )
            for kind in ("experts", "dense")
        }  # fmt: skip
    mx_stats: dict[str, Any] = {}
    for arm in arms:
        if arm not in MX_ARMS:
            continue
        mx_stats[arm] = {
            k: interval([r["_stats"].get(k) for r in runs[arm]])
            for k in ("saturated_fraction", "flushed_fraction", "underflowed_scale_fraction")
        }
    held = {a: interval([r["eval_loss"] for r in runs[a]]) for a in arms}
    for rs in runs.values():
        for r in rs:
            r.pop("_grads")
            r.pop("_stats")
    diverged = [f"{a} seed {r['seed']}" for a in arms for r in runs[a] if r["status"] != "ok"]
    mx = [a for a in MX_ARMS if a in gaps]
    worse = [a for a in mx if gaps[a]["verdict"].endswith("higher loss")]
    better = [a for a in mx if gaps[a]["verdict"].endswith("lower loss")]
    if diverged:
        overall = f"diverged: {', '.join(diverged)}"
    elif worse or better:
        overall = "; ".join(
            [f"{', '.join(worse)} above bf16" for _ in worse[:1]]
            + [f"{', '.join(better)} below bf16" for _ in better[:1]]
        )
        rest = [a for a in mx if a not in worse + better]
        if rest:
            overall += f"; {', '.join(rest)} not distinguishable from bf16"
    else:
        overall = f"{', '.join(mx)}: not distinguishable from bf16"
    return {
        "status": "diverged" if diverged else "ok",
        "verdict": overall,
        "arms": arms,
        "held_out_loss": held,
        "gap_to_bf16": gaps,
        "detectable_gap": {a: gaps[a]["half_width"] for a in gaps},
        "gap_curve_ema": {"alpha": EMA_ALPHA, **curves},
        "grad_sqnr_db_vs_fp32": sqnr,
        "mx_value_stats": mx_stats,
        "runs": runs,
    }


def project_seconds(
    opts: StudyOptions, model_dir: Path | None = None, repeats: int = 2
) -> dict[str, Any]:
    """Projected wall time of `run_study`: one warm-up and `repeats` timed training steps per
    arm on this machine, times steps and seeds (held-out passes are a few steps more)."""
    model, _, _ = _load_model(model_dir, opts, opts.first_seed)
    patch(model, "bf16", opts.block_size)
    if opts.scope == "experts+dense":
        patch_dense(model)
    model.to(opts.device)
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, min(vocab, 256), (opts.batch, opts.seq_len + 1), generator=g)
    b = b.to(opts.device)
    arms = [a for a in ARMS if a in opts.arms or a in ("fp32", "bf16")]
    per_step: dict[str, float] = {}
    for arm in arms:
        _set_arm(model, arm, opts.scope)
        times = []
        for _ in range(1 + repeats):
            t = time.perf_counter()
            model.zero_grad(set_to_none=True)
            _loss(model, b).backward()
            if opts.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        per_step[arm] = min(times[1:])
    steps = opts.steps + opts.eval_batches // 2
    total = sum(per_step.values()) * steps * opts.seeds
    return {
        "per_step_s": per_step,
        "projected_s": total,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_run": opts.steps * opts.batch * opts.seq_len,
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels to a PNG at `path` (1600 x 900 px; needs matplotlib): smoothed training loss
    per arm (raw values faint), and the paired gap to bf16 per arm with its 95% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fp32": "0.45", "bf16": "black", "neuron": "tab:blue", "ocp": "tab:red",
              "rceil": "tab:green"}  # fmt: skip
    names = {"fp32": "fp32", "bf16": "bf16", "neuron": "MXFP8 NEURON", "ocp": "MXFP8 OCP floor",
             "rceil": "MXFP8 RCEIL"}  # fmt: skip
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 9), dpi=100)
    runs = report["runs"]
    held = report["held_out_loss"]
    gaps = report["gap_to_bf16"]
    tokens_per_step = report["options"]["batch"] * report["options"]["seq_len"]

    def fmt_iv(iv: dict[str, Any], sign: bool = False) -> str:
        if iv.get("mean") is None:
            return "n/a"
        f = "{:+.4f}" if sign else "{:.4f}"
        if iv.get("half_width") is None:
            return f.format(iv["mean"])
        return f"{f.format(iv['mean'])} ± {iv['half_width']:.4f}"

    # lighter smoothing on short runs: a falling loss outruns an α=0.1 average in 60 steps
    alpha1 = min(0.5, max(EMA_ALPHA, 20 / max(1, len(runs["bf16"][0]["losses"]))))
    for arm in report["arms"]:
        c = colors.get(arm, None)
        steps = len(runs[arm][0]["losses"])
        x = range(1, steps + 1)
        mean_raw = [
            _mean([r["losses"][t] for r in runs[arm]]) for t in range(steps)
        ]  # mean over seeds, per step
        ax1.plot(x, [float("nan") if v is None else v for v in mean_raw], color=c, alpha=0.3,
                 lw=0.8)  # fmt: skip
        sm = ema_two_way(mean_raw, alpha1)
        label = f"{names.get(arm, arm)}: held-out {fmt_iv(held[arm])}"
        ax1.plot(x, [float("nan") if v is None else v for v in sm], color=c, lw=1.8, label=label)
    ax1.set_xlabel(f"optimizer step ({tokens_per_step} tokens each)")
    ax1.set_ylabel("training loss (nats/token), mean over seeds")
    ax1.set_title(f"Training loss, EMA α={alpha1:.2f} run forward and backward (raw faint)")
    ax1.legend(fontsize=9, title="held-out loss, mean ± 95% CI over seeds", title_fontsize=9)
    ax1.grid(alpha=0.3)
    curves = report["gap_curve_ema"]
    ax2.axhline(0.0, color="black", lw=1.0)
    for arm in report["arms"]:
        if arm == "bf16" or arm not in curves:
            continue
        cv = curves[arm]
        xs = list(range(1, len(cv["mean"]) + 1))
        nan = float("nan")
        m = [nan if v is None else v for v in cv["mean"]]
        lo = [nan if v is None else v for v in cv["low"]]
        hi = [nan if v is None else v for v in cv["high"]]
        c = colors.get(arm, None)
        g = gaps[arm]
        label = f"{names.get(arm, arm)}: held-out gap {fmt_iv(g, sign=True)} ({g['verdict']})"
        ax2.plot(xs, m, color=c, lw=1.8, label=label)
        ax2.fill_between(xs, lo, hi, color=c, alpha=0.15)
    ax2.set_xlabel(f"optimizer step ({tokens_per_step} tokens each)")
    ax2.set_ylabel("paired training-loss gap to bf16 (nats/token)")
    ax2.set_title(f"Arm − bf16 on the same batch, EMA α={EMA_ALPHA}, 95% band over seeds")
    ax2.legend(fontsize=9, title="held-out gap to bf16, mean ± 95% CI", title_fontsize=9)
    ax2.grid(alpha=0.3)
    n = len(report["seeds"])
    fig.suptitle(
        f"Will MXFP8 hurt? {report['verdict']}  ({n} paired seeds, scope "
        f"{report['options']['scope']}, {report['tokens_per_run']} tokens per run)",
        fontsize=12,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _mean(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return math.fsum(v) / len(v) if v and len(v) == len(xs) else None
