"""Verification reports: a rich table for people, JSON for scripts, JUnit XML for CI."""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mxcli.fsutil import atomic_output
from mxcli.verification.compare import TensorReport


@dataclass
class CaseResult:
    """All comparisons of one case (a suite case, or ``golden`` for ``verify OUT --golden``)."""

    case: str
    kernel: str
    reports: list[TensorReport] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    # why the case did not run: the chosen kernel refuses the combination (issue 20)
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(r.passed for r in self.reports)

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "kernel": self.kernel,
            "passed": self.passed,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 4),
            "error": self.error,
            "info": self.info,
            "tensors": [r.to_json() for r in self.reports],
        }


def summary(results: Sequence[CaseResult]) -> dict[str, int]:
    checks = [r for c in results for r in c.reports]
    return {
        "cases": len(results),
        "cases_failed": sum(not c.passed for c in results),
        "cases_skipped": sum(c.skipped is not None for c in results),
        "checks": len(checks),
        "checks_failed": sum(not r.passed for r in checks),
    }


def to_json(results: Sequence[CaseResult], **extra: Any) -> dict[str, Any]:
    s = summary(results)
    return {
        "passed": s["cases_failed"] == 0,
        "summary": s,
        **extra,
        "cases": [c.to_json() for c in results],
    }


