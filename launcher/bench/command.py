"""`lms-launch bench max-batch|max-resolution RECIPE [--set k=v ...] [--judge auto|estimate|run]
[--device-memory 16GiB] [--host-memory 512GiB] [--link nvlink2] [--links nvlink2,pcie3] [--device v100]
[--configs none,grappler,lms-launch] [--min N] [--max N] [--start N] [--step N] [--no-floor-bound]
[--run-steps 5] [--run-timeout 900] [--out DIR]`

Finds the largest batch (max-batch), or the largest square (ResNet-50) or cubic (3D U-Net) input
(max-resolution), that fits a device, for three configurations side by side: no swapping,
TensorFlow's own Grappler swapping (SWAPPING_HEURISTICS), and lms-launch auto-tuned. Galloping then
bisection, one progress line per probe. Writes results.md, results.csv, results.png (with the papers'
figures), probes.csv and bench.json to --out (default runs/bench-<recipe>-<kind>-<time>).

Judges: `estimate` (TensorFlow Grappler's peak-memory estimate on a virtual GPU of --device-memory;
step times predicted by lms-launch's simulator for --device on --link); `run` (a real training step
of each candidate in a fresh process; out of memory is detected; measured samples/s); `auto` (run
where NVML sees a GPU, else estimate). The output says which judge was used.

Exit status: 0 done; 2 bad input (nothing is written); 1 a probe failed for another reason than
memory (no results; the probes' logs are kept beside --out, in OUT.probes/); 130 after Ctrl-C and 143
after SIGTERM (nothing is written either, and no probe is left running).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from launcher.bench.configurations import CONFIGURATIONS, FLOORS, LABELS
from launcher.bench.papers import figures_for
from launcher.bench.search import SizeGrid
from launcher.arguments import UsageError, UsageParser
from launcher.bench.sizes import KINDS, SizeAxis, size_axis
from launcher.config import Recipe
from launcher.recipe import RecipeError, load_recipe
from lms_core.config import SettingError
from lms_core.costs import PROFILES
from lms_core.link import LinkRates, link_named
from lms_core.nvml import GpuInfo, probe_gpu
from lms_core.units import format_bytes, parse_bytes

DEFAULT_DEVICE_MEMORY = "16GiB"  # the papers' 16 GB V100 and P100
DEFAULT_HOST_MEMORY = "512GiB"  # estimate judge: a host that does not bound the search (the papers' POWER9 hosts held more)
DEFAULT_LINK = "nvlink2"  # the papers' POWER9-V100 link, and the issue's goals
DEFAULT_LINKS = "nvlink2,pcie3"
DEFAULT_DEVICE = "v100"
DEFAULT_RUN_STEPS = 5  # per probe of the run judge: 2 unmeasured (tracing, warm-up), 3 measured
RUN_SKIP_STEPS = 2
DEFAULT_RUN_TIMEOUT_S = 900
MAX_DOUBLINGS = 12  # without --max, a search never goes past start x 2^12 (it says so when it stops there)


class Stopped(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so the running probe and the partial results go."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


def parser() -> UsageParser:
    p = UsageParser(prog="lms-launch bench", description=__doc__)
    p.add_argument("kind", choices=KINDS, help="max-batch: the largest batch; max-resolution: the largest input side")
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="override a recipe key, as for lms-launch (repeatable)")
    p.add_argument("--judge", choices=("auto", "estimate", "run"), default="auto",
                   help="estimate: Grappler's estimate; run: real steps in fresh processes; auto: run on a GPU")
    p.add_argument("--device-memory", help=f"device memory to fit (default {DEFAULT_DEVICE_MEMORY}; with --judge run "
                                           f"on a GPU, the GPU's own; given, the GPU is held to it)")
    p.add_argument("--host-memory", help=f"host memory lms-launch may park swaps in (default lms.host_memory, else "
                                         f"{DEFAULT_HOST_MEMORY}; with --judge run, this machine's)")
    p.add_argument("--link", help=f"the link lms-launch tunes for and times are predicted on (default {DEFAULT_LINK}; "
                                  f"with --judge run, each rank's own)")
    p.add_argument("--links", default=DEFAULT_LINKS,
                   help=f"links to re-tune lms-launch's result for and show the predicted overhead of "
                        f"(default {DEFAULT_LINKS}; estimate judge)")
    p.add_argument("--device", help=f"device profile for the predicted times (default {DEFAULT_DEVICE}; with --judge "
                                    f"run, each rank's own)")
    p.add_argument("--configs", default=",".join(CONFIGURATIONS),
                   help=f"configurations to compare (default {','.join(CONFIGURATIONS)})")
    p.add_argument("--min", type=int, help="smallest size to try (default: the smallest the model accepts)")
    p.add_argument("--max", type=int, help="largest size to try (default: unbounded; give one to the run judge on "
                                           "a machine where the step never runs out of memory)")
    p.add_argument("--start", type=int, help="where each search starts (default: the recipe's size)")
    p.add_argument("--step", type=int, help="grid step (default 1 for batches; for sides the model's: 2^(levels-1) "
                                            "for the U-Net, 32 for ResNet-50); must be a multiple of the model's")
    p.add_argument("--no-floor-bound", action="store_true",
                   help="skip the search for the largest size whose floor fits (cheap: traces only)")
    p.add_argument("--run-steps", type=int, default=DEFAULT_RUN_STEPS,
                   help=f"training steps per run-judge probe, the first {RUN_SKIP_STEPS} unmeasured "
                        f"(default {DEFAULT_RUN_STEPS})")
    p.add_argument("--run-timeout", type=float, default=DEFAULT_RUN_TIMEOUT_S,
                   help=f"seconds a run-judge probe may take (default {DEFAULT_RUN_TIMEOUT_S:g})")
    p.add_argument("--out", help="results directory (default runs/bench-<recipe>-<kind>-<time>); must be new or empty")
    return p


@dataclass(frozen=True)
class BenchSetup:
    """Everything the benchmark needs, checked before anything starts; every flag parsed once."""

    kind: str
    recipe_path: Path
    overrides: list[str]
    recipe: Recipe
    axis: SizeAxis
    grid: SizeGrid
    start: int
    judge: str  # estimate or run
    gpu: GpuInfo | None  # what NVML says of GPU 0, None without one
    device_memory_bytes: int | None  # None: the run judge on a GPU fits the GPU's own memory
    host_memory_bytes: int
    link: LinkRates | None  # None: the run judge leaves each rank its own
    links: list[LinkRates]  # the estimate judge re-tunes lms-launch for each and shows its overhead
    device: str | None
    configs: list[str]
    floor_bound: bool
    run_steps: int
    run_timeout_s: float
    out: Path
    command: str

    @property
    def on_gpu(self) -> bool:
        return self.gpu is not None


def default_host_memory(judge: str) -> int:
    """What lms-launch may park swaps in when nothing says: for real runs this machine's memory (the
    probes pin it: planned for 512 GiB on a 125 GiB machine, an H200's probe at batch 1024 asked
    for 64 GiB of pinned memory at once and was killed, 2026-11-27); for estimates a host that does
    not bound the search."""
    if judge == "run":
        import psutil

        return int(psutil.virtual_memory().total)
    return parse_bytes(DEFAULT_HOST_MEMORY)


def resolve(args: argparse.Namespace, argv: list[str]) -> BenchSetup:
    """Checks every input and works out the defaults; raises UsageError, RecipeError or
    SettingError naming what to change."""
    recipe = load_recipe(args.recipe, args.overrides)
    axis = size_axis(args.kind, recipe)
    gpu = probe_gpu(0)
    judge = args.judge if args.judge != "auto" else ("run" if gpu is not None else "estimate")
    grid, start = size_grid(args, axis)
    link, links = chosen_links(args, judge)
    device_memory = _bytes_flag("--device-memory", args.device_memory)
    if device_memory is None and not (judge == "run" and gpu is not None):
        device_memory = parse_bytes(DEFAULT_DEVICE_MEMORY)
    host_memory = (_bytes_flag("--host-memory", args.host_memory) or recipe.lms.host_memory_bytes
                   or default_host_memory(judge))
    if args.device is not None and args.device not in PROFILES:
        raise UsageError(f"--device: {args.device!r} is not a device profile; use one of {', '.join(PROFILES)}")
    if args.run_steps <= RUN_SKIP_STEPS:
        raise UsageError(f"--run-steps {args.run_steps}: must be more than the {RUN_SKIP_STEPS} unmeasured steps")
    if args.run_timeout <= 0:
        raise UsageError(f"--run-timeout {args.run_timeout:g}: must be > 0 seconds")
    setup = BenchSetup(
        kind=args.kind, recipe_path=Path(args.recipe), overrides=list(args.overrides), recipe=recipe, axis=axis,
        grid=grid, start=start, judge=judge, gpu=gpu, device_memory_bytes=device_memory, host_memory_bytes=host_memory,
        link=link, links=links, device=args.device if (args.device or judge == "run") else DEFAULT_DEVICE,
        configs=configurations(args.configs), floor_bound=not args.no_floor_bound, run_steps=args.run_steps,
        run_timeout_s=args.run_timeout, out=out_dir(args), command="lms-launch bench " + shlex.join(argv))
    lms_config(setup)  # the lms settings must be valid before anything starts
    if judge == "run":
        from launcher.bench.run_judge import probe_overrides

        for key in setup.configs:  # every probe's recipe must load, or the search would stop halfway
            load_recipe(setup.recipe_path, probe_overrides(run_setting(setup, Path(".")), key, setup.start))
    return setup


def configurations(text: str) -> list[str]:
    configs = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown or not configs or len(set(configs)) != len(configs):
        raise UsageError(f"--configs {text!r}: give each of {', '.join(CONFIGURATIONS)} at most once, "
                         f"comma-separated" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return configs


def chosen_links(args: argparse.Namespace, judge: str) -> tuple[LinkRates | None, list[LinkRates]]:
    """The link lms-launch tunes for (None: the run judge leaves each rank its own) and the links
    the estimate judge shows overheads for, the tuned one first."""
    link = _link_flag("--link", args.link) if args.link else None
    links = [_link_flag("--links", text.strip()) for text in args.links.split(",") if text.strip()]
    if judge == "run":
        return link, []
    link = link or link_named(DEFAULT_LINK)
    return link, [link] + [other for other in links if other != link]


def size_grid(args: argparse.Namespace, axis: SizeAxis) -> tuple[SizeGrid, int]:
    """The grid of sizes the searches walk, and where they start."""
    step = args.step or axis.step
    if step < 1 or step % axis.step:
        raise UsageError(f"--step {step}: must be a positive multiple of {axis.step} ({axis.describe()})")
    for key in ("min", "max", "start"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise UsageError(f"--{key} {value}: must be >= 1")
    minimum = args.min if args.min is not None else max(step, axis.smallest)
    if minimum % step or minimum < axis.smallest:
        raise UsageError(f"--min {minimum}: must be a multiple of the step {step} and at least {axis.smallest}")
    start = args.start if args.start is not None else axis.start
    maximum = args.max
    if maximum is not None and (maximum % step or maximum < minimum):
        raise UsageError(f"--max {maximum}: must be a multiple of the step {step} and at least --min {minimum}")
    if maximum is None:
        maximum = max(minimum, start - start % step) * 2 ** MAX_DOUBLINGS
    grid = SizeGrid(step, minimum, maximum)
    return grid, grid.snap(start)


def out_dir(args: argparse.Namespace) -> Path:
    out = Path(args.out) if args.out else (Path("runs") / f"bench-{Path(args.recipe).stem}-{args.kind}-"
                                                           f"{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} already holds files; give a new directory or remove it")
    return out


def _link_flag(flag: str, text: str) -> LinkRates:
    try:
        return link_named(text)
    except ValueError as err:
        raise UsageError(f"{flag}: {err}") from None


def _bytes_flag(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise UsageError(f"{flag}: {err}") from None


def lms_config(setup: BenchSetup):
    """lms-launch's settings: the recipe's, switched on, auto-tuned, for the benchmark's target."""
    changes = {"enabled": True, "mode": "auto", "host_memory": setup.host_memory_bytes, "rank_links": []}
    if setup.link is not None:
        changes["link"] = setup.link.name
    if setup.device is not None:
        changes["device"] = setup.device
    if setup.device_memory_bytes is not None:
        changes["device_memory"] = setup.device_memory_bytes
    try:
        return dataclasses.replace(setup.recipe.lms, **changes)
    except SettingError as err:
        raise UsageError(f"lms.{err}") from None


