"""lms_core without TensorFlow: categories, levels and plans on small hand-built graphs.

The graph below is a training step in miniature:

    x ─ conv ─ relu ─ pool ─ loss          (forward; `loss` is the step's output)
         │      └───────────┐
         │    gradient_tape/pool_grad ─ gradient_tape/relu_grad ─ gradient_tape/conv_filter_grad ─ sgd/mul ─ sgd/assign
         └──────────────────────────────────────────────────┘                                   sgd/lr ┘
    relu is read again by relu_grad, the input batch x by conv_filter_grad, the weight w by
    conv_input_grad: all three are long-lived, but a weight is never swapped.
"""
from __future__ import annotations

import json

import pytest

from lms_core.config import LMSConfig, SettingError
from lms_core.graph import BACKWARD, FORWARD, OTHER, UPDATE, Graph, Op, TensorInfo
from lms_core.passes import Pass, run_passes
from lms_core.passes.categorize import CATEGORIZE
from lms_core.passes.levels import ASSIGN_LEVELS
from lms_core.passes.pipeline import analyze
from lms_core.planner import plan_swaps
from tests.fixtures import MIB, analyzed, t, tiny_step

def test_categories_come_from_structure_and_the_gradient_scope():
    g = analyzed(tiny_step())
    assert {n: g[n].category for n in ("conv", "relu", "pool", "loss", "w")} == dict.fromkeys(
        ("conv", "relu", "pool", "loss", "w"), FORWARD)
    assert g["gradient_tape/relu_grad"].category == BACKWARD
    assert g["gradient_tape/conv_filter_grad"].category == BACKWARD
    assert g["sgd/mul"].category == UPDATE and g["sgd/assign"].category == UPDATE
    assert g["x"].category == OTHER and g["ones"].category == OTHER


def test_collectives_and_everything_after_them_are_updates():
    extra = [Op("allreduce", "HorovodGroupedAllreduce", inputs=["gradient_tape/conv_filter_grad:0"], outputs=[t(0.01)]),
             Op("sgd/mul2", "Mul", inputs=["allreduce:0"], outputs=[t(0.01)]),
             Op("sgd/assign2", "AssignVariableOp", inputs=["w_handle:0", "sgd/mul2:0"])]
    g = analyzed(tiny_step(extra))
    assert [g[n].category for n in ("allreduce", "sgd/mul2", "sgd/assign2")] == [UPDATE] * 3
    assert g["gradient_tape/conv_filter_grad"].category == BACKWARD


def test_levels_climb_along_every_edge_and_backward_follows_forward():
    g = analyzed(tiny_step())
    for op in g.ops.values():
        for pred in g.predecessors(op):
            assert g[pred].level < op.level, (pred, op.name)
    last_forward = max(op.level for op in g.ops.values() if op.category == FORWARD)
    assert min(op.level for op in g.ops.values() if op.category == BACKWARD) == last_forward + 1
    # The gradient seed needs only a constant, yet sits after the forward phase, not at level 1.
    assert g["gradient_tape/pool_grad"].level == last_forward + 1


def test_a_pass_cannot_run_before_what_it_requires():
    with pytest.raises(ValueError, match="assign_levels requires category"):
        run_passes(tiny_step(), [ASSIGN_LEVELS, CATEGORIZE])
    later = Pass("reader", requires=frozenset({"level"}), ensures=frozenset(), run=lambda g: None)
    run_passes(analyzed(tiny_step()), [later], available=frozenset({"category", "level"}))


def test_the_long_lived_activations_are_swapped_for_their_backward_consumers():
    g = analyzed(tiny_step())
    plan = plan_swaps(g, LMSConfig(enabled=True, swapout_threshold=2, swapin_ahead=1, min_tensor_bytes=MIB),
                      data_inputs=frozenset({"x"}))
    assert [s.tensor for s in plan.swaps] == ["x:0", "relu:0"]
    relu = plan.swaps[1]
    assert relu.swap_out == "lms/swapout_relu_0" and relu.nbytes == 4 * MIB
    (swap_in,) = relu.swap_ins
    assert swap_in.name == "lms/swapin_relu_0_0"
    assert swap_in.consumers == ["gradient_tape/relu_grad"]  # not the Shape op: it reads only metadata
    assert swap_in.trigger == "gradient_tape/pool_grad"  # the backward op right before the consumer
    assert plan.swapped_bytes == 5 * MIB
    assert any(s.tensor == "w:0" and "never swapped" in s.reason for s in plan.skipped)


