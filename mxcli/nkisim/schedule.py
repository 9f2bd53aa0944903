"""Timeline of a recorded kernel: per-engine busy time, bounds, a list schedule, a trace file.

Input: the `trace.Recorder` of each program (LNC core) and a `cost.Hardware`.

- **Busy time** per compute engine (sum of its instruction costs), per DMA engine (the data time
  of its share of each transfer) and HBM (bytes over the core's share of HBM bandwidth).
- **Lower bound**: perfect overlap, the maximum of those; its argmax is the bottleneck.
- **List schedule** (issue 29 item 3): the compiler's scheduler reorders instructions within
  their dependencies (nki/guides/how-to-scheduling-apis.rst: "the reordering that the automatic
  scheduler will do"), so the schedule does not run an engine's instructions in program order.
  In program order of priority, each instruction takes the earliest gap on its engine (a DMA:
  its queue's sequencer for the hardware-DGE issue time, then, after the trigger-to-start
  latency, its share of the data on each DMA engine it uses: the engine's free time as it comes,
  split across gaps, because an engine serves its queues round robin, nki-dma-overview.rst "DMA
  Queues") at or after the finish of every earlier instruction it depends on: read-after-write,
  write-after-write and write-after-read on overlapping regions (partition x byte boxes per
  allocation on chip, or in the buffer itself for tensors the kernel placed at an ``address``;
  byte ranges in HBM). A software-DGE transfer first takes GpSimd time for its descriptors; a hardware-DGE one whose trigger engine the
  compiler picks takes the SyncE or ScalarE queue, whichever is free first. The programs are
  scheduled together: at a ``core_barrier`` each core arrives when its engine is free and its
  HBM writes have landed, both leave `FIGURES` core_barrier_ns after the later one, and HBM reads
  after it start no earlier. ``sendrecv`` waits are not modelled.
- **Trace**: Chrome-trace JSON (opens in Perfetto / chrome://tracing): one process per core, one
  track per engine and DMA queue, events named after the instruction with the kernel source line.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from mxcli.nkisim.cost import (
    COMPUTE_ENGINES,
    DGE_EITHER,
    DMA_QUEUES,
    Cost,
    Hardware,
    instruction_cost,
)
from mxcli.nkisim.trace import Instr, Recorder

__all__ = ["Event", "ProgramSchedule", "Profile", "schedule_program", "build_profile"]

_PRUNE_AT = 64  # dependency entries per tensor before finished ones are dropped
_GAP = 1.0  # ns: gaps this short between two busy intervals are merged
_SMALL = 16  # tables this small are searched for superseded entries on every write


@dataclass(slots=True)
class Event:
    """One scheduled instruction (times in ns from the program's start)."""

    index: int
    op: str
    track: str
    start: float
    end: float
    source: str
    cost: Cost


@dataclass
class ProgramSchedule:
    """The schedule of one program (core)."""

    program_id: int
    events: list[Event]
    busy_ns: dict[str, float]  # compute engines, "dma" (busiest DMA engine), "hbm"
    dma_engine_ns: list[float]
    queue_ns: dict[str, float]  # DMA data time per queue
    makespan_ns: float
    counts: dict[str, int]

    @property
    def lower_bound_ns(self) -> float:
        return max(self.busy_ns.values(), default=0.0)

    @property
    def bottleneck(self) -> str:
        return max(self.busy_ns, key=lambda k: self.busy_ns[k]) if self.busy_ns else "none"

    def first_start_ns(self, track: str) -> float | None:
        """When the first instruction on `track` starts (None when none runs there)."""
        return min((e.start for e in self.events if e.track == track), default=None)


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def _covers(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[0] <= b[0] and b[1] <= a[1] and a[2] <= b[2] and b[3] <= a[3]


Region = tuple[int, int, int, int]


class _Deps:
    """Last writers and readers of every region, per allocation (region -> finish time)."""

    def __init__(self) -> None:
        self.writes: dict[int, dict[Region, float]] = defaultdict(dict)
        self.reads: dict[int, dict[Region, float]] = defaultdict(dict)

    def ready(self, ins: Instr) -> float:
        t = 0.0
        for o in ins.operands:
            for reg, end in self.writes.get(o.key, {}).items():
                if end > t and _overlap(reg, o.region):
                    t = end
            if o.write:
                for reg, end in self.reads.get(o.key, {}).items():
                    if end > t and _overlap(reg, o.region):
                        t = end
        return t

    def commit(self, ins: Instr, end: float, floor: float) -> None:
        for o in ins.operands:
            if o.write:
                for table in (self.writes[o.key], self.reads[o.key]):
                    # a covered entry finished before this write (WAW / WAR): superseded
                    if len(table) <= _SMALL:
                        for reg in [r for r in table if _covers(o.region, r)]:
                            del table[reg]
                    self._prune(table, floor)
                self.writes[o.key][o.region] = end
            else:
                table = self.reads[o.key]
                if table.get(o.region, -1.0) < end:
                    table[o.region] = end
                self._prune(table, floor)

    @staticmethod
    def _prune(table: dict[Region, float], floor: float) -> None:
        """Entries finished before the scheduling floor can no longer delay anything."""
        if len(table) > _PRUNE_AT:
            for reg in [r for r, e in table.items() if e <= floor]:
                del table[reg]


class _Timeline:
    """Busy intervals of one resource (an engine, a DMA queue's sequencer, a DMA engine): an
    instruction takes the earliest gap it fits in (`fit`, `take`); a DMA engine's share of a
    transfer takes its free time as it comes (`take_shared`)."""

    __slots__ = ("starts", "ends", "hint")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        # hint[b]: every gap before this time is shorter than 2**b ns (gaps only shrink, so
        # a hint stays true); lets `fit` skip the fragments a long occupation cannot use
        self.hint = [0.0] * 64

    def fit(self, t: float, d: float) -> float:
        """The earliest start >= t of a d-long occupation."""
        starts, ends, hint = self.starts, self.ends, self.hint
        if d >= 1:  # 2**b <= d: no gap before hint[b] fits
            t = max(t, hint[int(math.log2(d))])
        t0 = t
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and ends[i] > t:
            t = ends[i]
        i += 1
        while i < len(starts) and starts[i] < t + d:
            t = max(t, ends[i])
            i += 1
        # the gaps in [t0, t) are shorter than d: so shorter than 2**k for 2**k >= d
        if d > 0 and t > t0:
            for j in range(max(0, math.ceil(math.log2(d))), len(hint)):
                if t0 <= hint[j] < t:
                    hint[j] = t
        return t

    def take_shared(self, t: float, d: float) -> tuple[float, float]:
        """Occupy d ns of the free time at or after t, split across gaps as needed; returns
        (first start, end). A DMA engine serves its 16 queues round robin (nki-dma-overview.rst
        "DMA Queues"), descriptor by descriptor, so a transfer does not wait for one gap that
        holds all of it: it fills the engine's idle time as it comes (gaps under 2 `_GAP` are
        skipped: `take` counts them as busy)."""
        if d <= 0:
            return t, t
        starts, ends = self.starts, self.ends
        n = len(starts)
        pieces: list[tuple[float, float]] = []
        need = d
        i = bisect.bisect_right(ends, t)
        while True:
            if i < n and starts[i] <= t:
                t = max(t, ends[i])
                i += 1
                continue
            free = (starts[i] if i < n else math.inf) - t
            piece = min(free, need)
            if piece == need or piece >= 2 * _GAP:
                pieces.append((t, piece))
                need -= piece
                if need <= 0:
                    break
            t = ends[i]
            i += 1
        for a, b in pieces:
            self.take(a, b)
        return pieces[0][0], pieces[-1][0] + pieces[-1][1]

    def take(self, t: float, d: float) -> None:
        """Occupy [t, t + d) (a gap `fit` returned), merged with the intervals it touches (gaps
        under `_GAP` ns count as busy: they keep the interval lists short)."""
        if d <= 0:
            return
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(starts, t)
        e = t + d
        if i < len(starts) and starts[i] - e < _GAP:
            e = max(e, ends[i])
            del starts[i], ends[i]
        if i > 0 and t - ends[i - 1] < _GAP:
            ends[i - 1] = max(ends[i - 1], e)
        else:
            starts.insert(i, t)
            ends.insert(i, e)

    def prune(self, floor: float) -> None:
        """Drop the intervals that ended before `floor` (nothing starts before it)."""
        k = bisect.bisect_right(self.ends, floor)
        if k > 64:
            del self.starts[:k]
            del self.ends[:k]


class _Core:
    """The list-schedule state of one program (core); the module docstring for the rules."""

    def __init__(self, program_id: int, hw: Hardware) -> None:
        self.program_id = program_id
        self.hw = hw
        n_dma = int(hw["dma_engines"])
        self.lines: dict[str, _Timeline] = defaultdict(_Timeline)  # engines and DMA queues
        self.dma_lines = [_Timeline() for _ in range(n_dma)]
        self.dma_busy = [0.0] * n_dma
        self.busy: dict[str, float] = {e: 0.0 for e in COMPUTE_ENGINES}
        self.queue_ns: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.hbm_bytes = 0
        self.deps = _Deps()
        self.events: list[Event] = []
        self.floor = 0.0
        self.window = int(hw["reorder_window"])  # FIGURES: the reordering's reach (floor)
        self.recent: list[float] = []  # start times of the last `window` instructions
        self.makespan = 0.0
        self.hbm_written = 0.0  # when every HBM write issued so far has finished
        self.fence = 0.0  # HBM reads start after the last core_barrier

    def _occupy(self, track: str, ready: float, d: float) -> float:
        line = self.lines[track]
        t = line.fit(ready, d)
        line.take(t, d)
        if track in self.busy:
            self.busy[track] += d
        return t

    def arrive(self, ins: Instr) -> tuple[Cost, float]:
        """A core_barrier reaches its engine: (its cost, the time this core arrives)."""
        c = instruction_cost(ins, self.hw)
        self.counts[ins.engine] += 1
        t = max(self.hbm_written, self.floor, self.lines[c.track].fit(self.floor, 0.0))
        return c, max(t, self.lines[c.track].ends[-1] if self.lines[c.track].ends else 0.0)

    def leave(self, ins: Instr, c: Cost, start: float, end: float) -> None:
        """Both cores passed the barrier: it held its engine from `start` to `end`."""
        self._occupy(c.track, start, end - start)
        self.fence = max(self.fence, end)
        self.makespan = max(self.makespan, end)
        self.events.append(Event(ins.index, ins.op, c.track, start, end, ins.source, c))

    def step(self, ins: Instr) -> None:
        c = instruction_cost(ins, self.hw)
        q = c.track
        self.counts[ins.engine] += 1
        ready = max(self.deps.ready(ins), self.floor)
        if c.kind == "dma":
            if any(o.buffer == "hbm" for o in ins.reads()):
                ready = max(ready, self.fence)
            if q == "dma.swdge" and c.gen_ns > 0:  # GpSimd generates the descriptors first
                g0 = self._occupy("gpsimd", ready, c.gen_ns)
                ready = g0 + c.gen_ns
                gen = Cost("gpsimd", c.gen_ns, "descriptors", {}, detail=f"{c.descriptors}")
                self.events.append(Event(ins.index, ins.op, "gpsimd", g0, ready, ins.source, gen))
            if q == DGE_EITHER:  # the DGE queue that can issue it first
                q = min(("dma.sync", "dma.act"), key=lambda k: self.lines[k].fit(ready, c.ns))
            issue = self._occupy(q, ready, c.ns)
            t0 = issue + c.ns + c.latency_ns
            start, end = math.inf, t0
            for e, t in c.dma_ns.items():
                se, ee = self.dma_lines[e].take_shared(t0, t)
                self.dma_busy[e] += t
                start, end = min(start, se), max(end, ee)
            start = min(start, end)
            self.queue_ns[q] += max(c.dma_ns.values(), default=0.0)
            self.hbm_bytes += c.hbm_bytes
            if any(o.buffer == "hbm" for o in ins.writes()):
                self.hbm_written = max(self.hbm_written, end)
        else:
            start = self._occupy(q, ready, c.ns)
            end = start + c.ns
        self.makespan = max(self.makespan, end)
        self.events.append(Event(ins.index, ins.op, q, start, end, ins.source, c))
        self.recent.append(start)
        if len(self.recent) >= 2 * self.window:
            # no instruction starts before every one of the last `window` instructions
            self.floor = max(self.floor, min(self.recent[-self.window :]))
            del self.recent[: self.window]
            for line in (*self.lines.values(), *self.dma_lines):
                line.prune(self.floor)
        self.deps.commit(ins, end, self.floor)

    def result(self) -> ProgramSchedule:
        busy = dict(self.busy)
        busy["dma"] = max(self.dma_busy, default=0.0)
        busy["hbm"] = self.hbm_bytes / self.hw.hbm_bytes_per_ns
        self.events.sort(key=lambda e: (e.index, e.cost.kind != "descriptors"))
        return ProgramSchedule(
            self.program_id, self.events, busy, self.dma_busy, dict(self.queue_ns),
            self.makespan, dict(self.counts),
        )  # fmt: skip


def _schedule(programs: list[tuple[int, list[Instr]]], hw: Hardware) -> list[ProgramSchedule]:
    """List-schedule the programs together: each runs to its next core_barrier, then every core
    leaves the n-th barrier when the last one has arrived (plus `FIGURES` core_barrier_ns)."""
    barrier_ns = hw["core_barrier_ns"] if len(programs) > 1 else 0.0  # LNC=1: a no-op
    cores = [_Core(pid, hw) for pid, _ in programs]
    pos = [0] * len(programs)
    while True:
        arrived: list[tuple[int, Instr, Cost, float]] = []
        for k, (_, instrs) in enumerate(programs):
            while pos[k] < len(instrs) and instrs[pos[k]].op != "core_barrier":
                cores[k].step(instrs[pos[k]])
                pos[k] += 1
            if pos[k] < len(instrs):
                ins = instrs[pos[k]]
                arrived.append((k, ins, *cores[k].arrive(ins)))
                pos[k] += 1
        if not arrived:
            break
        leave = max(t for *_, t in arrived) + barrier_ns
        for k, ins, c, t in arrived:
            cores[k].leave(ins, c, t, leave)
    return [c.result() for c in cores]


def schedule_program(program_id: int, instrs: list[Instr], hw: Hardware) -> ProgramSchedule:
    """List-schedule one program's instructions alone (module docstring for the rules).

    To keep the tables small, no instruction starts before a floor: the earliest start among the
    last `FIGURES` reorder_window instructions (the compiler's reordering is taken to reach no further back);
    finished entries below it are dropped."""
    return _schedule([(program_id, instrs)], hw)[0]


@dataclass
class Profile:
    """The cost model's view of one kernel launch (all programs)."""

    target: str
    lnc: int
    hw: Hardware
    programs: list[ProgramSchedule] = field(default_factory=list)

    # -- aggregates -------------------------------------------------------------------------

    @property
    def makespan_ns(self) -> float:
        return max((p.makespan_ns for p in self.programs), default=0.0)

    @property
    def lower_bound_ns(self) -> float:
        return max((p.lower_bound_ns for p in self.programs), default=0.0)

    def busy_ns(self) -> dict[str, float]:
        """Per engine: the busiest program's busy time."""
        out: dict[str, float] = {}
        for p in self.programs:
            for k, v in p.busy_ns.items():
                out[k] = max(out.get(k, 0.0), v)
        return out

    @property
    def bottleneck(self) -> str:
        b = self.busy_ns()
        return max(b, key=lambda k: b[k]) if b else "none"

    def _sum(self, attr: str) -> float:
        return sum(getattr(e.cost, attr) for p in self.programs for e in p.events)

    def pe_utilization(self, time_ns: float | None = None) -> dict[str, float]:
        """Useful PE FLOPs over `time_ns` (default: the list schedule) against the peaks.

        ``mx``: MX FLOPs / MX peak time; ``bf16``: other matmul FLOPs / BF16 peak time;
        ``total``: their sum (the fraction of the PE's time at peak rate doing useful FLOPs).
        """
        t = self.makespan_ns if time_ns is None else time_ns
        if t <= 0:
            return {"mx": 0.0, "bf16": 0.0, "total": 0.0}
        cores = self.lnc
        mx_peak = self.hw["pe_mx_tflops"] * 1e3 * cores  # FLOP per ns
        bf_peak = self.hw["pe_bf16_tflops"] * 1e3 * cores
        mx = self._sum("flops_mx") / (t * mx_peak) if mx_peak > 0 else 0.0
        bf = self._sum("flops_bf16") / (t * bf_peak)
        return {"mx": mx, "bf16": bf, "total": mx + bf}

    def pe_start(self) -> dict[str, float] | None:
        """How long the Tensor engine waits before its first instruction (the latest program's
        start), in us and as a share of the schedule; None when no program uses it. AWS reports
        this for its MXFP8 backward with DMA transposes ("the PE idles ~49% of wall-clock
        waiting for its operands before the first matmul", `mxcli.nkisim.measured.BWD_SOURCE`),
        so it is an observable the model can be checked on."""
        starts = [s for p in self.programs if (s := p.first_start_ns("tensor")) is not None]
        if not starts or self.makespan_ns <= 0:
            return None
        t = max(starts)
        return {"us": t / 1e3, "share": t / self.makespan_ns}

    def top_lines(self, n: int = 10) -> list[dict[str, Any]]:
        """The source lines with the most engine time (summed over programs), largest first."""
        acc: dict[tuple[str, str, str], list[float]] = {}
        for p in self.programs:
            for e in p.events:
                t = max(e.cost.dma_ns.values(), default=0.0) if e.cost.kind == "dma" else e.cost.ns
                k = (e.source, e.track, e.op)
                a = acc.setdefault(k, [0.0, 0.0])
                a[0] += t
                a[1] += 1
        total = sum(v[0] for v in acc.values()) or 1.0
        rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:n]
        return [
            {"source": s, "track": tr, "op": op, "count": int(v[1]), "busy_us": v[0] / 1e3,
             "share": v[0] / total}
            for (s, tr, op), v in rows
        ]  # fmt: skip

    def summary(self, top: int = 10) -> dict[str, Any]:
        """A JSON-ready report."""
        busy = self.busy_ns()
        counts: dict[str, int] = defaultdict(int)
        for p in self.programs:
            for k, n in p.counts.items():
                counts[k] += n
        queues: dict[str, float] = defaultdict(float)
        for prog in self.programs:
            for k, v in prog.queue_ns.items():
                queues[k] = max(queues[k], v)
        return {
            "target": self.target,
            "lnc": self.lnc,
            "instructions": dict(counts),
            "busy_us": {k: v / 1e3 for k, v in busy.items()},
            "dma_queue_us": {k: v / 1e3 for k, v in queues.items()},
            "bottleneck": self.bottleneck,
            "lower_bound_us": self.lower_bound_ns / 1e3,
            "schedule_us": self.makespan_ns / 1e3,
            "pe_flops": {"mx": self._sum("flops_mx"), "bf16": self._sum("flops_bf16")},
            "pe_utilization": self.pe_utilization(),
            "pe_utilization_at_lower_bound": self.pe_utilization(self.lower_bound_ns),
            "pe_start": self.pe_start(),
            "dma": {
                "bytes": int(self._sum("dma_bytes")),
                "hbm_bytes": int(self._sum("hbm_bytes")),
                "descriptors": int(self._sum("descriptors")),
            },
            "top_lines": self.top_lines(top),
        }

    # -- trace export -----------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome-trace JSON (Perfetto): pid = core, tid = engine / DMA queue track."""
        order = [*COMPUTE_ENGINES, "sync", *DMA_QUEUES]
        events: list[dict[str, Any]] = []
        for p in self.programs:
            pid = p.program_id
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"core {pid} ({self.target})"}})  # fmt: skip
            lanes: dict[str, list[float]] = defaultdict(list)  # track -> end time of each lane
            tids: dict[str, int] = {}
            for e in p.events:
                if e.cost.kind == "control" and e.end <= e.start:
                    continue
                ends = lanes[e.track]
                lane = next((i for i, t in enumerate(ends) if t <= e.start), len(ends))
                if lane == len(ends):
                    ends.append(e.end)
                else:
                    ends[lane] = e.end
                name = e.track if lane == 0 else f"{e.track} ({lane + 1})"
                if name not in tids:
                    base = order.index(e.track) if e.track in order else len(order)
                    tids[name] = base * 100 + lane + 1
                events.append({
                    "name": e.op, "ph": "X", "pid": pid, "tid": tids[name],
                    "ts": e.start / 1e3, "dur": max(e.end - e.start, 0.0) / 1e3,
                    "args": {"source": e.source, "index": e.index, "detail": e.cost.detail},
                })  # fmt: skip
            for name, tid in tids.items():
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": name}})  # fmt: skip
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})  # fmt: skip
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"target": self.target, "lnc": self.lnc, "model": "mxcli.nkisim.cost"}}  # fmt: skip


def build_profile(recorders: list[Recorder], target: str, hw: Hardware, lnc: int) -> Profile:
    """Schedule every recorded program."""
    prof = Profile(target, lnc, hw)
    recs = sorted(recorders, key=lambda r: r.program_id)
    prof.programs.extend(_schedule([(r.program_id, r.instrs) for r in recs], hw))
    return prof
