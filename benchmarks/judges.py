"""The no-swap row judged two ways on this CPU: Grappler's estimate against TensorFlow's real allocator
(issue 17: "the real allocator's answer next to the estimate's, so the estimate is checked on this model").

    .venv/bin/python benchmarks/judges.py                       # the 3D U-Net at 1, 2 and 4 GiB
    .venv/bin/python benchmarks/judges.py --device-memory 2GiB --max 128

For each device memory it runs, each in its own process, exactly

    lms-launch bench max-resolution recipes/unet3d.yaml --configs none --judge estimate --device-memory M ...
    lms-launch bench max-resolution recipes/unet3d.yaml --configs none --judge run --device-memory M ...

(`run`: real training steps in a fresh process per probe, TensorFlow's CPU allocator held to M: a
BFC allocator, as a GPU's is), and prints one table: each judge's largest cube, the peak each
reports there, and the other judge's peak at the same cube where it probed it. Each bench's whole
output goes to runs/judges-<time>/ and the table to stdout (benchmarks/results/judges-unet3d.txt
holds one, headed by date, machine and command).
"""
from __future__ import annotations

import argparse
import csv
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
JUDGES = ("estimate", "run")


def run_bench(recipe: str, memory: str, judge: str, out: Path, args: argparse.Namespace) -> dict[int, dict]:
    """One bench of the no-swap row; its probes by size (fits, peak bytes)."""
    argv = ["bench", "max-resolution", recipe, "--configs", "none", "--judge", judge, "--device-memory", memory,
            "--run-steps", str(args.run_steps), "--max", str(args.max), "--out", str(out)]
    print(f"$ lms-launch {shlex.join(argv)}", flush=True)
    with open(out.with_suffix(".log"), "w") as log:
        done = subprocess.run([sys.executable, "-m", "launcher.cli", *argv], cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if done.returncode != 0:
        raise SystemExit(f"the bench failed (exit {done.returncode}); its output: {out.with_suffix('.log')}")
    with open(out / "probes.csv") as probes:
        rows = [row for row in csv.DictReader(probes) if row["configuration"] == "none"]
    return {int(row["size"]): row for row in rows}


def peak(row: dict | None) -> str:
    from lms_core.units import format_bytes

    if row is None:
        return "not probed"
    if not row.get("peak_bytes"):  # the run judge has no peak for a step that ran out of memory
        return "out of memory"
    text = format_bytes(int(row["peak_bytes"]))
    return text if row["fits"] == "True" else f"{text} (over)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/unet3d.yaml")
    parser.add_argument("--device-memory", default="1GiB,2GiB,4GiB", help="comma-separated sizes")
    parser.add_argument("--max", type=int, default=176, help="largest cube side tried (default 176)")
    parser.add_argument("--run-steps", type=int, default=3, help="steps per run-judge probe (default 3)")
    args = parser.parse_args()
    base = REPO / "runs" / f"judges-{time.strftime('%Y%m%d-%H%M%S')}"
    base.mkdir(parents=True)
    lines = ["| device memory | judge | largest cube | its peak (that judge) | the other judge at that cube |",
             "| --- | --- | --- | --- | --- |"]
    for memory in args.device_memory.split(","):
        probes = {judge: run_bench(args.recipe, memory, judge, base / f"{judge}-{memory}", args) for judge in JUDGES}
        for judge, other in zip(JUDGES, reversed(JUDGES)):
            fitting = [size for size, row in probes[judge].items() if row["fits"] == "True"]
            largest = max(fitting, default=None)
            if largest is None:
                lines.append(f"| {memory} | {judge} | none fits | - | - |")
                continue
            lines.append(f"| {memory} | {judge} | {largest}^3 | {peak(probes[judge][largest])} | "
                         f"{other}: {peak(probes[other].get(largest))} |")
    print("\n".join(lines))
    print(f"bench outputs in {base.relative_to(REPO)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
