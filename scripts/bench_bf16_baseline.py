"""The cost model against every bf16 ``torch.matmul`` latency AWS measured on Trn3.

Each shape of nki-library's ``bf16_baseline_cache.json`` (`mxcli.nkisim.measured.MATMUL_BF16_TABLE`,
162 shapes, LNC 2) is estimated by the cost model for our plain tiled bf16 NKI matmul
(tests/nkisim/matmul_kernels.py: check-only runs, list-scheduled, extrapolated from one-core
samples as tests/nkisim/matmul_estimate.py says). Printed per shape: the estimate, AWS's
measurement, and their ratio; then the spread (min / median / max ratio) overall and by size, and
the worst shapes. This compares a model of OUR kernel with a measurement of the COMPILER's
kernel for the same product: it checks the model's figures and schedule at the scale of whole
kernels, not either kernel.

Last line: the median ratio estimate / measured over the shapes run (this run's estimates,
AWS's measurements).

    PYTHONPATH=$PWD python scripts/bench_bf16_baseline.py [--only MxKxN ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import mxcli.nkisim as nkisim
from mxcli.nkisim import measured

ROOT = Path(__file__).resolve().parents[1]  # the kernel and its estimator live in tests/nkisim


def _spread(rows: list[dict]) -> str:
    r = sorted(x["ratio"] for x in rows)
    return f"{len(r)} shapes: min {r[0]:.2f}, median {statistics.median(r):.2f}, max {r[-1]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="shape keys MxKxN (default: all)")
    ap.add_argument("--json", default=None, help="write the per-shape rows here")
    args = ap.parse_args()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.nkisim import matmul_estimate as est

    points = measured.MATMUL_BF16_TABLE
    if args.only:
        points = tuple(measured.matmul_point(k) for k in args.only)
    rows = []
    t0 = time.perf_counter()
    with nkisim.installed():
        mm = importlib.import_module("tests.nkisim.matmul_kernels")
        for p in points:
            t = time.perf_counter()
            e = est.estimate_us(mm, p.M, p.K, p.N)
            row = {"key": p.key, "name": p.name, "est_us": e, "measured_us": p.us,
                   "ratio": e / p.us, "mfu_percent": p.mfu_percent,
                   "run_s": time.perf_counter() - t}  # fmt: skip
            rows.append(row)
            print(
                f"{p.key:>16}  est {e:9.1f} us  measured {p.us:9.1f} us  ratio {e / p.us:5.2f}"
                f"  (AWS MFU {p.mfu_percent:4.1f}%; {row['run_s']:.1f} s)  {p.name}",
                flush=True,
            )
    print(f"== spread, estimate / measured ({measured.MATMUL_SOURCE})")
    print(f"   all {_spread(rows)}")
    big = [x for x in rows if x["measured_us"] >= 100.0]
    small = [x for x in rows if x["measured_us"] < 100.0]
    for label, sub in (("measured >= 100 us", big), ("measured < 100 us", small)):
        if sub:
            print(f"   {label}: {_spread(sub)}")
    worst = sorted(rows, key=lambda x: abs(x["ratio"] - 1.0), reverse=True)[:8]
    print("   worst: " + ", ".join(f"{x['key']} {x['ratio']:.2f}" for x in worst))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"(total {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(f"median estimate / measured: {statistics.median(x['ratio'] for x in rows):.3f}")


if __name__ == "__main__":
    main()
