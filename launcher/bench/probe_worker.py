"""`python -m launcher.bench.probe_worker --memory-optimizer off|swapping -- WORKER ARGS`: one probe of
`lms-launch bench --judge run`, which is one rank of `launcher.worker` with Grappler's memory
optimizer set for the functions it runs.

TensorFlow runs Grappler on every `tf.function` it instantiates, with the rewriter options of the
thread's function-call options. Its default memory optimizer level (DEFAULT_MEM_OPT) already runs
the swapping heuristic on a GPU; `off` (NO_MEM_OPT) turns it off for the rows that measure no
swapping and lms-launch, `swapping` (SWAPPING_HEURISTICS) turns it on for the Grappler row. It is
set before the worker builds anything, without starting TensorFlow's devices (the worker must still
choose them: one GPU, or two logical CPU devices for LMS).
"""
from __future__ import annotations

import argparse
import sys

MODES = {"off": "NO_MEM_OPT", "swapping": "SWAPPING_HEURISTICS"}


def set_memory_optimizer(mode: str) -> None:
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    options = context.context().function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(options.config_proto_serialized)
    config.graph_options.rewrite_options.memory_optimization = getattr(rewriter_config_pb2.RewriterConfig, MODES[mode])
    options.config_proto_serialized = config


def memory_optimizer_in_force() -> str:
    """The memory optimizer level the thread's functions are optimized with (for the test)."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    config.ParseFromString(context.context().function_call_options.config_proto_serialized)
    return rewriter_config_pb2.RewriterConfig.MemOptType.Name(config.graph_options.rewrite_options.memory_optimization)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.bench.probe_worker", description=__doc__)
    parser.add_argument("--memory-optimizer", choices=sorted(MODES), required=True)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then launcher.worker's arguments")
    args = parser.parse_args(argv)
    worker_args = args.worker_args[1:] if args.worker_args[:1] == ["--"] else args.worker_args
    # launcher.worker sets the allocator environment TensorFlow reads at import: import it first.
    from launcher import worker

    set_memory_optimizer(args.memory_optimizer)
    print(f"lms-launch bench probe: Grappler memory optimizer {memory_optimizer_in_force()}", flush=True)
    return worker.main(worker_args)


if __name__ == "__main__":
    sys.exit(main())
