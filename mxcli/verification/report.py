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

    @property
    def passed(self) -> bool:
        return self.error is None and all(r.passed for r in self.reports)

    def to_json(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "kernel": self.kernel,
            "passed": self.passed,
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


def render_table(
    results: Sequence[CaseResult], console: Any, *, title: str = "mxcli verify"
) -> None:
    """Print one row per compared tensor, grouped by case, then a one-line verdict."""
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for col in (
        "case",
        "check",
        "tensor",
        "max abs",
        "max rel",
        "cosine",
        "mismatch",
        "exact",
        "tolerance",
        "result",
    ):
        numeric = col in ("max abs", "max rel", "cosine", "mismatch")
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")
    for c in results:
        if c.error is not None:
            table.add_row(c.case, "-", "-", "", "", "", "", "", "", f"[red]ERROR[/] {c.error}")
            continue
        first = True
        for r in c.reports:
            verdict = "[green]pass[/]" if r.passed else "[red]FAIL[/]"
            if r.message:
                verdict += f" [dim]{r.message}[/]"
            mism = f"{r.mismatches}/{r.numel}" if r.numel else "-"
            table.add_row(
                c.case if first else "",
                r.check,
                r.name,
                _fmt(r.max_abs),
                _fmt(r.max_rel),
                _fmt(r.cosine, ".6f"),
                mism,
                "yes" if r.bit_exact else "no",
                r.tolerance,
                verdict,
            )
            first = False
        table.add_section()
    console.print(table)
    s = summary(results)
    if s["cases_failed"]:
        console.print(
            f"[red bold]FAILED[/]: {s['cases_failed']} of {s['cases']} case(s), "
            f"{s['checks_failed']} of {s['checks']} check(s) failed"
        )
    else:
        console.print(f"[green bold]PASSED[/]: {s['cases']} case(s), {s['checks']} check(s)")


def junit_xml(results: Sequence[CaseResult], *, suite: str = "mxcli.verify") -> str:
    """JUnit XML: one testcase per compared tensor (classname = case), errors as <error>."""
    cases: list[ET.Element] = []
    failures = errors = 0
    total_time = 0.0
    for c in results:
        total_time += c.seconds
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
        skipped="0",
        time=f"{total_time:.3f}",
    )
    ts.extend(cases)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(
    results: Sequence[CaseResult], path: str | os.PathLike[str], *, suite: str = "mxcli.verify"
) -> None:
    """Write the JUnit report atomically (an existing report is replaced)."""
    text = junit_xml(results, suite=suite)
    with atomic_output(path, force=True) as tmp:
        tmp.write_text(text, encoding="utf-8")
