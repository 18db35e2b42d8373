"""The link model, the cost model and the simulator, on hand-checkable graphs and against Grappler."""
from __future__ import annotations

import math

import pytest

from lms_core.config import LMSConfig
from lms_core.costs import PROFILES, op_flops, op_seconds
from lms_core.graph import Graph, Op, TensorInfo
from lms_core.link import INFINITE, NAMED_LINKS, LinkRates, link_named, pcie_link
from lms_core.plan import Plan, Swap, SwapIn
from lms_core.planner import plan_swaps
from lms_core.simulator import SimulationStalled, simulate
from benchmarks.architectures import resnet50_imagenet, training_step
from tests.fixtures import MIB, analyzed, chain_step, conv_graph, tiny_step, unit_costs


def test_a_number_of_gb_per_s_sets_both_directions_whatever_its_spelling():
    for spelling in (25, 25.0, "25", "25GB/s"):
        rates = link_named(spelling)
        assert rates.h2d_bytes_per_s == rates.d2h_bytes_per_s == 25e9
    assert link_named(link_named(12.5).name) == link_named(12.5)  # a stated rate's name reads back as it
    with pytest.raises(ValueError, match="unknown link 'pcie9'; use auto, pcie3"):
        link_named("pcie9")
    with pytest.raises(ValueError, match="must be > 0"):
        link_named(0)


def test_a_measured_link_rate_is_the_slope_of_copy_time_not_one_copy_s_average():
    from lms_core.tf.bandwidth import fit_copy_times

    # 20 us per copy plus 12 GB/s: a 16 MiB copy alone would read as 16 MiB / 1.418 ms = 11.83 GB/s.
    timings = {size: 20e-6 + size / 12e9 for size in (16 << 20, 64 << 20, 256 << 20)}
    rate, latency = fit_copy_times(timings)
    assert rate == pytest.approx(12e9) and latency == pytest.approx(20e-6)


def test_pcie_rates_scale_with_lanes():
    assert pcie_link(4, 16).h2d_bytes_per_s == NAMED_LINKS["pcie4"].h2d_bytes_per_s
    assert pcie_link(4, 8).h2d_bytes_per_s == NAMED_LINKS["pcie4"].h2d_bytes_per_s / 2
    assert pcie_link(3, 16).name == "pcie3x16"


def test_convolution_flops_and_roofline_time():
    g = conv_graph()
    assert op_flops(g, g["conv"]) == 2 * 8 * 32 * 32 * 32 * (3 * 3 * 16)  # 2 x outputs x window
    v100 = PROFILES["v100"]
    expected = 2 * 8 * 32 * 32 * 32 * 144 / (v100.flops_per_s * v100.compute_efficiency) + v100.launch_overhead_s
    assert op_seconds(g, g["conv"], v100) == pytest.approx(max(expected, 0))


def test_without_swaps_the_peak_is_what_is_live_at_once():
    g = analyzed(tiny_step())
    result = simulate(g, Plan(settings={}), unit_costs(g), INFINITE)
    # conv (4 MiB) is read by relu; while relu runs both are live, with x (1 MiB) held for the
    # filter gradient, pool_grad and relu_grad's inputs later; 4 + 4 + 1 MiB live plus small ones.
    assert result.peak_device_bytes >= 9 * MIB
    assert result.stall_time_s == 0 and result.transfer_time_s == 0 and result.hidden_share == 1.0
    assert result.step_time_s == pytest.approx(result.compute_time_s)


CHAIN_LMS = LMSConfig(swapout_threshold=4, swapin_ahead=1, min_tensor_bytes=MIB)


