"""Which share of the layers one process converts when a launcher runs N of them (multi-host prep).

A shard is ``I/N`` (0-based I). It comes from ``--shard I/N`` or, when the flag is absent, from the
environment of the launcher users already run (`from_env`):

- torchrun: ``RANK`` / ``WORLD_SIZE``;
- Slurm: ``SLURM_PROCID`` / ``SLURM_NTASKS`` (tasks of an ``srun`` step) and
  ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT`` (array jobs; ``SLURM_ARRAY_TASK_MIN`` and
  ``_STEP`` are honoured); both together give ``array_index * ntasks + procid`` of
  ``array_count * ntasks``.

`partition` splits the layers into N contiguous runs balanced by bytes (not by count): layer i
goes to the shard whose byte range holds the middle of its bytes. It is a pure function of the
layer list, their sizes and N, so every process computes the same split without talking to the
others, and the one that finishes last (or ``--finalize``) can name the shards still missing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mxcli.errors import InputError


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based), and where it came from (for messages)."""

    index: int
    count: int
    source: str = "--shard"

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise InputError(
                f"{self.source}: expected a shard I/N with 0 <= I < N, got {self.index}/{self.count}"
            )

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``"2/8"`` -> `Shard` (2, 8)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise InputError(f"--shard: expected I/N such as 0/4 (0-based), got {text!r}")
    return Shard(int(m.group(1)), int(m.group(2)))


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise InputError(f"{name}: expected an integer, got {v!r}") from None


def from_env(env: Mapping[str, str]) -> Shard | None:
    """The shard the launcher's environment gives this process, or None (not launched as one of
    several). torchrun's variables win over Slurm's (torchrun may run inside a Slurm job)."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        return Shard(rank, world, "RANK/WORLD_SIZE (torchrun)")
    procid, ntasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    a_id, a_count = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_COUNT")
    tasks = procid is not None and ntasks is not None
    array = a_id is not None and a_count is not None
    if not tasks and not array:
        return None
    t_i, t_n = (procid, ntasks) if tasks else (0, 1)
    a_i, a_n = 0, 1
    if array:
        assert a_id is not None and a_count is not None
        step = _int(env, "SLURM_ARRAY_TASK_STEP") or 1
        a_i, a_n = (a_id - (_int(env, "SLURM_ARRAY_TASK_MIN") or 0)) // step, a_count
    assert t_i is not None and t_n is not None
    names = " and ".join(
        n
        for n, on in (
            ("SLURM_PROCID/SLURM_NTASKS", tasks),
            ("SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT", array),
        )
        if on
    )
    return Shard(a_i * t_n + t_i, a_n * t_n, f"{names} (Slurm)")


def partition(layers: Sequence[int], sizes: Mapping[int, int], count: int) -> list[list[int]]:
    """Split `layers` (in order) into `count` contiguous runs balanced by ``sizes[layer]`` bytes.

    Layer i goes to shard ``floor(N * mid_i / total)``, ``mid_i`` being the middle of its byte
    range: so each shard's bytes are within one layer of ``total / N``, and equal layers split
    into counts that differ by at most one. Shards may be empty (more shards than layers).
    """
    if count < 1:
        raise InputError(f"shard count: expected >= 1, got {count}")
    out: list[list[int]] = [[] for _ in range(count)]
    sz = [max(0, int(sizes.get(L, 0))) for L in layers]
    if sum(sz) == 0:
        sz = [1] * len(layers)  # nothing known: by count
    total, acc = sum(sz), 0
    for L, s in zip(layers, sz, strict=True):
        k = min(count - 1, (count * (2 * acc + s)) // (2 * total))  # integers: no rounding
        out[k].append(L)
        acc += s
    return out


def describe(layers: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5,9"`` (``"none"`` when empty)."""
    parts: list[str] = []
    for L in layers:
        if parts and parts[-1].split("-")[-1] == str(L - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{L}"
        else:
            parts.append(str(L))
    return ",".join(parts) or "none"
