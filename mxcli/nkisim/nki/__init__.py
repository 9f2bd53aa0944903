"""The top-level ``nki`` module as provided by mxcli's interpreter (api spec §1, §3)."""

from __future__ import annotations

from mxcli.nkisim.kernel import Kernel, jit, simulate
from mxcli.nkisim.nki import dtype, isa, language

__mxcli_nkisim__ = True
__version__ = "0.6.0+mxcli.nkisim"

__all__ = ["Kernel", "dtype", "isa", "jit", "language", "simulate"]
