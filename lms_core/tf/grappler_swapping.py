"""TensorFlow's own swapping, the peer LMS is compared with: Grappler's memory optimizer with
`RewriterConfig.memory_optimization = SWAPPING_HEURISTICS`, run offline through
`tensorflow.python.grappler.tf_optimizer.OptimizeGraph` on the same virtual cluster that
`lms_core.tf.estimate` judges with, and then estimated the same way.

How that optimizer decides (tensorflow/core/grappler/optimizers/memory_optimizer.cc,
`IdentifySwappingCandidates` and `SwappingPass`):
- it looks only at devices of type GPU whose `memory_size` is set, and only when its own static
  estimate of the peak (GraphMemory::InferStatically) exceeds that size; it then swaps tensors live
  at the peak until the excess is covered, best first by a fitness of distances from the peak;
- a tensor qualifies when it is over 1 KiB, lives over 1 ms of the virtual schedule, is read again
  after the peak, and is not a reference or a persistent tensor;
- each qualifying *input of a consumer* gets a `_CopyFromGpuToHost` / `_CopyFromHostToGpu` pair: the
  tensor's earliest other reader waits for the swap-out (none: no swap), and the swap-in waits for
  an op upstream of the consumer that completes in time for a 16 GB/s copy (none: no swap). Other
  readers of the same tensor keep reading the original, so a tensor with several backward readers
  stays resident until the last of them unless each is swapped.

So the virtual GPU must be given the real device memory: with unbounded memory (what
`estimate_peak` gives its virtual GPU) the optimizer sees nothing to do. Every other Grappler pass
is switched off here, so the comparison is the same graph with and without its swapping.

The CPU build of TensorFlow does not register the two copy ops (they exist only with CUDA), so
Grappler's estimator cannot load a graph that has them. For the estimate, each pair becomes what it
does: the swap-out an `Identity` on the host, the swap-in an `Identity` on the host with the swap-in
trigger's control input, which Grappler's scheduler ships to the device after the trigger. That is
exactly how LMS's own gated swap-ins are estimated, so both are judged by one model.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer

from lms_core.tf.estimate import CPU, GPU, UNBOUNDED_BYTES, PeakEstimate, _device, _place, estimate_peak

SWAP_OUT_OP = "_CopyFromGpuToHost"
SWAP_IN_OP = "_CopyFromHostToGpu"

_OTHER_PASSES = ("layout_optimizer", "constant_folding", "shape_optimization", "remapping",
                 "common_subgraph_elimination", "arithmetic_optimization", "dependency_optimization",
                 "loop_optimization", "function_optimization", "debug_stripper", "scoped_allocator_optimization",
                 "pin_to_host_optimization", "implementation_selector", "auto_mixed_precision",
                 "auto_mixed_precision_mkl", "auto_mixed_precision_onednn_bfloat16", "auto_mixed_precision_cpu")


@dataclass
class GrapplerSwap:
    """One swap Grappler inserted: the consumer's input it swapped, and the swap-in's trigger."""

    tensor: str  # the swapped tensor, as the consumer read it
    consumer: str
    swap_out: str
    swap_in: str
    trigger: str  # the op whose completion lets the swap-in run


@dataclass
class GrapplerSwapping:
    graph_def: graph_pb2.GraphDef  # the optimized step, copy ops replaced by Identity (see the module doc)
    swaps: list[GrapplerSwap]
    host_ops: frozenset[str]  # the swap-outs and swap-ins, placed on the host for the estimate


def swapping_config() -> config_pb2.ConfigProto:
    """Grappler with only its memory optimizer, at SWAPPING_HEURISTICS, one round."""
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    for name in _OTHER_PASSES:
        setattr(rewrite, name, rewriter_config_pb2.RewriterConfig.OFF)
    rewrite.disable_model_pruning = True
    rewrite.disable_tfg_optimizer = True  # its MLIR import fails on the CUDA-only copy ops, loudly
    rewrite.min_graph_nodes = -1
    rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
    rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.SWAPPING_HEURISTICS
    return config


def optimize_with_swapping(graph_def: graph_pb2.GraphDef, concrete, device_memory_bytes: int) -> GrapplerSwapping:
    """The step as Grappler's swapping rewrites it for a virtual GPU of `device_memory_bytes`."""
    placed = _place(graph_def, concrete, frozenset())
    metagraph = meta_graph_pb2.MetaGraphDef(graph_def=placed)
    fetches = [t.name.rpartition(":")[0] for t in concrete.graph.outputs]
    fetches += sorted(op.name for op in concrete.graph.control_outputs)
    metagraph.collection_def["train_op"].node_list.value.extend(fetches)
    cluster = grappler_cluster.Cluster(devices=[_device(GPU, "GPU", device_memory_bytes),
                                                _device(CPU, "CPU", UNBOUNDED_BYTES)])
    try:
        optimized = tf_optimizer.OptimizeGraph(swapping_config(), metagraph, verbose=False, cluster=cluster)
    finally:
        cluster.Shutdown()
    return _as_identities(optimized)


def _as_identities(optimized: graph_pb2.GraphDef) -> GrapplerSwapping:
    nodes = {node.name: node for node in optimized.node}
    readers = {i: node.name for node in optimized.node for i in node.input if not i.startswith("^")}
    swaps, host = [], set()
    for node in optimized.node:
        if node.op not in (SWAP_OUT_OP, SWAP_IN_OP):
            continue
        host.add(node.name)
        if node.op == SWAP_IN_OP:
            source = next(i for i in node.input if not i.startswith("^"))
            trigger = next((i[1:] for i in node.input if i.startswith("^")), "")
            consumer = readers.get(node.name, "")
            swaps.append(GrapplerSwap(tensor=next(i for i in nodes[source].input if not i.startswith("^")),
                                      consumer=consumer, swap_out=source, swap_in=node.name, trigger=trigger))
    for name in host:
        node = nodes[name]
        node.op = "Identity"
        del node.attr["_class"]  # the colocation Grappler asked for: the estimate places them itself
    swaps.sort(key=lambda s: s.swap_in)
    return GrapplerSwapping(optimized, swaps, frozenset(host))


def estimate_with_swapping(graph_def: graph_pb2.GraphDef, concrete,
                           device_memory_bytes: int) -> tuple[PeakEstimate, GrapplerSwapping]:
    """Grappler's peak estimate of the step after Grappler's own swapping, for a virtual GPU of
    `device_memory_bytes` (the size the optimizer plans for and the estimate is judged against)."""
    swapping = optimize_with_swapping(graph_def, concrete, device_memory_bytes)
    estimate = estimate_peak(swapping.graph_def, concrete, device_memory_bytes, host_ops=swapping.host_ops)
    return estimate, swapping
