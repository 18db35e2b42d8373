"""The per-rank process: `python -m launcher.worker RECIPE --run-dir DIR [--set k=v ...] [--resume]`.

Started once per rank by `lms-launch` (directly for one rank, by horovodrun or mpirun for more).
Each rank resolves the recipe itself; rank 0 alone writes to the run directory. A rank runs these
phases in order, and any of them can end it with a `RankFailure` (a message and an exit status):

1. before TensorFlow starts: its Horovod identity when srun started it (from Slurm's), its thread
   pools and, on a GPU with LMS, the pinned host memory cap;
2. join the other ranks (Horovod, only when there are others) and pick its device;
3. build the model, optimizer and step; resume from a checkpoint; take rank 0's weights;
4. hand the step to LMS (launcher.lms.step), which rewrites and checks it;
5. train, measuring every interval; 6. average what ranks keep apart and write the summary.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

# TensorFlow keeps CPU allocator statistics (needed for peak memory on CPU ranks) only with the BFC
# allocator; it reads this once, at import, so it must be set before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from launcher import env as ev  # noqa: E402
from launcher.config import Recipe  # noqa: E402
from launcher.recipe import RecipeError, load_recipe, recipe_to_dict  # noqa: E402

RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
USAGE_STATUS = 2  # a bad recipe or checkpoint folder: nothing trained
FAILED_STATUS = 1


class RankFailure(Exception):
    """Ends the rank with `status` after printing `message`. With `alike`, every rank fails the same
    way at the same point, and rank 0 alone says so."""

    def __init__(self, status: int, message: str, alike: bool = False):
        super().__init__(message)
        self.status, self.message, self.alike = status, message, alike


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launcher.worker", description=__doc__)
    parser.add_argument("recipe")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in checkpoint.dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # Until training starts (launcher/rank/stop.py), Ctrl-C ends a rank at once, as SIGTERM does, not
    # with a KeyboardInterrupt traceback that would read as the rank's own failure.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    args = parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as err:
        print(f"lms-launch worker: {err}", file=sys.stderr)
        return USAGE_STATUS
    if os.environ.get(ev.LMS_LAUNCH_SRUN):
        from launcher.launch.slurm import SlurmError, srun_task_identity

        try:  # before anything reads HOROVOD_* (the thread split, Horovod itself)
            os.environ.update(srun_task_identity(os.environ, recipe.distributed))
        except SlurmError as err:
            print(f"lms-launch worker: {err}", file=sys.stderr)
            return USAGE_STATUS
    prepare_process(recipe)
    rank = 0
    try:
        from launcher.rank.collectives import join_ranks
        from launcher.rank.devices import pin_device

        ctx = join_ranks(lambda local_rank: pin_device(local_rank, recipe.lms.enabled))
        rank = ctx.rank
        return run_rank(recipe, ctx, Path(args.run_dir), args.resume)
    except RankFailure as failure:
        if rank == 0 or not failure.alike:
            print(f"lms-launch worker: {failure.message}", file=sys.stderr, flush=True)
        return failure.status


def prepare_process(recipe: Recipe) -> None:
    """Before TensorFlow starts: this rank's share of its host's cores, and on a GPU rank with LMS
    the cap on pinned host memory its swap-outs land in (each said once per host)."""
    from launcher.launch.threads import apply_thread_defaults, local_rank_from_env

    first_on_host = local_rank_from_env(os.environ) == 0
    say_here = (lambda line: print(f"lms-launch worker on {_hostname()}: {line}", flush=True)) if first_on_host \
        else (lambda line: None)
    say_here(apply_thread_defaults(os.environ))
    if ev.TF_CPU_BFC_MEM_LIMIT_IN_MB in os.environ and ev.TF_ENABLE_ONEDNN_OPTS not in os.environ:
        os.environ[ev.TF_ENABLE_ONEDNN_OPTS] = "0"  # an allocation failing in a oneDNN kernel would crash the rank
        say_here(f"{ev.TF_CPU_BFC_MEM_LIMIT_IN_MB} is set: {ev.TF_ENABLE_ONEDNN_OPTS}=0, so running out of that "
                 f"memory ends in TensorFlow's error, not a crash in oneDNN")
    if recipe.lms.enabled:
        from launcher.lms.host_memory import cap_pinned_host_memory

        line = cap_pinned_host_memory(os.environ, recipe.lms)
        if line:
            say_here(line)


def run_rank(recipe: Recipe, ctx, run_dir: Path, resume: bool) -> int:
    import tensorflow as tf

    from launcher.lms.step import LMSSetupError, prepare_step
    from launcher.rank import checkpoint, collectives, training
    from launcher.rank.oom import out_of_memory_advice, OUT_OF_MEMORY_STATUS
    from lms_core.tf.allocations import out_of_memory

    say = _root_printer(ctx)
    recipe = precision_for_device(recipe, ctx, say)
    if ctx.is_root:
        write_resolved_recipe(recipe, run_dir)
    setup = build_training(recipe, ctx)
    state = list(setup.model.variables) + list(setup.optimizer.variables)
    try:  # with --resume rank 0 loads the checkpoint here, and the broadcast below shares it
        resumed = checkpoint.resume_point(recipe.checkpoint, setup.model, setup.optimizer, ctx,
                                          recipe.train.steps, resume, log=say)
    except checkpoint.CheckpointError as err:
        raise RankFailure(USAGE_STATUS, str(err), alike=True) from None
    collectives.broadcast_variables(ctx, state)
    resumed.restore_own_state(setup.model, ctx, log=say)  # each rank's own batch-norm statistics again
    try:
        # The one place the traced step is handed to LMS (it comes back unchanged when lms.enabled is false).
        # Calibration measures plans on the step without its allreduce: a rank out of memory leaves none waiting.
        local_step = (training.make_train_step(setup.model, setup.optimizer, setup.task, 1)
                      if ctx.size > 1 and recipe.lms.enabled else None)
        step = prepare_step(setup.step, setup.specs, recipe.lms, ctx, run_dir, log=print if ctx.is_root else None,
                            variables=state, local_step=local_step)
        result = train(recipe, ctx, setup, step, run_dir, resumed.step, say)
    except LMSSetupError as err:  # raised on every rank alike, before any training step
        raise RankFailure(FAILED_STATUS, f"LMS: {err}", alike=True) from None
    except (tf.errors.ResourceExhaustedError, tf.errors.NotFoundError, tf.errors.InternalError) as err:
        reason = out_of_memory(err)  # a step did not fit the device, however TensorFlow words it
        if reason is None:
            raise
        raise RankFailure(OUT_OF_MEMORY_STATUS, out_of_memory_advice(recipe, ctx.rank, ctx.device, reason)) from None
    if result.stopped_by:
        return result.stop_status
    finish(recipe, ctx, setup, result, run_dir, resumed.step)
    return 0


def build_training(recipe: Recipe, ctx):
    """The rank's model, optimizer and step; a builder that breaks its contract fails every rank alike."""
    from launcher.rank import training
    from launcher.rank.tasks.builder import BuilderError

    try:
        return training.build_training(recipe, ctx.size, ctx.device)
    except BuilderError as err:
        raise RankFailure(USAGE_STATUS, str(err), alike=True) from None


