"""The papers' tables, re-measured: the largest ResNet-50 batch and the largest 3D U-Net cube that fit a
16 GiB device, for no swapping, TensorFlow's Grappler swapping and lms-launch (issue 10).

    .venv/bin/python benchmarks/max_size.py            # both, one after the other (about 10 minutes here)
    .venv/bin/python benchmarks/max_size.py --only max-batch

Runs, each in its own process, exactly:

    lms-launch bench max-batch recipes/resnet50.yaml --out runs/bench-papers-<time>/max-batch-resnet50
    lms-launch bench max-resolution recipes/unet3d.yaml --out runs/bench-papers-<time>/max-resolution-unet3d

with the defaults (--judge auto: Grappler's estimate on a machine without a GPU, a 16 GiB virtual
GPU, lms-launch tuned for nvlink2 and v100, overheads also re-tuned for pcie3), and writes each
command's whole output, headed by the date, the machine and the command, to
benchmarks/results/bench-<kind>-<model>.txt. The run directories keep the tables, CSVs and charts.
The total wall time of both is printed at the end: issue 10 asks for under 20 minutes on a 2-core
CPU machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = (("max-batch", "recipes/resnet50.yaml", "resnet50"), ("max-resolution", "recipes/unet3d.yaml", "unet3d"))


def machine() -> str:
    import psutil

    return (f"{platform.node()}, {len(os.sched_getaffinity(0))} CPU cores, "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM, Python {platform.python_version()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=[kind for kind, _, _ in RUNS])
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"), help="where the raw outputs go")
    args = parser.parse_args()
    base = REPO / "runs" / f"bench-papers-{time.strftime('%Y%m%d-%H%M%S')}"
    total = 0.0
    for kind, recipe, model in RUNS:
        if args.only and kind != args.only:
            continue
        out = base / f"{kind}-{model}"
        argv = [sys.executable, "-m", "launcher.cli", "bench", kind, recipe, "--out", str(out)]
        shown = f"lms-launch bench {kind} {recipe} --out {out.relative_to(REPO)}"
        header = (f"{time.strftime('%Y-%m-%d %H:%M %Z')}\nmachine: {machine()}\ncommand: {shown}\n"
                  f"(run by: .venv/bin/python benchmarks/max_size.py)\n")
        print(header, flush=True)
        started = time.perf_counter()
        lines = []
        with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}) as process:
            for line in process.stdout:  # shown as it comes: the probes are the progress
                if not line.startswith("WARNING:"):
                    print(line, end="", flush=True)
                    lines.append(line)
        seconds = time.perf_counter() - started
        total += seconds
        ending = f"exit status {process.returncode}; wall time {seconds:.0f} s\n"
        print(ending, flush=True)
        text = header + "".join(lines) + ending
        target = Path(args.results) / f"bench-{kind}-{model}.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(target)
        print(f"raw output written to {target}", flush=True)
        if process.returncode != 0:
            return process.returncode
    print(f"total wall time: {total:.0f} s ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