def test_swapping_lowers_the_simulated_peak_and_levels_are_reported():
    g = chain_step()
    baseline = simulate(g, Plan(settings={}), unit_costs(g), INFINITE)
    plan = plan_swaps(g, CHAIN_LMS)
    assert [s.tensor for s in plan.swaps] == ["a:0", "b:0"]  # c is read right after the forward pass
    swapped = simulate(g, plan, unit_costs(g), INFINITE, keep_timeline=True)
    # When grad_b starts: a, b, c, seed and grad_c, and grad_b itself. Buffers freed at the instant
    # another is allocated still count (Grappler's trace does the same): 6 x 4 MiB.
    assert baseline.peak_device_bytes == 6 * 4 * MIB
    assert swapped.peak_device_bytes < baseline.peak_device_bytes
    levels = [level for level, _ in swapped.device_by_level]
    assert levels == sorted(levels) and len(levels) == len({op.level for op in g.ops.values()})
    assert max(b for _, b in swapped.device_by_level) <= swapped.peak_device_bytes
    assert dict(swapped.resident_at_peak).keys() <= {"c:0", "gradient_tape/seed:0", "gradient_tape/grad_c:0",
                                                     "lms/swapin_b_0_0", "gradient_tape/grad_b:0",
                                                     "lms/swapin_a_0_0", "a:0", "b:0", "loss:0", "ones:0"}


def test_a_slow_link_stalls_and_a_fast_one_hides_the_copies():
    g = chain_step()
    plan = plan_swaps(g, CHAIN_LMS)
    slow = LinkRates("slow", 1 * MIB, 1 * MIB, "test")  # 4 s per copy of a 4 MiB activation
    fast = LinkRates("fast", 1e15, 1e15, "test")
    slow_run = simulate(g, plan, unit_costs(g), slow)
    fast_run = simulate(g, plan, unit_costs(g), fast)
    assert slow_run.transfer_time_s == pytest.approx(4 * 4.0)  # two tensors, out and back
    assert slow_run.stall_time_s > 0 and slow_run.step_time_s > fast_run.step_time_s
    assert slow_run.hidden_share < 1.0
    # With swapin_ahead 1 no op runs between trigger and consumer, so even a fast copy is not
    # hidden, it only takes no time to speak of.
    assert fast_run.stall_time_s < 1e-6
    assert slow_run.peak_host_bytes == 8 * MIB and fast_run.peak_host_bytes <= 8 * MIB
    # A slow swap-out holds its device buffer until the copy is done: never less device memory.
    assert slow_run.peak_device_bytes >= fast_run.peak_device_bytes


@pytest.mark.parametrize("sync_mode", [0, 1, 2, 3])
def test_an_infinite_link_is_the_limit_of_ever_faster_links(sync_mode):
    """A copy, however fast, ends after the op that started it: the op waiting for it allocates its
    output after the frees of that instant, so zero-time copies give the same peak as tiny ones."""
    g = chain_step()
    plan = plan_swaps(g, LMSConfig(swapout_threshold=4, swapin_ahead=1, sync_mode=sync_mode, min_tensor_bytes=MIB))
    instant = simulate(g, plan, unit_costs(g), INFINITE)
    nearly = simulate(g, plan, unit_costs(g), LinkRates("fast", 1e21, 1e21, "test"))
    assert instant.peak_device_bytes == nearly.peak_device_bytes
    assert instant.step_time_s == pytest.approx(nearly.step_time_s)


def unet3d_paper(size: int):
    """The paper recipe's 3D U-Net (Isensee et al. 2017: 4 channels, 3 labels, 5 levels from 16
    filters) at size^3, batch 1."""
    def build():
        from launcher.rank.tasks.unet3d import unet3d

        return (unet3d([size, size, size, 4], labels=3, levels=5, base_filters=16),
                ((1, size, size, size, 4), (1, size, size, size)))
    return build


# The papers' two steps, the U-Net with threshold 4 and synchronous copies (sync mode 3), ResNet-50
# with the defaults (backward branches ordered, backward tensors swapped too), each swap-in triggered
# by the op right before its consumer (swapin_ahead 1).
UNET_RECIPE_LMS = LMSConfig(enabled=True, swapout_threshold=4, swapin_ahead=1, sync_mode=3)
AGAINST_GRAPPLER = [("resnet50", batch, LMSConfig(enabled=True, swapin_ahead=1)) for batch in (32, 64, 128)]
AGAINST_GRAPPLER += [("unet3d", size, UNET_RECIPE_LMS) for size in (96, 144, 192)]


@pytest.mark.parametrize("model, size, config", AGAINST_GRAPPLER,
                         ids=[f"{model}-{size}" for model, size, _ in AGAINST_GRAPPLER])
