"""Planning: what `prep-weights` will read and write, decided from config.json and the shard
headers alone (no tensor data).

`build_plan` validates everything it can before a byte is written: the family and its config
keys, TP/EP divisibility, and every source tensor's presence and shape for every selected layer.
Sizes the kernels cannot take are zero-padded (`mxcli.weightprep.padding`). The `Plan` then
lists, per rank, the output tensors of a layer with their shapes, dtypes and byte counts, and
estimates the peak memory. Tensors whose shard is not here (``--dry-run`` from config.json, with
or without the index) are planned from the config: shapes from its sizes, dtypes from
``torch_dtype`` and ``quantization_config``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxcli.errors import InputError
from mxcli.kernels.blockwise_moe.prequant import scale_rows
from mxcli.weightprep import export
from mxcli.weightprep.checkpoint import (
    FP8_SOURCE_DTYPES,
    INDEX_NAME,
    Checkpoint,
    CheckpointError,
    TensorInfo,
)
from mxcli.weightprep.families import (
    NORM_1PW,
    ConfigError,
    Fused,
    ModelConfig,
    bind_tensor_names,
    check_shape,
    detect_family,
    fp8_scale_shape,
    resolve_config,
)
from mxcli.weightprep.fp8 import FP8_RANGES, Fp8Semantics, check_source_target, source_semantics
from mxcli.weightprep.padding import Padding
from mxcli.weightprep.sources import CtQuant
from mxcli.weightprep.writer import TensorSpec

FORMATS = ("bf16", "mxfp8")
SCALE_LAYOUTS = ("packed", "unpacked")
SCALE_RULES = ("neuron", "ocp", "rceil", "ct")
# the rules only some exports take (`Exporter.scale_rules`; their consumers decode any E8M0
# byte), and only for a +-448 target
EXPORT_ONLY_RULES = ("rceil", "ct")
# Expert chunk size: experts are read, converted and written this many bytes (bf16) at a time.
CHUNK_BYTES = 64 << 20
# Measured: peak RSS of one worker ~ this many chunk sizes on top of the interpreter + torch.
_CHUNK_PEAK_FACTOR = 6
_BASE_RSS = 400 << 20


@dataclass(frozen=True)
class PrepOptions:
    """User choices of one `prep-weights` run (the CLI flags)."""

    tp: int = 1
    ep: int = 1
    formats: tuple[str, ...] = FORMATS
    scale_layout: str = "packed"
    scale_rule: str = "auto"  # auto: the output format's (`Exporter.default_scale_rule`)
    layers: str | None = None  # "3-10,12"; None or "all" = every MoE layer
    model_type: str | None = None  # None or "auto" = config.json's model_type
    workers: int = 1
    threads: int = 0  # torch intra-op threads per worker; 0 = auto (`threads_per_worker`)
    check: bool = False
    chunk_bytes: int = CHUNK_BYTES
    allow_nonfinite: bool = False  # convert source weights holding NaN/Inf (else an error)
    fp8_range: int = 448  # 448: OCP E4M3FN; 240: codes saturated for Neuron FP8 (`fp8`)
    output_format: str = "mxcli"  # a registered `mxcli.weightprep.export.Exporter`'s name
    nxdi_base: str | None = None  # nxdi: NxDI's own sharded checkpoint to complete (`export.nxdi`)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or self.workers < 1 or self.threads < 0:
            raise InputError(
                f"--tp, --ep and --workers must be >= 1 and --threads >= 0, got tp={self.tp} ep={self.ep} "
                f"workers={self.workers} threads={self.threads}"
            )
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise InputError(
                f"--formats: expected a comma list of {', '.join(FORMATS)}, got {','.join(self.formats) or 'nothing'}"
            )
        if self.scale_layout not in SCALE_LAYOUTS:
            raise InputError(
                f"--scale-layout: expected packed or unpacked, got {self.scale_layout!r}"
            )
        exp = export.find(self.output_format)  # None: refused below, after the rule checks
        if self.scale_rule == "auto":
            rule = (exp or export.default()).default_scale_rule(self.fp8_range)
            object.__setattr__(self, "scale_rule", rule)
        if self.scale_rule not in SCALE_RULES:
            raise InputError(
                f"--scale-rule: expected neuron, ocp, rceil or ct, got {self.scale_rule!r}"
            )
        if self.fp8_range not in FP8_RANGES:
            raise InputError(f"--fp8-range: expected 448 or 240, got {self.fp8_range}")
        exp = export.get(self.output_format)
        if (
            self.fp8_range == 240
            and self.scale_rule == "ocp"
            and exp.default_scale_rule(240) != "ocp"  # a format whose +-240 bytes it records so
        ):
            raise InputError(
                "--fp8-range 240 --scale-rule ocp: a +-240 target scales with byte = exponent - 7 "
                "(OCP's algorithm for a +-240 element is the NEURON rule): use --scale-rule neuron"
            )
        if self.nxdi_base is not None and "nxdi_base" not in exp.options:
            raise InputError(
                f"--nxdi-base: for --output-format {' or '.join(export.taking_option('nxdi_base'))}"
                f" only (got {self.output_format})"
            )
        exp.check_options(self)
        if self.scale_rule not in exp.scale_rules:
            raise InputError(
                f"--scale-rule {self.scale_rule}: for --output-format "
                f"{' or '.join(export.taking_rule(self.scale_rule))} only (got --output-format "
                f"{self.output_format}; its outputs take {' or '.join(exp.scale_rules)})"
            )
        if self.scale_rule in EXPORT_ONLY_RULES and self.fp8_range == 240:
            raise InputError(
                f"--scale-rule {self.scale_rule} --fp8-range 240: a +-240 target scales with "
                "byte = exponent - 7 (use --scale-rule neuron or ocp)"
            )

    def fp8(self) -> Fp8Semantics:
        """The FP8 semantics of the outputs (variant, range, scale rule)."""
        return Fp8Semantics(self.fp8_range, self.scale_rule)

    def threads_per_worker(self) -> int:
        """``threads``, or auto: CPUs / workers less one (at most 8, at least 1).

        Each worker's writer thread hashes and writes the previous chunk while torch converts
        the next one; leaving it a core measured faster than giving torch every core (on 2
        CPUs: one torch thread converted a 1.2 GB layer in 3.9 s, two threads in 5.3 s).
        """
        import os

        if self.threads:
            return self.threads
        cpus = os.cpu_count() or 1
        return max(1, min(8, cpus // self.workers - 1))

    def settings(self) -> dict[str, Any]:
        """The choices that shape the outputs (a resumed run must repeat them)."""
        return {
            "tp": self.tp,
            "ep": self.ep,
            "formats": list(self.formats),
            "scale_layout": self.scale_layout,
            "scale_rule": self.scale_rule,
            "elem": "e4m3fn",
            "quant_scheme": "wrapx",
            "tile_k": 512,
            "fp8_range": self.fp8_range,
            "output_format": self.output_format,
            **({"nxdi_base": self.nxdi_base} if self.nxdi_base is not None else {}),
        }


def parse_formats(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))


def parse_layers(spec: str | None, num_layers: int) -> list[int] | None:
    """``"3-10,12"`` -> sorted layer indices (inclusive ranges); None/"all" -> None. An empty
    spec is an error, not "all" (``--layers "$UNSET"`` must not convert every layer)."""
    if spec is None or spec.strip().lower() == "all":
        return None
    if not spec.strip():
        raise InputError(f"--layers: expected 'all', e.g. '3-10' or '0,2,5-7', got {spec!r}")
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise InputError(f"--layers: expected e.g. '3-10' or '0,2,5-7', got {spec!r}")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise InputError(f"--layers: range {part!r} is empty")
        if b >= num_layers:
            raise InputError(
                f"--layers: layer {b} out of range (the model has {num_layers} layers, 0-{num_layers - 1})"
            )
        out.update(range(a, b + 1))
    return sorted(out)


@dataclass(frozen=True)
class Rank:
    """One output rank: a TP slice of I and an EP range of experts."""

    rank: int
    tp_rank: int
    ep_rank: int
    i_range: tuple[int, int]
    expert_range: tuple[int, int]
    shared_i_range: tuple[int, int] | None

    @property
    def dir(self) -> str:
        return f"rank{self.rank}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "ep_rank": self.ep_rank,
            "dir": self.dir,
            "intermediate_range": list(self.i_range),
            "expert_range": list(self.expert_range),
            "shared_intermediate_range": list(self.shared_i_range) if self.shared_i_range else None,
        }


@dataclass(frozen=True)
class Output:
    """One output tensor of a layer on a rank (name without the ``layers.{L}.`` prefix)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    kernel_arg: str  # the kernel argument it feeds
    layout: str  # human description of the layout

    @property
    def nbytes(self) -> int:
        return TensorSpec(self.key, self.dtype, self.shape).nbytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes": self.nbytes,
            "kernel_arg": self.kernel_arg,
            "layout": self.layout,
        }


