"""Does TensorFlow's own tf.recompute_grad save memory on Keras 3's ResNet-50?

    python3 benchmarks/peers/tf_recompute_grad.py --out DIR [--device GPU:0] [--batch 64] [--image-size 224]
    .venv/bin/python benchmarks/peers/tf_recompute_grad.py --out /tmp/rg --device CPU:0 --batch 32 --image-size 96

keras.applications.ResNet50(weights=None) is cut into its stem, its four stages (conv2..conv5, the
outputs of conv2_block3 .. conv5_block3) and its head, as Keras models that share the full model's
layers. The same training step (SGD(0.1, momentum 0.9) on the logits' sparse softmax cross-entropy,
one batch of random data) runs plain and with each stage wrapped in tf.recompute_grad, on the same
weights. For each: the step's peak (tf.config.experimental.get_memory_info after reset_memory_stats),
what was in use before it (weights, optimizer slots, the batch), and the step time; then whether the
two gradients match (max |difference| against the largest gradient, over the model and per variable).
If recompute_grad fails under Keras 3, its error is the answer.

On CPU:0 TensorFlow keeps allocator statistics only with its BFC allocator (TF_CPU_ALLOCATOR_USE_BFC,
set here before TensorFlow starts): that checks the question on a CPU, it is not a GPU figure.
Writes DIR/gpu-peers-tf-recompute-grad.txt line by line; the last line is `tf-recompute-grad: done in N s`.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.reporting import Log, nvidia_smi  # noqa: E402  (the repository's root is on the path)

STARTED = time.monotonic()
TF_CPU_ALLOCATOR_USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"  # CPU:0 keeps memory statistics only with BFC
TF_CPP_MIN_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
TXT = "gpu-peers-tf-recompute-grad.txt"
GIB, MIB = 1 << 30, 1 << 20
# The stem ends at pool1_pool; each stage ends at its last block's output (Keras's own layer names).
CUTS = ("pool1_pool", "conv2_block3_out", "conv3_block4_out", "conv4_block6_out", "conv5_block3_out")


def header(log: Log, args: argparse.Namespace) -> None:
    import keras
    import tensorflow as tf

    build = tf.sysconfig.get_build_info()
    log(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    log(f"command: python3 benchmarks/peers/tf_recompute_grad.py {shlex.join(sys.argv[1:])}")
    log(f"machine: {platform.node()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}")
    if args.device.upper().startswith("GPU"):
        log(f"GPU (nvidia-smi): {nvidia_smi('name,memory.total') or 'unknown'}; driver "
            f"{nvidia_smi('driver_version') or 'unknown'}")
    else:
        log(f"NO GPU: {args.device}'s figures come from TensorFlow's CPU BFC allocator "
            f"({TF_CPU_ALLOCATOR_USE_BFC}=true); they check the question, they are not GPU figures")
    log(f"TensorFlow {tf.__version__} (CUDA {build.get('cuda_version', '-')}, cuDNN {build.get('cudnn_version', '-')}), "
        f"Keras {keras.__version__}; TF32 {'on' if tf.config.experimental.tensor_float_32_execution_enabled() else 'off'}")
    log(f"step: keras.applications.ResNet50(weights=None, classifier_activation=None), batch {args.batch}, "
        f"{args.image_size}x{args.image_size}x3 float32, SGD(0.1, momentum 0.9), sparse softmax cross-entropy; "
        f"{args.steps} measured steps after 1 (tracing)")
    log(f"stages wrapped: the four between {', '.join(CUTS)} (stem and head plain)")
    log()


def build_parts(image_size: int):
    """The full model, and its stem, stages and head as Keras models over the same layers."""
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3), classes=1000,
                                        classifier_activation=None)
    outputs = [model.get_layer(name).output for name in CUTS]
    stem = keras.Model(model.input, outputs[0])
    stages = [keras.Model(start, end) for start, end in zip(outputs, outputs[1:])]
    head = keras.Model(outputs[-1], model.output)
    return model, stem, stages, head


def make_loss_fn(parts, recompute: bool):
    """Forward pass and loss; with `recompute`, each stage's activations are recomputed in the backward pass."""
    import tensorflow as tf

    _, stem, stages, head = parts

    def call(stage):
        return lambda x: stage(x, training=True)

    runners = [tf.recompute_grad(call(stage)) if recompute else call(stage) for stage in stages]

    def loss_fn(images, labels):
        x = stem(images, training=True)
        for run in runners:
            x = run(x)
        logits = head(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    return loss_fn


def make_functions(parts, optimizer, recompute: bool):
    """(gradients only, a whole training step), both traced functions."""
    import tensorflow as tf

    model = parts[0]
    loss_fn = make_loss_fn(parts, recompute)

    @tf.function
    def gradients(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(images, labels)
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(images, labels)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return gradients, train_step


def measure(train_step, batch, device: str, steps: int) -> dict:
    """The steps' peak, what was in use before them, and the median step time; the first step (tracing,
    algorithm search) is not counted."""
    import tensorflow as tf

    float(train_step(*batch))
    peaks, times, before = [], [], None
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        started = time.perf_counter()
        float(train_step(*batch))  # reading the loss waits for the step
        times.append(time.perf_counter() - started)
        peaks.append(tf.config.experimental.get_memory_info(device)["peak"])
    return {"peak": max(peaks), "before": before, "step_s": statistics.median(times)}


def gradient_difference(model, plain, recomputed) -> tuple[float, float, str]:
    """max |plain - recomputed| over the largest |plain| gradient (the model's scale), and the worst variable's
    own ratio with its name."""
    import numpy as np

    largest = max(float(np.max(np.abs(g))) for g in plain) or 1.0
    overall, worst, worst_name = 0.0, 0.0, "-"
    for variable, a, b in zip(model.trainable_variables, plain, recomputed):
        a, b = np.asarray(a), np.asarray(b)
        difference = float(np.max(np.abs(a - b)))
        overall = max(overall, difference / largest)
        own = difference / (float(np.max(np.abs(a))) or 1.0)
        if own > worst:
            worst, worst_name = own, variable.path
    return overall, worst, worst_name


def describe(name: str, figures: dict) -> str:
    return (f"{name:<16} peak {figures['peak'] / MIB:9.1f} MiB, in use before the step {figures['before'] / MIB:8.1f} "
            f"MiB, the step's own {(figures['peak'] - figures['before']) / MIB:9.1f} MiB; step {figures['step_s'] * 1000:8.1f} ms")


def run(log: Log, args: argparse.Namespace) -> int:
    import keras
    import tensorflow as tf

    with tf.device(args.device):
        parts = build_parts(args.image_size)
        optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        optimizer.build(parts[0].trainable_variables)
        batch = (tf.random.normal([args.batch, args.image_size, args.image_size, 3], seed=1),
                 tf.random.uniform([args.batch], 0, 1000, dtype=tf.int32, seed=2))
        plain_gradients, plain_step = make_functions(parts, optimizer, recompute=False)
        reference = [tf.identity(g) for g in plain_gradients(*batch)]  # before any step changes the weights
        try:
            recompute_gradients, recompute_step = make_functions(parts, optimizer, recompute=True)
            recomputed = recompute_gradients(*batch)
        except Exception as err:  # noqa: BLE001 - any failure is the answer
            log(f"answer: tf.recompute_grad does not work in Keras 3: {type(err).__name__}: "
                f"{str(err).strip().splitlines()[0][:400] if str(err).strip() else ''}")
            log(describe("plain", measure(plain_step, batch, args.device, args.steps)))
            return 0
        overall, worst, worst_name = gradient_difference(parts[0], reference, recomputed)
        log(f"gradients, recompute_grad vs plain: max |difference| {overall:.2e} of the largest gradient; worst "
            f"variable {worst_name}: {worst:.2e} of its own largest")
        del reference, recomputed
        plain = measure(plain_step, batch, args.device, args.steps)
        log(describe("plain", plain))
        recompute = measure(recompute_step, batch, args.device, args.steps)
        log(describe("recompute_grad", recompute))
    saved = plain["peak"] - recompute["peak"]
    log(f"answer: recompute_grad on the four stages {'saves' if saved > 0 else 'does not save'} memory here: peak "
        f"{plain['peak'] / MIB:.1f} -> {recompute['peak'] / MIB:.1f} MiB ({-saved / plain['peak']:+.1%}); step "
        f"{plain['step_s'] * 1000:.1f} -> {recompute['step_s'] * 1000:.1f} ms "
        f"({recompute['step_s'] / plain['step_s'] - 1:+.0%})")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder for gpu-peers-tf-recompute-grad.txt")
    parser.add_argument("--device", default="GPU:0", help="GPU:0 or CPU:0 (GPU:0)")
    parser.add_argument("--batch", type=int, default=64, help="the batch both steps train (64)")
    parser.add_argument("--image-size", type=int, default=224, help="square image side (224)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after the first (3)")
    args = parser.parse_args(argv)
    kind, _, index = args.device.upper().partition(":")
    if kind not in ("GPU", "CPU") or not index.isdigit():
        parser.error(f"--device: {args.device!r} is not GPU:N or CPU:N")
    args.device = f"{kind}:{index}"
    if args.batch < 1:
        parser.error(f"--batch: {args.batch} is not a positive batch size")
    if args.image_size < 32:
        parser.error(f"--image-size: {args.image_size} is below 32, ResNet-50's total stride")
    if args.steps < 1:
        parser.error(f"--steps: {args.steps} is not a positive number of steps")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out: {args.out} exists and is not a folder")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault(TF_CPU_ALLOCATOR_USE_BFC, "true")  # read once, when TensorFlow makes the allocator
    os.environ.setdefault(TF_CPP_MIN_LOG_LEVEL, "2")
    try:
        import tensorflow as tf
    except ImportError as err:
        print(f"tf_recompute_grad.py only runs where TensorFlow is installed ({err})", file=sys.stderr)
        return 2
    if args.device.startswith("GPU"):
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            print(f"--device: {args.device}, but TensorFlow sees no GPU here (use --device CPU:0)", file=sys.stderr)
            return 2
        for gpu in gpus:  # the step's peak is the measure, not what TensorFlow maps at start
            tf.config.experimental.set_memory_growth(gpu, True)
    log = Log(Path(args.out) / TXT)
    try:
        header(log, args)
        return run(log, args)
    finally:
        log(f"tf-recompute-grad: done in {time.monotonic() - STARTED:.0f} s")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
