"""What ``verify --checkpoint`` shares between the formats (each format's verifier lives with
its exporter): the report, key/shape/dtype comparison against safetensors headers, SQNR, and
the plan OUT's recorded settings imply for its source.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError

# MXFP8 (E4M3, 32-element groups) of any weight keeps ~30 dB; far below means wrong data.
MIN_MXFP8_SQNR_DB = 20.0


class Report:
    """The ``verify --checkpoint`` report being built (`finish` returns it, ``passed`` set)."""

    def __init__(self, kind: str, out: Path, against: Path) -> None:
        self.data: dict[str, Any] = {
            "checkpoint": str(out),
            "against": str(against),
            "output_format": kind,
            "missing": [],
            "unexpected": [],
            "wrong": [],
            "unquantized": [],
            "numerics": {},
            "failures": [],
        }

    def fail(self, key: str, what: str) -> None:
        self.data[key].append(what)

    def numeric(self, name: str, exact: bool, sqnr: float | None, want_exact: bool) -> None:
        self.data["numerics"][name] = {"exact": exact, "sqnr_db": sqnr}
        if want_exact and not exact:
            self.data["failures"].append(f"{name}: not bit-exact against the source")
        elif not want_exact and sqnr is not None and sqnr < MIN_MXFP8_SQNR_DB:
            self.data["failures"].append(
                f"{name}: SQNR {sqnr:.1f} dB < {MIN_MXFP8_SQNR_DB:g} dB against the source"
            )

    def finish(self, **extra: Any) -> dict[str, Any]:
        d = self.data
        d.update(extra)
        d["passed"] = not (d["missing"] or d["unexpected"] or d["wrong"] or d["unquantized"]
                           or d["failures"])  # fmt: skip
        return d


def refuse_hashes_only(out: Path, kind: str, hashes_only: bool) -> None:
    """``--hashes-only`` on an export, which records no hashes: refused, one line."""
    if hashes_only:
        raise InputError(
            f"--hashes-only: {out} is a {kind} export, which records no hashes; run without "
            "--hashes-only (its codes and scales are re-derived from the source)"
        )


def sqnr(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float | None]:
    o, r = out.to(torch.float64), ref.to(torch.float64)
    exact = torch.equal(o, r)
    noise = float((o - r).pow(2).sum())
    signal = float(r.pow(2).sum())
    if noise == 0 or signal == 0 or not math.isfinite(noise):
        return exact, None
    return exact, round(10 * math.log10(signal / noise), 3)


def over_range(codes: torch.Tensor, fp8_max: float) -> int:
    """E4M3FN codes whose magnitude exceeds `fp8_max` (NaN codes aside)."""
    v = codes.view(torch.float8_e4m3fn).to(torch.float32).abs()
    return int((v > fp8_max).sum())


_HASH_CHUNK = 16 << 20


def file_hashes(path: Path) -> dict[str, str]:
    """sha256 of every tensor's stored bytes in a safetensors file (`tensor_sha256`'s
    definition), streamed from the file a chunk at a time (layers larger than memory)."""
    import hashlib

    from mxcli.weightprep.checkpoint import read_safetensors_header

    header, start = read_safetensors_header(path)
    out: dict[str, str] = {}
    with path.open("rb") as f:
        for name, e in header.items():
            if name == "__metadata__":
                continue
            a, b = (int(x) for x in e["data_offsets"])
            h = hashlib.sha256()
            f.seek(start + a)
            left = b - a
            while left > 0:
                buf = f.read(min(_HASH_CHUNK, left))
                if not buf:
                    break
                h.update(buf)
                left -= len(buf)
            out[name] = h.hexdigest()
    return out


def plan_for(against: Path, report: Report, **opts: Any) -> Any:
    """The plan OUT's settings imply for SRC; a divisibility error becomes a failure."""
    from mxcli.weightprep.plan import PrepOptions, build_plan

    try:
        return build_plan(against, PrepOptions(**opts))
    except InputError as exc:
        if "divisible" in str(exc):
            report.fail("wrong", f"divisibility: {exc}")
            return None
        raise


def headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from mxcli.weightprep.checkpoint import read_safetensors_header

    header, _ = read_safetensors_header(path)
    return {
        n: (e["dtype"], tuple(int(d) for d in e["shape"]))
        for n, e in header.items()
        if n != "__metadata__"
    }


def compare_keys(
    report: Report,
    expected: dict[str, tuple[str, tuple[int, ...]]],
    actual: dict[str, tuple[str, tuple[int, ...]]],
    where: str,
    describe: Any = None,
) -> list[str]:
    """Missing, unexpected and wrong (dtype/shape) keys; returns the names that match."""
    ok = []
    for n, (dt, shape) in expected.items():
        got = actual.get(n)
        label = f"{where}{n}" + (f" ({describe(n)})" if describe and describe(n) else "")
        if got is None:
            report.fail("missing", label)
        elif got[0] != dt and got[1] == shape and dt in ("F8_E4M3", "U32") and got[0] == "BF16":
            report.fail("unquantized", f"{label}: {got[0]}, expected {dt}")
        elif got != (dt, shape):
            report.fail(
                "wrong", f"{label}: expected {dt} {list(shape)}, got {got[0]} {list(got[1])}"
            )
        else:
            ok.append(n)
    for n in actual:
        if n not in expected:
            report.fail("unexpected", f"{where}{n} (not mapped to any source tensor)")
    return ok
