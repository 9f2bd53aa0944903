"""Benchmark `mxcli prep-weights` on a synthetic checkpoint with Qwen3-30B-A3B expert shapes.

A 2-layer qwen3_moe checkpoint (E=128, H=2048, I=768: 1.21 GB of bf16 experts per layer, sharded so
that a layer's experts span two files) is converted with the default formats (bf16 + MXFP8). In the
same run, a floor is measured: loading the same expert tensors and saving them unchanged with
safetensors (no re-stacking, no quantization). Each side runs in its own subprocess so that its
peak RSS is its own.

Prints throughput (GB/s of source bf16) beside the floor, the CPU seconds of each side (all
threads, user + sys: on a shared machine, where wall times follow the load, their ratio is the
steadier figure), peak RSS beside one layer's expert bytes, the targets (>= 0.8x the floor, issue
#21; peak RSS <= 2x one layer), and, last, the throughput ratio.

    python scripts/bench_prep.py [--formats bf16,mxfp8] [--threads N] [--workers N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

E, H, I = 128, 2048, 768  # noqa: E741 - Qwen3-30B-A3B experts

FLOOR = r"""
import json, resource, sys, time
from mxcli.weightprep.runner import peak_rss_bytes
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
src, out, layers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
ru0 = resource.getrusage(resource.RUSAGE_SELF)
cpu0 = ru0.ru_utime + ru0.ru_stime
t0 = time.perf_counter()
for L in range(layers):
    names = [n for n in index if n.startswith(f"model.layers.{L}.mlp.experts.")]
    tensors = {}
    for fname in sorted({index[n] for n in names}):
        with safe_open(str(src / fname), "pt", backend="pread") as f:
            for n in names:
                if index[n] == fname:
                    tensors[n] = f.get_tensor(n)
    save_file(tensors, str(out / f"layer_{L}.safetensors"))
    del tensors
secs = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": secs, "peak": peak_rss_bytes(), "cpu": ru.ru_utime + ru.ru_stime - cpu0}))
"""

PREP = r"""
import json, resource, sys
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import peak_rss_bytes, prepare_weights
opts = PrepOptions(formats=tuple(sys.argv[3].split(",")), threads=int(sys.argv[4]), workers=int(sys.argv[5]))
ru0 = resource.getrusage(resource.RUSAGE_SELF)
res = prepare_weights(sys.argv[1], sys.argv[2], opts)
ru = resource.getrusage(resource.RUSAGE_SELF)
cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
print(json.dumps({"seconds": res["seconds"], "peak": peak_rss_bytes(),
                  "bytes": res["source_bf16_bytes"], "cpu": cpu}))
"""


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench subprocess failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,mxfp8")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (0 = auto, as prep-weights)",
    )
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--workdir", type=Path, default=None, help="keep files here (default: a temp dir)"
    )
    args = ap.parse_args()

    from mxcli.weightprep.synthetic import build_checkpoint

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_prep_"))
    try:
        t0 = time.perf_counter()
        src = work / "src"
        if not (src / "config.json").is_file():
            build_checkpoint("qwen3_moe", src, num_layers=args.layers, hidden_size=H, intermediate_size=I,
                             num_experts=E, top_k=8)  # fmt: skip
        layer_bytes = 3 * E * H * I * 2
        total = layer_bytes * args.layers
        print(f"checkpoint: qwen3_moe E={E} H={H} I={I}, {args.layers} layers, "
              f"{total / 1e9:.2f} GB bf16 experts (built in {time.perf_counter() - t0:.1f} s)")  # fmt: skip

        floor_out = work / "floor"
        shutil.rmtree(floor_out, ignore_errors=True)
        floor_out.mkdir()
        floor = _run(FLOOR, str(src), str(floor_out), str(args.layers))
        shutil.rmtree(floor_out, ignore_errors=True)

        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        prep = _run(PREP, str(src), str(out), args.formats, str(args.threads), str(args.workers))

        floor_gbps = total / floor["seconds"] / 1e9
        prep_gbps = prep["bytes"] / prep["seconds"] / 1e9
        ratio = prep_gbps / floor_gbps
        budget = 2 * layer_bytes
        print(f"floor (load + save, no transform): {floor['seconds']:.2f} s, {floor_gbps:.3f} GB/s, "
              f"peak RSS {floor['peak'] / 1e9:.2f} GB")  # fmt: skip
        print(f"prep-weights --formats {args.formats} --threads {args.threads} --workers {args.workers}: "
              f"{prep['seconds']:.2f} s, {prep_gbps:.3f} GB/s")  # fmt: skip
        print(f"CPU seconds (all threads, user + sys): floor {floor['cpu']:.2f}, prep {prep['cpu']:.2f} "
              f"(ratio floor / prep {floor['cpu'] / prep['cpu']:.3f})")  # fmt: skip
        print(f"peak RSS {prep['peak'] / 1e9:.2f} GB vs one layer's experts {layer_bytes / 1e9:.2f} GB "
              f"(target <= {budget / 1e9:.2f} GB: {'ok' if prep['peak'] <= budget else 'MISSED'})")  # fmt: skip
        print(f"throughput target >= 0.8x floor: {'ok' if ratio >= 0.8 else 'MISSED'}")
        print(f"throughput ratio (prep / floor): {ratio:.3f}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
