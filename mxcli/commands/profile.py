"""``mxcli profile <kernel>``: the per-engine cost model of an NKI kernel, without hardware.

The kernel runs once in the interpreter's check-only mode; the issued instructions are costed
with the documented engine figures (`mxcli.nkisim.cost`) and list-scheduled
(`mxcli.nkisim.schedule`). ``--trace`` writes the timeline as Chrome-trace JSON for Perfetto.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._kernel_flags import (
    Lazy,
    click_command,
    command,
    lazy_group,
    merge_params,
    merged_param,
)
from mxcli.commands._shared import (
    Force,
    KernelPath,
    Steps,
    aligned_rows,
    global_options,
    kernel_lines,
    print_json,
    stdout_console,
    wrap_items,
)
from mxcli.errors import InputError
from mxcli.kernels.spec import KernelSpec

app = typer.Typer(
    name="profile",
    cls=lazy_group((), lambda: _generated()),  # the kernels in registration order, then calibrate
    help="Estimate a kernel's time per engine, without hardware.\n\nThe kernel runs once in the "
    "interpreter's check-only mode; its instructions are costed from the documented engine "
    "figures and list-scheduled. One subcommand per kernel; its shape flags default to the "
    "kernel API's values where it has them.\n\nWith Trn3 time: 'mxcli profile --calibrate "
    "MEASURED.json -o CAL.json' (no kernel) refits the model's fitted figures to measured "
    "latencies and writes a calibration file; later runs take it with --calibration CAL.json.",
    no_args_is_help=True,
    subcommand_metavar="[COMMAND [ARGS]...]",  # none with --calibrate
)

InputArg = Annotated[
    Path | None,
    typer.Argument(
        help="make-inputs .safetensors file; or give the shape flags instead.", show_default=False
    ),
]
TraceOpt = Annotated[
    Path | None,
    typer.Option("--trace", help="Write the timeline as Chrome-trace JSON (open in Perfetto).",
                 show_default=False),
]  # fmt: skip
LncOpt = Annotated[int, typer.Option("--lnc", help="LNC degree: 1 or 2 cores.")]
TargetOpt = Annotated[str, typer.Option("--target", help="Cost tables: trn3 (trn2 lacks MX ops).")]
TopOpt = Annotated[int, typer.Option("--top", help="Source lines to list, by engine time.")]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option("--calibration", help="Calibration file (from 'profile --calibrate') giving the "
                 "fitted figures' values and ranges.", show_default=False),
]  # fmt: skip

KernelsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--kernel",
        help="NKI kernel: mxcli (default), nkilib or MODULE:FUNCTION; give it twice "
        "(--kernel mxcli --kernel nkilib) to compare two kernels side by side.",
        show_default=False,
    ),
]


def _shape_or_file(input: Path | None, shape: dict[str, Any]) -> None:
    given = [k for k, v in shape.items() if v is not None]
    if input is not None and given:
        raise InputError(
            f"input: give a file or shape flags, not both (got {input} and --{given[0]})"
        )
    if input is None:
        missing = [k for k, v in shape.items() if v is None]
        if missing:
            flag = missing[0].replace("_", "-")
            raise InputError(f"{missing[0]}: --{flag} is required without an input file")


def _trace_paths(trace: Path | None, labels: list[str]) -> list[Path | None]:
    """One trace file per kernel: `trace` itself for one, ``name.<kernel>.json`` for several."""
    if trace is None:
        return [None] * len(labels)
    if len(labels) == 1:
        return [trace]
    out: list[Path | None] = []
    for i, label in enumerate(labels):
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label) or f"k{i}"
        out.append(trace.with_name(f"{trace.stem}.{i + 1}-{safe}{trace.suffix or '.json'}"))
    return out


def _write_traces(profiles: list[Any], paths: list[Path | None], force: bool) -> None:
    from mxcli.fsutil import atomic_output

    for kp, path in zip(profiles, paths, strict=True):
        if path is not None:
            with atomic_output(path, force) as tmp:
                tmp.write_text(json.dumps(kp.profile.chrome_trace()))


def comparison(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each kernel's schedule and lower bound against the first one's (ratio = other / first),
    with the ratio's range and a verdict when the summaries carry ranges."""
    from mxcli.kernels import calibrating

    base = summaries[0]
    rows = []
    for s in summaries:
        rows.append(
            {
                "kernel": s.get("nki_kernel", {}).get("kernel", "mxcli"),
                "schedule_us": s["schedule_us"],
                "lower_bound_us": s["lower_bound_us"],
                "bottleneck": s["bottleneck"],
                "schedule_ratio": s["schedule_us"] / base["schedule_us"]
                if base["schedule_us"]
                else None,
                "lower_bound_ratio": (
                    s["lower_bound_us"] / base["lower_bound_us"] if base["lower_bound_us"] else None
                ),
            }
        )
    for s, r in list(zip(summaries, rows, strict=True))[1:]:
        if "range" in s and "range" in base:  # issue 29 item 5: figures shared by both
            r["range"] = calibrating.comparison_ranges(s["range"], base["range"])
            r["verdict"] = calibrating.verdict(
                s["range"], base["range"], r["kernel"], rows[0]["kernel"]
            )
    out: dict[str, Any] = {"baseline": rows[0]["kernel"], "kernels": rows}
    by = {r["kernel"]: r for r in rows}
    if "mxcli" in by and "nkilib" in by and by["nkilib"]["schedule_us"]:
        # issue 29 item 4: our backward against AWS's, both estimated by the same model
        out["ours_over_aws"] = {
            "schedule": by["mxcli"]["schedule_us"] / by["nkilib"]["schedule_us"],
            "lower_bound": by["mxcli"]["lower_bound_us"] / by["nkilib"]["lower_bound_us"],
        }
    return out