def test_the_simulator_and_grappler_agree_on_the_unswapped_step_and_both_see_the_swaps(model, size, config):
    """Two models written apart, of one schedule: without swaps they count the same tensors over the
    same order of ops, so their peaks agree but for where each breaks ties between ready ops (5%).
    With swaps they part ways by design (Grappler's swap-in runs just before its consumer, the
    simulator's allocates when its copy starts), so there each is held to what it must show: the
    swaps lower both peaks, and a real link never needs less memory, nor less time, than an instant one."""
    pytest.importorskip("tensorflow")
    import lms_core.tf as lms_tf
    from lms_core.costs import step_costs

    build = resnet50_imagenet(size) if model == "resnet50" else unet3d_paper(size)
    _, _, step, specs, _ = training_step(build)
    rewritten = lms_tf.rewrite(step, *specs, config=config)
    assert rewritten.plan.swaps
    estimate = lms_tf.estimate_rewrite(rewritten, 1 << 40)
    graph, plan = rewritten.planning.graph, rewritten.plan
    costs = step_costs(graph, PROFILES["v100"])
    sim_base = simulate(rewritten.planning.traced, Plan(settings=plan.settings), costs, INFINITE)  # no LMS, no order
    sim_lms = simulate(graph, plan, costs, INFINITE)
    assert sim_base.peak_device_bytes == pytest.approx(estimate.baseline_bytes, rel=0.05)
    assert sim_lms.peak_device_bytes < sim_base.peak_device_bytes
    assert estimate.lms_bytes < estimate.baseline_bytes
    for link in ("nvlink2", "pcie3"):
        real = simulate(graph, plan, costs, NAMED_LINKS[link])
        assert real.peak_device_bytes >= sim_lms.peak_device_bytes
        assert real.step_time_s >= sim_lms.step_time_s and not math.isnan(real.hidden_share)


def test_both_estimates_count_an_ops_outputs_with_what_its_predecessor_frees_as_it_ends():
    """A residual join and its ReLU, `relu(x * 2 + x * 3)`, every tensor 64 MiB. Freed before the
    next op allocates, no moment would hold more than three tensors (the add's two inputs and its
    output). Grappler's estimate, the bench's judge, allocates an op's outputs in the instant its
    predecessor's inputs are released and counts both: four tensors, 256 MiB, and so does the
    simulator. At a ResNet-50 block's join this is four stem-sized tensors that no plan of swaps
    can take away: every later forward op depends on the ReLU, so nothing can run between the two
    (docs/lms.md, "Past the floor": the batch the estimate allows with swaps ends at 1317)."""
    pytest.importorskip("tensorflow")
    import tensorflow as tf

    from lms_core.tf.capture import graph_ir
    from lms_core.tf.estimate import estimate_peak

    n = 16 * MIB  # float32 elements: 64 MiB a tensor

    @tf.function
    def join_then_relu(x):
        return tf.reduce_sum(tf.nn.relu(x * 2.0 + x * 3.0))

    concrete = join_then_relu.get_concrete_function(tf.TensorSpec([n], tf.float32))
    grappler = estimate_peak(concrete.graph.as_graph_def(), concrete, 1 << 40).device_bytes
    graph = analyzed(graph_ir(concrete.graph))
    simulated = simulate(graph, Plan(settings={}), unit_costs(graph), INFINITE).peak_device_bytes
    assert grappler == pytest.approx(4 * 64 * MIB, abs=MIB)
    assert simulated == pytest.approx(4 * 64 * MIB, abs=MIB)


def test_swapin_ahead_holds_the_copy_longer_in_the_simulator_and_changes_nothing_in_grappler():
    """What Grappler cannot see: a swap-in triggered earlier holds its buffer longer on a GPU (the
    _Recv allocates it as soon as the host sends), so the simulator's peak grows with swapin_ahead;
    Grappler runs the _Recv just before the consumer anyway, and its estimate stays put."""
    pytest.importorskip("tensorflow")
    import lms_core.tf as lms_tf
    from lms_core.costs import step_costs

    _, _, step, specs, _ = training_step(resnet50_imagenet(32))
    grappler, simulated = [], []
    for ahead in (1, 4):
        rewritten = lms_tf.rewrite(step, *specs, config=LMSConfig(enabled=True, swapin_ahead=ahead))
        grappler.append(lms_tf.estimate_rewrite(rewritten, 1 << 40).lms_bytes)
        graph = rewritten.planning.graph
        simulated.append(simulate(graph, rewritten.plan, step_costs(graph, PROFILES["v100"]), INFINITE).peak_device_bytes)
    assert grappler[1] == grappler[0]
    assert simulated[1] > simulated[0]


