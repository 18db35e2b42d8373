"""Launcher overhead in training: samples/s of `lms-launch` (one rank, LMS off) against a bare
hand-written tf.function loop on the same model, batch and machine, alternated so drift hits both alike.

    .venv/bin/python benchmarks/launcher_overhead.py [--rounds 3] [--steps 30] [--batch 16] [--size 64]

Prints each round and the ratio of medians (the goal: at least 97%). The bare loop shares no code with
the launcher: it is what a user would write by hand. What the ratio prices is the launcher's training
loop in steady state: its step wrapper, the metrics taken every `--interval` steps (device memory
statistics, the loss and learning rate read back, the records written to metrics.jsonl, the console
and TensorBoard), all timed by wall clock from the end of the first metrics interval to the end of
the last (`end_time_s` in metrics.jsonl), so the work between intervals is inside the clock. Start-up
(recipe loading, TensorFlow's import, building and tracing the model) is outside both clocks: it is
paid once per run, not per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP = 3  # steps not timed in either: tracing and allocator warm-up


def bare_loop(steps: int, batch: int, size: int) -> float:
    """The hand-written baseline; returns samples/s over the timed steps."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(42)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10,
                                        classifier_activation=None)
    optimizer = keras.optimizers.SGD(learning_rate=0.001, momentum=0.9)
    images = tf.random.uniform([batch, size, size, 3])
    labels = tf.random.uniform([batch], maxval=10, dtype=tf.int32)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for _ in range(SKIP):
        loss = step(images, labels)
    float(loss)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(images, labels)
    float(loss)  # wait for the device
    return batch * steps / (time.perf_counter() - start)


def run_bare(steps: int, batch: int, size: int, env: dict) -> float:
    out = subprocess.run([sys.executable, __file__, "--bare", "--steps", str(steps), "--batch", str(batch),
                          "--size", str(size)], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_launcher(steps: int, batch: int, size: int, interval: int, env: dict) -> float:
    """samples/s from the end of the first metrics interval to the end of the last, by wall clock."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        argv = [sys.executable, "-m", "launcher.cli", str(REPO / "recipes" / "resnet50-cpu.yaml"), "--np", "1",
                "--run-dir", str(run_dir), "--no-progress",
                "--set", f"model.input_shape=[{size},{size},3]", "--set", f"train.batch_size={batch}",
                "--set", f"train.steps={steps + SKIP}", "--set", f"logging.skip_steps={SKIP}",
                "--set", f"logging.interval={interval}", "--set", "lms.enabled=false"]
        subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=REPO)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first, last = records[0], records[-1]
        return batch * (last["step"] - first["step"]) / (last["end_time_s"] - first["end_time_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--interval", type=int, default=5, help="the launcher's metrics interval (the CPU recipes': 5)")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        print(bare_loop(args.steps, args.batch, args.size))
        return 0

    from launcher.launch.threads import thread_defaults, usable_cpus

    # Both sides get the thread settings a lone rank gives itself, and the same allocator.
    env = dict(os.environ)
    env.update(thread_defaults(os.environ, usable_cpus(), 1))
    env.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if args.steps % args.interval or args.steps < 2 * args.interval:
        parser.error("--steps must be a multiple of --interval, and at least two intervals")
    print(f"ResNet-50 {args.size}x{args.size}, batch {args.batch}, {args.steps} steps (the launcher timed over the "
          f"last {args.steps - args.interval}, metrics every {args.interval}), {args.rounds} alternating rounds, "
          f"{os.cpu_count()} CPU(s)")
    bare, launched = [], []
    for round_number in range(1, args.rounds + 1):
        bare.append(run_bare(args.steps, args.batch, args.size, env))
        launched.append(run_launcher(args.steps, args.batch, args.size, args.interval, env))
        print(f"round {round_number}: bare loop {bare[-1]:.2f} samples/s, lms-launch {launched[-1]:.2f} samples/s")
    ratio = statistics.median(launched) / statistics.median(bare)
    print(f"median: bare {statistics.median(bare):.2f}, lms-launch {statistics.median(launched):.2f} samples/s; "
          f"lms-launch / bare = {ratio:.1%} (goal >= 97%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