def _finish(summaries: list[dict[str, Any]], json_out: bool, quiet: bool = False) -> None:
    if json_out:
        if len(summaries) == 1:
            print_json(summaries[0])
        else:
            print_json({"profiles": summaries, "comparison": comparison(summaries)})
        return
    if quiet:
        return
    for s in summaries:
        print_report(s)
    if len(summaries) > 1:
        con = stdout_console()
        cmp = comparison(summaries)
        con.print(f"[bold]side by side[/] (ratio against {cmp['baseline']}):", highlight=False)
        for r in cmp["kernels"]:
            ratio = r["schedule_ratio"]
            lb = r["lower_bound_ratio"]
            con.print(
                f"  {r['kernel']:<24} schedule {r['schedule_us']:10.1f} us  x{ratio:.3f}   "
                f"lower bound {r['lower_bound_us']:10.1f} us  x{lb:.3f}   ({r['bottleneck']})",
                highlight=False,
                markup=False,
            )
            if "range" in r:
                x = r["range"]["schedule_ratio"]
                con.print(f"    schedule ratio range x{x['low']:.3f}..x{x['high']:.3f} "
                          f"(figures shared): {r['verdict']}", highlight=False, markup=False)  # fmt: skip
        if "ours_over_aws" in cmp:
            r = cmp["ours_over_aws"]
            con.print(
                f"  ours / AWS's (same model): schedule {r['schedule']:.3f}, lower bound "
                f"{r['lower_bound']:.3f}",
                highlight=False,
                markup=False,
            )