def test_near_consumers_are_not_worth_a_swap():
    g = analyzed(tiny_step())
    distance = g["gradient_tape/relu_grad"].level - g["relu"].level
    assert plan_swaps(g, LMSConfig(swapout_threshold=distance, min_tensor_bytes=0)).swaps
    assert not [s for s in plan_swaps(g, LMSConfig(swapout_threshold=distance + 1, min_tensor_bytes=0)).swaps
                if s.tensor == "relu:0"]


def test_size_floor_scope_and_type_filters():
    g = analyzed(tiny_step())
    base = dict(enabled=True, swapout_threshold=1, swap_backward=False)  # forward tensors only, here
    assert not plan_swaps(g, LMSConfig(**base, min_tensor_bytes=8 * MIB)).swaps
    assert plan_swaps(g, LMSConfig(**base, min_tensor_bytes=8 * MIB)).skipped_small == 2  # relu and pool
    assert not plan_swaps(g, LMSConfig(**base, exclude_types=["Relu"])).swaps
    assert "lms.exclude_types" in plan_swaps(g, LMSConfig(**base, exclude_types=["Relu"])).skipped[-1].reason
    assert not plan_swaps(g, LMSConfig(**base, include_scopes=["encoder/"])).swaps
    assert [s.tensor for s in plan_swaps(g, LMSConfig(**base, include_types=["Relu"])).swaps] == ["relu:0"]


def test_unknown_sizes_and_control_flow_are_skipped_with_the_reason():
    g = analyzed(tiny_step(relu_bytes=None))
    plan = plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0))
    assert not plan.swaps
    assert [s.reason for s in plan.skipped if s.tensor == "relu:0"] == [
        "unknown size (shape [16, 64, 64, 16], dtype float32)"]
    cond = [Op("gradient_tape/cond", "StatelessIf", inputs=["gradient_tape/relu_grad:0", "relu:0"], outputs=[t(4)])]
    g = analyzed(tiny_step(cond))
    plan = plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0))
    assert [s.reason for s in plan.skipped if s.tensor == "relu:0"] == [
        "consumed by control flow (StatelessIf gradient_tape/cond)"]


def test_sync_modes_add_waiters():
    g = analyzed(tiny_step())
    plan = plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0, sync_mode=3))
    relu = next(s for s in plan.swaps if s.tensor == "relu:0")
    assert relu.waiters == ["pool"]  # the forward consumer waits for the swap-out
    assert relu.swap_ins[0].waiters == ["gradient_tape/relu_grad"]  # the trigger's successors wait for the swap-in
    assert plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0, sync_mode=0)).swaps[0].waiters == []


def test_a_trigger_is_never_computed_from_constants_alone():
    # Grappler folds such ops into constants and drops control edges on them.
    g = tiny_step()
    g.ops["gradient_tape/pool_grad"].inputs = ["ones:0"]
    g = analyzed(Graph(g.ops.values(), g.outputs))
    plan = plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0))
    assert "relu:0" not in [s.tensor for s in plan.swaps]
    assert [s.reason for s in plan.skipped if s.tensor == "relu:0"] == [
        "no backward op that depends on data runs before gradient_tape/relu_grad to start its swap-in"]


