"""Per-engine cost-model estimate of mxcli's two NKI kernels at production shapes (no hardware).

Each kernel runs in the interpreter's check-only mode with instruction recording; every issued
instruction is costed with the documented Trn3 engine figures and list-scheduled
(`mxcli.nkisim.cost`, `mxcli.nkisim.schedule`; the figures and their sources are in README.md,
"Benchmarks"). Per kernel it prints the busy time of each engine, the bottleneck, the lower bound
(perfect overlap), the list-schedule estimate, the Tensor-engine utilization against its MX and
BF16 peaks, and the source lines with the most engine time. This is an ESTIMATE from documented
figures, not a measurement.

Shapes (LNC=2):
- prefill, DeepSeek-V3 router (H 7168, E 256, K 8, NOAUX_TC 8 groups / 4 kept), T = 2048, 8192;
- backward, Qwen3-30B-A3B (H 2048, I 768, E 128, K 8) and DeepSeek-V3 per EP rank (H 7168,
  I 2048, 32 local experts; EP 8 puts one of the 8 NOAUX_TC groups on each rank and a token
  choosing that group sends it 8/4 = 2 experts on average: K 2), T = 4096 tokens, block sizes
  512 and 1024. The plan's padding is its own line: routed pairs / the positions of the plan's
  static block count N = ceil((T*K - (E-1)) / B) + E - 1.

The backward kernel is profiled on (blocks, experts) = (1, 2), (2, 2), (2, 2) with both blocks
on expert 0, and (1, 4) at the real T, H, I, B and extrapolated linearly to the plan's N blocks
(first blocks of their expert, and later ones, whose weight-gradient reads are not skipped) and
E experts (`mxcli.kernels.blockwise_moe.profile.profile_bwd_scaled`: the kernel runs the same instruction
stream per block, and its per-launch work is per token or per expert). The real plans take 100k-1M
instructions in check-only mode (several minutes each on 2 cores) and, with all E experts'
weights as inputs, 10-25 GB of memory.

AWS's tuned shape (H 4096, I 1536, one block of B = T = 4096 tokens of one expert, LNC 2;
`mxcli.nkisim.measured.BWD_MXFP8`, from nki-library's tuned_blocking.py): mxcli's backward and
AWS's (`--kernel-path`, or an importable nkilib with the MXFP8 backward) are profiled in full
under the same model, AWS's with AWS's tuned per-phase blocking (`measured.BWD_TUNED_BLOCKING`)
and its phase-3/4 transposes on the PE (its faster, 2.190 ms launch) and on the DMA; the ratio
ours / AWS's is of the two estimates. At the README's backward shapes AWS's kernel (its default
blockings: AWS tuned none there) is profiled and extrapolated like ours, and the ratio printed.

Calibration: the model's one fitted figure (`FIGURES` dma_descriptor_overhead_bytes) was fitted
to AWS's 2.190 ms; AWS's DMA-transpose launch (2.342 ms) was not used in the fit. Each estimate
of AWS's kernel is printed beside AWS's measurement of that same launch, with their ratio, and
the PE's wait before its first instruction beside AWS's note on it (the PE idles ~49% of the
DMA-transpose launch before its first matmul). No estimate is printed beside a measurement of
another kernel.

Last line: the minimum over kernels of the estimated Tensor-engine utilization at the
bottleneck (useful PE time at peak / the lower bound), given the plan (padded positions count).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from mxcli.errors import MxcliError
from mxcli.kernels import calibrating, selection
from mxcli.kernels import profiling as prof
from mxcli.kernels.blockwise_moe import profile as bwd_prof
from mxcli.kernels.blockwise_moe.spec import SPEC as BWD
from mxcli.kernels.rmsnorm_mx_prefill import profile as prefill_prof
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC as PREFILL
from mxcli.nkisim import measured


def _report(s: dict[str, Any], top: int) -> float:
    shape = ", ".join(f"{k}={v}" for k, v in s["shape"].items())
    who = s.get("nki_kernel", {}).get("kernel", "mxcli")
    print(f"== {who} {s['kernel']} ({shape}; LNC={s['lnc']}, {s['target']})")
    print("   instructions: " + ", ".join(f"{k} {v}" for k, v in sorted(s["instructions"].items())))
    busy = ", ".join(f"{k} {v:.1f}" for k, v in s["busy_us"].items())
    print(f"   busy per engine (us, busiest core): {busy}")
    print(
        f"   bottleneck {s['bottleneck']}: lower bound {s['lower_bound_us']:.1f} us, list "
        f"schedule {s['schedule_us']:.1f} us"
    )
    u, ub = s["pe_utilization"], s["pe_utilization_at_lower_bound"]
    print(
        f"   Tensor engine: {s['pe_flops']['mx'] / 1e9:.1f} GFLOP MX, "
        f"{s['pe_flops']['bf16'] / 1e9:.2f} GFLOP BF16; utilization of peak {ub['total']:.3f} "
        f"at the bottleneck (MX {ub['mx']:.3f}, BF16 {ub['bf16']:.3f}), {u['total']:.3f} in "
        "the list schedule"
    )
    if "plan_padding" in s:
        p = s["plan_padding"]
        print(
            f"   plan padding: {p['pairs']} routed pairs in N={p['blocks']} blocks x "
            f"{p['block_size']} = {p['positions']} positions: {p['efficiency']:.3f} useful "
            f"({p['blocks_needed']} blocks hold tokens)"
        )
    if "sampled" in s:
        print("   top source lines of the (2 blocks, 2 experts) sample, engine time of both cores:")
    for r in s["top_lines"][:top]:
        print(
            f"   {r['busy_us']:10.1f} us {100 * r['share']:5.1f}%  {r['track']:<10} "
            f"{r['op']:<20} x{r['count']:<6} {r['source']}"
        )
    sampled = ""
    if "sampled" in s:
        sampled = f", extrapolated from (blocks, experts) = {s['sampled']['blocks_experts']}"
    if "range" in s:  # over the assumed/fitted figures' ranges (issue 29 item 5)
        rs, rl = s["range"]["schedule_us"], s["range"]["lower_bound_us"]
        print(
            f"   range over the assumed/fitted figures: list schedule {rs['low']:.1f}.."
            f"{rs['high']:.1f} us, lower bound {rl['low']:.1f}..{rl['high']:.1f} us"
        )
    print(f"   (check-only runs took {s['check_only_run_s']:.1f} s{sampled})")
    return float(ub["total"])


def _aws_point(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Ours and AWS's (PE and DMA transposes, AWS's tuned blocking) at AWS's tuned shape."""
    m = measured.BWD_MXFP8
    shape = bwd_prof.AWS_SHAPE
    label = {"model": "AWS tuned shape", **shape.__dict__}
    tensors, kwargs = bwd_prof.bwd_inputs(shape)
    cal = args.calibration
    ours = prof.profile_kernel(
        BWD, tensors, kwargs, lnc=m.lnc, shape=label, calibration=cal
    ).summary(args.top)
    runs: dict[str, Any] = {}
    try:
        choice = selection.parse_implementation("nkilib", BWD, args.kernel_path)
        selection.describe(choice)  # not importable: one line, no run
    except MxcliError as exc:
        return ours, runs, str(exc)
    for mode, dma in (("PE transposes", False), ("DMA transposes", True)):
        kw = {**kwargs, "config": bwd_prof.aws_tuned_config(dma_transposes=dma)}
        lab = {**label, "config": f"AWS's tuned blocking, {mode}"}
        kp = prof.profile_kernel(
            BWD,
            tensors,
            kw,
            lnc=m.lnc,
            shape=lab,
            nki_kernel=choice,
            calibration=cal,
        )
        runs[mode] = kp.summary(args.top)
    return ours, runs, ""