def _fmt(v: float | None, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    return format(v, spec)


def _row_cells(r: TensorReport) -> list[str]:
    """The short columns of one check: verdict, tensor, cosine, max abs, max rel."""
    return [
        "pass" if r.passed else "FAIL",
        r.name,
        _fmt(r.cosine, ".6f"),
        _fmt(r.max_abs),
        _fmt(r.max_rel),
    ]


def _details(r: TensorReport) -> str:
    """What does not fit a short column: tolerance, mismatch count, exactness, message."""
    parts = [f"tolerance {r.tolerance}"]
    if r.numel:
        parts.append(f"{r.mismatches}/{r.numel} out of tolerance")
    if r.tolerance != "bit-exact":
        parts.append("bit-exact" if r.bit_exact else "not bit-exact")
    if r.message:
        parts.append(r.message)
    return "; ".join(parts)


def _wrap(text: str, width: int, indent: str, more: str | None = None) -> list[str]:
    """Wrap at spaces only: a number or a name is never split (a word longer than the line
    runs past it rather than break)."""
    import textwrap

    return textwrap.wrap(
        text,
        width=max(width, len(indent) + 20),
        initial_indent=indent,
        subsequent_indent=indent if more is None else more,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


_HEADERS = ["", "tensor", "cosine", "max abs", "max rel"]
_RIGHT = {2, 3, 4}  # numeric columns


def render_table(
    results: Sequence[CaseResult], console: Any, *, title: str = "mxcli verify"
) -> None:
    """Print the checks in a layout that fits the console (80 columns included) without
    splitting a number or a name: per case and check kind a heading, then one row per tensor
    with short columns (verdict, tensor, cosine, max abs, max rel) and its details below
    (tolerance, mismatch count, exactness, message), wrapped at spaces. Then a verdict line.
    """
    from rich.text import Text

    width = int(getattr(console, "width", 80) or 80)
    rows: list[
        tuple[str, str | None, list[str] | None, str]
    ] = []  # (heading, error, cells, details)
    for c in results:
        if c.error is not None:
            rows.append((c.case, c.error, None, ""))
            continue
        if c.skipped is not None:
            rows.append((c.case, f"\0{c.skipped}", None, ""))
        for r in c.reports:
            rows.append(
                (f"{c.case}: {r.check}" if r.check else c.case, None, _row_cells(r), _details(r))
            )
    cell_rows = [cells for _, _, cells, _ in rows if cells is not None]
    widths = [max(len(x) for x in col) for col in zip(_HEADERS, *cell_rows, strict=False)]
    # the numbers move to the details line when the tensor name leaves them no room
    full = sum(widths) + 2 * len(widths) <= width
    ncols = len(_HEADERS) if full else 2

    def line(cells: list[str]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells[:ncols], widths[:ncols], strict=True)):
            out.append(cell.rjust(w) if i in _RIGHT else cell.ljust(w))
        return ("  " + "  ".join(out)).rstrip()

    def styled(text: str, verdict: str) -> Text:
        t = Text(text)
        start = text.index(verdict)
        t.stylize("green" if verdict == "pass" else "bold red", start, start + len(verdict))
        return t

    for text in _wrap(title, width, "", "    "):
        console.print(Text(text, style="bold"), soft_wrap=True)
    console.print(Text(line(_HEADERS), style="bold"), soft_wrap=True)
    heading = None
    for head, error, cells, details in rows:
        if error is not None and error.startswith("\0"):
            for text in _wrap(f"skip {head}: {error[1:]}", width, "  "):
                console.print(Text(text, style="yellow"), soft_wrap=True)
            heading = None
            continue
        if error is not None:
            for i, text in enumerate(_wrap(f"ERROR {head}: {error}", width, "  ")):
                console.print(styled(text, "ERROR") if i == 0 else Text(text), soft_wrap=True)
            heading = None
            continue
        assert cells is not None
        if head != heading:
            console.print(Text(f"{head}", style="bold cyan"), soft_wrap=True)
            heading = head
        console.print(styled(line(cells), cells[0]), soft_wrap=True)
        if not full:
            details = f"cosine {cells[2]}, max abs {cells[3]}, max rel {cells[4]}; " + details
        for text in _wrap(details, width, " " * 8):
            console.print(Text(text, style="dim"), soft_wrap=True)
    s = summary(results)
    if s["cases_failed"]:
        console.print(
            f"[red bold]FAILED[/]: {s['cases_failed']} of {s['cases']} case(s), "
            f"{s['checks_failed']} of {s['checks']} check(s) failed"
        )
    else:
        skipped = (
            f", {s['cases_skipped']} not supported by this kernel" if s["cases_skipped"] else ""
        )
        console.print(
            f"[green bold]PASSED[/]: {s['cases']} case(s), {s['checks']} check(s){skipped}"
        )


def junit_xml(results: Sequence[CaseResult], *, suite: str = "mxcli.verify") -> str:
    """JUnit XML: one testcase per compared tensor (classname = case), errors as <error>."""
    cases: list[ET.Element] = []
    failures = errors = skipped = 0
    total_time = 0.0
    for c in results:
        total_time += c.seconds
        if c.skipped is not None and c.error is None and not c.reports:
            tc = ET.Element(
                "testcase", classname=f"{suite}.{c.case}", name="run", time=f"{c.seconds:.3f}"
            )
            ET.SubElement(tc, "skipped", message=c.skipped)
            skipped += 1
            cases.append(tc)
            continue
        if c.error is not None:
            tc = ET.Element(
                "testcase", classname=f"{suite}.{c.case}", name="run", time=f"{c.seconds:.3f}"
            )
            ET.SubElement(tc, "error", message=c.error).text = c.error
            errors += 1
            cases.append(tc)
            continue
        share = c.seconds / max(len(c.reports), 1)
        for r in c.reports:
            name = f"{r.check}: {r.name}" if r.check else r.name
            tc = ET.Element(
                "testcase", classname=f"{suite}.{c.case}", name=name, time=f"{share:.3f}"
            )
            detail = (
                f"max_abs={_fmt(r.max_abs)} max_rel={_fmt(r.max_rel)} cosine={_fmt(r.cosine, '.6f')} "
                f"mismatches={r.mismatches}/{r.numel} bit_exact={r.bit_exact} "
                f"tolerance={r.tolerance}"
            )
            if not r.passed:
                failures += 1
                ET.SubElement(tc, "failure", message=r.message or "out of tolerance").text = detail
            else:
                ET.SubElement(tc, "system-out").text = detail
            cases.append(tc)
    root = ET.Element("testsuites")
    ts = ET.SubElement(
        root,
        "testsuite",
        name=suite,
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        skipped=str(skipped),
        time=f"{total_time:.3f}",
    )
    ts.extend(cases)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(
    results: Sequence[CaseResult],
    path: str | os.PathLike[str],
    *,
    suite: str = "mxcli.verify",
    force: bool = True,
) -> None:
    """Write the JUnit report atomically (an existing report is replaced only with `force`)."""
    text = junit_xml(results, suite=suite)
    with atomic_output(path, force=force) as tmp:
        tmp.write_text(text, encoding="utf-8")
