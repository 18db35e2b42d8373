"""The per-rank process: `python -m launcher.worker RECIPE --run-dir DIR [--set k=v ...]`.

Started once per rank by `lms-launch` (directly for one rank, by horovodrun or mpirun for more).
Each rank resolves the recipe itself; rank 0 alone writes to the run directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from pathlib import Path

# TensorFlow keeps CPU allocator statistics (needed for peak memory on CPU ranks) only with the BFC
# allocator; it reads this once, at import, so it must be set before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from launcher.recipe import RecipeError, load_recipe  # noqa: E402

RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launcher.worker", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    return parser.parse_args(argv)


def pin_device(local_rank: int) -> str:
    """One GPU per rank (by local rank), with memory growth so ranks sharing a GPU in tests do not
    each reserve it all; CPU when there is no GPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU:0"
    gpu = gpus[local_rank % len(gpus)]
    tf.config.set_visible_devices(gpu, "GPU")
    tf.config.experimental.set_memory_growth(gpu, True)
    return "GPU:0"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as err:
        print(f"lms-launch worker: {err}", file=sys.stderr)
        return 2

    import horovod.tensorflow as hvd
    import tensorflow as tf

    from launcher import metrics, training
    from launcher.lms_step import prepare_step
    from launcher.recipe import recipe_to_dict

    hvd.init()
    ctx = training.RankContext(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                               host=socket.gethostname(), device=pin_device(hvd.local_rank()))
    run_dir = Path(args.run_dir)
    if ctx.rank == 0:
        import yaml

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    is_root = ctx.rank == 0
    if recipe.train.precision == "mixed_float16" and ctx.device.startswith("CPU"):
        # TensorFlow has no float16 CPU kernels for several ops (MaxPool3D among them), and float16
        # buys nothing on a CPU: mixed precision is for GPUs.
        if is_root:
            print("lms-launch worker: train.precision=mixed_float16 needs a GPU; this rank computes on the CPU, "
                  "so it trains in float32", flush=True)
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, precision="float32"))

    setup = training.build_training(recipe, ctx.size, ctx.device)
    if ctx.size > 1:
        training.broadcast_from_rank0(list(setup.model.variables) + list(setup.optimizer.variables))
    # The one place the traced step is handed to LMS (it comes back unchanged when lms.enabled is false).
    step = prepare_step(setup.step, setup.specs, recipe.lms, ctx, run_dir, log=print if is_root else None,
                        local_size=hvd.local_size(),
                        variables=list(setup.model.variables) + list(setup.optimizer.variables))

    sinks: list = []
    if is_root:
        sinks = [metrics.JsonlSink(run_dir / METRICS_FILE), metrics.ConsoleSink(recipe.train.steps)]
        if recipe.logging.tensorboard:
            sinks.append(metrics.TensorBoardSink(run_dir / "tensorboard"))
    logger = metrics.MetricsLogger(sinks)

    def on_interval(records: list[metrics.IntervalRecord]) -> None:
        everyone = [r for part in hvd.allgather_object(records) for r in part] if ctx.size > 1 else records
        logger.write(everyone)

    batch = recipe.train.batch_size
    model, task = setup.model, setup.task
    try:
        batches = task.batches(batch, ctx.rank, ctx.size, ctx.device)
    except (FileNotFoundError, ValueError) as err:  # the reader names the file, shape or label at fault
        print(f"lms-launch worker (rank {ctx.rank}): data: {err}", file=sys.stderr, flush=True)
        return 1
    with tf.device(ctx.device):
        records, initial_loss, final_loss = training.train(step, batches, recipe, ctx, task, setup.optimizer,
                                                           on_interval)

    # Batch-norm statistics were updated from each rank's own batches: average them so every rank
    # ends with the same model, then fingerprint it.
    trainable = {id(v) for v in model.trainable_variables}
    if ctx.size > 1:
        training.average_across_ranks([v for v in model.variables if id(v) not in trainable])
    fingerprint = training.weights_fingerprint(model.variables)
    mine = metrics.summarize_rank(ctx.rank, ctx.host, ctx.device, records, initial_loss, final_loss, fingerprint)
    everyone = hvd.allgather_object(mine) if ctx.size > 1 else [mine]
    logger.close()
    if is_root:
        extra = {
            "model": recipe.model.name, "input_shape": recipe.model.input_shape,
            "batch_size_per_rank": batch, "global_batch_size": batch * ctx.size, "np": ctx.size,
            "steps": recipe.train.steps, "precision": recipe.train.precision,
            "lms_enabled": recipe.lms.enabled,
        }
        summary = metrics.build_summary(everyone, extra)
        tmp = run_dir / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(run_dir / SUMMARY_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