def _print_aws(ours: dict[str, Any], runs: dict[str, Any], missing: str) -> None:
    m = measured.BWD_MXFP8
    print(
        f"== AWS's tuned shape H={m.hidden} I={m.intermediate} B=T={m.tokens} E={m.experts} "
        f"LNC={m.lnc}: both backwards under the same cost model (estimates)"
    )
    print(
        f"   mxcli:  schedule {ours['schedule_us'] / 1e3:.3f} ms, lower bound "
        f"{ours['lower_bound_us'] / 1e3:.3f} ms ({ours['bottleneck']})"
    )
    if not runs:
        print(f"   nkilib: not costed ({missing}); no ratio")
        return
    for mode, r in runs.items():
        print(
            f"   nkilib ({mode}, AWS's tuned blocking): schedule {r['schedule_us'] / 1e3:.3f} ms, "
            f"lower bound {r['lower_bound_us'] / 1e3:.3f} ms ({r['bottleneck']})"
        )
    best = min(runs.values(), key=lambda r: r["schedule_us"])
    print(
        f"   ours / AWS's (its faster launch), same model: schedule "
        f"{ours['schedule_us'] / best['schedule_us']:.3f}, lower bound "
        f"{ours['lower_bound_us'] / best['lower_bound_us']:.3f}"
    )
    if "range" in ours and "range" in best:  # figures shared: the ratio per setting
        rs = calibrating.comparison_ranges(ours["range"], best["range"])["schedule_ratio"]
        print(
            f"   ours / AWS's over the assumed/fitted figures' ranges (shared by both): schedule "
            f"{rs['low']:.3f}..{rs['high']:.3f}; "
            + calibrating.verdict(ours["range"], best["range"], "mxcli", "nkilib")
        )
    print(f"== the model against AWS's measurement of AWS's kernel ({measured.BWD_SOURCE})")
    for (mode, r), us, role in zip(
        runs.items(), (m.us_pe_transposes, m.us_dma_transposes), ("fitted to", "predicted"),
        strict=True,
    ):  # fmt: skip
        pe = r["busy_us"]["tensor"] / r["schedule_us"]
        start = r.get("pe_start") or {"share": float("nan")}
        print(
            f"   {mode}: estimate {r['schedule_us'] / 1e3:.3f} ms, measured {us / 1e3:.3f} ms "
            f"(x{r['schedule_us'] / us:.3f}, {role}); the PE idles "
            f"{100 * start['share']:.0f}% of the estimate before its first instruction, and is "
            f"busy {100 * pe:.0f}% of it"
        )
    print(
        "   AWS's note (same file): with DMA transposes 'the PE idles ~49% of wall-clock waiting "
        "for its operands before the first matmul'; with PE transposes 'matmuls start "
        "immediately'"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lnc", type=int, default=2, help="LNC degree of every launch (1 or 2)")
    ap.add_argument("--top", type=int, default=5, help="source lines listed per kernel")
    ap.add_argument("--skip-bwd", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-aws", action="store_true", help="skip AWS's tuned-shape bwd point")
    ap.add_argument(
        "--kernel-path",
        help="folder holding AWS's nkilib (with experimental/moe_mxfp8), put first on the "
        "import path to cost AWS's backward at its tuned shape",
    )
    ap.add_argument(
        "--skip-aws-readme",
        action="store_true",
        help="skip AWS's backward at the README shapes (four extrapolated profiles)",
    )
    ap.add_argument("--json", help="also write every summary to this JSON file")
    ap.add_argument(
        "--calibration",
        help="calibration file (mxcli profile --calibrate): the fitted figures' values and ranges",
    )
    args = ap.parse_args()
    try:
        if args.calibration:
            args.calibration = calibrating.load_calibration(args.calibration)
    except MxcliError as exc:
        ap.error(str(exc))  # one line, exit 2
    t0 = time.perf_counter()
    summaries: list[dict[str, Any]] = []
    if not args.skip_prefill:
        for T in (2048, 8192):
            ps = prefill_prof.PrefillShape(T, 7168, 256, 8, "noaux_tc", 8, 4, pack_affinities=True)
            tensors, kwargs = prefill_prof.prefill_inputs(ps)
            kp = prof.profile_kernel(
                PREFILL, tensors, kwargs, lnc=args.lnc, shape=dict(ps.__dict__),
                calibration=args.calibration,
            )  # fmt: skip
            summaries.append(kp.summary(args.top))
    if not args.skip_bwd:
        for name, (H, I, E, K) in (("qwen3-30b-a3b", (2048, 768, 128, 8)),  # noqa: E741
                                   ("deepseek-v3 EP rank", (7168, 2048, 32, 2))):  # fmt: skip
            for B in (512, 1024):
                s = bwd_prof.profile_bwd_scaled(
                    bwd_prof.BwdShape(4096, H, I, E, K, B),
                    lnc=args.lnc,
                    calibration=args.calibration,
                )
                s["shape"] = {"model": name, **s["shape"]}
                summaries.append(s)
    ours_aws, aws_runs, aws_missing = _aws_point(args) if not args.skip_aws else (None, {}, "")
    if ours_aws is not None:
        summaries.append(ours_aws)
    readme_aws: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if not args.skip_bwd and aws_runs and not args.skip_aws_readme:
        choice = selection.parse_implementation("nkilib", BWD, args.kernel_path)
        for s in [x for x in summaries if "sampled" in x]:
            sh = {k: v for k, v in s["shape"].items() if k != "model"}
            theirs = bwd_prof.profile_bwd_scaled(
                bwd_prof.BwdShape(**sh),
                lnc=args.lnc,
                nki_kernel=choice,
                calibration=args.calibration,
            )
            theirs["shape"] = s["shape"]
            readme_aws.append((s, theirs))
    utils = [_report(s, args.top) for s in summaries]
    for r in aws_runs.values():
        _report(r, args.top)  # AWS's kernel: not part of the utilization line below
        summaries.append(r)
    for _, theirs in readme_aws:
        _report(theirs, args.top)
        summaries.append(theirs)
    if ours_aws is not None:
        _print_aws(ours_aws, aws_runs, aws_missing)
    if readme_aws:
        print("== README shapes: ours / AWS's (same model, AWS's default blockings; estimates)")
        for ours, theirs in readme_aws:
            print(
                f"   {ours['shape']['model']} B={ours['shape']['block_size']}: mxcli "
                f"{ours['schedule_us']:.1f} us, nkilib {theirs['schedule_us']:.1f} us, ours / "
                f"AWS's {ours['schedule_us'] / theirs['schedule_us']:.3f}"
            )
            rs = calibrating.comparison_ranges(ours["range"], theirs["range"])["schedule_ratio"]
            print(f"     range (figures shared): {rs['low']:.3f}..{rs['high']:.3f}; "
                  + calibrating.verdict(ours["range"], theirs["range"], "mxcli", "nkilib"))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1, default=str)
    print(f"(total {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if utils:
        print(
            "estimated Tensor-engine utilization at the bottleneck, given the plan "
            f"(min over kernels): {min(utils):.3f}"
        )


if __name__ == "__main__":
    main()
