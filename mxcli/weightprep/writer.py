"""Writing outputs: a streaming safetensors writer, the Hugging Face-style index, JSON files.

`StreamingWriter` writes a safetensors file whose tensor list (names, dtypes, shapes) is known up
front, as the plan knows it: the header goes first, then each tensor's bytes arrive in pieces
(an expert chunk at a time) and go straight to their place in the file. Nothing but the piece
being written is held, and each tensor's sha256 (that of `mxcli.io.files.tensor_sha256`: the
stored bytes) is computed on the way. The file is produced
under a temporary name and renamed only when every byte has arrived (`mxcli.fsutil`).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import MxcliError
from mxcli.fsutil import atomic_output
from mxcli.io.files import tensor_bytes
from mxcli.weightprep.checkpoint import st_dtype, st_nbytes


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: its full name in the file, dtype (safetensors string) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return st_nbytes(self.dtype, self.shape)


class StreamingWriter:
    """Write one safetensors file piece by piece; see the module docstring.

    ``write(name, piece)`` appends `piece` (a tensor whose bytes continue `name`'s data) at the
    tensor's fill position. `finish` checks every tensor is complete and returns their sha256.
    """

    def __init__(self, fd: int, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        self._fd = fd
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        offset = 0
        self._spec: dict[str, TensorSpec] = {}
        self._start: dict[str, int] = {}
        for s in specs:
            if s.name in self._spec:
                raise MxcliError(f"internal: duplicate output tensor {s.name}")
            header[s.name] = {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            self._spec[s.name] = s
            self._start[s.name] = offset
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
        self._data0 = 8 + len(raw)
        self.total_bytes = self._data0 + offset
        self._filled = dict.fromkeys(self._spec, 0)
        self._hash = {n: hashlib.sha256() for n in self._spec}
        self._pwrite(len(raw).to_bytes(8, "little") + raw, 0)

    def _pwrite(self, data: bytes | memoryview, pos: int) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n

    def write(self, name: str, piece: torch.Tensor) -> None:
        spec = self._spec[name]
        if st_dtype(piece.dtype) != spec.dtype:
            raise MxcliError(
                f"internal: {name} piece has dtype {piece.dtype}, header says {spec.dtype}"
            )
        data = tensor_bytes(piece)
        pos = self._filled[name]
        if pos + data.nbytes > spec.nbytes:
            raise MxcliError(f"internal: {name} overflows its {spec.nbytes} bytes")
        self._pwrite(data, self._data0 + self._start[name] + pos)
        self._hash[name].update(data)
        self._filled[name] = pos + data.nbytes

    def finish(self) -> dict[str, str]:
        short = [n for n, s in self._spec.items() if self._filled[n] != s.nbytes]
        if short:
            raise MxcliError(f"internal: output tensors incomplete: {', '.join(short)}")
        return {n: h.hexdigest() for n, h in self._hash.items()}


class WriteQueue:
    """Writes (and their sha256) on one background thread, in submission order, so that the
    next expert chunk is read and converted while this one goes to disk.

    A tensor handed to `write` must stay unchanged until a later `fence` has completed.
    """

    def __init__(self) -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prep-weights-write")
        self._jobs: list[cf.Future[None]] = []

    def write(self, writer: StreamingWriter, name: str, piece: torch.Tensor) -> None:
        self._jobs.append(self._pool.submit(writer.write, name, piece))

    def fence(self) -> cf.Future[None]:
        """A future done once every write submitted so far is done."""
        self._raise_errors()
        fut: cf.Future[None] = self._pool.submit(lambda: None)
        self._jobs.append(fut)
        return fut

    def _raise_errors(self) -> None:
        pending = []
        for job in self._jobs:
            if job.done():
                job.result()  # re-raises a failed write
            else:
                pending.append(job)
        self._jobs = pending

    def wait(self) -> None:
        """Block until every write is done; re-raise the first that failed."""
        for job in self._jobs:
            job.result()
        self._jobs = []

    def close(self) -> None:
        """Drop writes not yet started and wait for the one running (safe before files close)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def streaming_file(
    path: Path, specs: list[TensorSpec], metadata: dict[str, str]
) -> Iterator[StreamingWriter]:
    """A `StreamingWriter` on a temporary file, renamed onto `path` when the block succeeds."""
    with atomic_output(path, force=True) as tmp:
        # No O_TRUNC: the temporary is new and empty, and truncating an ext4 file to zero marks
        # it for a flush of all its dirty pages on close (auto_da_alloc): measured 0.13 s per
        # 400 MB written, paid while the next layer waits.
        fd = os.open(tmp, os.O_WRONLY)
        try:
            w = StreamingWriter(fd, specs, metadata)
            yield w
            os.ftruncate(fd, w.total_bytes)
        finally:
            os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    with atomic_output(path, force=True) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_index(
    path: Path, weight_map: dict[str, str], total_size: int, metadata: dict[str, Any]
) -> None:
    """A ``model.safetensors.index.json``: ``{"metadata": {"total_size": ...}, "weight_map": ...}``."""
    write_json(
        path,
        {
            "metadata": {"total_size": int(total_size), **metadata},
            "weight_map": dict(sorted(weight_map.items())),
        },
    )
