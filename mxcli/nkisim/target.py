"""Targets (NeuronCore versions) and their hardware constants (api spec §2.1, §3.3)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

__all__ = ["Target", "TARGETS", "nc_version", "resolve_target", "KiB"]

KiB = 1024


class nc_version(enum.IntEnum):  # noqa: N801 - NKI's spelling
    """NeuronCore version. api spec §12.4: an IntEnum so kernels can compare with ``>=``."""

    gen2 = 2
    gen3 = 3
    gen4 = 4


@dataclass(frozen=True)
class Target:
    """One NeuronCore generation: its name, version and per-partition budgets."""

    name: str  # "trn1" | "trn2" | "trn3"
    version: nc_version
    sbuf_partition_bytes: int  # physical SBUF bytes per partition
    sbuf_fmax_bytes: int  # usable bytes per partition (api spec §2.1 table, KLR values)
    sub_version: int = 0

    pmax: int = 128
    psum_bank_fmax: int = 512
    psum_bank_fmax_bytes: int = 2048
    psum_banks: int = 8
    gemm_stationary_fmax: int = 128
    gemm_moving_fmax: int = 512
    bn_stats_fmax: int = 512
    psum_min_align: int = 4
    sbuf_min_align: int = 1

    @property
    def psum_partition_bytes(self) -> int:
        return self.psum_banks * self.psum_bank_fmax_bytes

    @property
    def psum_num_banks(self) -> int:
        """8, or 7 when bank 7 is reserved by ``NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE=true``."""
        if os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true":
            return self.psum_banks - 1
        return self.psum_banks

    @property
    def psum_budget_bytes(self) -> int:
        """Usable PSUM bytes per partition: `psum_num_banks` whole banks."""
        return self.psum_num_banks * self.psum_bank_fmax_bytes

    @property
    def supports_mx(self) -> bool:
        return self.version >= nc_version.gen4


TARGETS: dict[str, Target] = {
    "trn1": Target("trn1", nc_version.gen2, 192 * KiB, 180224),
    "trn2": Target("trn2", nc_version.gen3, 224 * KiB, 212984),
    "trn3": Target("trn3", nc_version.gen4, 256 * KiB, 245752),
}
_ALIASES = {
    "gen2": "trn1",
    "gen3": "trn2",
    "gen4": "trn3",
    "trn1": "trn1",
    "trn2": "trn2",
    "trn3": "trn3",
}
DEFAULT_TARGET = "trn3"
ENV_TARGET = "NEURON_PLATFORM_TARGET_OVERRIDE"


def target_by_name(name: str) -> Target:
    key = _ALIASES.get(str(name).strip().lower())
    if key is None:
        raise ValueError(f"target: expected one of trn1/gen2, trn2/gen3, trn3/gen4, got {name!r}")
    return TARGETS[key]


def resolve_target(explicit: str | Target | None = None, jit_target: str | None = None) -> Target:
    """Pick the target: explicit argument > ``NEURON_PLATFORM_TARGET_OVERRIDE`` > the
    kernel's deprecated ``@nki.jit(platform_target=...)`` (api spec §12.29: honoured when
    nothing else says) > trn3 (api spec §3.3: the simulator's default without a chip)."""
    if isinstance(explicit, Target):
        return explicit
    if explicit:
        return target_by_name(explicit)
    env = os.environ.get(ENV_TARGET)
    if env:
        return target_by_name(env)
    if jit_target:
        return target_by_name(jit_target)
    return TARGETS[DEFAULT_TARGET]