def run_setting(setup: BenchSetup, workdir: Path):
    from launcher.bench.run_judge import RunSetting

    lms_overrides = [f"lms.host_memory={setup.host_memory_bytes}"]
    if setup.link is not None:
        lms_overrides.append(f"lms.link={setup.link.name}")
    if setup.device is not None:
        lms_overrides.append(f"lms.device={setup.device}")
    if setup.device_memory_bytes is not None:
        lms_overrides.append(f"lms.device_memory={setup.device_memory_bytes}")
    return RunSetting(recipe_path=setup.recipe_path, recipe=setup.recipe, overrides=setup.overrides, axis=setup.axis,
                      workdir=workdir, steps=setup.run_steps, skip_steps=RUN_SKIP_STEPS, timeout_s=setup.run_timeout_s,
                      on_gpu=setup.on_gpu, device_memory_bytes=setup.device_memory_bytes, lms_overrides=lms_overrides)


def machine() -> str:
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = probe_gpu(0)
    gpu_text = f"GPU {gpu.name} ({format_bytes(gpu.memory_bytes)})" if gpu else "no GPU"
    return f"{platform.node()}, {cores} CPU cores, {format_bytes(psutil.virtual_memory().total)} RAM, {gpu_text}"


def judge_text(setup: BenchSetup, target) -> str:
    if setup.judge == "estimate":
        return (f"estimate: TensorFlow Grappler's peak-memory estimate on a virtual GPU of "
                f"{format_bytes(setup.device_memory_bytes)} (an estimate, not a GPU measurement); step times "
                f"predicted by lms-launch's simulator for {target.device.name} on {target.link.name}")
    if setup.on_gpu:
        held = ("" if setup.device_memory_bytes is None else
                f", TensorFlow given {format_bytes(setup.device_memory_bytes)} of it (one logical device of that size)")
        return (f"run: {setup.run_steps} real training steps per probe in a fresh process on {setup.gpu.name}{held} "
                f"({setup.run_steps - RUN_SKIP_STEPS} measured); out of memory detected from TensorFlow's error")
    return (f"run: {setup.run_steps} real training steps per probe in a fresh process on this machine's CPU, "
            f"TensorFlow's CPU allocator held to {format_bytes(setup.device_memory_bytes)} (no GPU here: the CPU "
            f"stands in for the device, and lms-launch's swaps save nothing on it)")


