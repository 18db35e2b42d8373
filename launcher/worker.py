"""The per-rank process: `python -m launcher.rank.worker RECIPE --run-dir DIR [--set k=v ...] [--resume]`.

Started once per rank by `lms-launch` (directly for one rank, by horovodrun or mpirun for more).
Each rank resolves the recipe itself; rank 0 alone writes to the run directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
from pathlib import Path

# TensorFlow keeps CPU allocator statistics (needed for peak memory on CPU ranks) only with the BFC
# allocator; it reads this once, at import, so it must be set before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from launcher.recipe import RecipeError, load_recipe  # noqa: E402
from launcher.launch.threads import apply_thread_defaults, local_rank_from_env  # noqa: E402

RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launcher.rank.worker", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in checkpoint.dir")
    return parser.parse_args(argv)


def cap_pinned_host_memory(lms) -> None:
    """On a GPU rank, before TensorFlow starts: TensorFlow's cap on the pinned host memory swap-outs
    land in, set from what this rank's plan may park there (launcher/lms/host_memory.py)."""
    from launcher.lms.host_memory import set_pinned_limit
    from launcher.lms.target import gpu_details, host_memory
    from launcher.launch.threads import local_size_from_env

    if gpu_details(local_rank_from_env(os.environ)) is None:
        return  # no GPU: nothing is pinned
    line = set_pinned_limit(os.environ, lms, host_memory(lms, local_size_from_env(os.environ))[1])
    if local_rank_from_env(os.environ) == 0:
        print(f"lms-launch worker on {socket.gethostname()}: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    # Until training starts (launcher/rank/stop.py), Ctrl-C ends a rank at once, as SIGTERM does, not
    # with a KeyboardInterrupt traceback that would read as the rank's own failure.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    args = parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as err:
        print(f"lms-launch worker: {err}", file=sys.stderr)
        return 2

    # Before TensorFlow starts: this rank's share of its own host's cores, said once per host.
    threads_note = apply_thread_defaults(os.environ)
    if local_rank_from_env(os.environ) == 0:
        print(f"lms-launch worker on {socket.gethostname()}: {threads_note}", flush=True)
    if recipe.lms.enabled:
        cap_pinned_host_memory(recipe.lms)

    import horovod.tensorflow as hvd
    import tensorflow as tf

    from launcher.rank import checkpoint, metrics, training
    from launcher.rank.devices import pin_device
    from launcher.lms.step import LMSSetupError, prepare_step
    from launcher.rank.oom import explain_out_of_memory, report_out_of_memory
    from launcher.recipe import recipe_to_dict
    from launcher.rank.stop import StopRequest

    hvd.init()
    ctx = training.RankContext(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                               host=socket.gethostname(), device=pin_device(hvd.local_rank(), recipe.lms.enabled))
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
    say = (lambda line: print(f"lms-launch worker: {line}", flush=True)) if is_root else (lambda line: None)
    try:  # with --resume rank 0 loads the checkpoint here, and the broadcast below shares it
        start_step = checkpoint.starting_step(recipe.checkpoint, setup.model, setup.optimizer, ctx.rank, ctx.size,
                                              recipe.train.steps, args.resume, log=say)
    except checkpoint.CheckpointError as err:
        if is_root:
            print(f"lms-launch worker: {err}", file=sys.stderr, flush=True)
        return 2
    if ctx.size > 1:
        training.broadcast_from_rank0(list(setup.model.variables) + list(setup.optimizer.variables))
    # The one place the traced step is handed to LMS (it comes back unchanged when lms.enabled is false).
    try:
        step = prepare_step(setup.step, setup.specs, recipe.lms, ctx, run_dir, log=print if is_root else None,
                            local_size=hvd.local_size(),
                            variables=list(setup.model.variables) + list(setup.optimizer.variables))
    except LMSSetupError as err:  # raised on every rank alike, before any training step
        if is_root:
            print(f"lms-launch worker: LMS: {err}", file=sys.stderr, flush=True)
        return 1
    except tf.errors.ResourceExhaustedError as err:  # a step run to check or profile the rewrite did not fit
        return report_out_of_memory(recipe, ctx.rank, ctx.device, err)

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
    checkpointer = checkpoint.Checkpointer(recipe.checkpoint, model, setup.optimizer, ctx.rank, ctx.size, log=say,
                                           metadata={"recipe": recipe_to_dict(recipe)})
    # From here on SIGTERM and Ctrl-C stop every rank after the same step (launcher/rank/stop.py).
    stop = StopRequest(ctx.size).install()
    with tf.device(ctx.device), explain_out_of_memory(recipe, ctx.rank, ctx.device):
        result = training.train(step, batches, recipe, ctx, task, setup.optimizer, on_interval,
                                start_step=start_step, checkpointer=checkpointer, stop=stop)
    if result.stopped_by:
        logger.close()
        saved = (f"checkpoint {checkpointer.last_saved}; continue with --resume" if checkpointer.last_saved
                 else "no checkpoint (checkpoint.dir is not set)")
        say(f"stopped by {result.stopped_by} after step {result.last_step}: {saved}")
        return stop.exit_status
    records, initial_loss, final_loss = result.records, result.initial_loss, result.final_loss

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
        model_file = checkpoint.save_trained_model(model, run_dir)
        extra = {
            "model": recipe.model.name, "input_shape": recipe.model.input_shape,
            "batch_size_per_rank": batch, "global_batch_size": batch * ctx.size, "np": ctx.size,
            "steps": recipe.train.steps, "precision": recipe.train.precision,
            "lms_enabled": recipe.lms.enabled,
            "model_file": model_file.name, "resumed_from_step": start_step or None,
            "last_checkpoint": str(checkpointer.last_saved) if checkpointer.last_saved else None,
        }
        summary = metrics.build_summary(everyone, extra)
        tmp = run_dir / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(run_dir / SUMMARY_FILE)
    if ctx.size > 1:
        training.barrier()  # every rank leaves together, once rank 0 has written its files
    return 0


if __name__ == "__main__":
    sys.exit(main())
