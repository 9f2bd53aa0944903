"""Reading a Hugging Face checkpoint folder: ``config.json``, the shard index, safetensors headers,
and lazy tensor loads.

`Checkpoint` parses every shard header once (8-byte length + JSON, no tensor data), so the whole
model can be planned and validated before anything is read. Tensor data is read only inside a
`Checkpoint.reader()` block: it opens the shards it needs with safetensors `safe_open` (the
``pread`` backend where available, so the page cache is not mapped into this process) and closes
them when the block ends. A caller that opens one reader per layer therefore holds at most one
layer's source tensors, whichever shards they sit in.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.io.jsonfile import loads, read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000

# safetensors dtype string -> (torch dtype or None when torch lacks it, bits per element)
_ST_DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "F64": (torch.float64, 64),
    "F32": (torch.float32, 32),
    "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16),
    "I64": (torch.int64, 64),
    "I32": (torch.int32, 32),
    "I16": (torch.int16, 16),
    "I8": (torch.int8, 8),
    "U8": (torch.uint8, 8),
    "BOOL": (torch.bool, 8),
    "U64": (getattr(torch, "uint64", None), 64),
    "U32": (getattr(torch, "uint32", None), 32),
    "U16": (getattr(torch, "uint16", None), 16),
    "F8_E4M3": (getattr(torch, "float8_e4m3fn", None), 8),
    "F8_E5M2": (getattr(torch, "float8_e5m2", None), 8),
    "F8_E8M0": (getattr(torch, "float8_e8m0fnu", None), 8),
    "F4": (getattr(torch, "float4_e2m1fn_x2", None), 4),
}
_TORCH_TO_ST = {dt: name for name, (dt, _) in _ST_DTYPES.items() if dt is not None}
FP8_SOURCE_DTYPES = ("F8_E4M3", "F8_E5M2")


def st_dtype(dtype: torch.dtype) -> str:
    """safetensors dtype string of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise InputError(f"dtype {dtype} has no safetensors name") from None


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a safetensors dtype string (``"BF16"`` -> ``torch.bfloat16``)."""
    dt = _ST_DTYPES.get(name, (None, 0))[0]
    if dt is None:
        raise InputError(f"safetensors dtype {name!r} is not supported by this torch")
    return dt


def st_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of this safetensors dtype and shape."""
    bits = _ST_DTYPES[dtype][1]
    return (math.prod(shape) * bits + 7) // 8


class CheckpointError(MxcliError):
    """The checkpoint folder is incomplete, inconsistent or corrupt."""


class MissingTensorError(CheckpointError):
    """A tensor the model family needs is in no shard."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives, read from its shard's header (no data loaded)."""

    name: str
    file: str  # file name relative to the checkpoint folder
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return st_nbytes(self.dtype, self.shape)


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header; return ``(header, data_start)``.

    Raises `CheckpointError` for a file that is truncated (data shorter than the header says),
    has a malformed header, or whose tensor entries are inconsistent.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors file ({size} bytes, no header)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or n > size - 8:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors file (header length {n}, file {size} bytes)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    header = loads(raw, f"{path}: corrupt safetensors header", CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_len = size - 8 - n
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = [int(d) for d in shape]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: corrupt safetensors header (bad entry for {name!r})"
            ) from None
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        if e - b != st_nbytes(dtype, shape) or b < 0:
            raise CheckpointError(
                f"{path}: corrupt safetensors header ({name!r}: offsets {b}..{e} do not match "
                f"{dtype} {shape})"
            )
        end = max(end, e)
    if end > data_len:
        raise CheckpointError(
            f"{path}: truncated or corrupt safetensors file (header needs {end} data bytes, "
            f"file has {data_len})"
        )
    return header, 8 + n


def open_safetensors(path: Path) -> Any:
    from safetensors import safe_open

    from mxcli.fsutil import utf8_path

    with utf8_path(path) as name:  # the handle safe_open returns stays valid after the block
        try:
            return safe_open(name, framework="pt", device="cpu", backend="pread")
        except TypeError:  # safetensors < 0.7: no backend choice, memory-mapped
            return safe_open(name, framework="pt", device="cpu")


