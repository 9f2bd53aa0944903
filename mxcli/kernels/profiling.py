"""Cost-model profiles of the NKI kernels (``mxcli profile``, ``scripts/bench_nki.py``).

Each kernel runs once in the interpreter's check-only mode (every hardware rule and the
SBUF/PSUM capacity checked, float arithmetic skipped) with instruction recording on; the recorded
stream is costed and scheduled by `mxcli.nkisim.cost` / `mxcli.nkisim.schedule`. Inputs come from
a ``make-inputs`` file or are synthesized from a shape by the kernel's profile part
(``mxcli/kernels/<kernel>/profile.py``, `ProfilePart`: its shape flags and inputs).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels.spec import get_spec, read_kernel_file
from mxcli.nkisim import cost, schedule, trace

__all__ = [
    "PlanPadding",
    "KernelProfile",
    "extrapolate",
    "file_inputs",
    "positive",
    "profile_kernel",
    "shape_inputs",
]

TARGETS = ("trn3", "trn2")


@dataclass(frozen=True)
class PlanPadding:
    """The block plan's padding (kept apart from kernel efficiency)."""

    pairs: int  # routed (token, expert) pairs
    blocks: int  # N, the plan's static block count
    block_size: int
    blocks_needed: int  # sum over experts of ceil(c_e / B)

    @property
    def positions(self) -> int:
        return self.blocks * self.block_size

    @property
    def efficiency(self) -> float:
        """Routed pairs / positions the kernel processes (1.0 = no padding)."""
        return self.pairs / self.positions if self.positions else 0.0


@dataclass
class KernelProfile:
    """A kernel's profile plus what it ran on."""

    kernel: str
    profile: Any  # mxcli.nkisim.schedule.Profile
    shape: dict[str, Any]
    padding: PlanPadding | None
    run_seconds: float
    # which NKI kernel ran (`mxcli.kernels.selection.describe`) and its never-written reads
    nki_kernel: dict[str, Any] | None = None
    uninit_reads: tuple[str, ...] = ()
    # the recorded instruction streams (one per core): re-costed under other figures for the
    # estimate's range and for calibration (`mxcli.kernels.calibrating`), with no second run
    recorders: list[Any] = field(default_factory=list, repr=False)
    calibration: Any = None  # `mxcli.kernels.calibrating.Calibration` the figures came from
    _range: dict[str, Any] | None = field(default=None, repr=False)

    def ranges(self) -> dict[str, Any]:
        """The estimates' ranges over the free figures (`calibrating.profile_ranges`; the
        recorded stream re-scheduled, computed once)."""
        from mxcli.kernels import calibrating

        if self._range is None:
            self._range = calibrating.profile_ranges(self, self.calibration)
        return self._range

    def summary(self, top: int = 10, ranges: bool = True) -> dict[str, Any]:
        """JSON-ready report; with `ranges` (and a recorded stream) each estimate's range
        under ``"range"`` (issue 29 item 5)."""
        out: dict[str, Any] = {"kernel": self.kernel, "shape": self.shape}
        if self.nki_kernel is not None:
            out["nki_kernel"] = self.nki_kernel
        if self.uninit_reads:
            out["uninit_reads"] = list(self.uninit_reads)
        out.update(self.profile.summary(top))
        if self.padding is not None:
            p = self.padding
            out["plan_padding"] = {
                "pairs": p.pairs, "blocks": p.blocks, "block_size": p.block_size,
                "positions": p.positions, "blocks_needed": p.blocks_needed,
                "efficiency": p.efficiency,
            }  # fmt: skip
        out["check_only_run_s"] = round(self.run_seconds, 3)
        if ranges and self.recorders:
            out["range"] = self.ranges()
        return out