def precision_for_device(recipe: Recipe, ctx, say) -> Recipe:
    """mixed_float16 is for GPUs: TensorFlow has no float16 CPU kernels for several ops (MaxPool3D
    among them), and float16 buys nothing on a CPU, so a CPU rank trains in float32 and says so."""
    if recipe.train.precision != "mixed_float16" or not ctx.device.startswith("CPU"):
        return recipe
    say("train.precision=mixed_float16 needs a GPU; this rank computes on the CPU, so it trains in float32")
    return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, precision="float32"))


def write_resolved_recipe(recipe: Recipe, run_dir: Path) -> None:
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))


def train(recipe: Recipe, ctx, setup, step, run_dir: Path, start_step: int, say):
    """The training loop with its metrics sinks (rank 0 writes them), checkpoints and stop request."""
    import tensorflow as tf

    from launcher.rank import checkpoint, collectives, metrics, training
    from launcher.rank.stop import StopRequest

    sinks: list = []
    if ctx.is_root:
        sinks = [metrics.JsonlSink(run_dir / METRICS_FILE), metrics.ConsoleSink(recipe.train.steps)]
        if recipe.logging.tensorboard:
            sinks.append(metrics.TensorBoardSink(run_dir / "tensorboard"))
    logger = metrics.MetricsLogger(sinks)

    def on_interval(records: list[metrics.IntervalRecord]) -> None:
        logger.write([record for part in collectives.allgather_object(ctx, records) for record in part])

    try:
        batches = setup.task.batches(recipe.train.batch_size, ctx.rank, ctx.size, ctx.device)
    except (FileNotFoundError, ValueError) as err:  # the reader names the file, shape or label at fault
        raise RankFailure(FAILED_STATUS, f"(rank {ctx.rank}) data: {err}") from None
    checkpointer = checkpoint.Checkpointer(recipe.checkpoint, setup.model, setup.optimizer, ctx, log=say,
                                           metadata={"recipe": recipe_to_dict(recipe)})
    # From here on SIGTERM and Ctrl-C stop every rank after the same step (launcher/rank/stop.py).
    stop = StopRequest(ctx.size).install()
    try:
        with tf.device(ctx.device):
            result = training.train(step, batches, recipe, ctx, setup.task, setup.optimizer, on_interval,
                                    start_step=start_step, checkpointer=checkpointer, stop=stop)
    finally:
        logger.close()
    if result.stopped_by:
        saved = (f"checkpoint {checkpointer.last_saved}; continue with --resume" if checkpointer.last_saved
                 else "no checkpoint (checkpoint.dir is not set)")
        say(f"stopped by {result.stopped_by} after step {result.last_step}: {saved}")
    return result