def test_consumers_within_groupby_levels_share_one_swap_in():
    extra = [Op("gradient_tape/second_use", "Mul", inputs=["gradient_tape/relu_grad:0", "relu:0"], outputs=[t(4)])]
    g = analyzed(tiny_step(extra))
    separate = plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0, swapin_groupby=0))
    shared = plan_swaps(g, LMSConfig(swapout_threshold=1, min_tensor_bytes=0, swapin_groupby=5))
    relu = lambda plan: next(s for s in plan.swaps if s.tensor == "relu:0")  # noqa: E731
    assert [si.consumers for si in relu(separate).swap_ins] == [["gradient_tape/relu_grad"], ["gradient_tape/second_use"]]
    assert [si.consumers for si in relu(shared).swap_ins] == [["gradient_tape/relu_grad", "gradient_tape/second_use"]]


def test_plans_are_deterministic_and_json_serializable():
    config = LMSConfig(swapout_threshold=1, min_tensor_bytes=0)
    first = json.dumps(plan_swaps(analyzed(tiny_step()), config).to_dict())
    assert first == json.dumps(plan_swaps(analyzed(tiny_step()), config).to_dict())
    data = json.loads(first)
    assert {"swaps", "swapped_bytes", "settings", "skipped", "control_edges"} <= set(data)
    assert data["settings"]["swapout_threshold"] == 1


def test_the_planner_refuses_a_graph_no_analysis_has_annotated():
    with pytest.raises(ValueError, match="the planner needs category, level, region on every op: analyse"):
        plan_swaps(tiny_step(), LMSConfig())


def test_nothing_qualifies_is_said_plainly():
    plan = plan_swaps(analyzed(tiny_step()), LMSConfig(swapout_threshold=1000))
    assert plan.swaps == [] and plan.summary().startswith("LMS plan: nothing to swap")


@pytest.mark.parametrize("field, value", [("swapout_threshold", 0), ("swapin_ahead", -1), ("swapin_groupby", -2),
                                          ("sync_mode", 4), ("min_tensor_bytes", -1)])
def test_invalid_settings_name_the_key(field, value):
    with pytest.raises(SettingError) as err:
        LMSConfig(**{field: value})
    assert err.value.key == field


def test_a_cycle_is_reported_not_looped_on():
    ops = [Op("a", "Relu", inputs=["b:0"], outputs=[t(1)]), Op("b", "Relu", inputs=["a:0"], outputs=[t(1)])]
    with pytest.raises(ValueError, match="cycle"):
        Graph(ops, outputs=["a:0"])


def v1_loop_step() -> Graph:
    """The tiny step with a TF1-style while loop over `relu` whose result the step also returns, and
    a backward op that reads a tensor of the loop body (as a gradient of a v1 loop would)."""
    loop = [
        Op("loop/Enter", "Enter", inputs=["relu:0"], outputs=[t(4)]),
        Op("loop/Merge", "Merge", inputs=["loop/Enter:0", "loop/NextIteration:0"], outputs=[t(4), t(0, (), "int32")]),
        Op("loop/LoopCond", "LoopCond", inputs=["loop/Merge:0"], outputs=[t(0, (), "bool")]),
        Op("loop/Switch", "Switch", inputs=["loop/Merge:0", "loop/LoopCond:0"], outputs=[t(4), t(4)]),
        Op("loop/body", "Mul", inputs=["loop/Switch:1", "w:0"], outputs=[t(4)]),
        Op("loop/NextIteration", "NextIteration", inputs=["loop/body:0"], outputs=[t(4)]),
        Op("loop/Exit", "Exit", inputs=["loop/Switch:0"], outputs=[t(4)]),
        Op("gradient_tape/loop_grad", "Mul", inputs=["gradient_tape/relu_grad:0", "loop/body:0"], outputs=[t(4)]),
    ]
    g = tiny_step(loop)
    return Graph(g.ops.values(), outputs=["loss:0", "loop/Exit:0"])


def test_a_v1_while_loop_is_no_cycle_and_its_body_is_a_region():
    g = analyzed(v1_loop_step())  # NextIteration -> Merge is a back edge, not a cycle
    assert g.order.index("loop/Merge") < g.order.index("loop/NextIteration")
    assert {n: g[n].region for n in ("loop/Merge", "loop/body", "loop/NextIteration", "loop/Exit")} == dict.fromkeys(
        ("loop/Merge", "loop/body", "loop/NextIteration", "loop/Exit"), "Enter loop/Enter")
    assert g["relu"].region is None and g["gradient_tape/relu_grad"].region is None and g["loss"].region is None
    for op in g.ops.values():
        for pred in g.predecessors(op):
            assert g[pred].level < op.level, (pred, op.name)