def positive(name: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InputError(f"{name}: expected a positive integer, got {v!r}")


def file_inputs(kernel: str, path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors and kwargs of a ``make-inputs`` file (``.safetensors``) for `kernel`."""
    spec = get_spec(kernel)
    f = read_kernel_file(path)
    if f.kernel not in (None, spec.name):
        raise InputError(f"{f.path}: input file is for {f.kernel}, not {spec.name}")
    tensors = dict(f.tensors)
    spec.check_tensors(tensors, str(f.path))
    kwargs = spec.resolve_kwargs(spec.metadata_kwargs(f.metadata))
    return tensors, kwargs


def profile_kernel(
    kernel: str,
    tensors: dict[str, Any],
    kwargs: dict[str, Any],
    *,
    lnc: int = 2,
    target: str = "trn3",
    shape: dict[str, Any] | None = None,
    nki_kernel: Any = None,
    calibration: Any = None,
) -> KernelProfile:
    """Run `kernel` in check-only mode with recording and return its cost-model profile.

    `nki_kernel`: the NKI implementation to profile (``mxcli`` default, ``nkilib``,
    ``MODULE:FUNCTION`` or a `mxcli.kernels.selection.ImplementationChoice`). `calibration`: a
    `mxcli.kernels.calibrating.Calibration` whose fitted figures replace the table's."""
    import warnings

    from mxcli.kernels import launcher, selection

    if target not in TARGETS:
        raise InputError(f"target: expected trn3 or trn2, got {target!r}")
    if target != "trn3":
        raise InputError(
            "target: both kernels use MX instructions (quantize_mx, nc_matmul_mx), which exist "
            f"on NeuronCore-v4 (trn3) only; got {target}"
        )
    if lnc not in (1, 2):
        raise InputError(f"lnc: expected 1 or 2, got {lnc}")
    spec = get_spec(kernel)
    choice = selection.parse_implementation(nki_kernel, spec)
    tuned = getattr(spec.profile(), "launch_kwargs", None)
    if tuned is not None:  # e.g. a third-party kernel at the shape its authors tuned and timed
        kwargs = tuned(choice.kind, tensors, kwargs)
    t0 = time.perf_counter()
    with trace.recording() as recorders, selection.recording() as launches:
        with warnings.catch_warnings():  # counted per site below instead
            warnings.filterwarnings("ignore", message=".*reads memory never written")
            launcher.launch_sim(
                spec, **tensors, **kwargs, lnc=lnc, check_only=True, implementation=choice
            )
    secs = time.perf_counter() - t0
    hw = calibration.hardware(target) if calibration is not None else cost.hardware(target)
    prof = schedule.build_profile(recorders, target, hw, lnc)
    # the block plan's padding, for kernels whose profile part reads one
    plan_padding = getattr(spec.profile(), "plan_padding", None)
    padding = plan_padding(tensors, kwargs) if plan_padding is not None else None
    if shape is None:
        shape = {k: list(v.shape) for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    info = launches[-1].kernel if launches else selection.describe(choice)
    reads = tuple(str(r) for launch in launches for r in launch.uninit_reads)
    return KernelProfile(
        spec.name, prof, shape, padding, secs, info, reads, list(recorders), calibration
    )


def extrapolate(base: Any, steps: list[tuple[Any, float]]) -> Any:
    """``base + sum(w * (sample - base))`` over `steps` ``(sample, w)``, on matching numbers."""
    if isinstance(base, dict):
        return {
            k: extrapolate(base[k], [(x[k], w) for x, w in steps])
            for k in base
            if all(k in x for x, _ in steps)
        }
    if isinstance(base, (int, float)) and not isinstance(base, bool):
        v = base + sum(w * (x - base) for x, w in steps)
        return int(round(v)) if isinstance(base, int) else float(v)
    return base


def shape_inputs(kernel: str, shape: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensors and kwargs of `kernel` at `shape` (its profile part's flags by name)."""
    spec = get_spec(kernel)
    part = spec.profile()
    if part is None:
        raise InputError(f"kernel: {spec.name} has no profile shapes ({spec.package}.profile)")
    return part.inputs(shape)
