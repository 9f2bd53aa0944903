"""``nki.isa.constants`` (undocumented in the 0.6 stubs; imported by 2.32 nki-library kernels as
``from nki.isa.constants import dge_mode, oob_mode`` — api spec §1, §12.1). The objects are the
same as ``nki.isa.<name>``."""

from __future__ import annotations

from mxcli.nkisim.nki.isa.enums import (
    dge_mode,
    dma_engine,
    engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)

__all__ = [
    "dge_mode",
    "oob_mode",
    "engine",
    "reduce_cmd",
    "matmul_perf_mode",
    "nc_version",
    "dma_engine",
]