def test_tensors_inside_v1_control_flow_are_skipped_and_never_trigger():
    g = analyzed(v1_loop_step())
    plan = plan_swaps(g, LMSConfig(swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0))
    assert [s.reason for s in plan.skipped if s.tensor == "loop/body:0"] == [
        "produced inside v1 control flow (Enter loop/Enter); a tensor there exists per iteration or branch"]
    assert "relu:0" in [s.tensor for s in plan.swaps]  # outside the loop, still swapped
    triggers = [si.trigger for s in plan.swaps for si in s.swap_ins]
    assert triggers and all(g[tr].region is None for tr in triggers)
    assert not {c for s in plan.swaps for si in s.swap_ins for c in si.consumers} & {
        n for n, op in g.ops.items() if op.region}


def test_int32_tensors_are_left_in_host_memory():
    extra = [Op("labels", "Placeholder", outputs=[t(4, dtype="int32")]),
             Op("gradient_tape/label_use", "Mul", inputs=["gradient_tape/relu_grad:0", "labels:0"], outputs=[t(4)])]
    plan = plan_swaps(analyzed(tiny_step(extra)), LMSConfig(swapout_threshold=1, min_tensor_bytes=0),
                      data_inputs=frozenset({"x", "labels"}))
    assert "labels:0" not in [s.tensor for s in plan.swaps]
    assert [s.reason for s in plan.skipped if s.tensor == "labels:0"] == [
        "int32: TensorFlow keeps int32 tensors of GPU ops in host memory already"]


def test_no_tensor_and_no_op_name_is_planned_twice():
    extra = [Op("gradient_tape/second_use", "Mul", inputs=["gradient_tape/relu_grad:0", "relu:0"], outputs=[t(4)])]
    plan = plan_swaps(analyzed(tiny_step(extra)), LMSConfig(swapout_threshold=1, min_tensor_bytes=0),
                      data_inputs=frozenset({"x"}))
    tensors = [s.tensor for s in plan.swaps]
    names = [s.swap_out for s in plan.swaps] + [si.name for s in plan.swaps for si in s.swap_ins]
    assert len(tensors) == len(set(tensors)) >= 2 and len(names) == len(set(names))
    rerouted = [(c, s.tensor) for s in plan.swaps for si in s.swap_ins for c in si.consumers]
    assert len(rerouted) == len(set(rerouted))  # each consumer reads each tensor from one swap-in only


def test_an_optimizer_without_the_gradient_scope_is_still_update():
    """Names are a hint only: strip `gradient_tape/` and the categories of data ops stay the same."""
    named = analyzed(tiny_step())
    rename = lambda s: s.replace("gradient_tape/", "")  # noqa: E731
    bare = analyzed(Graph([Op(rename(o.name), o.type, o.device, [rename(i) for i in o.inputs],
                              [rename(c) for c in o.control_inputs], o.outputs) for o in tiny_step().ops.values()],
                          outputs=["loss:0"]))
    for name, op in named.ops.items():
        if name != "gradient_tape/conv_input_grad":  # a gradient nothing reads: only the hint finds it
            assert bare[rename(name)].category == op.category, name
    assert bare["conv_input_grad"].category == "other"


def test_facts_derived_once_per_graph_are_kept_per_graph_object():
    from lms_core.graph import once_per_graph

    calls = []

    @once_per_graph
    def op_count(graph: Graph) -> int:
        calls.append(graph)
        return len(graph)

    small, larger = tiny_step(), tiny_step(extra=[Op("extra", "NoOp")])
    assert (op_count(small), op_count(small), op_count(larger)) == (len(small), len(small), len(small) + 1)
    assert calls == [small, larger]  # the second question about `small` was answered from memory