def tensor_name(layer: int, key: str) -> str:
    return f"layers.{layer}.{key}"


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


def mxfp8_outputs(
    prefix: str,
    E: int,
    H: int,
    I: int,  # noqa: E741 (spec notation)
    layout: str,
    data_arg: str,
    scale_arg: str,
) -> list[Output]:
    """Pre-quantized x4 data + E8M0 scales of a gate/up and a down weight (bwd spec §5.5)."""
    packed = layout == "packed"
    lay = f"wrapX/512 groups along K, x4 little-endian words, {layout} scales"
    gu, d = prefix + "gate_up", prefix + "down"
    return [
        Output(
            gu + "_proj_weight_mxfp8",
            "U32",
            (E, 2 * I // 4, H),
            data_arg.replace("*", "gate_up"),
            "[E, 2I/4, H] x4 of W_gu[e].reshape(H, 2I).T; " + lay,
        ),
        Output(
            gu + "_weight_scales",
            "U8",
            (E, scale_rows(2 * I, layout), H),
            scale_arg.replace("*", "gate_up"),
            f"[E, {'ceil(2I/2048)*128' if packed else '2I/4'}, H] E8M0 bytes",
        ),
        Output(
            d + "_proj_weight_mxfp8",
            "U32",
            (E, H // 4, I),
            data_arg.replace("*", "down"),
            "[E, H/4, I] x4 of W_d[e].T; " + lay,
        ),
        Output(
            d + "_weight_scales",
            "U8",
            (E, scale_rows(H, layout), I),
            scale_arg.replace("*", "down"),
            f"[E, {'ceil(H/2048)*128' if packed else 'H/4'}, I] E8M0 bytes",
        ),
    ]


@dataclass
class Plan:
    """Everything a run will do; `to_dict` is the ``--dry-run --json`` output."""

    source: Path
    model: ModelConfig
    options: PrepOptions
    layers: list[int]  # selected MoE layers
    skipped_dense: list[int]  # selected by --layers but not MoE
    prefix: str  # decoder layer name prefix, "{L}" = layer
    ranks: list[Rank]
    outputs: list[list[Output]]  # per rank
    source_tensors: dict[int, list[str]]  # per layer
    source_bytes: dict[int, int]  # per layer, as stored
    source_bf16_bytes: int  # one layer's expert weights as bf16 (routed + shared)
    gamma_dtype: str
    router_dtype: str
    router_bias_dtype: str | None
    source_format: str  # "bf16" | "fp8-block" | "mxfp4" | ...
    model_type: str = ""  # config.json's model_type
    notes: list[str] = field(default_factory=list)
    config_only: bool = False  # some source tensors planned from config.json (no header)
    hub: dict[str, Any] | None = None  # {"repo_id", "revision", "commit"} of a Hub source
    source_files: dict[str, str] = field(default_factory=dict)  # tensor -> shard ("" unknown)
    source_fp8: dict[str, Any] | None = None  # FP8 semantics the source declares (`fp8`)

    @property
    def H(self) -> int:
        return self.model.H

    @property
    def padding(self) -> Padding:
        return Padding.of(self.model.H, self.I_tp, self.shared_I_tp)

    @property
    def H_padded(self) -> int:
        """H of the prefill tensors (a multiple of 512)."""
        return self.padding.prefill_hidden_size

    @property
    def I_tp(self) -> int:
        return self.model.I // self.options.tp

    @property
    def shared_I_tp(self) -> int | None:
        Is = self.model.shared_I
        return Is // self.options.tp if Is else None

    def layer_prefix(self, layer: int) -> str:
        return self.prefix.format(L=layer)

    def output_bytes_per_layer(self) -> int:
        return sum(o.nbytes for outs in self.outputs for o in outs)

    def chunk_experts(self) -> int:
        per_expert = 3 * self.H * self.model.I * 2
        e_rank = self.ranks[0].expert_range[1] - self.ranks[0].expert_range[0]
        return max(1, min(e_rank, self.options.chunk_bytes // max(1, per_expert)))

    def estimated_peak_bytes(self) -> int:
        per_expert = 3 * self.H * self.model.I * 2
        chunk = self.chunk_experts() * per_expert
        shared = 3 * self.H * (self.model.shared_I or 0) * 2
        return _BASE_RSS + self.options.workers * _CHUNK_PEAK_FACTOR * max(chunk, shared)

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "source": str(self.source),
            "hub": self.hub,
            "family": m.family.name,
            "model_type": self.model_type,
            "source_format": self.source_format,
            "num_layers": m.num_layers,
            "moe_layers": m.moe_layers(),
            "layers": self.layers,
            "skipped_dense_layers": self.skipped_dense,
            "num_experts": m.E,
            "hidden_size": m.H,
            "padded_hidden_size": self.H_padded,
            "intermediate_size": m.I,
            "intermediate_size_per_rank": self.I_tp,
            "padding": self.padding.to_dict(),
            "shared_intermediate_size": m.shared_I,
            "top_k": m.values["top_k"],
            "options": self.options.settings()
            | {
                "workers": self.options.workers,
                "threads": self.options.threads_per_worker(),
                "check": self.options.check,
            },
            "router": m.router.to_dict(),
            "config_defaults": [d.to_dict() for d in m.defaulted],
            "ranks": [rk.to_dict() for rk in self.ranks],
            "outputs_per_layer": {
                rk.dir: [o.to_dict() for o in outs]
                for rk, outs in zip(self.ranks, self.outputs, strict=True)
            },
            "source_bytes": sum(self.source_bytes.values()),
            "output_bytes": self.output_bytes_per_layer() * len(self.layers),
            "source_bf16_bytes_per_layer": self.source_bf16_bytes,
            "estimated_peak_memory_bytes": self.estimated_peak_bytes(),
            "per_layer": [
                {
                    "layer": L,
                    "source_bytes": self.source_bytes[L],
                    "source_shards": sorted(
                        {self.source_files.get(n, "") for n in self.source_tensors[L]} - {""}
                    ),
                    "output_bytes": self.output_bytes_per_layer(),
                    "estimated_peak_memory_bytes": self.estimated_peak_bytes(),
                }
                for L in self.layers
            ],
            "fp8": self.options.fp8().to_dict(),
            "source_fp8": self.source_fp8,
            "planned_from_config": self.config_only,
            "notes": self.notes,
        }


def _ranks(m: ModelConfig, opts: PrepOptions) -> list[Rank]:
    """TP slices of I (contiguous, each zero-padded to a multiple of 128 later, `Padding`) and
    EP ranges of experts."""
    E, I, Is = m.E, m.I, m.shared_I  # noqa: E741
    if I % opts.tp:
        raise InputError(f"intermediate size I ({I}) is not divisible by --tp {opts.tp}")
    if Is and Is % opts.tp:
        raise InputError(
            f"shared-expert intermediate size ({Is}) is not divisible by --tp {opts.tp}"
        )
    if E % opts.ep:
        raise InputError(f"number of experts E ({E}) is not divisible by --ep {opts.ep}")
    it, et = I // opts.tp, E // opts.ep
    ist = Is // opts.tp if Is else 0
    return [
        Rank(
            rank=ep * opts.tp + tp,
            tp_rank=tp,
            ep_rank=ep,
            i_range=(tp * it, (tp + 1) * it),
            expert_range=(ep * et, (ep + 1) * et),
            shared_i_range=(tp * ist, (tp + 1) * ist) if Is else None,
        )
        for ep in range(opts.ep)
        for tp in range(opts.tp)
    ]


def _outputs(
    plan_args: dict[str, Any], m: ModelConfig, opts: PrepOptions, rank: Rank
) -> list[Output]:
    E = m.E
    e0, e1 = rank.expert_range
    Er = e1 - e0
    It = rank.i_range[1] - rank.i_range[0]
    Is = rank.shared_i_range[1] - rank.shared_i_range[0] if rank.shared_i_range else None
    padding = Padding.of(m.H, It, Is)
    Hp, H, Ip = (  # H: the backward's padded hidden size from here on
        padding.prefill_hidden_size,
        padding.backward_hidden_size,
        padding.padded_intermediate_size,
    )
    act = m.router.act_fn
    pad = f", rows {m.H}..{Hp - 1} zero" if Hp != m.H else ""
    hpad = f"; H rows/cols {m.H}..{H - 1} zero" if H != m.H else ""
    ipad = f"; I cols/rows {It}..{Ip - 1} zero" if Ip != It else ""
    outs = [
        Output("gamma", plan_args["gamma_dtype"], (Hp,), "gamma", f"[H] natural order{pad}"),
        Output(
            "router_weights",
            plan_args["router_dtype"],
            (Hp, E),
            "router_weights",
            f"[H, E] arranged for {act} (prefill spec §6.1){pad}",
        ),
    ]
    if plan_args["router_bias_dtype"]:
        outs.append(
            Output("router_bias", plan_args["router_bias_dtype"], (E,), "router_bias", "[E]")
        )
    fam = m.family
    if "bf16" in opts.formats:
        outs += [
            Output(
                "gate_up_proj_weight",
                "BF16",
                (Er, H, 2, Ip),
                "gate_up_proj_weight",
                "[E, H, 2, I_TP] gate=0, up=1" + hpad + ipad,
            ),
            Output(
                "down_proj_weight",
                "BF16",
                (Er, Ip, H),
                "down_proj_weight",
                "[E, I_TP, H]" + hpad + ipad,
            ),
        ]
    if "mxfp8" in opts.formats:
        outs += mxfp8_outputs("", Er, H, Ip, opts.scale_layout, "*_proj_weight", "*_weight_scales")
    if isinstance(fam.experts, Fused):
        if fam.experts.gate_up_bias:
            outs.append(
                Output(
                    "gate_up_proj_bias",
                    plan_args["bias_dtype"],
                    (Er, 2, Ip),
                    "gate_up_bias",
                    "[E, 2, I_TP] gate=0, up=1" + ipad,
                )
            )
        if fam.experts.down_bias:
            outs.append(
                Output(
                    "down_proj_bias",
                    plan_args["bias_dtype"],
                    (Er, H),
                    "down_bias",
                    "[E, H] (full on every TP rank: add once after the reduction)" + hpad,
                )
            )
    if rank.shared_i_range:
        Ist = padding.padded_shared_intermediate_size
        assert Ist is not None
        if "bf16" in opts.formats:
            outs += [
                Output(
                    "shared_expert.gate_up_proj_weight",
                    "BF16",
                    (1, H, 2, Ist),
                    "gate_up_proj_weight",
                    "[1, H, 2, Is_TP] single-expert dense stack",
                ),
                Output(
                    "shared_expert.down_proj_weight",
                    "BF16",
                    (1, Ist, H),
                    "down_proj_weight",
                    "[1, Is_TP, H]",
                ),
            ]
        if "mxfp8" in opts.formats:
            outs += mxfp8_outputs(
                "shared_expert.", 1, H, Ist, opts.scale_layout, "*_proj_weight", "*_weight_scales"
            )
        if fam.shared and fam.shared.gate_weight:
            outs.append(
                Output(
                    "shared_expert_gate_weight",
                    plan_args["shared_gate_dtype"],
                    (1, m.H),
                    "-",
                    "[1, H] sigmoid gate of the shared expert (not a kernel input, not padded)",
                )
            )
    return outs


def _dtype_for_16bit(dtype: str) -> str:
    return dtype if dtype in ("BF16", "F16") else "BF16"


_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


class _Sources:
    """Shapes and dtypes of the source tensors: from the shard headers where the shard is here,
    else predicted from config.json (``--dry-run`` before a download; the index, when present,
    still proves each name exists)."""

    def __init__(self, ckpt: Checkpoint, m: ModelConfig) -> None:
        self.ckpt, self.m = ckpt, m
        cfg = ckpt.config.get("text_config") if m.family.text_config else None
        cfg = cfg if isinstance(cfg, dict) else ckpt.config
        dt = cfg.get("torch_dtype") or cfg.get("dtype") or ckpt.config.get("torch_dtype")
        self.model_dtype = _CONFIG_DTYPES.get(str(dt), "BF16")
        self.predicted: list[str] = []
        self._infos: dict[str, TensorInfo] = {}

    def info(self, name: str, shape: tuple[int, ...], why: str, quantized: bool) -> TensorInfo:
        """`name`'s entry, its shape checked against the config's `shape` where a header says
        it; `quantized`: an expert weight (FP8 in an fp8 checkpoint)."""
        if self.ckpt.in_header(name):
            check_shape(self.ckpt, name, shape, why)
            info = self.ckpt.info(name)
        else:
            ck = self.ckpt
            listed = ck.file_of(name)
            if (listed is None and (ck.indexed or ck.present)) or listed in ck.present:
                ck.info(name)  # MissingTensorError: in no index, or in no shard that is here
            info = TensorInfo(
                name, self.ckpt.file_of(name) or "", self._dtype(name, quantized), shape
            )
            self.predicted.append(name)
        self._infos[name] = info
        return info

    def __getitem__(self, name: str) -> TensorInfo:
        return self._infos[name]

    def _dtype(self, name: str, quantized: bool) -> str:
        if name.endswith("_scale_inv"):
            return "F32"
        if name.endswith(("_blocks", "_scales")):
            return "U8"
        if name.endswith(".weight_scale") and isinstance(self.m.fp8_block, CtQuant):
            return "U8" if self.m.fp8_block.scheme == "mxfp8" else "F32"
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            return "F32"  # DeepSeek-V3 and its descendants keep the correction bias in fp32
        if quantized and self.m.fp8_block is not None:
            return "F8_E4M3"
        return self.model_dtype


class _MxFp4View:
    """`Fused.expected` asks the checkpoint whether its experts are MXFP4 ``_blocks``; with no
    index and no shard the config's ``quantization_config`` answers (config-only plans)."""

    def __init__(self, ckpt: Checkpoint, m: ModelConfig) -> None:
        self.ckpt, self.mxfp4 = ckpt, m.used.get("quantization_config.quant_method") == "mxfp4"

    def has(self, name: str) -> bool:
        if self.ckpt.indexed or self.ckpt.present:
            return self.ckpt.has(name)
        return self.mxfp4 if name.endswith("_blocks") else True

    def info(self, name: str) -> TensorInfo:
        return self.ckpt.info(name)

    def names(self) -> list[str]:
        return self.ckpt.names()


def build_plan(
    source: str | Path,
    opts: PrepOptions,
    ckpt: Checkpoint | None = None,
    *,
    config_only_ok: bool = False,
) -> Plan:
    """Validate the checkpoint against the family and options; list what a run would write.

    `config_only_ok` (``--dry-run``): tensors whose shard is not here are planned from
    config.json (shapes from the config, dtypes from ``torch_dtype`` and
    ``quantization_config``), and the plan says so; otherwise they are an error.
    """
    ckpt = ckpt or Checkpoint(source, require_shards=not config_only_ok)
    fam = detect_family(ckpt.config, opts.model_type)
    source_fp8 = source_semantics(ckpt.config, ckpt.root)
    check_source_target(source_fp8, opts.fp8(), str(ckpt.root))
    m = resolve_config(ckpt.config, fam)
    moe = m.moe_layers()
    selected = parse_layers(opts.layers, m.num_layers)
    if selected is None:
        layers, dense = moe, []
    else:
        layers = [L for L in selected if L in moe]
        dense = [L for L in selected if L not in moe]
    if not layers:
        what = f"--layers {opts.layers}" if opts.layers else "the config"
        raise InputError(f"no MoE layer selected ({what}; MoE layers: {_ranges(moe) or 'none'})")
    ranks = _ranks(m, opts)

    view: Any = _MxFp4View(ckpt, m)
    prefix = _detect_prefix(view, fam, layers[0])
    forced = ckpt.config.get("model_type") not in fam.model_types
    m = bind_tensor_names(m, view, prefix.format(L=layers[0]), forced)  # bias spelling
    fam = m.family
    src = _Sources(ckpt, m)
    H, E, I, Is = m.H, m.E, m.I, m.shared_I  # noqa: E741
    source_tensors: dict[int, list[str]] = {}
    source_bytes: dict[int, int] = {}
    formats_seen: set[str] = set()
    for L in layers:
        p = prefix.format(L=L)
        expected: dict[str, tuple[tuple[int, ...], str, bool]] = {
            p + fam.gamma: ((H,), f"hidden_size={H}", False),
            p + fam.router_weight: ((E, H), f"experts={E}, hidden_size={H}", False),
        }
        if fam.router_bias:
            expected[p + fam.router_bias] = ((E,), f"experts={E}", False)
        if isinstance(fam.experts, Fused):
            experts = fam.experts.expected(p, E, H, I, view)
            why = f"experts={E}, hidden_size={H}, intermediate={I}"
        else:
            experts = fam.experts.expected(p, E, H, I)
            why = f"hidden_size={H}, intermediate={I}"
        for n, s in experts.items():
            expected[n] = (s, why, len(s) == 2)  # 2-D: a Linear weight (FP8 in fp8 checkpoints)
        if fam.shared and Is:
            for n, s in fam.shared.mlp.expected(p, 1, H, Is).items():
                why = f"hidden_size={H}, shared intermediate={Is}"
                expected[n.replace("{e}", "")] = (s, why, True)
            if fam.shared.gate_weight:
                expected[p + fam.shared.gate_weight] = ((1, H), f"hidden_size={H}", False)
        names = list(expected)
        for name, (shape, why, quantized) in expected.items():
            info = src.info(name, shape, why, quantized)
            _check_value_dtype(name, info.dtype, m)
            if info.dtype in FP8_SOURCE_DTYPES and not quantized:
                raise ConfigError(
                    f"{name}: FP8-quantized, but only expert weights may be (dequantize it first)"
                )
            if info.dtype in FP8_SOURCE_DTYPES:
                if m.fp8_block is None:
                    raise ConfigError(
                        f"{name}: FP8 weight, but config.json has no fp8 quantization_config"
                    )
                sname, sshape, swhy = _scale_companion(name, info.shape, m.fp8_block)
                src.info(sname, sshape, swhy, False)
                names.append(sname)
        for name in experts:  # the routed experts' storage format, as reported in the plan
            dtype = src[name].dtype
            formats_seen.add(
                _quantized_format(m.fp8_block) if dtype in FP8_SOURCE_DTYPES
                else "mxfp4" if name.endswith(("_blocks", "_scales")) else dtype.lower()
            )  # fmt: skip
        source_tensors[L] = names
        source_bytes[L] = sum(src[n].nbytes for n in names)
    if src.predicted and not config_only_ok:
        missing = src.predicted[0]
        raise CheckpointError(
            f"{missing}: shard {ckpt.file_of(missing) or '(unknown)'} listed in "
            f"{INDEX_NAME} is missing from {ckpt.root} (--dry-run plans without it)"
        )

    p0 = prefix.format(L=layers[0])
    args: dict[str, Any] = {
        # a (1 + w) norm is folded into an fp32 gamma (families.fold_gamma)
        "gamma_dtype": "F32" if fam.norm == NORM_1PW else src[p0 + fam.gamma].dtype,
        "router_dtype": _dtype_for_16bit(src[p0 + fam.router_weight].dtype),
        "router_bias_dtype": src[p0 + fam.router_bias].dtype if fam.router_bias else None,
        "bias_dtype": None,
        "shared_gate_dtype": None,
    }
    if isinstance(fam.experts, Fused) and fam.experts.gate_up_bias:
        args["bias_dtype"] = src[p0 + fam.experts.gate_up_bias].dtype
    if fam.shared and fam.shared.gate_weight and Is:
        args["shared_gate_dtype"] = src[p0 + fam.shared.gate_weight].dtype
    outputs = [_outputs(args, m, opts, rk) for rk in ranks]

    defaults_note = m.defaults_note()
    notes = (
        list(fam.notes)
        + ([defaults_note] if defaults_note else [])
        + padding_notes(Padding.of(H, I // opts.tp, Is // opts.tp if Is else None))
    )
    if args["router_dtype"] != src[p0 + fam.router_weight].dtype:
        notes.append(
            f"router weight cast from {src[p0 + fam.router_weight].dtype} to BF16 (the kernel needs 16-bit)"
        )
    if dense:
        notes.append(f"dense (not MoE) layers skipped: {_ranges(dense)}")
    if src.predicted:
        notes.append(
            f"planned from config.json{' and the index' if ckpt.indexed else ''}: "
            f"{len(src.predicted)} source tensor(s) in shards not here, their shapes from the "
            f"config and dtypes from torch_dtype/quantization_config"
        )
    src_fmt = "+".join(sorted(formats_seen)) or "bf16"
    return Plan(
        source=ckpt.root.resolve(),
        model=m,
        options=opts,
        layers=layers,
        skipped_dense=dense,
        prefix=prefix,
        ranks=ranks,
        outputs=outputs,
        source_tensors=source_tensors,
        source_bytes=source_bytes,
        source_bf16_bytes=3 * H * (E * I + (Is or 0)) * 2,
        gamma_dtype=args["gamma_dtype"],
        router_dtype=args["router_dtype"],
        router_bias_dtype=args["router_bias_dtype"],
        source_format=src_fmt,
        model_type=str(ckpt.config.get("model_type") or fam.name),
        notes=notes,
        config_only=bool(src.predicted),
        source_files={n: src[n].file for ns in source_tensors.values() for n in ns},
        source_fp8=source_fp8,
    )


# Source dtypes whose stored numbers are the weight values (safetensors names).
_VALUE_DTYPES = ("BF16", "F16", "F32", "F64")


def _check_value_dtype(name: str, dtype: str, m: ModelConfig) -> None:
    """`ConfigError` for a source tensor whose stored numbers are codes, not values, without a
    ``quantization_config`` that decodes them (issue 28: I8, I64, U8, BOOL weights were
    converted as if their codes were values). FP8 needs an fp8 / compressed-tensors config (its
    own check), MXFP4 ``_blocks``/``_scales`` (U8) an mxfp4 one."""
    if dtype in _VALUE_DTYPES or dtype in FP8_SOURCE_DTYPES:
        return
    qm = m.used.get("quantization_config.quant_method")
    if qm == "mxfp4" and name.endswith(("_blocks", "_scales")):
        return
    decl = f"quantization_config {qm!r}" if qm else "no quantization_config"
    raise ConfigError(
        f"{name}: dtype {dtype} holds codes, not values, and config.json has {decl} that "
        f"decodes {dtype}: expected {', '.join(_VALUE_DTYPES)} (or FP8 / MXFP4 with its "
        "quantization_config)"
    )


def _scale_companion(
    name: str, shape: tuple[int, ...], q: tuple[int, int] | CtQuant
) -> tuple[str, tuple[int, ...], str]:
    """The scale tensor an FP8 source weight needs: name, shape and why (for the error)."""
    if isinstance(q, CtQuant):
        return q.scale_name(name), q.scale_shape(shape), f"compressed-tensors {q.scheme}"
    return name + "_scale_inv", fp8_scale_shape(shape, q), f"{q[0]}x{q[1]} blocks"


def _quantized_format(q: tuple[int, int] | CtQuant | None) -> str:
    return q.source_format if isinstance(q, CtQuant) else "fp8-block"


def padding_notes(p: Padding) -> list[str]:
    """What the plan and the manifest say about zero padding (one line per padded size)."""
    notes = []
    if p.prefill_hidden_size != p.hidden_size:
        notes.append(
            f"H={p.hidden_size} is zero-padded to {p.prefill_hidden_size} for the prefill kernel "
            f"(unpadded_hidden_size={p.hidden_size})"
        )
    if p.backward_hidden_size != p.hidden_size:
        notes.append(
            f"H={p.hidden_size} is zero-padded to {p.backward_hidden_size} in the expert weights "
            "(backward: H % 128)"
        )
    if p.padded_intermediate_size != p.intermediate_size:
        notes.append(
            f"I_TP={p.intermediate_size} is zero-padded to {p.padded_intermediate_size} "
            "(backward: I % 128)"
        )
    Is, Isp = p.shared_intermediate_size, p.padded_shared_intermediate_size
    if Is != Isp:
        notes.append(f"shared I_TP={Is} is zero-padded to {Isp} (backward: I % 128)")
    if notes:
        notes.append(
            "zero padding is exact: make-inputs, run-* and verify pad and un-pad from the manifest"
        )
    return notes


def _detect_prefix(ckpt: Any, fam: Any, layer: int) -> str:
    for p in fam.prefixes:
        if ckpt.has(p.format(L=layer) + fam.router_weight):
            return str(p)
    # not found under any prefix: report the tensor under the first one
    ckpt.info(fam.prefixes[0].format(L=layer) + fam.router_weight)
    raise AssertionError("unreachable")


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