def test_a_plan_that_deadlocks_names_the_waits_that_hold_it_up():
    """b waits for the copy out of c, which b's own output feeds: c can never be made, b never runs,
    and the simulator says which op waits for which tensor's copy (what the access-order planner
    drops before it replays again)."""
    g = chain_step()
    swap = Swap(tensor="c:0", producer_type="Relu", shape=[4, 256, 256, 4], dtype="float32", nbytes=4 * MIB,
                producer_level=g["c"].level, swap_out="lms/swapout_c_0",
                swap_ins=[SwapIn(name="lms/swapin_c_0_0", trigger="gradient_tape/seed",
                                 trigger_level=g["gradient_tape/seed"].level, consumers=["gradient_tape/grad_c"],
                                 consumer_levels=[g["gradient_tape/grad_c"].level])],
                waiters=["b"])
    with pytest.raises(SimulationStalled) as stalled:
        simulate(g, Plan(settings={"sync_mode": 1}, swaps=[swap]), unit_costs(g), INFINITE)
    assert stalled.value.waiting_for_copies_out == {"c:0": ["b"]}
    assert stalled.value.parked == {}


def test_a_buffer_made_and_released_in_the_instant_a_copy_arrives_is_released_after_it_is_made():
    """a is swapped out and brought back for gradient_tape/r, a Reshape that takes no time, read by
    gradient_tape/e, which takes none either. r waits for the copy, so its output is allocated after
    that instant's frees, and e releases it at that very instant: the release must follow the
    allocation, or the buffer would count as never released (and a trace of TensorFlow's buffers
    would keep it for good)."""
    info = lambda: TensorInfo((1024, 1024), "float32", 4 * MIB)  # noqa: E731
    ops = [Op("x", "Placeholder", outputs=[TensorInfo((4,), "float32", 16)]),
           Op("a", "Relu", inputs=["x:0"], outputs=[info()]),
           Op("b", "Relu", inputs=["a:0"], outputs=[info()]),
           Op("loss", "Sum", inputs=["b:0"], outputs=[TensorInfo((), "float32", 4)]),
           Op("gradient_tape/g", "Mul", inputs=["loss:0"], outputs=[info()]),
           Op("gradient_tape/r", "Reshape", inputs=["a:0"], outputs=[info()]),
           Op("gradient_tape/e", "ExpandDims", inputs=["gradient_tape/r:0"], outputs=[info()]),
           Op("gradient_tape/out", "Mul", inputs=["gradient_tape/e:0", "gradient_tape/g:0"], outputs=[info()])]
    g = analyzed(Graph(ops, outputs=["loss:0"]))
    swap = Swap(tensor="a:0", producer_type="Relu", shape=[1024, 1024], dtype="float32", nbytes=4 * MIB,
                producer_level=g["a"].level, swap_out="lms/swapout_a_0",
                swap_ins=[SwapIn(name="lms/swapin_a_0_0", trigger="gradient_tape/g",
                                 trigger_level=g["gradient_tape/g"].level, consumers=["gradient_tape/r"],
                                 consumer_levels=[g["gradient_tape/r"].level])])
    costs = {**unit_costs(g), "gradient_tape/r": 0.0, "gradient_tape/e": 0.0}
    result = simulate(g, Plan(settings={}, swaps=[swap]), costs, LinkRates("slow", MIB, MIB, "test"),
                      keep_events=True)
    r_events = [(e.time, e.nbytes) for e in result.memory_events if e.buffer == "gradient_tape/r:0"]
    assert len(r_events) == 2 and r_events[0][0] == r_events[1][0]  # made and released in one instant
    assert r_events[0][1] > 0 > r_events[1][1]  # in that order
