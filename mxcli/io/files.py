"""safetensors files: read one whole, write one atomically, and the one tensor hash.

Storage of MX data (all little-endian), the contract of every file mxcli writes:

- fp8 bytes are stored as ``F8_E4M3`` (``torch.float8_e4m3fn``): the packed prefill rows
  ``norm_quant_packed [T, row]`` keep the kernel's byte layout (codes, then the scale region,
  then the optional affinity tail); read them back with ``.view(torch.uint8)``. ``uint8`` is
  accepted on input wherever fp8 bytes are expected.
- x4 data (four fp8 codes in one 32-bit word, byte ``j`` = element ``j``), such as pre-quantized
  weights ``gate_up_proj_weight [E, 2I/4, H]``, is stored as ``U32`` (``torch.uint32``).
- E8M0 scales are stored as ``U8`` bytes (``value = 2 ** (byte - 127)``); ``F8_E8M0`` is not used
  because older readers lack it.
- Everything else keeps its dtype (bf16 activations, int32 indices and block plans, fp32
  NOAUX affinities).

A tensor's sha256 (`tensor_sha256`) is that of its stored bytes: output metadata, prep-weights
manifests and ``verify`` all use this one definition, so that they agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from mxcli.errors import InputError, MxcliError
from mxcli.fsutil import atomic_output, display_path, utf8_path
from mxcli.io.kwargs import json_or_raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The stored bytes of a tensor: row-major, little-endian, on the CPU (no copy when it is
    already a contiguous CPU tensor)."""
    t = t.detach().cpu().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's stored bytes (`tensor_bytes`), as hex."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


@dataclass
class TensorFile:
    """A safetensors file read whole: tensors in order, plus its ``__metadata__``."""

    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    def meta_json(self, key: str, default: Any = None) -> Any:
        """A metadata value parsed as JSON (falls back to the raw string)."""
        raw = self.metadata.get(key)
        return default if raw is None else json_or_raw(raw)

    @property
    def kernel(self) -> str | None:
        return self.metadata.get("kernel")

    @property
    def kwargs(self) -> dict[str, Any]:
        value = self.meta_json("kwargs", {})
        return dict(value) if isinstance(value, Mapping) else {}


def read_file(
    path: str | os.PathLike[str],
    *,
    order: Callable[[str | None, Iterable[str]], list[str]] | None = None,
) -> TensorFile:
    """Read every tensor and the metadata of a safetensors file.

    safetensors stores names sorted; ``order(kernel, names)`` (the metadata's ``kernel``)
    restores another order, such as the kernel's argument and return order. A missing, empty,
    truncated or otherwise corrupt file raises ``InputError`` naming the file.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p}: is a folder, expected a .safetensors file")
    if p.stat().st_size < 8:
        raise InputError(f"{p}: not a safetensors file (only {p.stat().st_size} bytes)")
    try:
        with utf8_path(p) as opened, safe_open(opened, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as exc:
        raise InputError(f"{p}: corrupt or truncated safetensors file ({exc})") from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise InputError(f"{p}: cannot read safetensors file ({exc})") from None
    if order is not None:
        tensors = {n: tensors[n] for n in order(metadata.get("kernel"), tensors)}
    return TensorFile(p, tensors, metadata)


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    *,
    force: bool = False,
) -> Path:
    """Write tensors atomically with ``__metadata__`` (non-string values are JSON-encoded).

    A write that fails (a full disk) raises `MxcliError` naming the file and leaves nothing.
    """
    meta = {
        # metadata must be UTF-8: a name from a non-UTF-8 path is recorded with \xff escapes
        k: display_path(v) if isinstance(v, str) else json.dumps(v, sort_keys=True)
        for k, v in metadata.items()
    }
    data = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    final = Path(path)
    with atomic_output(final, force=force) as tmp:
        try:
            safetensors.torch.save_file(data, str(tmp), metadata=meta)
        except SafetensorError as exc:
            raise MxcliError(f"{final}: cannot write ({exc}); nothing written") from None
        _canonical_header(tmp)
    return final


def _canonical_header(path: Path) -> None:
    """Rewrite, in place, a safetensors file's header with its ``__metadata__`` keys sorted,
    so that the same tensors and metadata give the same bytes in every process.

    safetensors (0.8.0 checked) keeps the metadata in a Rust ``HashMap`` (randomly seeded per
    process) and serializes it in that map's iteration order: two runs of ``make-inputs`` with
    the same arguments wrote the same keys in different orders. The tensor entries are already
    in a fixed order (their data order). The header is re-serialized as serde_json writes it:
    compact, non-ASCII as UTF-8, and escaping exactly what Python's ``json`` escapes with
    ``ensure_ascii=False`` (``"``, ``\\`` and the control characters, in the same forms), so it
    is the same bytes permuted and keeps its length, the data's offset and alignment."""
    with open(path, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n).decode("utf-8"))
        meta = header.pop("__metadata__", None)
        if meta is not None:
            header = {"__metadata__": dict(sorted(meta.items())), **header}
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(raw) > n:  # cannot happen with the escaping above; nothing is then written
            raise MxcliError(f"internal: {path}: the sorted header is longer than safetensors'")
        fh.seek(8)
        fh.write(raw + b" " * (n - len(raw)))  # safetensors' own padding: spaces


def describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """JSON-ready shape, dtype and sha256 of each tensor (the summaries of the commands)."""
    return {
        name: {"shape": list(t.shape), "dtype": describe_dtype(t.dtype), "sha256": tensor_sha256(t)}
        for name, t in tensors.items()
    }


__all__ = [
    "TensorFile",
    "describe_dtype",
    "describe_tensors",
    "read_file",
    "tensor_bytes",
    "tensor_sha256",
    "write_file",
]
