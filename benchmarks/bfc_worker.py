"""One process of benchmarks/bfc_model.py: builds a model and runs its training step a few times on
the CPU, with TensorFlow's BFC allocator as the environment sets it (`TF_CPU_ALLOCATOR_USE_BFC`,
`TF_CPU_BFC_MEM_LIMIT_IN_MB`).

    python -m benchmarks.bfc_worker MODEL SIZE [--steps 2] [--trace FILE]

Exit 0 when every step ran, 1 with TensorFlow's out-of-memory message when the allocator refused. With
`--trace` the profiler records every allocation from before the first tensor to the end (the probes
run the same code without it). What the process does must not depend on the limit or on the recording:

- one inter-op and one intra-op thread, so the executor runs one op at a time in one order;
- Python's cyclic garbage collector off, so no tensor is freed at a moment that depends on how
  many Python objects the profiler made;
- the same batch for every step, made once before the first.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(model: str, size: int):
    """(model builder for benchmarks.architectures.training_step, description) for MODEL at SIZE."""
    import keras

    if model == "resnet50":
        def make():
            net = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10,
                                              classifier_activation=None)
            return net, ((8, size, size, 3), (8,))
        return make, f"ResNet-50 {size}x{size}x3, batch 8, 10 classes"
    if model == "unet3d":
        from launcher.rank.tasks.unet3d import unet3d

        def make():  # recipes/unet3d-cpu.yaml's network (Isensee et al.: 4 levels, 8 base filters, 3 labels)
            return unet3d([size, size, size, 4], labels=3, levels=4, base_filters=8), ((1, size, size, size, 4),
                                                                                      (1, size, size, size))
        return make, f"3D U-Net {size}^3x4, 4 levels, 8 base filters, batch 1"
    if model == "densenet_block":
        from benchmarks import architectures

        def make():
            net, _ = architectures.dense_block()
            return net, ((size, 16, 16, 8), (size,))
        return make, f"DenseNet block (benchmarks/architectures.py) 16x16x8, batch {size}"
    raise ValueError(f"unknown model {model!r}")


def executor(kind: str):
    """TensorFlow's single-threaded executor runs the step's kernels one at a time in one fixed
    order; the default executor, even with one inter-op thread, runs inexpensive kernels inline on
    the calling thread beside the pool's, and the order of independent ops (and so the allocation
    trace) changes from run to run."""
    import contextlib

    import tensorflow as tf

    if kind == "single":
        return tf.experimental.function_executor_type("SINGLE_THREADED_EXECUTOR")
    return contextlib.nullcontext()


RESERVE_MARGIN = 2 << 20  # the first region, made for the small tensors allocated before the reserve


def reserve_pool() -> None:
    """Turns TensorFlow's CPU allocator, which grows by regions of 2, 4, 8, ... MiB that never merge,
    into one region of (nearly) the whole limit, as a GPU's BFC allocator has by default: a first
    tensor of the limit less 2 MiB makes the allocator take everything the limit leaves in one region
    (its next region size, doubled past the request, is cut to what is left); freed at once, it
    leaves one free chunk. Without a limit it does nothing."""
    import tensorflow as tf

    limit_mib = int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "0"))
    if limit_mib <= 2:
        return
    block = tf.zeros([((limit_mib << 20) - RESERVE_MARGIN) // 4], tf.float32)
    del block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.bfc_worker")
    parser.add_argument("model")
    parser.add_argument("size", type=int)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trace", help="record the allocations and write them, with the outcome, here (JSON)")
    parser.add_argument("--executor", choices=("single", "default"), default="single")
    parser.add_argument("--grappler", choices=("on", "off"), default="on")
    parser.add_argument("--reserve", action="store_true",
                        help="first allocate (and free) one tensor of the whole limit less 2 MiB (see reserve_pool)")
    args = parser.parse_args(argv)
    gc.disable()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # oneDNN's kernels abort the process when an allocation fails inside them (mkl_util.h: "'tensor'
    # Must be non NULL"), losing the trace; TensorFlow's own (Eigen) kernels raise ResourceExhausted.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if args.grappler == "off":
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    recorder = None
    if args.trace:
        from lms_core.tf.allocations import Recorder

        recorder = Recorder()
        recorder.start()
    if args.reserve:
        reserve_pool()
    from benchmarks.architectures import training_step

    make, what = build(args.model, args.size)
    outcome = {"outcome": "ran", "oom_message": None, "failed_request_bytes": None}
    try:
        _, _, step, specs, batch = training_step(make)
        with executor(args.executor):
            for _ in range(args.steps):
                step(*batch).numpy()
    except tf.errors.ResourceExhaustedError as err:
        from lms_core.tf.allocations import failed_request_bytes

        message = str(err).splitlines()[0]
        outcome.update(outcome="oom", oom_message=message, failed_request_bytes=failed_request_bytes(str(err)))
        print(f"bfc_worker: out of memory: {message}", flush=True)
    finally:
        if recorder is not None:
            outcome["trace"] = recorder.stop().to_dict()
            Path(args.trace).write_text(json.dumps(outcome))
    if outcome["outcome"] == "oom":
        return 1
    print(f"bfc_worker: {what}: {args.steps} step(s) ran; peak {tf.config.experimental.get_memory_info('CPU:0')['peak']} B",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
