"""Per-instruction cost model for NeuronCore-v3 (trn2) and NeuronCore-v4 (trn3).

Every number comes from one table, `FIGURES`, with its source in the AWS Neuron documentation
(aws-neuron/aws-neuron-sdk at tag v2.32.0 unless the row says otherwise) or, where the docs give
no number, the assumption and why. README.md ("Benchmarks") repeats the table.

The model (each rule cites its figure by key):
- **Vector / Scalar / GpSimd**: ``overhead + k * N / w`` engine cycles, with N the elements per
  partition, k the number of full-size input tiles the instruction streams (the arch guide's
  "two input tiles: roughly 2N"), w the engine's data-path width per partition (``width / 128``
  lanes; the fast width applies when every streamed tile is a 2-/1-byte float in SBUF). Documented
  per-op exceptions: ``quantize_mx`` (4 elements/partition/cycle), VectorE ``reciprocal`` (8x),
  VectorE ``exponential`` (4x ScalarE's activation rate), ``iota`` (``150 + N``), ``topk``
  (``4n + K``), and the accumulator read-out of an activation with ``reduce_res`` (+MIN_II).
- **Tensor engine**: ``max(min(MM_INIT, M), N)`` PE cycles for a matmul with stationary free size
  M and moving free size N (bf16/fp16/fp8/tf32; fp32 4x); MX matmuls the same on x4 elements (4x
  the FLOPs per cycle); PE transposes ``max(P, min(MM_INIT, F))`` (4-byte data 2x).
- **DMA**: a transfer is split over the DMA engines that own its SBUF partitions (8 partitions per
  engine, 16 engines); each engine moves its share at its bandwidth, plus a per-descriptor
  overhead for every contiguous run (so 2-byte strided element runs cost ~256x their bytes),
  ``dma_transpose`` at the documented 90% (HBM source) / 50% (SBUF source) efficiency. A fixed
  trigger-to-start latency delays the data but does not occupy the engines; hardware-DGE
  instructions occupy their issuing queue for their documented execution time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mxcli.nkisim.trace import Instr, Operand

__all__ = ["Figure", "FIGURES", "Hardware", "hardware", "Cost", "instruction_cost", "DMA_QUEUES"]

_ARCH3 = "nki/guides/architecture/trainium3_arch.rst"
_ARCH2 = "nki/guides/architecture/trainium2_arch.rst"
_ARCH1 = "nki/guides/architecture/trainium_inferentia2_arch.rst"
_DMA_OV = "nki/get-started/about/nki-dma-overview.rst"
_DMA_BW = "nki/deep-dives/nki-dma-bandwidth-guide.rst"
_ISA226 = "v2.26.0:general/nki/api/nki/isa/__init__.py"  # per-op costs (dropped from 0.x stubs)


@dataclass(frozen=True)
class Figure:
    """One hardware figure, per target, with where it comes from (issue 29 item 3).

    ``kind``: ``"documented"`` (``source`` cites the doc), ``"fitted"`` (``source`` names the
    measurement it was fitted to) or ``"assumed"`` (``source`` says why). ``low`` / ``high``: the
    plausible range of the trn3 value for an assumed figure (for a fitted one, the range the
    fit's residual allows); None for a documented figure, which has no range.
    """

    key: str
    trn2: float
    trn3: float
    unit: str
    source: str  # doc path (+ section), the measurement fitted to, or "ASSUMED: why"
    kind: str = "documented"
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("documented", "fitted", "assumed"):
            raise ValueError(f"Figure {self.key}: kind {self.kind!r}")
        if self.kind != "documented" and (self.low is None or self.high is None):
            raise ValueError(f"Figure {self.key}: a {self.kind} figure needs a low..high range")


FIGURES: tuple[Figure, ...] = (
    Figure("pe_ghz", 2.4, 2.4, "GHz", f"{_ARCH2}, {_ARCH3}: Compute Engine Specifications"),
    Figure("vector_ghz", 0.96, 1.2, "GHz", f"{_ARCH2}, {_ARCH3}: Compute Engine Specifications"),
    Figure("scalar_ghz", 1.2, 1.2, "GHz", f"{_ARCH2}, {_ARCH3}: Compute Engine Specifications"),
    Figure("gpsimd_ghz", 1.2, 1.2, "GHz", f"{_ARCH2}, {_ARCH3}: Compute Engine Specifications"),
    Figure(
        "vector_width_fast", 512, 512, "elem/cycle",
        f"{_ARCH2} Vector Engine Performance Mode: the 4x mode (512 of {_ARCH3}'s table) only for "
        "tensor_copy / tensor_scalar with every tile in SBUF, BF16/FP16 (FP8 on v4) and a "
        "contiguous inner-most free dim",
    ),
    Figure(
        "vector_width", 256, 256, "elem/cycle",
        f"{_ARCH2}, {_ARCH3}: Vector 256 input/output for other data types; every other op "
        f"(tensor_tensor's documented 2x mode: {_ARCH2} Vector Engine Performance Mode, 2x "
        f"of {_ARCH1}'s 'roughly 2N cycles' for two input tiles = 256)",
    ),
    Figure(
        "scalar_width_fast", 128, 256, "elem/cycle",
        f"{_ARCH3} Scalar Engine Performance mode: 2x (256) for tensor_scalar / tensor_copy on "
        "BF16/FP16 only (as VectorE's 2x mode: SBUF or PSUM); activation stays at 128",
    ),
    Figure("scalar_width", 128, 128, "elem/cycle", f"{_ARCH2}, {_ARCH3}: Scalar 128 other types"),
    Figure(
        "gpsimd_width", 128, 128, "elem/cycle",
        f"{_ARCH3}: GpSimd 128 for all types (trn2 takes the same value: its row is blank)",
    ),
    Figure(
        "act_vec_overhead_cycles", 100, 100, "cycles",
        f"{_ARCH1} Vector Engine 'Cost Model': static instruction overhead of 100 engine cycles "
        "(ScalarE: 'all the performance notes ... are applicable')",
    ),
    Figure(
        "gpsimd_overhead_cycles", 150, 150, "cycles",
        f"{_ISA226} iota / affine_select: GPSIMD_START roughly 150 engine cycles",
    ),
    Figure(
        "min_ii_cycles", 64, 64, "cycles",
        f"{_ISA226} activation_reduce / tensor_scalar_reduce: '+ MIN_II' accumulator read-out; "
        "MIN_II roughly 64 engine cycles",
    ),
    Figure(
        "quantize_mx_elems_per_cycle", 4, 4, "elem/partition/cycle",
        f"{_ARCH3} MX data-type Quantization: four input elements per partition per cycle",
    ),
    Figure("reciprocal_vector_factor", 8, 8, "x", f"{_ISA226} reciprocal: max(MIN_II, 8*N)"),
    Figure(
        "exponential_vs_scalar", 4, 4, "x",
        f"{_ARCH3} Fast Exponential Evaluation: 4x the throughput of activation(exp) on ScalarE",
    ),
    Figure(
        "mm_init_cycles", 64, 64, "cycles",
        f"{_ISA226} nc_matmul: max(min(64, N_stationary), N_moving) cycles; {_ARCH1}: "
        "MM_INIT_LATENCY 64 cycles",
    ),
    Figure("pe_fp32_factor", 4, 4, "x", f"{_ISA226} nc_matmul: 4 * ... for float32 inputs"),
    Figure(
        "pe_transpose_fp32_factor", 2, 2, "x",
        f"{_ARCH2} Built-in Transpose Support: transpose mode 2x faster than the 4x fp32 matmul",
    ),
    Figure(
        "pe_mx_tflops", 0, 315, "TFLOPS/core",
        f"{_ARCH3} Tensor Engine: 315 MXFP8/MXFP4 TFLOPS (= 2*512*128*2.4 GHz)",
    ),
    Figure(
        "pe_bf16_tflops", 79, 79, "TFLOPS/core",
        f"{_ARCH2}, {_ARCH3} Tensor Engine: 79 BF16/FP16/TF32 TFLOPS (= 2*128*128*2.4 GHz)",
    ),
    Figure("dma_engines", 16, 16, "per core", f"{_DMA_OV}: 16 DMA engines per NeuronCore"),
    Figure(
        "dma_partitions_per_engine", 8, 8, "partitions",
        f"{_DMA_OV}: each DMA engine moves eight SBUF partitions (128 / 16)",
    ),
    Figure(
        "dma_engine_bytes_per_ns", 23, 33, "B/ns",
        f"{_DMA_OV}, {_DMA_BW}: BW per engine (aggregate 368 / 528 GB/s per core). CHOSEN over "
        f"the 27.2 / 38.4 GB/s {_DMA_OV} calls 'theoretical': the bandwidth guide's table "
        "gives the per-engine rate large payloads sustain, which is what the model charges; "
        "the measured bf16 matmuls (mxcli.nkisim.measured) are PE-bound and cannot tell the "
        "two apart",
    ),
    Figure(
        "dma_descriptor_overhead_bytes", 508, 508, "B-equivalent",
        "FITTED to AWS's measured MXFP8 backward, 2.190 ms with PE transposes and its tuned "
        "blockings (mxcli.nkisim.measured.BWD_MXFP8 / BWD_TUNED_BLOCKING): per contiguous run "
        "(descriptor) an overhead worth this many bytes of transfer; the schedule reproduces "
        f"2.190 ms within 1% between 494 and 522. {_DMA_BW} gives no number (only '< 256 B "
        "severely overhead-bound', '>= 2 KiB approaches peak', '>= 4 KiB saturates'); before "
        "any fit it was assumed 512. (Fitted to 360 while the schedule made a transfer wait for "
        "one gap on each DMA engine that held all of it, instead of sharing the engines' time "
        f"as their round robin over queues does: {_DMA_OV} DMA Queues)",
        kind="fitted", low=494, high=522,
    ),
    Figure(
        "dma_latency_ns", 1300, 1300, "ns",
        f"{_DMA_BW}: descriptor setup, synchronization and semaphore-to-start latency ~1300 ns "
        "(delays the data; does not occupy the engines)",
    ),
    Figure(
        "hwdge_issue_ns", 600, 600, "ns",
        f"ASSUMED for trn3: {_ARCH2} DGE / nki/deep-dives/nki-dge.rst give each hardware-DGE "
        "DMA instruction about 600 ns to execute on trn2 (it occupies its issuing queue); no "
        "trn3 figure is documented, so trn2's is taken, +-50%",
        kind="assumed", low=300, high=900,
    ),
    Figure(
        "dma_transpose_eff_hbm", 0.9, 0.9, "x",
        f"ASSUMED for trn3: {_ARCH2} DMA Transpose gives HBM2SBUF transposes 'up to 90% DMA "
        "throughput' on trn2; no trn3 figure is documented, so trn2's is taken (range: 70% to "
        "a copy's 100%)",
        kind="assumed", low=0.7, high=1.0,
    ),
    Figure(
        "dma_transpose_eff_sbuf", 0.5, 0.5, "x",
        f"ASSUMED for trn3: {_ARCH2} SBUF2SBUF DMA transpose gives 'up to 50% of DMA "
        "throughput' on trn2; no trn3 figure is documented, so trn2's is taken (range: 35% to "
        "the HBM2SBUF transpose's 90%; trn3 doubled other SBUF-side DMA work, the near-memory "
        f"accumulate, from 50% to a copy's rate: {_ARCH3} SBUF accumulation)",
        kind="assumed", low=0.35, high=0.9,
    ),
    Figure(
        "dma_transpose_full_run", 16, 16, "elements",
        f"{_ARCH2} HBM2SBUF DMA transpose: the 16 engines write a [128, 16] SBUF tile at a time, "
        "'the 16 elements along free dimension must be contiguous'; a multiple of 16 in the "
        "inner-most free dim is 'a pre-requisite to achieve best DMA throughput efficiency'",
    ),
    Figure(
        "dma_transpose_short_run_exponent", 1.0, 1.0, "x",
        "ASSUMED: a transpose whose output's inner-most free dim c < 16 runs at the documented "
        "efficiency times (c / 16) ** this (1: each [128, 16] write carries c useful elements); "
        f"{_ARCH2} says only 'at the cost of DMA performance'",
        kind="assumed", low=0.5, high=1.0,
    ),
    Figure(
        "swdge_descriptor_ns", 0.5, 0.5, "ns",
        "ASSUMED: GpSimd time per contiguous run of a software-DGE DMA, before its data moves. "
        "nki/deep-dives/nki-dge.rst swdge: 'Consumes GpSimd Engine cycles for descriptor "
        f"generation' (and {_ARCH2} DGE: software DGE 'occupies GpsimdE'); no per-descriptor "
        "time is documented. 0.5 ns ~ 5 cycles on each of GpSimd's 8 cores at 1.2 GHz; bounded "
        "by AWS's measured backward (~1.39 M such runs per core within 2.190 ms: < 1.6 ns)",
        kind="assumed", low=0.1, high=1.5,
    ),
    Figure(
        "core_barrier_ns", 1300, 1300, "ns",
        "ASSUMED: nki/api/nki/isa/__init__.py core_barrier (v2.32.0): a remote semaphore update "
        "and a local semaphore wait that block the barrier's engine (GpSimd by default) until "
        f"both cores arrive; the round trip is taken as {_DMA_BW}'s ~1300 ns semaphore-to-start "
        "latency (no figure is documented)",
        kind="assumed", low=500, high=3000,
    ),
    Figure(
        "hbm_tbps_chip", 2.9, 4.9, "TB/s per chip (8 cores)",
        "about-neuron/arch/neuron-hardware/trainium3.rst (HBM Bandwidth 2.9 / 4.9 TB/sec); "
        f"{_ARCH3} says 4.7 TB/s. CHOSEN: the hardware page; with either figure a core's HBM "
        "share (612 / 588 GB/s) exceeds its 16 DMA engines' 528 GB/s, so no estimate here "
        "changes",
    ),
    Figure(
        "reorder_window", 4096, 4096, "instructions",
        "ASSUMED: how far back in program order the compiler's scheduler moves an instruction "
        "(nki/guides/how-to-scheduling-apis.rst documents the reordering, not its reach); the "
        "schedule starts nothing before every one of the last this-many instructions. AWS's "
        "2.190 ms launch: 2.426 ms at 1024, 2.190 ms at 4096, 2.188 ms at 16384",
        kind="assumed", low=1024, high=16384,
    ),
    Figure("cores_per_chip", 8, 8, "cores", f"{_ARCH2}, {_ARCH3}: 8 NeuronCores per device"),
)  # fmt: skip


@dataclass(frozen=True)
class Hardware:
    """The figures for one target, by key (see `FIGURES`)."""

    name: str
    values: dict[str, float]

    def __getitem__(self, key: str) -> float:
        return self.values[key]

    @property
    def hbm_bytes_per_ns(self) -> float:
        """One core's share of the chip's HBM bandwidth."""
        return self["hbm_tbps_chip"] * 1e3 / self["cores_per_chip"]


def hardware(target: str) -> Hardware:
    """The figures of ``"trn2"`` or ``"trn3"``."""
    if target not in ("trn2", "trn3"):
        raise ValueError(f"target must be trn2 or trn3, got {target!r}")
    return Hardware(target, {f.key: float(getattr(f, target)) for f in FIGURES})


# DMA queues (api spec §6.1; nki-dge.rst: the queue follows the trigger engine and the
# descriptor-generation method)
DMA_QUEUES = ("dma.sync", "dma.act", "dma.swdge", "dma.static")
DGE_EITHER = "dma.sync|dma.act"  # a hardware-DGE DMA whose trigger engine the compiler picks
COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")


@dataclass
class Cost:
    """What one instruction costs and where it runs.

    ``track``: the in-order queue it occupies ("tensor", "vector", "scalar", "gpsimd", "sync" or
    one of `DMA_QUEUES`). ``ns``: its occupancy of that queue (compute: the whole cost; DMA: the
    issue time, 0 unless hardware DGE). ``dma_ns``: per DMA engine index, the time it moves data;
    ``latency_ns``: the DMA's trigger-to-start delay. ``kind``: "matmul", "mx_matmul",
    "transpose", "elementwise", "dma" or "control". FLOPs are the PE's (2*K*M*N).
    """

    track: str
    ns: float
    kind: str
    dma_ns: dict[int, float]
    latency_ns: float = 0.0
    flops_mx: float = 0.0
    flops_bf16: float = 0.0
    hbm_bytes: int = 0
    dma_bytes: int = 0
    descriptors: int = 0
    run_bytes: int = 0  # smallest contiguous run of the transfer (DMA)
    gen_ns: float = 0.0  # software DGE: GpSimd time generating the descriptors (before the data)
    detail: str = ""


def _streams(ins: Instr) -> tuple[list[Operand], Operand | None]:
    """(full-size input tiles, the dst): reads with dst's elements per partition, excluding
    per-partition scalars and index tensors."""
    dst = ins.get("dst", "val_dst")
    reads = [o for o in ins.reads() if not o.name.endswith("vector_offset")]
    if dst is None:
        return reads[:1], None
    full = [o for o in reads if o.per_part == dst.per_part and o.parts == dst.parts]
    return full, dst


_PERF_OPS = ("tensor_copy", "tensor_scalar")  # the ops the performance modes name


def _fast(ins: Instr, ops: list[Operand]) -> bool:
    """The performance-mode width applies (`FIGURES` ``vector_width_fast`` /
    ``scalar_width_fast``): only tensor_copy / tensor_scalar, every tile a float of at most 2
    bytes; VectorE's 4x mode also needs every tile in SBUF with a contiguous inner-most free dim
    (trainium2_arch.rst Vector Engine Performance Mode 1a-1c), ScalarE's 2x mode takes SBUF or
    PSUM (trainium3_arch.rst Scalar Engine Performance mode: 'same as the 2x performance mode
    on VectorE')."""
    if ins.op not in _PERF_OPS:
        return False
    if not all(o.itemsize <= 2 and not o.dtype.startswith(("int", "uint")) for o in ops):
        return False
    if ins.engine == "vector":
        return all(o.buffer == "sbuf" and o.contiguous_free for o in ops)
    return True


def _compute_cost(ins: Instr, hw: Hardware) -> Cost:
    eng = ins.engine
    full, dst = _streams(ins)
    n = max([o.per_part for o in full] + ([dst.per_part] if dst is not None else [1]))
    k = max(1, len(full))
    tiles = full + ([dst] if dst is not None else [])
    ghz = hw[f"{eng}_ghz"]
    if eng == "gpsimd":
        over = hw["gpsimd_overhead_cycles"]
        w = hw["gpsimd_width"] / 128
    else:
        over = hw["act_vec_overhead_cycles"]
        w = hw[f"{eng}_width_fast" if _fast(ins, tiles) else f"{eng}_width"] / 128
    op = ins.op
    if op == "quantize_mx":
        cycles = over + n / hw["quantize_mx_elems_per_cycle"]
    elif op == "reciprocal" and eng == "vector":
        cycles = over + hw["reciprocal_vector_factor"] * k * n / w
    elif op == "exponential":
        ws = hw["scalar_width"] / 128  # activation(exp) has no performance mode
        cycles = over + k * n / (ws * hw["exponential_vs_scalar"])
    elif op == "iota":
        cycles = hw["gpsimd_overhead_cycles"] + n
    elif op == "topk":
        src = ins.get("src")
        kk = ins.get("val_dst")
        cycles = 4 * (src.per_part if src else n) + (kk.per_part if kk else 8)
    else:
        cycles = over + k * n / w
    if ins.get("reduce_res") is not None:
        cycles += hw["min_ii_cycles"]
    return Cost(eng, cycles / ghz, "elementwise", {}, detail=f"N={n} k={k} w={w:g}/cycle")


def _pe_cost(ins: Instr, hw: Hardware) -> Cost:
    ghz = hw["pe_ghz"]
    init = hw["mm_init_cycles"]
    if ins.op == "nc_transpose":
        x = ins.get("data")
        p, f = (x.parts, x.per_part) if x else (128, 128)
        cyc = max(p, min(init, f))
        if x is not None and x.itemsize == 4:
            cyc *= hw["pe_transpose_fp32_factor"]
        return Cost("tensor", cyc / ghz, "transpose", {}, detail=f"P={p} F={f}")
    st, mv = ins.get("stationary"), ins.get("moving")
    if st is None or mv is None:
        return Cost("tensor", init / ghz, "matmul", {})
    kpart, m, nmov = st.parts, st.per_part, mv.per_part
    if ins.op == "nc_matmul_mx":
        cyc = max(min(init, m), nmov)
        flops = 2.0 * 4 * kpart * m * nmov
        return Cost("tensor", cyc / ghz, "mx_matmul", {}, flops_mx=flops,
                    detail=f"K={4 * kpart} M={m} N={nmov} MX")  # fmt: skip
    double = ins.args.get("perf_mode") == "double_row"
    if double:  # layout (K, 2, M) x (K, 2, N): contraction 2K
        m, nmov = m // 2, nmov // 2
    cyc = max(min(init, m), nmov)
    if "float32" in (st.dtype, mv.dtype):
        cyc *= hw["pe_fp32_factor"]
    if ins.args.get("is_transpose") == "True":
        return Cost("tensor", cyc / ghz, "transpose", {}, detail=f"P={kpart} F={m}")
    flops = 2.0 * kpart * (2 if double else 1) * m * nmov
    return Cost("tensor", cyc / ghz, "matmul", {}, flops_bf16=flops,
                detail=f"K={kpart * (2 if double else 1)} M={m} N={nmov} {st.dtype}")  # fmt: skip


def _queue(ins: Instr, ops: list[Operand]) -> str:
    mode = ins.args.get("dge_mode", "unknown")
    if any(o.name.endswith("vector_offset") for o in ops) or mode == "swdge":
        return "dma.swdge"
    if mode == "hwdge":
        eng = ins.args.get("engine")
        # two DGE instances, commanded from SyncE or ScalarE; without `engine` the compiler
        # picks (trainium2_arch.rst Descriptor Generation Engine): the schedule takes the
        # earlier-free of the two (`DGE_EITHER`)
        return {"scalar": "dma.act", "sync": "dma.sync"}.get(eng or "", DGE_EITHER)
    if ins.op in ("sendrecv",):
        return "dma.sync"
    return "dma.static"


def _descriptors(size: int, runs: list[int]) -> int:
    """Contiguous pieces of a transfer whose sides have these run lengths (elements): the
    distinct run boundaries of all sides, each side's runs starting at element 0."""
    runs = [max(1, min(r, size)) for r in runs] or [size]
    if len(runs) == 1:
        return math.ceil(size / runs[0])
    a, b = runs[0], min(runs[1:])
    return math.ceil(size / a) + math.ceil(size / b) - size // math.lcm(a, b)


def _is_offset(o: Operand) -> bool:
    """An index operand of a DMA (a gather/scatter's ``vector_offset``, or the 1-element tensor
    read for a ``scalar_offset``): it addresses the transfer and moves no data."""
    return o.name.endswith("vector_offset") or o.name == "offset tensor"


def _dma_cost(ins: Instr, hw: Hardware) -> Cost:
    ops = ins.operands
    queue = _queue(ins, ops)
    dst = ins.get("dst")
    # (a scalar-offset tensor read as a source made a 128 x 512 weight-gradient read-modify-
    # write cost 2 bytes on one DMA engine)
    srcs = [o for o in ins.reads() if not _is_offset(o)]
    if dst is None or not srcs:
        return Cost(queue, 0.0, "dma", {})
    moved = dst.rows * dst.per_part if dst.rows < dst.parts else min(o.size for o in srcs)
    moved = min(moved, dst.size)
    nbytes = moved * dst.itemsize
    hbm = sum(min(o.size, moved) * o.itemsize for o in srcs if o.buffer == "hbm")
    hbm += nbytes if dst.buffer == "hbm" else 0
    sbuf_side = dst if dst.buffer == "sbuf" else next((o for o in srcs if o.buffer == "sbuf"), None)
    per_engine = hw["dma_partitions_per_engine"]
    n_eng = int(hw["dma_engines"])
    share: dict[int, float] = {}
    if sbuf_side is not None:
        p0, p1 = sbuf_side.region[0], sbuf_side.region[1]
        rows = max(1, min(sbuf_side.rows, p1 - p0))
        pe = int(per_engine)
        for e in range(p0 // pe, (p0 + rows - 1) // pe + 1):
            lo, hi = max(p0, e * pe), min(p0 + rows, (e + 1) * pe)
            share[e % n_eng] = share.get(e % n_eng, 0.0) + (hi - lo) / rows
    else:
        used = max(1, min(n_eng, dst.rows))
        share = {e: 1.0 / used for e in range(used)}
    bw = hw["dma_engine_bytes_per_ns"]
    if ins.op == "dma_transpose":
        eff = (
            hw["dma_transpose_eff_hbm"] if srcs[0].buffer == "hbm" else hw["dma_transpose_eff_sbuf"]
        )
        inner = dst.shape[-1] if dst.shape else 1
        full = hw["dma_transpose_full_run"]
        if inner < full:  # FIGURES dma_transpose_full_run / _short_run_exponent
            eff *= (inner / full) ** hw["dma_transpose_short_run_exponent"]
        desc = _descriptors(moved, [o.run for o in srcs])
        per = {e: f * nbytes / (bw * eff) for e, f in share.items()}
        run_b = 0
        detail = f"{nbytes} B transpose, eff {eff:g}"
    else:
        desc = _descriptors(moved, [dst.run] + [o.run for o in srcs])
        over = hw["dma_descriptor_overhead_bytes"]
        per = {e: f * (nbytes + desc * over) / bw for e, f in share.items()}
        run_b = min([dst.run] + [o.run for o in srcs]) * dst.itemsize
        detail = f"{nbytes} B in {desc} runs (min run {run_b} B) over {len(per)} DMA engines"
    gen = desc * hw["swdge_descriptor_ns"] if queue == "dma.swdge" else 0.0
    issue = hw["hwdge_issue_ns"] if ins.args.get("dge_mode") == "hwdge" else 0.0
    return Cost(
        queue, issue, "dma", per, latency_ns=hw["dma_latency_ns"], hbm_bytes=int(hbm),
        dma_bytes=int(nbytes), descriptors=desc, run_bytes=int(run_b), gen_ns=gen, detail=detail,
    )  # fmt: skip


def instruction_cost(ins: Instr, hw: Hardware) -> Cost:
    """The `Cost` of one recorded instruction on `hw`."""
    if ins.op == "core_barrier":
        # blocks its engine (GpSimd by default) until both cores arrive (FIGURES core_barrier_ns)
        eng = ins.args.get("engine", "gpsimd")
        track = eng if eng in (*COMPUTE_ENGINES, "sync") else "gpsimd"
        return Cost(track, hw["core_barrier_ns"], "barrier", {})
    if ins.engine == "dma":
        return _dma_cost(ins, hw)
    if ins.engine == "tensor":
        return _pe_cost(ins, hw)
    if ins.engine in ("vector", "scalar", "gpsimd"):
        return _compute_cost(ins, hw)
    return Cost("sync", 0.0, "control", {})
