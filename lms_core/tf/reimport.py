"""Turn an edited GraphDef of a traced step back into a callable that updates the same variables.

The step's graph reads its variables through captured resource handles; the re-imported function
takes those handles as inputs and is called with the real ones, so updates land in the original
variables. Ops that must run without producing an output (variable writes, allreduces) are the
FuncGraph's control outputs; the outputs are made to depend on them so nothing is pruned.
"""
from __future__ import annotations

import tensorflow as tf

IMPORT_SCOPE = "lms_step"


class RewrittenStep:
    """Called like the original step: same inputs, same outputs, same variables updated.

    Besides the callable: `graph_def` (the rewritten graph), `concrete` (the traced original),
    `planning` (lms_core.planning: the plan, its report, and the IR, tuning and simulation behind it),
    the device pair the rewrite placed its ops on, and `host_ops` (the added ops on the host)."""

    def __init__(self, concrete, graph_def, planning, compute_device: str = "", host_device: str = "",
                 host_ops: frozenset[str] = frozenset()):
        self.graph_def = graph_def
        self.concrete = concrete
        self.planning = planning
        self.compute_device = compute_device
        self.host_device = host_device
        self.host_ops = host_ops
        graph = concrete.graph
        captured = {id(internal) for _, internal in graph.captures}
        self._data_inputs = [t for t in graph.inputs if id(t) not in captured]
        self._captures = [external for external, _ in graph.captures]
        self._variables = tuple(graph.variables)  # held, as the captured handles are: the step uses them
        self._structured_outputs = concrete.structured_outputs
        self._function = self.instantiate()

    @property
    def plan(self):
        """What is swapped (lms_core.plan.Plan)."""
        return self.planning.plan

    @property
    def report(self):
        """The plan with its target and prediction (lms_core.report.PlanReport)."""
        return self.planning.report

    @property
    def variables(self) -> list:
        """The resource variables the step reads or writes (weights, optimizer state)."""
        return list(self._variables)

    def instantiate(self):
        """A new TensorFlow function of the rewritten graph. Each one is partitioned and placed on
        its first call, which is when TensorFlow reports its partition graphs (lms_core.tf.gating)."""
        graph = self.concrete.graph
        input_names = [t.name for t in self._data_inputs] + [internal.name for _, internal in graph.captures]
        output_names = [t.name for t in graph.outputs]
        control_names = sorted(op.name for op in graph.control_outputs)
        signature = [tf.TensorSpec(t.shape, t.dtype) for t in self._data_inputs]
        signature += [tf.TensorSpec(internal.shape, internal.dtype) for _, internal in graph.captures]
        graph_def = self.graph_def

        def imported(*args):
            results = tf.graph_util.import_graph_def(
                graph_def, input_map=dict(zip(input_names, args)),
                return_elements=output_names + control_names, name=IMPORT_SCOPE)
            outputs, must_run = results[:len(output_names)], results[len(output_names):]
            with tf.control_dependencies(must_run):
                return [tf.identity(o) for o in outputs]

        return tf.compat.v1.wrap_function(imported, signature)

    def call_with(self, function, *args):
        """Runs `function` (this step's, or one from `instantiate`) on `args` with the real variables.
        A traced step's ops carry no device of their own: TensorFlow places them on the device of the
        call when it instantiates the function, so the call is made on the compute device (the
        swap-outs and gated swap-ins name the host themselves)."""
        with tf.device(self.compute_device or None):
            results = function(*tf.nest.flatten(args), *self._captures)
        return tf.nest.pack_sequence_as(self._structured_outputs, results)

    def __call__(self, *args):
        return self.call_with(self._function, *args)
