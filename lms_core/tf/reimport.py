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
    """Called like the original step: same inputs, same outputs, same variables updated."""

    def __init__(self, concrete, graph_def, plan):
        self.plan = plan
        self.graph_def = graph_def  # the rewritten graph
        self.concrete = concrete  # the traced original
        graph = concrete.graph
        captured = {id(internal) for _, internal in graph.captures}
        self._data_inputs = [t for t in graph.inputs if id(t) not in captured]
        self._captures = [external for external, _ in graph.captures]
        self._structured_outputs = concrete.structured_outputs
        input_names = [t.name for t in self._data_inputs] + [internal.name for _, internal in graph.captures]
        output_names = [t.name for t in graph.outputs]
        control_names = sorted(op.name for op in graph.control_outputs)
        signature = [tf.TensorSpec(t.shape, t.dtype) for t in self._data_inputs]
        signature += [tf.TensorSpec(internal.shape, internal.dtype) for _, internal in graph.captures]

        def imported(*args):
            results = tf.graph_util.import_graph_def(
                graph_def, input_map=dict(zip(input_names, args)),
                return_elements=output_names + control_names, name=IMPORT_SCOPE)
            outputs, must_run = results[:len(output_names)], results[len(output_names):]
            with tf.control_dependencies(must_run):
                return [tf.identity(o) for o in outputs]

        self._function = tf.compat.v1.wrap_function(imported, signature)

    def __call__(self, *args):
        flat = tf.nest.flatten(args)
        results = self._function(*flat, *self._captures)
        return tf.nest.pack_sequence_as(self._structured_outputs, results)