def print_report(s: dict[str, Any]) -> None:
    """The human-readable report of a profile summary, fitting the terminal: lists wrap between
    items, and the source lines are shown relative to their common folder."""
    import os

    from rich.text import Text

    con = stdout_console()

    def out(line: str) -> None:
        con.print(Text(line), soft_wrap=True)

    def items(head: str, parts: list[str]) -> None:
        for line in wrap_items(head, parts, con.width):
            out(line)

    con.print(Text(f"{s['kernel']} on {s['target']} (LNC={s['lnc']}), cost-model estimate",
                   style="bold"), soft_wrap=True)  # fmt: skip
    if "nki_kernel" in s:
        for line in kernel_lines("  kernel: ", s["nki_kernel"], con.width):
            out(line)
    items("  instructions:", [f"{k} {v}" for k, v in sorted(s["instructions"].items())])
    items("  busy per engine (us, busiest core):",
          [f"{k} {v:.1f}" for k, v in s["busy_us"].items()])  # fmt: skip
    out(f"  bottleneck: {s['bottleneck']}; lower bound {s['lower_bound_us']:.1f} us; "
        f"list schedule {s['schedule_us']:.1f} us")  # fmt: skip
    if "range" in s:
        rs, rl = s["range"]["schedule_us"], s["range"]["lower_bound_us"]
        items("  range over the assumed/fitted figures:",
              [f"list schedule {rs['low']:.1f}..{rs['high']:.1f} us",
               f"lower bound {rl['low']:.1f}..{rl['high']:.1f} us"])  # fmt: skip
        odd = sorted(set(rs["non_monotone"]) | set(rl["non_monotone"]))
        if odd:  # the corners are then not guaranteed extremes (nkisim/calibration.py)
            out(f"    not monotone in {', '.join(odd)}: the range may not hold every setting")
    u, ul = s["pe_utilization"], s["pe_utilization_at_lower_bound"]
    out(f"  Tensor engine utilization: {u['total']:.3f} of peak (MX {u['mx']:.3f}, "
        f"BF16 {u['bf16']:.3f})")  # fmt: skip
    out(f"    at the lower bound: {ul['total']:.3f}")
    if s.get("pe_start"):
        ps = s["pe_start"]
        out(f"    first Tensor-engine instruction at {ps['us']:.1f} us "
            f"({100 * ps['share']:.0f}% of the list schedule)")  # fmt: skip
    d = s["dma"]
    out(f"  DMA: {d['bytes'] / 1e6:.1f} MB ({d['hbm_bytes'] / 1e6:.1f} MB HBM) in "
        f"{d['descriptors']} contiguous runs")  # fmt: skip
    if "plan_padding" in s:
        p = s["plan_padding"]
        items("  plan padding:", [f"{p['pairs']} routed pairs in {p['blocks']} blocks x "
                                  f"{p['block_size']} = {p['positions']} positions",
                                  f"{p['efficiency']:.3f} useful"])  # fmt: skip
    lines = s["top_lines"]
    if lines:
        sources = [str(r["source"]) for r in lines]
        folder = os.path.commonpath([x.rsplit(":", 1)[0] for x in sources]) if sources else ""
        if folder and not os.path.isdir(folder):  # one file: keep its name on every row
            folder = os.path.dirname(folder)
        head = "  top source lines (engine time, all cores)"
        if not folder:
            out(head + ":")
        elif len(head) + len(folder) + 6 <= con.width:
            out(f"{head} in {folder}/:")
        else:
            out(head)
            out(f"    in {folder}/:")
        rows = [[f"{r['busy_us']:.1f} us", f"{100 * r['share']:.1f}%", str(r["track"]),
                 str(r["op"]), f"x{r['count']}",
                 os.path.relpath(src, folder) if folder else src]
                for r, src in zip(lines, sources, strict=True)]  # fmt: skip
        for line in aligned_rows(rows, right=frozenset({0, 1})):
            if len(line) + 4 <= con.width:
                out("    " + line)
            else:  # a long op name: the source line goes below its row
                head, src = line.rsplit("  ", 1)
                out("    " + head.rstrip())
                out("      " + src.strip())
    for line in s.get("uninit_reads", ()):
        out(f"  never-written read: {line}")
    if "trace" in s:
        out(f"  wrote {s['trace']}")


