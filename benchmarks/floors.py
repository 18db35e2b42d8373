"""The bench's two floor rows, without the rest of the bench: the floor of the traced step and the
floor after the floor-lowering rewrites (lms_core.add_chains), at given sizes and as the largest size
whose floor fits the device, by `lms-launch bench`'s own probes and search (launcher.bench).

    .venv/bin/python benchmarks/floors.py max-batch recipes/resnet50.yaml --at 1321 --start 1321
    .venv/bin/python benchmarks/floors.py max-resolution recipes/unet3d.yaml --at 304,384 --start 384

Tracing only (no Grappler estimate): a ResNet-50 size takes about 6 s here. The full bench
(`lms-launch bench`, benchmarks/max_size.py) prints the same two rows after its configurations.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
DEVICE_MEMORY = 16 << 30  # the papers' 16 GB V100, as the bench's default


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("max-batch", "max-resolution"))
    parser.add_argument("recipe")
    parser.add_argument("--at", default="", help="sizes to show both floors at, comma-separated")
    parser.add_argument("--start", type=int, help="where the searches start (default: the recipe's size)")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from launcher.bench.configurations import FLOORS, LABELS, PROBES, EstimateSetting
    from launcher.bench.search import SizeGrid, largest_fitting
    from launcher.bench.sizes import size_axis
    from launcher.bench.steps import StepSource
    from launcher.recipe import load_recipe
    from lms_core.units import format_bytes

    print(f"command: .venv/bin/python benchmarks/floors.py {shlex.join(sys.argv[1:])}")
    recipe = load_recipe(args.recipe, [])
    axis = size_axis(args.kind, recipe)
    source = StepSource(axis, recipe)
    for size in [int(s) for s in args.at.split(",") if s]:
        started = time.perf_counter()
        for key, floor in zip(FLOORS, source.floors_at(size)):
            print(f"{axis.label(size):>11}  {key:<16} {format_bytes(floor.total_bytes):>10}  largest op "
                  f"{floor.op_type} {floor.op} {format_bytes(floor.working_set_bytes)}; weights "
                  f"{format_bytes(floor.weights_bytes)}, optimizer {format_bytes(floor.optimizer_bytes)}; "
                  f"{floor.add_chains} AddN(s) as chains")
        print(f"{'':>11}  ({time.perf_counter() - started:.1f} s)")
    grid = SizeGrid(axis.step, max(axis.step, axis.smallest))
    start = grid.snap(args.start or axis.start)
    for key in FLOORS:
        judge = partial(PROBES[key], EstimateSetting(source, DEVICE_MEMORY, None, None))
        found = largest_fitting(judge, grid, start, stride=axis.step * 8, on_probe=lambda p: print(
            f"  {key:<16} {axis.label(p.size):>11}  {format_bytes(p.peak_bytes):>10}  "
            f"{'fits' if p.fits else 'does NOT fit':<12} {p.seconds:5.1f} s  {p.detail}", flush=True))
        print(f"{LABELS[key]}: largest {axis.label(found.largest)} on {format_bytes(DEVICE_MEMORY)}, "
              f"{axis.label(found.smallest_failing)} does not fit; {len(found.probes)} probes, {found.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
