"""The simulated machine: one run (a kernel launch) and its programs (LNC cores).

A `Run` holds what the programs of one launch share (configuration, ``shared_hbm`` tensors,
the LNC exchange); a `Program` is one core's state (``program_id``, counters, the ScalarE and
VectorE accumulator registers, the instruction clock and the allocation records used for the
capacity check). The current program is thread-local: under LNC=2 each program runs the kernel
body in its own thread (api spec §3.2, as the real simulator does).
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from types import FrameType
from typing import Any, Protocol

import numpy as np

from mxcli.nkisim.errors import (
    NkiCapacityError,
    NkiNotActiveError,
    NkiUninitializedReadError,
    NkiValidationError,
)
from mxcli.nkisim.target import Target

__all__ = [
    "UninitPolicy",
    "UninitRead",
    "RunConfig",
    "Counters",
    "RunReport",
    "AllocRecord",
    "Run",
    "Program",
    "current",
    "current_or_none",
]


class UninitPolicy(str, enum.Enum):
    """What a read of never-written memory does (api spec §2.4: fresh memory holds NaN / 4).

    ERROR raises `NkiUninitializedReadError` (default: such a read is a kernel bug on hardware);
    WARN emits a warning once per op and operand; IGNORE reads the sentinel values like the real
    simulator does.
    """

    ERROR = "error"
    WARN = "warn"
    IGNORE = "ignore"


@dataclass(frozen=True)
class RunConfig:
    """How a launch is simulated."""

    target: Target
    lnc: int = 1
    check_only: bool = False
    uninit: UninitPolicy = UninitPolicy.ERROR
    check_capacity: bool = True
    sendrecv_timeout_s: float = 600.0


@dataclass
class Counters:
    """Per-program instruction and traffic counts (raw material for roofline estimates).

    ``instructions``: per engine ("tensor", "vector", "scalar", "gpsimd", "dma", "sync").
    ``dma_bytes``: bytes written by DMA instructions (dst side; skipped OOB rows excluded).
    ``hbm_read_bytes`` / ``hbm_write_bytes``: the HBM side of those transfers.
    ``matmul_flops``: 2*K*M*N per ``nc_matmul`` (transposes excluded, counted in
    ``transpose_elements``); ``mx_matmul_flops``: 2*(4K)*M*N per ``nc_matmul_mx``.
    ``peak_sbuf_bytes`` / ``peak_psum_bytes``: peak live bytes per partition (PSUM in whole
    2 KiB banks), live meaning from the first instruction that touches an allocation to the
    last (`Program.finish_capacity`), plus the software-DGE descriptor reserve.
    """

    instructions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dma_bytes: int = 0
    hbm_read_bytes: int = 0
    hbm_write_bytes: int = 0
    matmul_flops: int = 0
    mx_matmul_flops: int = 0
    transpose_elements: int = 0
    peak_sbuf_bytes: int = 0
    peak_psum_bytes: int = 0

    @property
    def total_instructions(self) -> int:
        return int(sum(self.instructions.values()))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = dict(v) if isinstance(v, dict) else v
        return out

    @staticmethod
    def combine(parts: list[Counters]) -> Counters:
        """Sum over programs; peaks (``peak_*``) are the max over programs (each core has its
        own memory)."""
        out = Counters()
        for c in parts:
            for f in fields(Counters):
                mine, theirs = getattr(out, f.name), getattr(c, f.name)
                if isinstance(mine, dict):
                    for k, v in theirs.items():
                        mine[k] += v
                elif f.name.startswith("peak_"):
                    setattr(out, f.name, max(mine, theirs))
                else:
                    setattr(out, f.name, mine + theirs)
        return out


@dataclass(frozen=True)
class UninitRead:
    """Reads of never-written memory at one kernel site (under ``uninit="warn"``/``"error"``).

    ``site``: the kernel source line of the instruction (``file:line``, the first frame outside
    the interpreter); ``op`` / ``operand``: the instruction and its operand; ``tensor``: the
    allocation read; ``count``: how many instructions at that site read unwritten memory;
    ``elements``: the unwritten elements they read, summed (0 where the op does not say).
    """

    site: str
    op: str
    operand: str
    tensor: str
    count: int
    elements: int

    def __str__(self) -> str:
        what = f"{self.elements} unwritten element(s)" if self.elements else "unwritten bytes"
        return (
            f"{self.site}: {self.op} {self.operand} read {what} of {self.tensor} "
            f"({self.count} instruction(s))"
        )


@dataclass
class RunReport:
    """What one simulated launch did: its configuration, counters per program and in total, and
    the kernel sites that read never-written memory (`UninitRead`, empty when none did)."""

    config: RunConfig
    programs: list[Counters]
    uninit_reads: tuple[UninitRead, ...] = ()

    @property
    def counters(self) -> Counters:
        return Counters.combine(self.programs)


@dataclass
class AllocRecord:
    """Lifetime of one on-chip allocation, for the capacity sweep (kept after the data is freed).

    ``alloc_t``: when ``nl.ndarray`` ran; ``first_t`` / ``last_t``: the first and last
    instruction that touched it (``first_t`` None while none has). The sweep charges
    [first_t, last_t]: the compiler gives a tile its address at its first write and releases it
    after its last read, whatever line declared it (see `Program.finish_capacity`).
    """

    name: str
    buffer: str  # "sbuf" | "psum"
    bytes_pp: int  # bytes per partition charged against the budget
    alloc_t: float
    last_t: float
    first_t: float | None = None


# Software-DGE descriptor storage in SBUF, bytes per partition, charged from a program's first
# software-DGE DMA (a `vector_offset` gather/scatter or ``dge_mode.swdge``) to its last.
# ASSUMED: the DGE reference (aws-neuron-sdk nki/deep-dives/nki-dge.rst, 2026-03-31) says only
# that the GpSimd engine generates swdge descriptors at run time; where they are kept and how
# much room they take is not documented. 256 B is the reserve nki-library keeps below KLR's
# usable size on Trn3 (experimental/mlp_mxfp8/common_utils.py MAX_AVAILABLE_SBUF_SIZE_TRN3 =
# 256 KiB - 16384 - 8 - 256, "minus reserved regions", its purpose unstated); plausible range
# 0-520 B (520: the reserve nki-library hard-codes on Trn2, nki_api_subset.md §2.1).
SWDGE_DESCRIPTOR_BYTES = 256
SWDGE_DESCRIPTOR_RANGE = (0, 520)
SWDGE_RECORD_NAME = "<swdge descriptors>"


class RaceDetector(Protocol):
    """What a launch asks of its LNC race detector (`races.RaceTracker`). The launcher hands one
    in: the detector reads tensor accesses, and tensor stands on this module, so this module
    does not import it (no import circle)."""

    enabled: bool

    def clear(self, st: Any) -> None: ...

    def record(
        self,
        acc: Any,
        program: int,
        write: bool,
        mask: np.ndarray | None,
        values: np.ndarray | None = None,
        commit: Any = None,
    ) -> None: ...


class Run:
    """State shared by the programs of one launch."""

    def __init__(self, config: RunConfig, race: RaceDetector | None = None) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.shared_allocs: list[Any] = []  # k-th shared_hbm allocation, matched across programs
        self.mailbox: dict[tuple[int, int, int], list[np.ndarray]] = defaultdict(list)
        self.finished: set[int] = set()
        self.failed = False
        self.barrier_count = [0] * config.lnc
        # the data tensor (storage) each program's n-th core_barrier synchronizes on
        self.barrier_data: dict[int, dict[int, Any]] = defaultdict(dict)
        self.race = race  # LNC > 1 only: the shared-HBM race detector (races.py)
        self.warned: set[str] = set()
        # (site, op, operand, tensor) -> [instructions, unwritten elements], in first-seen order
        self.uninit: dict[tuple[str, str, str, str], list[int]] = {}

    def record_uninit(self, key: tuple[str, str, str, str], elements: int) -> bool:
        """Count one read of never-written memory at a site; True the first time for that site."""
        with self.lock:
            hit = self.uninit.get(key)
            if hit is None:
                self.uninit[key] = [1, elements]
                return True
            hit[0] += 1
            hit[1] += elements
            return False

    def uninit_reads(self) -> tuple[UninitRead, ...]:
        with self.lock:
            return tuple(UninitRead(*k, n, e) for k, (n, e) in self.uninit.items())

    def warn_once(self, key: str, message: str) -> None:
        with self.lock:
            if key in self.warned:
                return
            self.warned.add(key)
        # 5 frames up: warn_once <- Program.uninit_read <- check_init <- read <- the instruction
        warnings.warn(message, stacklevel=5)

    def abort(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def finish(self, program_id: int) -> None:
        with self.cond:
            self.finished.add(program_id)
            self.cond.notify_all()


class Program:
    """One core running the kernel body."""

    def __init__(self, run: Run, program_id: int) -> None:
        self.run = run
        self.config = run.config
        self.target = run.config.target
        self.program_id = program_id
        self.counters = Counters()
        self.clock = 0  # instructions issued so far
        self.records: list[AllocRecord] = []
        self.swdge_record: AllocRecord | None = None
        self.shared_index = 0
        self.scalar_acc = np.zeros(128, dtype=np.float32)  # api spec §5.4 ScalarE accumulator
        self.vector_acc = np.zeros(128, dtype=np.float32)  # api spec §5.4 VectorE accumulator
        self.no_reorder_depth = 0
        self.op_log: list[str] = []
        # instruction recorder for the cost model (mxcli.nkisim.trace); None unless tracing
        self.trace: Any = _trace_factory(program_id) if _trace_factory is not None else None

    @property
    def compute(self) -> bool:
        """False in check-only mode: instructions validate and track state, skip arithmetic."""
        return not self.config.check_only

    def begin(self, op: str, engine: str) -> int:
        """Issue one instruction: advance the clock and count it."""
        self.clock += 1
        self.counters.instructions[engine] += 1
        self.counters.ops[op] += 1
        self.op_log.append(op)
        if self.trace is not None:
            self.trace.begin(op, engine)
        return self.clock

    @property
    def checks_init(self) -> bool:
        """False under ``UninitPolicy.IGNORE``: reads of never-written memory are not checked."""
        return self.config.uninit is not UninitPolicy.IGNORE

    def uninit_read(
        self,
        key: str,
        message: str,
        *,
        operand: str = "",
        tensor: str = "",
        elements: int = 0,
    ) -> None:
        """Report a read of never-written memory at the kernel's current source line: raise under
        ERROR; under WARN count it per site (`RunReport.uninit_reads`) and warn once per site,
        naming it."""
        site = _kernel_site()
        if self.config.uninit is UninitPolicy.ERROR:
            raise NkiUninitializedReadError(f"{message} at {site}")
        op = key.split(":")[1] if key.count(":") >= 2 else key
        first = self.run.record_uninit((site, op, operand or key, tensor), elements)
        if first:
            self.run.warn_once(f"{key}@{site}", f"{message} at {site}")

    def new_record(
        self, name: str, buffer: str, bytes_pp: int, *, written: bool = False
    ) -> AllocRecord:
        """Record an on-chip allocation; `written`: filled where it is declared (``nl.zeros``
        and friends write it there, so it is live from there)."""
        at = self.clock + 0.5
        rec = AllocRecord(name, buffer, bytes_pp, at, at, at if written else None)
        self.records.append(rec)
        return rec

    def swdge_dma(self) -> None:
        """A software-DGE DMA was issued (the current instruction): its descriptors are kept in
        SBUF (`SWDGE_DESCRIPTOR_BYTES`, assumed) from the program's first such DMA to its last."""
        rec = self.swdge_record
        if rec is None:
            rec = AllocRecord(SWDGE_RECORD_NAME, "sbuf", SWDGE_DESCRIPTOR_BYTES, self.clock, 0)
            rec.first_t = self.clock
            self.swdge_record = rec
            self.records.append(rec)
        rec.last_t = self.clock

    def finish_capacity(self) -> None:
        """Sweep allocation lifetimes: peak live bytes per partition; raise past the budget.

        A tile is live from the first instruction that touches it to the last, not from the
        line that declares it: nki.compiler.Allocation (NKI API reference) says the compiler
        "assigns an address to a tile at its first write and releases the address after its
        last read" (LINEAR; the default COLORING allocates the same traced live ranges by graph
        colouring). So a buffer declared at the top of a phase and first written late in it
        takes no room before that write, and a tile no instruction touches takes none. The
        sum of live bytes is what any allocator needs at that instruction (an upper bound
        would need fragmentation, which the docs do not describe).
        """
        t = self.target
        budgets = {"sbuf": t.sbuf_fmax_bytes, "psum": t.psum_budget_bytes}
        for buf in ("sbuf", "psum"):
            recs = [r for r in self.records if r.buffer == buf and r.first_t is not None]
            if not recs:
                continue
            starts = np.array([r.first_t for r in recs])
            ends = np.array([r.last_t + 0.25 for r in recs])
            sizes = np.array([r.bytes_pp for r in recs], dtype=np.int64)
            times = np.concatenate([starts, ends])
            deltas = np.concatenate([sizes, -sizes])
            order = np.lexsort((deltas, times))  # at equal times frees (<0) come first
            live = np.cumsum(deltas[order])
            k = int(np.argmax(live))
            peak = int(live[k])
            if buf == "sbuf":
                self.counters.peak_sbuf_bytes = peak
            else:
                self.counters.peak_psum_bytes = peak
            if self.config.check_capacity and peak > budgets[buf]:
                at = float(times[order][k])
                alive = [
                    r for r in recs if r.first_t is not None and r.first_t <= at < r.last_t + 0.25
                ]
                alive.sort(key=lambda r: -r.bytes_pp)
                top = ", ".join(f"{r.name or '<unnamed>'}={r.bytes_pp}B" for r in alive[:6])
                instr = int(at)
                where = self.op_log[instr - 1] if 0 < instr <= len(self.op_log) else "start"
                raise NkiCapacityError(
                    f"capacity: live {buf.upper()} bytes per partition exceed the {t.name} budget "
                    f"(got {peak}, expected <= {budgets[buf]}) at instruction {instr} ({where}) "
                    f"of program {self.program_id}; largest live: {top}"
                )

    # -- LNC exchange -------------------------------------------------------------------------

    def sendrecv(self, payload: np.ndarray, to: int, frm: int, pipe_id: int) -> np.ndarray:
        run = self.run
        me = self.program_id
        with run.cond:
            run.mailbox[(pipe_id, me, to)].append(payload)
            run.cond.notify_all()
            key = (pipe_id, frm, me)
            ok = run.cond.wait_for(
                lambda: run.mailbox[key] or run.failed or frm in run.finished,
                timeout=run.config.sendrecv_timeout_s,
            )
            if run.mailbox[key]:
                return run.mailbox[key].pop(0)
        if run.failed:
            raise NkiValidationError("sendrecv: the partner program failed")
        if not ok:
            raise NkiValidationError(f"sendrecv: timed out waiting for rank {frm} (pipe {pipe_id})")
        raise NkiValidationError(
            f"sendrecv: rank {frm} finished without sending on pipe {pipe_id} "
            "(LNC programs must issue matching sendrecv calls)"
        )

    def core_barrier(self, data: Any = None) -> None:
        """Two-party barrier keyed by call order (api spec §6.5). `data` is the storage of the
        barrier's tensor: when both programs' n-th barriers name the same tensor, the race
        detector orders that tensor's accesses across it (and only that tensor's)."""
        run = self.run
        n = run.config.lnc
        if n == 1:
            return
        me = self.program_id
        with run.cond:
            gen = run.barrier_count[me]
            run.barrier_count[me] += 1
            run.barrier_data[gen][me] = data

            def released() -> bool:
                return all(run.barrier_count[p] > gen for p in range(n))

            if released():  # the last to arrive closes the window of the common tensor
                named = run.barrier_data.pop(gen)
                tensors = {id(v) for v in named.values()}
                if run.race is not None and data is not None and len(tensors) == 1:
                    run.race.clear(data)
            run.cond.notify_all()

            ok = run.cond.wait_for(
                lambda: (
                    released()
                    or run.failed
                    or any(p in run.finished and run.barrier_count[p] <= gen for p in range(n))
                ),
                timeout=run.config.sendrecv_timeout_s,
            )
            if released():
                return
        if run.failed:
            raise NkiValidationError("core_barrier: the other program failed")
        if not ok:
            raise NkiValidationError("core_barrier: timed out waiting for the other program")
        raise NkiValidationError(
            "core_barrier: the other program finished without reaching this barrier "
            "(LNC programs must call core_barrier the same number of times)"
        )


_tls = threading.local()
_trace_factory: Any = None  # set by mxcli.nkisim.trace.recording(); program_id -> recorder


def set_trace_factory(factory: Any) -> Any:
    """Install `factory(program_id)` to give each new Program an instruction recorder; returns
    the previous factory (None = no tracing, the default)."""
    global _trace_factory
    prev, _trace_factory = _trace_factory, factory
    return prev


def current_or_none() -> Program | None:
    return getattr(_tls, "program", None)


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _kernel_site() -> str:
    """``file:line`` of the innermost frame outside the interpreter (the kernel's source line)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PKG_DIR):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def current() -> Program:
    prog = getattr(_tls, "program", None)
    if prog is None:
        raise NkiNotActiveError(
            "NKI call outside a simulated kernel: run the kernel through nki.simulate / "
            "mxcli.nkisim.simulate"
        )
    return prog


@contextmanager
def bind(program: Program | None) -> Iterator[None]:
    """Make `program` the current one in this thread for the duration of the block."""
    prev = getattr(_tls, "program", None)
    _tls.program = program
    try:
        yield
    finally:
        _tls.program = prev