def _run(kernel: str, input: Path | None, tensors_kwargs: Any, shape: dict[str, Any], lnc: int,
         target: str, trace: Path | None, force: bool, json_out: bool, top: int,
         kernels: list[str] | None = None, kernel_path: str | None = None,
         quiet: bool = False, calibration: Path | None = None) -> None:  # fmt: skip
    from mxcli.fsutil import check_output_path, refuse_inputs
    from mxcli.kernels import calibrating, profiling, selection

    if top < 0:
        raise InputError(f"top: expected a non-negative integer, got {top}")
    choices = [
        selection.parse_implementation(k, kernel, kernel_path) for k in (kernels or ["mxcli"])
    ]
    paths = _trace_paths(trace, [c.label for c in choices])
    for path in paths:
        if path is not None:
            check_output_path(path, force)  # fail before the (long) run
            refuse_inputs(path, [("input file", input)])
    for c in choices:
        selection.describe(c)  # a missing module is one line before any work
    cal = calibrating.load_calibration(calibration) if calibration is not None else None
    if input is not None:
        tensors, kwargs = profiling.file_inputs(kernel, input)
        shape = {"input": str(input)}
    else:
        tensors, kwargs = tensors_kwargs()
    with Steps(quiet) as steps, steps.step(f"Profiling {kernel}"):
        profiles = [
            profiling.profile_kernel(
                kernel,
                tensors,
                kwargs,
                lnc=lnc,
                target=target,
                shape=shape,
                nki_kernel=c,
                calibration=cal,
            )
            for c in choices
        ]
        for kp in profiles:  # each estimate's range (issue 29 item 5), under the spinner
            kp.ranges()
    _write_traces(profiles, paths, force)
    summaries = []
    for kp, path in zip(profiles, paths, strict=True):
        s = kp.summary(top)
        if path is not None:
            s["trace"] = str(path)
        summaries.append(s)
    _finish(summaries, json_out, quiet)


def profile_command(spec: KernelSpec, part: Any) -> Callable[..., None]:
    """``profile <short>``: its shape flags generated from the kernel's profile part (a flag
    without a default is required without an input file)."""
    merged = merge_params([(spec, part.PARAMS)])
    required = [p.name for p in part.PARAMS if p.default is None]

    def run(**kw: Any) -> None:
        from mxcli.kernels import profiling

        opts = global_options(kw["ctx"])  # the root's --json / --quiet
        shape = {n: kw[n] for n in required}
        _shape_or_file(kw["input"], shape)
        full = {p.name: kw[p.name] for p in part.PARAMS}
        _run(spec.short, kw["input"], lambda: profiling.shape_inputs(spec.name, full), full,
             kw["lnc"], kw["target"], kw["trace"], kw["force"], opts.json, kw["top"],
             kw["kernel"], kw["kernel_path"], opts.quiet, kw["calibration"])  # fmt: skip

    flags = ", ".join(f"--{n.replace('_', '-')}" for n in required)
    flags = " and ".join(flags.rsplit(", ", 1)) if required else ""
    note = getattr(part, "NOTE", "")
    doc = (
        f"{_summary(spec.name)}\n\n"
        f"Give a make-inputs file{', or ' + flags if flags else ''}.{' ' + note if note else ''}"
    )
    params: list[tuple[str, Any, Any]] = [
        ("ctx", typer.Context, inspect.Parameter.empty),  # the root's global options
        ("input", InputArg, None),
        *(merged_param(m, {spec.short: spec}) for m in merged),
        ("lnc", LncOpt, 2),
        ("target", TargetOpt, "trn3"),
        ("trace", TraceOpt, None),
        ("top", TopOpt, 10),
        ("kernel", KernelsOpt, None),
        ("kernel_path", KernelPath, None),
        ("calibration", CalibrationOpt, None),
        ("force", Force, False),
    ]
    return command(run, spec.short, doc, params)


def _summary(name: str) -> str:
    """The first line of ``profile <short>``'s help (``profile --help`` lists it)."""
    return f"Profile {name} from a file or shape flags."


def _generated() -> dict[str, Lazy]:
    """``profile <short>`` for every registered kernel with a profile part, built when asked
    for (listed from the kernels' identities, which load no kernel)."""
    from mxcli.kernels.spec import get_spec, kernel_identities

    def build(short: str) -> Any:
        spec = get_spec(short)
        return click_command(profile_command(spec, spec.profile()), short)

    return {
        k.short: Lazy(_summary(k.name), functools.partial(build, k.short))
        for k in kernel_identities()
        if "profile" in k.parts
    }


