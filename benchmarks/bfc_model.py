"""Is the BFC model right? TensorFlow's CPU allocator (BFC, held to a limit) against lms_core.memory.bfc,
on the same steps (issue 19).

    .venv/bin/python benchmarks/bfc_model.py                    # all three parts (about 15 minutes here)
    .venv/bin/python benchmarks/bfc_model.py --part validation --only resnet50
    .venv/bin/python benchmarks/bfc_model.py --part pool
    .venv/bin/python benchmarks/bfc_model.py --part reserve

Part "validation", for 3 models x 2 sizes (ResNet-50, the CPU recipe's 3D U-Net, the DenseNet block of
benchmarks/architectures.py), each run a fresh process (benchmarks/bfc_worker.py: 2 training steps on the CPU,
one thread, TensorFlow's single-threaded executor, oneDNN off) that records its own allocations with
TensorFlow's profiler:
1. one run without a limit: its trace gives the model's first answer, where the search starts;
2. runs at whole-MiB limits (`TF_CPU_BFC_MEM_LIMIT_IN_MB`; TensorFlow takes nothing finer) until one
   runs at N MiB and one at N - 1 fails: a search outward from the model's answer by doubling steps,
   then bisection; the real allocator alone decides each probe;
3. every probe is also replayed on the model, on that probe's own trace at its limit: a run that ran
   must replay, a run that failed must fail at the very request TensorFlow refused (cut from its
   trace where the allocator's dump, NumAllocs and InUse, says the failure came);
4. the table: the real smallest limit N; the model's answer on the trace of the run at N and on the
   unlimited run's; the model's answer on the simulator's trace of the same step (lms_core.simulator's
   replay of the traced graph without the IdentityN Grappler removes, buffers as TensorFlow's runtime
   holds them, 2 steps), and on the same with the kernels' temporaries the profiler measured on the
   unlimited run (no graph has them); live peaks; the planned pool on the real trace; errors in
   percent of N.
TensorFlow's order of independent ops is not the same from one process to the next (its graph passes
do not keep node order), so each run's trace, and its smallest limit, differ a little: the spread of the
model's answers over every full trace recorded is printed too.

Part "pool", on the simulator's traces of the papers' sizes (ResNet-50 at batch 256, the 3D U-Net at
192^3; original, and rewritten by lms-launch for nvlink2 with `swapin_ahead: 1`): the planned pool
against the lower bound (the most bytes live at once), and against the GPU BFC model's requirement
(one region of the whole limit, as TensorFlow's GPU allocator has by default) on the same trace.

Part "reserve" (can a pool's saving reach a real TensorFlow run?): TensorFlow cannot place a tensor at a
planned offset; what it can be made to do is take its memory as one region. Its CPU allocator always
grows by regions of 2, 4, 8, ... MiB that never merge; a first tensor of the whole limit (less 2 MiB),
freed at once, makes it take the rest of the limit as one region (bfc_worker --reserve). For one size
of each model: the real smallest limit with and without, and the model's prediction with.

Writes benchmarks/results/bfc-model.txt (date, machine and command on top).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MIB = 1 << 20
CASES = (("resnet50", 32), ("resnet50", 64), ("unet3d", 24), ("unet3d", 32), ("densenet_block", 64),
         ("densenet_block", 256))
PROBE_TIMEOUT_S = 600
RESULTS = REPO / "benchmarks" / "results" / "bfc-model.txt"


@dataclass
class Probe:
    """One real run at a limit (None: TensorFlow's default, 64 GiB) and what the model says of its trace."""

    limit_mib: int | None
    ran: bool
    trace: object  # RecordedTrace (the run's allocations, up to its end)
    failure: object | None  # OutOfMemory, when it ran out of memory
    seconds: float
    model_agrees: bool | None = None
    model_detail: str = ""


def run_probe(model: str, size: int, limit_mib: int | None, workdir: Path, reserve: bool = False) -> Probe:
    from launcher.bench.run_judge import describe_status, out_of_memory, run_isolated
    from lms_core.tf.allocations import RecordedTrace, limit_environment, parse_out_of_memory

    out = workdir / f"{model}-{size}-{limit_mib or 'unlimited'}.json"
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", PYTHONUNBUFFERED="1")  # INFO: the allocator's dump
    environment.update(limit_environment(limit_mib * MIB) if limit_mib else {"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    started = time.perf_counter()
    argv = [sys.executable, "-m", "benchmarks.bfc_worker", model, str(size), "--trace", str(out)]
    status, output = run_isolated(argv + (["--reserve"] if reserve else []), environment, PROBE_TIMEOUT_S)
    seconds = time.perf_counter() - started
    oom = out_of_memory(output)
    if status not in (0, 1) or (status == 1 and oom is None) or not out.exists():
        tail = "\n".join(output.rstrip().splitlines()[-15:])
        raise RuntimeError(f"{model} {size} at {limit_mib} MiB failed without running out of memory "
                           f"({describe_status(status)}):\n{tail}")
    data = json.loads(out.read_text())
    out.unlink()
    failure = parse_out_of_memory(output) if status == 1 else None
    if status == 1 and failure is None:
        raise RuntimeError(f"{model} {size} at {limit_mib} MiB ran out of memory, but the allocator's dump is missing")
    return Probe(limit_mib, status == 0, RecordedTrace.from_dict(data["trace"]), failure, seconds)


def judge_probe(probe: Probe) -> None:
    """The model, on this run's own trace at its limit: the same outcome, at the same request."""
    from lms_core.memory import replay
    from lms_core.tf.allocations import until_failure

    if probe.limit_mib is None:
        probe.model_agrees, probe.model_detail = None, "(no limit)"
        return
    if probe.ran:
        result = replay(probe.trace.trace, probe.limit_mib * MIB)
        probe.model_agrees = result.ok
        probe.model_detail = "model: runs" if result.ok else f"model: {result.failure.describe()}"
        return
    trace = until_failure(probe.trace, probe.failure)
    result = replay(trace, probe.limit_mib * MIB)
    at_request = result.failure is not None and result.failure.event_index == len(trace) - 1
    probe.model_agrees = at_request
    probe.model_detail = ("model: fails at the same request" if at_request else
                          "model: runs" if result.ok else f"model fails elsewhere: {result.failure.describe()}")


def search(model: str, size: int, start_mib: int, workdir: Path, log, reserve: bool = False) -> list[Probe]:
    """Real runs until N runs and N - 1 fails: outward from `start_mib` by doubling steps, then bisection."""
    probes: dict[int, Probe] = {}

    def at(limit: int) -> bool:
        if limit not in probes:
            probe = run_probe(model, size, limit, workdir, reserve)
            judge_probe(probe)
            probes[limit] = probe
            log(f"    {limit:>6} MiB  {'runs ' if probe.ran else 'OOM  '}  {probe.seconds:5.1f} s  "
                f"{'agrees' if probe.model_agrees else 'DISAGREES'}: {probe.model_detail}"
                + ("" if probe.ran else f"  [TensorFlow: {probe.failure.rounded_bytes} B for {probe.failure.op}]"))
        return probes[limit].ran

    step = 1
    if at(start_mib):
        high, low = start_mib, start_mib - 1
        while low > 0 and at(low):
            high, step = low, step * 2
            low = max(1, high - step)
    else:
        low, high = start_mib, start_mib + 1
        while not at(high):
            low, step = high, step * 2
            high = low + step
    while high - low > 1:
        middle = (low + high) // 2
        if at(middle):
            high = middle
        else:
            low = middle
    return [probes[k] for k in sorted(probes)]


def simulated_step(model: str, size: int):
    """(graph, SimulationResult) of the same step (same model, seeds and batch as the worker's), as
    the simulator replays it: the traced IR without the IdentityN Grappler removes, v100 costs for
    the order, an infinitely fast link (nothing is swapped)."""
    from benchmarks.bfc_worker import build
    from lms_core.costs import PROFILES, step_costs
    from lms_core.link import INFINITE
    from lms_core.memory import executed_graph
    from lms_core.plan import Plan
    from lms_core.simulator import simulate
    from lms_core.tf import trace_step
    from benchmarks.architectures import training_step

    import keras

    keras.backend.clear_session()  # layer names as in a fresh process (the worker's), so op names match
    make, _ = build(model, size)
    _, _, step, specs, _ = training_step(make)
    graph = executed_graph(trace_step(step, *specs).graph)
    return graph, simulate(graph, Plan(settings={}), step_costs(graph, PROFILES["v100"]), INFINITE, keep_events=True)


def validation(only: str | None, log) -> None:
    from benchmarks.bfc_worker import build
    from lms_core.memory import plan_pool, smallest_limit, step_memory

    log("Part 1: TensorFlow's CPU BFC allocator against the model, smallest working limit (whole MiB)")
    log("each probe: limit, real outcome, seconds, and the model on that probe's own trace at that limit")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lms-bfc-") as tmp:
        workdir = Path(tmp)
        for model, size in CASES:
            if only and model != only:
                continue
            _, what = build(model, size)
            log(f"  {what}")
            started = time.perf_counter()
            unlimited = run_probe(model, size, None, workdir)
            first = smallest_limit(unlimited.trace.trace)
            log(f"    unlimited run: {len(unlimited.trace.trace)} events, recorded order consistent with the "
                f"allocator: {'yes' if not unlimited.trace.check() else unlimited.trace.check()[:2]}; "
                f"model: {first.limit_bytes // MIB} MiB")
            probes = search(model, size, first.limit_bytes // MIB, workdir, log)
            real = min(p.limit_mib for p in probes if p.ran)
            at_real = next(p for p in probes if p.limit_mib == real)
            on_real = smallest_limit(at_real.trace.trace)
            full = [p.trace.trace for p in probes if p.ran] + [unlimited.trace.trace]
            spread = [smallest_limit(t).limit_bytes // MIB for t in full]
            graph, simulation = simulated_step(model, size)
            sim_trace = step_memory(graph, simulation).trace(steps=2)
            on_sim = smallest_limit(sim_trace)
            # The kernels' temporaries, measured on the unlimited run (another process than the one at N).
            scratch = unlimited.trace.scratch_by_op()
            on_sim_scratch = smallest_limit(step_memory(graph, simulation, scratch=scratch).trace(steps=2))
            pool = plan_pool(at_real.trace.trace.lifetimes())
            agree = sum(1 for p in probes if p.model_agrees)
            temp_at_peak = at_real.trace.peak_by_kind().get("temp", 0)
            rows.append((what, real, on_real, first, on_sim, on_sim_scratch, at_real.trace.trace.live_peak(),
                         sim_trace.live_peak(), temp_at_peak, pool, agree, len(probes), min(spread), max(spread),
                         time.perf_counter() - started))
            log(f"    real {real} MiB; model on its trace {on_real.limit_bytes // MIB} MiB ({on_real.describe()}); "
                f"on the simulator's trace {on_sim.limit_bytes // MIB} MiB, with the measured scratch "
                f"{on_sim_scratch.limit_bytes // MIB} MiB; {pool.describe()}; "
                f"model's answers over {len(full)} full traces: {min(spread)}-{max(spread)} MiB; "
                f"{time.perf_counter() - started:.0f} s")
    log("")
    log("MiB. real: smallest limit that ran (1 MiB less failed); model: the model's answer on that run's trace, and on "
        "the unlimited run's (unlim.); spread: the model's answers over every full trace recorded; sim: on the "
        "simulator's trace; +scr: the same with the kernels' temporaries measured on the unlimited run; err: "
        "(model - real) / real; live: most bytes requested and live at once; temp: kernels' temporaries live at the "
        "real live peak, which no graph IR has; pool: planned on the real trace; agree: probes whose outcome the "
        "model reproduced on their own trace")
    log(f"{'step':<50} {'real':>5} {'model':>5} {'err':>6} {'unlim.':>6} {'err':>6} {'spread':>8} {'sim':>5} {'err':>7} "
        f"{'+scr':>5} {'err':>6} {'live':>6} {'sim live':>8} {'temp':>5} {'pool':>6} {'pool/BFC':>8} {'agree':>5}")
    for (what, real, on_real, first, on_sim, on_scr, live, sim_live, temp, pool, agree, count, low, high, _) in rows:
        model_mib, first_mib = on_real.limit_bytes // MIB, first.limit_bytes // MIB
        sim_mib, scr_mib = on_sim.limit_bytes // MIB, on_scr.limit_bytes // MIB
        log(f"{what:<50} {real:>5} {model_mib:>5} {(model_mib - real) / real:>6.1%} {first_mib:>6} "
            f"{(first_mib - real) / real:>6.1%} {f'{low}-{high}':>8} {sim_mib:>5} {(sim_mib - real) / real:>7.1%} "
            f"{scr_mib:>5} {(scr_mib - real) / real:>6.1%} {live / MIB:>6.1f} {sim_live / MIB:>8.1f} {temp / MIB:>5.1f} "
            f"{pool.pool_bytes / MIB:>6.1f} {pool.pool_bytes / on_real.limit_bytes - 1:>8.1%} {agree:>2}/{count:<2}")


def unet3d_recipe_step(size: int):
    """recipes/unet3d.yaml's network (Isensee et al.: 4 channels, 3 labels, 5 levels, 16 base filters)
    at size^3, batch 1, with keras_steps' SGD step -> (tf.function step, input specs)."""
    import keras
    import tensorflow as tf
    from keras_steps import sgd_step  # beside this script

    from launcher.rank.tasks.unet3d import unet3d

    keras.utils.set_random_seed(0)
    model = unet3d([size, size, size, 4], labels=3, levels=5, base_filters=16)
    return sgd_step(model), (tf.TensorSpec([1, size, size, size, 4]), tf.TensorSpec([1, size, size, size], tf.int32))


def pool_part(log) -> None:
    from keras_steps import resnet_step  # beside this script

    import lms_core.tf as lms_tf
    from lms_core.config import LMSConfig
    from lms_core.costs import PROFILES, step_costs
    from lms_core.link import NAMED_LINKS
    from lms_core.memory import GPU_BFC, executed_graph, overlapping_pairs, plan_pool, smallest_limit, step_memory
    from lms_core.plan import Plan
    from lms_core.simulator import simulate

    log("Part 2: planned pool against the lower bound and against the GPU BFC model, simulator's traces (v100 costs, "
        "nvlink2), one step after the resident buffers (variables, constants, the batch)")
    log(f"{'step':<28} {'live (bound)':>12} {'pool':>9} {'gap':>6} {'BFC (GPU)':>10} {'pool vs BFC':>11} "
        f"{'BFC frag.':>9} {'overlaps':>8}  seconds")
    cases = [("ResNet-50 batch 256", lambda: resnet_step("ResNet50", 256), LMSConfig(enabled=True, swapin_ahead=1)),
             ("3D U-Net 192^3", lambda: unet3d_recipe_step(192), LMSConfig(enabled=True, swapout_threshold=4, swapin_ahead=1,
                                                                   sync_mode=3))]
    for name, build, config in cases:
        step, specs = build()
        rewritten = lms_tf.rewrite(step, *specs, config=config)
        graph, plan, traced = rewritten.planning.graph, rewritten.plan, rewritten.planning.traced
        for label, g, p in ((f"{name}", executed_graph(traced), Plan(settings=plan.settings)),
                            (f"{name} LMS ({len(plan.swaps)} swaps)", executed_graph(graph), plan)):
            started = time.perf_counter()
            result = simulate(g, p, step_costs(g, PROFILES["v100"]), NAMED_LINKS["nvlink2"], keep_events=True)
            trace = step_memory(g, result).trace(steps=1)
            lifetimes = trace.lifetimes()
            pool = plan_pool(lifetimes)
            bfc = smallest_limit(trace, GPU_BFC)
            overlaps = len(overlapping_pairs(lifetimes, pool))
            log(f"{label:<28} {pool.lower_bound_bytes / 2**30:>9.3f} GiB {pool.pool_bytes / 2**30:>5.3f} GiB "
                f"{pool.gap:>6.2%} {bfc.limit_bytes / 2**30:>6.3f} GiB {pool.pool_bytes / bfc.limit_bytes - 1:>11.1%} "
                f"{bfc.at_limit.peak.fragmentation:>9.2f} {overlaps:>8}  {time.perf_counter() - started:.0f}")


RESERVE_CASES = (("resnet50", 32), ("unet3d", 32), ("densenet_block", 256))


def with_reserve(trace, limit_bytes: int):
    """`trace` after what benchmarks/bfc_worker.py's reserve_pool makes the allocator do first: a
    4-byte shape tensor, the limit less 2 MiB, both released."""
    from benchmarks.bfc_worker import RESERVE_MARGIN
    from lms_core.memory import AllocationTrace, TraceEvent

    big = limit_bytes - RESERVE_MARGIN
    return AllocationTrace((TraceEvent("reserve shape", 4, True), TraceEvent("reserve", big, True),
                            TraceEvent("reserve shape", 4, False), TraceEvent("reserve", big, False)) + trace.events)


def smallest_with_reserve(trace, low_mib: int, high_mib: int) -> int:
    """The model's smallest whole-MiB limit for `trace` run after the reserve (bisection)."""
    from lms_core.memory import replay

    def runs(mib: int) -> bool:
        return replay(with_reserve(trace, mib * MIB), mib * MIB).ok

    while not runs(high_mib):
        low_mib, high_mib = high_mib + 1, high_mib * 2
    while low_mib < high_mib:
        middle = (low_mib + high_mib) // 2
        if runs(middle):
            high_mib = middle
        else:
            low_mib = middle + 1
    return high_mib


def reserve_part(only: str | None, log) -> None:
    """Can a pool's saving reach a real TensorFlow run? TensorFlow has no way to place a tensor at a
    planned offset; what it can be made to do is allocate from one region instead of regions that
    grow by doubling and never merge (the CPU allocator always grows): reserve the whole limit with a
    first tensor and free it (bfc_worker --reserve). Real smallest limit with and without it."""
    from benchmarks.bfc_worker import build
    from lms_core.memory import plan_pool, smallest_limit

    log("Part 3: one region reserved up front (bfc_worker --reserve) against the growing regions, real runs (MiB)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lms-bfc-") as tmp:
        workdir = Path(tmp)
        for model, size in RESERVE_CASES:
            if only and model != only:
                continue
            _, what = build(model, size)
            log(f"  {what}")
            unlimited = run_probe(model, size, None, workdir)
            trace = unlimited.trace.trace
            plain = smallest_limit(trace)
            live_mib = -(-trace.live_peak() // MIB)
            predicted = smallest_with_reserve(trace, live_mib, plain.limit_bytes // MIB)
            log(f"    model on the unlimited run's trace: {plain.limit_bytes // MIB} MiB growing, {predicted} MiB reserved")
            plain_probes = search(model, size, plain.limit_bytes // MIB, workdir, log)
            reserved_probes = search(model, size, predicted, workdir, log, reserve=True)
            real_plain = min(p.limit_mib for p in plain_probes if p.ran)
            real_reserved = min(p.limit_mib for p in reserved_probes if p.ran)
            agree = sum(1 for p in plain_probes + reserved_probes if p.model_agrees)
            pool = plan_pool(trace.lifetimes())
            rows.append((what, trace.live_peak(), pool.pool_bytes, real_plain, real_reserved, predicted, agree,
                         len(plain_probes) + len(reserved_probes)))
    log("")
    log("live: the unlimited run's live peak; pool: planned on its trace; growing / reserved: real smallest limits; "
        "model: the model's answer for reserved, on the unlimited run's trace")
    log(f"{'step':<52} {'live':>7} {'pool':>7} {'growing':>8} {'reserved':>9} {'saved':>6} {'model':>6} {'agree':>6}")
    for what, live, pool, plain, reserved, predicted, agree, count in rows:
        log(f"{what:<52} {live / MIB:>7.1f} {pool / MIB:>7.1f} {plain:>8} {reserved:>9} {1 - reserved / plain:>6.1%} "
            f"{predicted:>6} {agree:>3}/{count:<2}")


def machine() -> str:
    import psutil

    return (f"{platform.node()}, {len(os.sched_getaffinity(0))} CPU cores, {psutil.virtual_memory().total / 2**30:.1f} "
            f"GiB RAM, Python {platform.python_version()}, no GPU")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("validation", "pool", "reserve", "all"), default="all")
    parser.add_argument("--only", help="validation: only this model (resnet50, unet3d, densenet_block)")
    parser.add_argument("--out", default=str(RESULTS), help="where the output goes (besides the terminal)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    lines = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), f"machine: {machine()}",
             "command: .venv/bin/python benchmarks/bfc_model.py" + "".join(f" {a}" for a in sys.argv[1:]), ""]
    print("\n".join(lines), flush=True)

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    started = time.perf_counter()
    if args.part in ("validation", "all"):
        validation(args.only, log)
        log("")
    if args.part in ("pool", "all"):
        pool_part(log)
        log("")
    if args.part in ("reserve", "all"):
        reserve_part(args.only, log)
    log(f"\ntotal {time.perf_counter() - started:.0f} s")
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
