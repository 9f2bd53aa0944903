"""Timeline of a recorded kernel: per-engine busy time, bounds, a list schedule, a trace file.

Input: the `trace.Recorder` of each program (LNC core) and a `cost.Hardware`. Each program is
scheduled on its own core (cross-core waits at ``sendrecv`` / ``core_barrier`` are not modelled):

- **Busy time** per compute engine (sum of its instruction costs), per DMA engine (the data time
  of its share of each transfer) and HBM (bytes over the core's share of HBM bandwidth).
- **Lower bound**: perfect overlap, the maximum of those; its argmax is the bottleneck.
- **List schedule**: instructions in program order; each engine (and each DMA queue) runs its
  instructions in order, and an instruction starts once every earlier instruction it depends on
  has finished: read-after-write, write-after-write and write-after-read on overlapping regions
  (partition x byte boxes on chip, byte ranges in HBM). A DMA additionally waits for the DMA
  engines it uses and for its trigger-to-start latency.
- **Trace**: Chrome-trace JSON (opens in Perfetto / chrome://tracing): one process per core, one
  track per engine and DMA queue, events named after the instruction with the kernel source line.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from mxcli.nkisim.cost import COMPUTE_ENGINES, DMA_QUEUES, Cost, Hardware, instruction_cost
from mxcli.nkisim.trace import Instr, Recorder

__all__ = ["Event", "ProgramSchedule", "Profile", "schedule_program", "build_profile"]

_PRUNE_AT = 64  # dependency entries per tensor before finished ones are dropped
_SMALL = 16  # tables this small are searched for superseded entries on every write
_WINDOW = 256  # instructions: the engines active in this window define the floor


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


def schedule_program(program_id: int, instrs: list[Instr], hw: Hardware) -> ProgramSchedule:
    """List-schedule one program's instructions (module docstring for the rules).

    To keep the dependency tables small, no instruction starts before a floor: the earliest
    next-free time among the queues used in the last `_WINDOW` instructions (finished entries
    below it are dropped). This can only delay an instruction on an engine that has been idle
    for that long, never one on a busy engine, so the bottleneck's timeline is unaffected."""
    n_dma = int(hw["dma_engines"])
    queue_free: dict[str, float] = defaultdict(float)  # next free time of each in-order queue
    queue_start: dict[str, float] = defaultdict(float)  # DMA: last data start (in order)
    dma_free = [0.0] * n_dma
    dma_busy = [0.0] * n_dma
    busy: dict[str, float] = {e: 0.0 for e in COMPUTE_ENGINES}
    queue_ns: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    hbm_bytes = 0
    deps = _Deps()
    events: list[Event] = []
    floor = 0.0  # no instruction starts earlier (see `schedule_program`'s docstring)
    last_use: dict[str, int] = {}
    makespan = 0.0
    for ins in instrs:
        c = instruction_cost(ins, hw)
        q = c.track
        counts[ins.engine] += 1
        last_use[q] = ins.index
        ready = max(deps.ready(ins), floor)
        if c.kind == "dma":
            issue = max(ready, queue_free[q])
            queue_free[q] = issue + c.ns
            start = max([issue + c.ns + c.latency_ns, queue_start[q]]
                        + [dma_free[e] for e in c.dma_ns])  # fmt: skip
            queue_start[q] = start
            dur = max(c.dma_ns.values(), default=0.0)
            for e, t in c.dma_ns.items():
                dma_free[e] = start + t
                dma_busy[e] += t
            queue_ns[q] += dur
            hbm_bytes += c.hbm_bytes
            end = start + dur
        else:
            start = max(ready, queue_free[q])
            end = start + c.ns
            queue_free[q] = end
            if q in busy:
                busy[q] += c.ns
        makespan = max(makespan, end)
        events.append(Event(ins.index, ins.op, q, start, end, ins.source, c))
        if ins.index % 64 == 63:
            active = [queue_free[k] for k, i in last_use.items() if ins.index - i < _WINDOW]
            floor = max(floor, min(active))
        deps.commit(ins, end, floor)
    busy["dma"] = max(dma_busy, default=0.0)
    busy["hbm"] = hbm_bytes / hw.hbm_bytes_per_ns
    return ProgramSchedule(
        program_id, events, busy, dma_busy, dict(queue_ns), makespan, dict(counts)
    )


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
    for r in sorted(recorders, key=lambda r: r.program_id):
        prof.programs.append(schedule_program(r.program_id, r.instrs, hw))
    return prof