CalibrateOpt = Annotated[
    Path | None,
    typer.Option("--calibrate", metavar="MEASURED.json", help="Measured latencies (a JSON list "
                 "of {kernel, shape, lnc, us, kwargs?, nki_kernel?}): refit the fitted figures "
                 "to them and write a calibration file (-o); give no kernel with it.",
                 show_default=False),
]  # fmt: skip
OutputOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", metavar="CAL.json", help="--calibrate: the calibration file "
                 "to write (JSON), for later runs' --calibration.", show_default=False),
]  # fmt: skip
CalibrateForce = Annotated[
    bool,
    typer.Option("--force", "-f", help="--calibrate: replace the -o file (only a calibration "
                 "file mxcli wrote)."),
]  # fmt: skip


@app.callback(invoke_without_command=True)
def profile_group(
    ctx: typer.Context,
    calibrate: CalibrateOpt = None,
    output: OutputOpt = None,
    force: CalibrateForce = False,
) -> None:
    """``mxcli profile --calibrate MEASURED.json -o CAL.json`` (issue 29 item 7): refit the
    model's fitted figures to measured latencies. Each measured launch runs once in check-only
    mode; its recorded instructions are re-costed while the fitted figures move within their
    ranges (least squares on log time). Later runs take the result with --calibration FILE.
    Without --calibrate the group only dispatches to its kernel subcommands."""
    kernel = ctx.invoked_subcommand
    if calibrate is None:
        if output is not None:
            raise InputError(f"--output: only with --calibrate MEASURED.json (got -o {output} "
                             f"without --calibrate)")  # fmt: skip
        if force:  # `mxcli profile --force bwd --trace t.json`: the kernel's own --force
            raise InputError("--force: before a kernel's name only with --calibrate (got it "
                             "without --calibrate; a kernel's --trace takes --force after the "
                             "kernel's name)")  # fmt: skip
        if kernel is None:  # `mxcli profile --json`: nothing asked for
            ctx.fail("Missing command (a kernel, or --calibrate MEASURED.json).")
        return
    if kernel is not None:
        raise InputError(f"--calibrate: refits from the measurements file alone; give no kernel "
                         f"with it (got --calibrate {calibrate} and '{kernel}')")  # fmt: skip
    if output is None:
        raise InputError(f"--output: -o CAL.json is required with --calibrate (got --calibrate "
                         f"{calibrate} and no -o)")  # fmt: skip
    _calibrate(calibrate, output, force, global_options(ctx))


def _calibrate(measured: Path, output: Path, force: bool, opts: Any) -> None:
    from mxcli.fsutil import refuse_inputs
    from mxcli.kernels import calibrating, measurements

    json_out, quiet = opts.json, opts.quiet
    calibrating.check_replaceable(output, force)  # before the (long) runs
    refuse_inputs(output, [("measurements file", measured)])
    ms = measurements.read_measurements(measured)
    with Steps(quiet) as steps, steps.step(f"Recording {len(ms)} measured launches"):
        profiles = [measurements.record(m, f"{measured}: measurement {i}")
                    for i, m in enumerate(ms)]  # fmt: skip
    with Steps(quiet) as steps, steps.step("Fitting"):
        result = calibrating.calibrate(profiles, ms)
    doc = calibrating.calibration_doc(result, ms)
    calibrating.write_calibration(output, doc, force)
    if json_out:
        print_json({**doc, "output": str(output)})
    elif not quiet:
        con = stdout_console()
        for k, v in doc["figures"].items():
            lo, hi = doc["ranges"][k]
            con.print(f"{k} = {v:.6g} (range {lo:.6g}..{hi:.6g}; was {doc['start'][k]:.6g})",
                      highlight=False, markup=False)  # fmt: skip
        for m in doc["measurements"]:
            con.print(f"  {m['kernel']} {m['shape']}: measured {m['us']:.1f} us, model "
                      f"{m['predicted_us']:.1f} us ({100 * m['log_residual']:+.1f}% log)",
                      highlight=False, markup=False)  # fmt: skip
        con.print(f"wrote {output}", highlight=False, markup=False)
