"""How long rank 0 takes to save and load a checkpoint, and to write the trained model, for the
paper's ResNet-50 (224x224, 1000 classes, SGD with momentum) and 3D U-Net (Adam).

    .venv/bin/python benchmarks/checkpoint_speed.py [--dir /tmp/lms-checkpoint-speed] [--repeats 3]

"save" is `Checkpointer.save` on one rank (copying the variables out, writing state.bin and the
manifest with fsyncs, the rename); "load" is `load_newest` (reading and hashing state.bin) plus
assigning every variable; "model.keras" is `save_trained_model`. Medians of the repeats. The folder
should be on the disk checkpoints would go to: fsync makes the figure that disk's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a new one under the system temp dir)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from launcher.config import CheckpointConfig
    from launcher.rank import checkpoint as ck
    from launcher.rank.collectives import RankContext
    from launcher.rank.training import build_training
    from launcher.recipe import load_recipe

    alone = RankContext(rank=0, size=1, local_rank=0, local_size=1, host="here", device="CPU:0")

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="lms-checkpoint-speed-"))
    print(f"folder {root}; median of {args.repeats}; {os.cpu_count()} CPU(s)")
    print(f"{'recipe':<14} {'variables':>9} {'MiB':>8} {'save s':>7} {'load s':>7} {'model.keras s':>14}")
    repo = Path(__file__).resolve().parent.parent
    for recipe_name in ("resnet50.yaml", "unet3d.yaml"):
        recipe = load_recipe(repo / "recipes" / recipe_name)
        setup = build_training(recipe, ranks=1, device="CPU:0")
        folder = root / recipe_name.split(".")[0]
        saves, loads, exports = [], [], []
        for repeat in range(args.repeats):
            shutil.rmtree(folder, ignore_errors=True)
            config = CheckpointConfig(dir=str(folder / "checkpoints"), keep=1)
            checkpointer = ck.Checkpointer(config, setup.model, setup.optimizer, alone, log=None)
            started = time.perf_counter()
            path = checkpointer.save(repeat + 1)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            ck.restore_on_rank0(config, setup.model, setup.optimizer, total_steps=10**9, resume=True, ranks=1,
                                log=lambda _: None)
            loads.append(time.perf_counter() - started)
            started = time.perf_counter()
            ck.save_trained_model(setup.model, folder)
            exports.append(time.perf_counter() - started)
        manifest = ck.scan(path.parent)[0][-1].manifest
        print(f"{recipe_name:<14} {len(manifest['tensors']):>9} {manifest['state_bytes'] / 2**20:>8.1f} "
              f"{statistics.median(saves):>7.2f} {statistics.median(loads):>7.2f} {statistics.median(exports):>14.2f}")
        shutil.rmtree(folder, ignore_errors=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
