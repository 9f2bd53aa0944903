"""``verify``'s modes as library functions (`mxcli.verification.modes`, `mxcli.runs.verify_suite`),
called without the CLI: what the command prints is what they return (issue 32)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

from mxcli.errors import InputError
from mxcli.verification import modes


def test_files_mode_golden_and_inputs(files: dict[str, Path], tmp_path: Path) -> None:
    out, inp = files["prefill_out"], files["prefill"]
    gold = tmp_path / "golden.safetensors"
    shutil.copyfile(out, gold)  # the same bytes: passes, with a warning that it proves nothing
    steps: list[str] = []

    def step(description: str):  # type: ignore[no-untyped-def]
        steps.append(description)
        return contextlib.nullcontext()

    o = modes.files(out, golden=gold, inputs=inp, step=step)
    assert o.passed and [r.case for r in o.results] == ["golden", "exact"]
    assert o.title == f"mxcli verify {out} --golden {gold} --inputs {inp}"
    assert list(o.fields) == ["mode", "nki_kernel", "output", "golden", "inputs"]
    assert o.fields["mode"] == "files" and o.fields["golden"] == str(gold)
    assert o.warnings == [
        f"{out} and --golden {gold} are identical files (same sha256): a file compared with "
        "itself proves nothing"
    ]
    assert steps == [f"Comparing {out} with {gold}", f"Checking {out} against exact math of {inp}"]


def test_files_mode_fails_a_mismatched_pair(files: dict[str, Path]) -> None:
    o = modes.files(files["prefill_out"], inputs=files["noaux"])
    assert not o.passed  # the inputs of another run: their recorded hashes differ
    assert o.fields["golden"] is None and o.warnings == []


@pytest.mark.parametrize(
    "tol,message",
    [
        (modes.Tolerances(rtol=-1.0), "rtol: expected a value >= 0, got -1.0"),
        (modes.Tolerances(min_cosine=1.5), "min_cosine: expected a value in [-1, 1], got 1.5"),
        (
            modes.Tolerances(max_mismatch=2.0),
            "max_mismatch: expected a fraction in [0, 1], got 2.0",
        ),
        (modes.Tolerances(atol=float("nan")), "atol: expected a value >= 0, got nan"),
    ],
)
def test_tolerances_out_of_range_are_user_errors(tol: modes.Tolerances, message: str) -> None:
    with pytest.raises(InputError) as info:
        tol.overrides()
    assert str(info.value) == message


def test_tolerances_in_range_become_overrides() -> None:
    got = modes.Tolerances(rtol=0.1, atol=0.0, min_cosine=-1.0, max_mismatch=1.0).overrides()
    assert got == {"rtol": 0.1, "atol": 0.0, "min_cosine": -1.0, "max_mismatch_frac": 1.0}


def test_files_mode_needs_a_golden_or_inputs(files: dict[str, Path]) -> None:
    with pytest.raises(InputError, match="give OUT --golden GOLDEN, OUT --inputs IN"):
        modes.files(files["prefill_out"])


def test_case_rows_list_the_suite() -> None:
    from mxcli.verification.cases import select

    rows = list(modes.case_rows("quick", "prefill"))
    assert [r["case"] for r in rows] == [c.name for c in select("quick", "prefill")]
    assert rows and all(r["quick"] and r["case"].startswith("prefill/") for r in rows)


def test_verify_suite_on_the_reference() -> None:
    from mxcli.runs import verify_suite
    from mxcli.verification.cases import select

    cases = select("quick")[:1]
    seen: list[tuple[str, bool]] = []
    o = verify_suite(
        "quick", cases, backend="reference", on_case=lambda c, r: seen.append((c.name, r is None))
    )
    assert o.passed and [r.case for r in o.results] == [cases[0].name]
    assert seen == [(cases[0].name, True), (cases[0].name, False)]
    assert list(o.fields) == ["mode", "suite", "backends", "device", "nki_kernels", "uninit_reads"]
    assert o.fields["backends"] == {cases[0].kernel: "reference"}
    assert o.title == "mxcli verify --suite quick (backend: reference)"