class Checkpoint:
    """A Hugging Face checkpoint folder: its config and where each tensor lives.

    ``Checkpoint(path)`` reads ``config.json``, the shard index (or the single
    ``model.safetensors``, or every ``*.safetensors`` when there is neither) and every shard
    header. `info` and `has` answer from the headers; `reader` loads data.

    ``require_shards=False`` accepts shards that are not there (a Hub download of some layers,
    or ``config.json`` with or without the index alone, for ``--dry-run``): the headers of the
    shards present are read, `has` also answers from the index, and `in_header` tells which
    tensors have a header.
    """

    def __init__(self, path: str | Path, *, require_shards: bool = True) -> None:
        self.root = Path(path)
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(
                f"{self.root}: is a file; expected the checkpoint folder (config.json + safetensors)"
            )
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: checkpoint folder not found")
        self.config = self._read_config()
        index = self.root / INDEX_NAME
        self._has_index = index.is_file()
        self._index_map: dict[str, str] = self._read_index(index) if self._has_index else {}
        self.files = self._shard_files(require_shards)
        self.present = [f for f in self.files if (self.root / f).is_file()]
        self._infos: dict[str, TensorInfo] = {}
        for fname in self.present:
            header, _ = read_safetensors_header(self.root / fname)
            for name, entry in header.items():
                if name != "__metadata__":
                    self._infos[name] = TensorInfo(
                        name, fname, entry["dtype"], tuple(entry["shape"])
                    )

    # -- folder structure ---------------------------------------------------------------------
    def _read_config(self) -> dict[str, Any]:
        path = self.root / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"{path}: not found (a Hugging Face checkpoint has a config.json)"
            )
        config = read_json(path, CheckpointError)
        if not isinstance(config, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return config

    def _read_index(self, index: Path) -> dict[str, str]:
        data = read_json(index, CheckpointError)
        try:
            weight_map = data["weight_map"]
            return {str(k): str(v) for k, v in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index}: not a valid index (expected a 'weight_map' object)"
            ) from None

    def _shard_files(self, require_shards: bool) -> list[str]:
        if self._index_map:
            names = sorted(set(self._index_map.values()))
            for name in names:
                if require_shards and not (self.root / name).is_file():
                    raise CheckpointError(
                        f"{self.root / name}: shard listed in {INDEX_NAME} is missing"
                    )
            return names
        if (self.root / SINGLE_NAME).is_file():
            return [SINGLE_NAME]
        names = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not names and require_shards:
            what = f"{INDEX_NAME} lists none" if self._has_index else f"and no {INDEX_NAME}"
            raise CheckpointError(
                f"{self.root}: no safetensors files ({what}; --dry-run plans from config.json)"
            )
        return names

    @property
    def index_name(self) -> str | None:
        return INDEX_NAME if self._has_index else None

    @property
    def indexed(self) -> bool:
        """Whether the tensor names are known without headers (an index that lists some)."""
        return bool(self._index_map)

    def file_of(self, name: str) -> str | None:
        """The shard holding `name`, from its header or the index."""
        info = self._infos.get(name)
        return info.file if info is not None else self._index_map.get(name)

    # -- headers ------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._infos or name in self._index_map

    def in_header(self, name: str) -> bool:
        """Whether a present shard's header describes `name` (shape and dtype known)."""
        return name in self._infos

    def names(self) -> list[str]:
        """Every tensor name in the shard headers and the index."""
        return list(dict.fromkeys([*self._infos, *self._index_map]))

    def info(self, name: str) -> TensorInfo:
        """Header entry of `name`; `MissingTensorError` when no shard holds it."""
        try:
            return self._infos[name]
        except KeyError:
            pass
        listed = self._index_map.get(name)
        if listed and listed not in self.present:
            where = f"{INDEX_NAME} maps it to {listed}, which is not here (not downloaded?)"
        elif listed:
            where = f"{INDEX_NAME} maps it to {listed}, which does not hold it"
        else:
            where = f"not in any of the {len(self.files)} shard(s)"
        raise MissingTensorError(f"{name}: tensor missing from the checkpoint ({where})") from None

    @contextmanager
    def reader(self) -> Iterator[CheckpointReader]:
        """A scope in which tensor data can be read; every shard opened in it is closed after."""
        rd = CheckpointReader(self)
        try:
            yield rd
        finally:
            rd.close()


class CheckpointReader:
    """Loads tensors from the shards of a `Checkpoint`, opening each shard once per scope."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._open: dict[str, Any] = {}

    def _handle(self, fname: str) -> Any:
        h = self._open.get(fname)
        if h is None:
            path = self.ckpt.root / fname
            try:
                h = open_safetensors(path).__enter__()
            except Exception as exc:  # safetensors raises its own error type
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors file ({exc})"
                ) from None
            self._open[fname] = h
        return h

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        info = self.ckpt.info(name)
        try:
            return self._handle(info.file).get_tensor(name)
        except MxcliError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"{self.ckpt.root / info.file}: cannot read {name} ({exc})"
            ) from None

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` along dim 0, reading only those rows."""
        info = self.ckpt.info(name)
        try:
            return self._handle(info.file).get_slice(name)[start:stop]
        except MxcliError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"{self.ckpt.root / info.file}: cannot read {name} ({exc})"
            ) from None

    def close(self) -> None:
        handles, self._open = self._open, {}
        for h in handles.values():
            try:
                h.__exit__(None, None, None)
            except Exception:  # closing must never mask the error that ended the scope
                pass