def finish(recipe: Recipe, ctx, setup, result, run_dir: Path, start_step: int) -> None:
    """Every rank ends with the same model: the batch-norm statistics each rank updated from its own
    batches are averaged, then fingerprinted; rank 0 writes the trained model and summary.json."""
    from launcher.rank import checkpoint, collectives, metrics, training

    model = setup.model
    trainable = {id(v) for v in model.trainable_variables}
    collectives.average_across_ranks(ctx, [v for v in model.variables if id(v) not in trainable])
    fingerprint = training.weights_fingerprint(model.weights)  # what model.keras holds (not dropout seed states)
    mine = metrics.summarize_rank(ctx.rank, ctx.host, ctx.device, result.records, result.initial_loss,
                                  result.final_loss, fingerprint)
    everyone = collectives.allgather_object(ctx, mine)
    if ctx.is_root:
        model_file = checkpoint.save_trained_model(setup.task.trained_model(model), run_dir)
        batch = recipe.train.batch_size
        extra = {
            "model": recipe.model.name, "input_shape": recipe.model.input_shape,
            "batch_size_per_rank": batch, "global_batch_size": batch * ctx.size, "np": ctx.size,
            "steps": recipe.train.steps, "precision": recipe.train.precision, "lms_enabled": recipe.lms.enabled,
            "model_file": model_file.name, "resumed_from_step": start_step or None,
            "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        }
        summary = metrics.build_summary(everyone, extra)
        tmp = run_dir / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(run_dir / SUMMARY_FILE)
    collectives.barrier(ctx)  # every rank leaves together, once rank 0 has written its files


def _root_printer(ctx):
    """A function that prints a worker line on rank 0 and does nothing elsewhere."""
    if ctx.is_root:
        return lambda line: print(f"lms-launch worker: {line}", flush=True)
    return lambda line: None


def _hostname() -> str:
    import socket

    return socket.gethostname()


if __name__ == "__main__":
    sys.exit(main())