def main(argv: list[str]) -> int:
    try:
        args = parser().parse_args(argv)
        setup = resolve(args, argv)
    except (RecipeError, UsageError, SettingError) as err:
        print(f"lms-launch bench: error: {err}", file=sys.stderr)
        return 2
    from launcher.bench.report import discard, markdown, partial_dir, write_report
    from launcher.bench.run_judge import ProbeError

    work = partial_dir(setup.out)
    work.mkdir(parents=True)
    previous = signal.signal(signal.SIGTERM, _stop)  # so a probe's process group is killed on the way out
    try:
        report = run(setup, work)
        write_report(report, work, setup.out.absolute())
    except RecipeError as err:  # a model.builder whose result breaks its contract
        discard(work)
        print(f"lms-launch bench: error: {err}\nno results were written", file=sys.stderr)
        return 2
    except ProbeError as err:
        # No results, but the failed probe's log is what the error sends the user to: keep the probes.
        kept = keep_probes(work, setup.out)
        discard(work)
        message = str(err).replace(str(work / "probes"), str(kept)) if kept else str(err)
        print(f"lms-launch bench: error: {message}\nno results were written" +
              (f"; the probes' logs are kept in {kept}/" if kept else ""), file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as stop:
        discard(work)
        signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
        print(f"lms-launch bench: stopped by {signal.Signals(signum).name}; nothing was written", file=sys.stderr)
        return 128 + signum
    except BaseException:
        discard(work)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print()
    print(markdown(report))
    print(f"results written to {setup.out}/ (results.md, results.csv, results.png, probes.csv, bench.json)")
    return 0


def keep_probes(work: Path, out: Path) -> Path | None:
    """Moves the probes' run folders (output.log, plan) of an unfinished bench beside --out, as
    OUT.probes (a number added if that exists); None when there were none."""
    probes = work / "probes"
    if not probes.is_dir() or not any(probes.iterdir()):
        return None
    kept, n = out.with_name(out.name + ".probes"), 1
    while kept.exists():
        n += 1
        kept = out.with_name(f"{out.name}.probes-{n}")
    probes.rename(kept)
    return kept


def run(setup: BenchSetup, work: Path):
    """The searches, then what is worked out at the sizes they found; returns the BenchReport."""
    from launcher.bench.report import BenchReport

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    started = time.perf_counter()
    say(f"{setup.kind} of {setup.recipe.model.name} {setup.recipe.model.input_shape}, batch "
        f"{setup.recipe.train.batch_size} ({setup.recipe_path}): {setup.axis.describe()}, from "
        f"{setup.axis.label(setup.start)} (TensorFlow loads first)")
    from launcher.rank.devices import split_cpu

    split_cpu()  # before TensorFlow starts: the gating check of lms-launch's result runs on two CPU devices
    from launcher.bench.steps import StepSource
    from launcher.lms.target import rank_target

    source = StepSource(setup.axis, setup.recipe)
    lms = lms_config(setup)
    target, lines = rank_target(lms, rank=0, local_rank=0, local_size=1, on_gpu=False)
    text = judge_text(setup, target)
    say(f"judge: {text}")
    if setup.judge == "estimate":
        for line in lines:
            say(f"lms-launch plans for: {line}")
    results = [search(setup, key, judge_for(setup, key, source, lms, target, work)) for key in setup.configs]
    notes = work_out_results(setup, results, source, lms, target)
    if setup.floor_bound:  # the traced step's floor, then the floor after the rewrites, scaled from it
        for key in FLOORS:
            results.append(floor_bound(setup, results, source, lms, target, key))
    lms_plan = None
    lms_result = next((r for r in results if r.key == "lms-launch"), None)
    if lms_result is not None and setup.judge == "estimate":
        lms_plan = check_gating(setup, lms_result)
    return BenchReport(
        kind=setup.kind, recipe=str(setup.recipe_path), model=setup.recipe.model.name,
        input_shape=list(setup.recipe.model.input_shape), batch_size=setup.recipe.train.batch_size, axis=setup.axis,
        judge=setup.judge, judge_text=text, command=setup.command, date=time.strftime("%Y-%m-%d %H:%M %Z"),
        machine=machine(), device_memory_bytes=setup.device_memory_bytes,
        link=setup.link.name if setup.link else "rank",
        links=[link.name for link in setup.links] if setup.judge == "estimate" else ["rank"], results=results,
        papers=figures_for(setup.recipe.model.name, setup.kind), seconds=time.perf_counter() - started, notes=notes,
        lms_plan=lms_plan)


def say(text: str) -> None:
    print(f"[bench] {text}", flush=True)


def judge_for(setup: BenchSetup, key: str, source, lms, target, work: Path):
    """size -> Probe for configuration `key` under the setup's judge."""
    if setup.judge == "run":
        from launcher.bench.run_judge import run_probe

        return partial(run_probe, run_setting(setup, work / "probes"), key)
    from launcher.bench.configurations import PROBES, EstimateSetting

    return partial(PROBES[key], EstimateSetting(source, setup.device_memory_bytes, target, lms))


def search(setup: BenchSetup, key: str, judge, start: int | None = None, stride: int | None = None):
    from launcher.bench.report import ConfigurationResult
    from launcher.bench.search import largest_fitting

    say(f"searching: {LABELS[key]}")

    def show(probe) -> None:
        verdict = "fits" if probe.fits else "does NOT fit"
        say(f"  {key:<10} {setup.axis.label(probe.size):>11}  peak {format_bytes(probe.peak_bytes):>10}  {verdict:<12} "
            f"{probe.seconds:6.1f} s  {probe.detail}")

    found = largest_fitting(judge, setup.grid, setup.start if start is None else start, stride=stride, on_probe=show)
    ending = (f"largest {setup.axis.label(found.largest)}"
              + (f", {setup.axis.label(found.smallest_failing)} does not fit" if found.smallest_failing else "")
              + (" (stopped at the grid's maximum, which fits)" if found.bounded else ""))
    say(f"  {key}: {ending}; {len(found.probes)} probes, {found.seconds:.0f} s")
    return ConfigurationResult(key, LABELS[key], found)


def work_out_results(setup: BenchSetup, results: list, source, lms, target) -> list[str]:
    """Floors, samples/s and overheads at each found size (re-tuning lms-launch for --links);
    returns notes for the report."""
    from launcher.bench.configurations import probe_lms, EstimateSetting
    from lms_core.report import Prediction

    notes = []
    described: dict[int, tuple] = {}
    batch = setup.recipe.train.batch_size
    for result in results:
        size = result.largest
        if size is None:
            result.notes.append(f"not even {setup.axis.label(setup.grid.minimum)} fits")
            continue
        if size not in described:
            described[size] = source.describe_at(size, target if setup.judge == "estimate" else None)
        floor, unswapped_s = described[size]
        result.floor = floor
        samples = size if setup.kind == "max-batch" else batch
        probe = result.search.probe_at(size)
        if setup.judge == "run":
            result.samples_per_s = probe.data.get("samples_per_s")
            predicted = probe.data.get("prediction") if result.key == "lms-launch" else None
            overhead = Prediction(**predicted).overhead if predicted else (None if result.key == "lms-launch" else 0.0)
            result.overheads["rank"] = overhead
            if result.key == "lms-launch":
                result.notes.append(f"at this size: {probe.detail}")
            if result.key == "grappler" and not setup.on_gpu:
                result.notes.append("Grappler's swapping considers GPU devices only (memory_optimizer.cc), so on a "
                                    "CPU this row runs the unswapped step")
            continue
        if result.key == "none" or (result.key == "grappler" and probe.data.get("swaps") == 0):
            result.samples_per_s = samples / unswapped_s
            result.overheads = {link.name: 0.0 for link in setup.links}
            if result.key == "grappler":
                result.notes.append("inserted no swap at this size, so it is the unswapped step")
        elif result.key == "grappler":
            result.notes.append(f"{probe.data['swaps']} swap(s) at this size; no step time predicted (lms-launch's "
                                f"simulator does not model Grappler's copy ops)")
        else:  # lms-launch
            prediction = probe.data["prediction"]
            result.samples_per_s = samples / prediction["step_time_s"]
            result.overheads[setup.link.name] = probe.data["overhead"]
            result.link_fits[setup.link.name] = True
            result.notes.append(probe.data["tuning"] or probe.detail)
            for link in setup.links:
                if link == setup.link:
                    continue
                say(f"re-tuning lms-launch at {setup.axis.label(size)} for {link.name}")
                other = dataclasses.replace(target, link=link)
                retuned = probe_lms(EstimateSetting(source, setup.device_memory_bytes, other, lms), size, target=other)
                say(f"  {link.name}: peak {format_bytes(retuned.peak_bytes)} "
                    f"{'fits' if retuned.fits else 'does NOT fit'}; {retuned.detail}")
                result.overheads[link.name] = retuned.data["overhead"]
                result.link_fits[link.name] = retuned.fits
    return notes


def floor_bound(setup: BenchSetup, results: list, source, lms, target, key: str = "floor"):
    """The largest size whose floor (`floor`, or `floor-rewritten`: after the floor-lowering
    rewrites) fits: no plan of swaps on that graph can pass it. The search starts from a guess scaled
    from a floor of the same kind already known (working sets grow with the batch, or with the side
    to the power of its dimensions), a step or two from the answer."""
    from launcher.bench.configurations import PROBES, EstimateSetting

    known = max((r for r in results if r.floor is not None), key=lambda r: r.largest, default=None)
    memory = setup.device_memory_bytes
    start, stride = None, None
    if known is not None and memory:
        floor = source.floors_at(known.largest)[FLOORS.index(key)]
        fixed = floor.weights_bytes + floor.optimizer_bytes
        if floor.working_set_bytes and memory > fixed:
            scale = ((memory - fixed) / floor.working_set_bytes) ** (1 / setup.axis.dims)
            start, stride = int(known.largest * scale), setup.grid.step
    if memory is None:  # the run judge on a GPU: its memory is the GPU's
        memory = setup.gpu.memory_bytes
    judge = partial(PROBES[key], EstimateSetting(source, memory, target, lms))
    result = search(setup, key, judge, start=start, stride=stride)
    probe = result.search.probe_at(result.largest)
    if probe is not None:
        result.floor = probe.data["floor_object"]
    return result


def check_gating(setup: BenchSetup, result) -> dict | None:
    """Proves lms-launch's plan at its largest size gated on what TensorFlow executes, on the step's
    structural twin (launcher.lms.twin), and returns its report (with the check) for the results."""
    from launcher.lms.twin import verify_on_twin

    probe = result.search.probe_at(result.largest)
    if probe is None or "report_object" not in probe.data:
        return None
    report = probe.data["report_object"]
    if not report.plan.swaps:
        result.notes.append("nothing swapped at this size, nothing to gate")
        return report.to_dict()
    say(f"checking that lms-launch's swap-ins at {setup.axis.label(result.largest)} wait for their triggers "
        f"(its twin, run on split CPU devices)")
    check = verify_on_twin(setup.axis.recipe_at(setup.recipe, result.largest), report.plan)
    text = check.describe()
    if not check.all_gated:
        text += f"; NOT gated: {', '.join(check.ungated[:3])}"
    say(f"  {text}")
    result.notes.append(text)
    return report.with_verification(check).to_dict()
