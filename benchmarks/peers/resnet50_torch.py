"""What a user would pick instead of lms-launch: PyTorch's own memory-saving options on ResNet-50.

    python3 benchmarks/peers/resnet50_torch.py --out DIR [--deadline-s 200] [--hold 16GiB]
        [--variants plain,ckpt-block,ckpt-stage,save-on-cpu,offload-overlap] [--max-batch 2048] [--start-batch 256]
    python3 benchmarks/peers/resnet50_torch.py --out /tmp/peers --device cpu --image-size 32 --max-batch 64

The step is recipes/resnet50.yaml's as far as PyTorch allows: torchvision's resnet50(weights=None,
num_classes=1000), 224x224x3 float32, SGD(lr=0.1, momentum=0.9), CrossEntropyLoss, random images and
labels made on the device once per batch size (the input pipeline costs nothing). The GPU is held to
`--hold` (default 16 GiB, the papers' V100) with torch.cuda.set_per_process_memory_fraction.

Variants, each in a fresh process (this script runs itself with `--variant NAME`):
- plain: PyTorch as it comes;
- ckpt-block: torch.utils.checkpoint.checkpoint(..., use_reentrant=False) around each Bottleneck block;
- ckpt-stage: the same around each of the four stages (layer1..layer4);
- save-on-cpu: torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward pass (its copies run
  on the compute stream);
- offload-overlap: an offloader that overlaps its copies with compute on a side stream, if one ships with
  this machine's packages (OFFLOADERS); otherwise its row says which were looked for.

For each: samples/s at batch 256 (2 warm-up steps, then up to 5 timed ones), then the largest batch that
trains 3 steps (doubling or halving from `--start-batch`, then bisecting to 8, then the answer re-run once
after every cached block is handed back), and samples/s at that batch; the peak allocated and reserved
GPU memory of each measured batch. Offloading variants pin host memory: a batch whose estimated pinned
bytes exceed 60% of the host's available memory is not tried ("capped by host memory").

Time: the whole run fits `--deadline-s`. The figures at 256 come first (40% of it), then the searches
share the rest; a stage that runs out of time stops probing, and an answer it could not finish is marked
a lower bound. Writes, line by line as results come: DIR/gpu-peers-resnet50.txt (the header: date,
machine, GPU, driver, versions, TF32 settings, command), DIR/gpu-peers-resnet50.json (the same figures),
and DIR/peers.done at the end. The last line is `peers: done in N s`.

`--device cpu` checks the script's logic only (use a small `--image-size`, e.g. 32, and a small
`--max-batch`): the hold does not apply there, and its figures are not GPU figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.util
import json
import os
import platform
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

STARTED = time.monotonic()  # a stage's share of the deadline counts from its process's start, imports included
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lms_core.units import parse_bytes  # noqa: E402  (plain Python: runs where only PyTorch is installed)
from benchmarks.reporting import nvidia_smi  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
VARIANTS = ("plain", "ckpt-block", "ckpt-stage", "save-on-cpu", "offload-overlap")
OFFLOADING = ("save-on-cpu", "offload-overlap")  # they pin host memory: the host guard applies
GRANULARITY = 8
FIT_STEPS, WARMUP_STEPS, TIMED_STEPS = 3, 2, 5
SPEED_BATCH = 256
SAVED_BYTES_BATCHES = (8, 16)  # two small forwards give autograd's saved bytes per sample and fixed
HOST_FRACTION = 0.6  # of the host's available memory, at most, for pinned activations
PINNED_ROUNDING = 2.0  # CUDA's host allocator rounds each pinned block up to a power of two: up to 2x
SPEED_PHASE_FRACTION = 0.4
RESERVE_S = 3.0  # after the last stage: the marker, the last lines
MIN_STAGE_S = 4.0  # a stage given less would spend it starting Python and PyTorch
EVENT = "@@peers "  # a child's stdout line that carries one JSON event
OFFLOADERS = (  # eager context managers that copy saved activations on a side stream; none is written here
    ("torchtune.training", "OffloadActivations"),
    ("trl.models.activation_offloading", "OffloadActivations"),
)
NOT_WIRED = (  # offloaders that exist elsewhere but need their framework's own training setup
    ("deepspeed", "deepspeed.checkpointing (cpu_checkpointing needs deepspeed's engine and partitioned activations)"),
    ("transformer_engine", "transformer_engine.pytorch.get_cpu_offload_context (per-layer hooks for TE models)"),
)
TXT, JSON_NAME, MARKER = "gpu-peers-resnet50.txt", "gpu-peers-resnet50.json", "peers.done"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The flags, parsed once at the boundary."""

    out: Path
    deadline_s: float
    hold_bytes: int
    variants: tuple[str, ...]
    device: str  # "cuda" or "cpu"
    image_size: int
    max_batch: int
    start_batch: int

    def child_argv(self) -> list[str]:
        return ["--out", str(self.out), "--deadline-s", str(self.deadline_s), "--hold", str(self.hold_bytes),
                "--device", self.device, "--image-size", str(self.image_size), "--max-batch", str(self.max_batch),
                "--start-batch", str(self.start_batch)]


def round_down(batch: float) -> int:
    return int(batch) // GRANULARITY * GRANULARITY


def emit(kind: str, **fields) -> None:
    """One event from a child to the driver, flushed at once so that a killed child has said what it measured."""
    print(EVENT + json.dumps({"event": kind, **fields}), flush=True)


class Clock:
    """A child's share of the deadline, counted from its process's start."""

    def __init__(self, share_s: float):
        self.share_s = share_s

    def elapsed(self) -> float:
        return time.monotonic() - STARTED

    def allows(self, predicted_s: float) -> bool:
        return self.elapsed() + predicted_s <= self.share_s


# ---- the step, one variant at a time (a child) ----

def out_of_memory_error() -> type[BaseException]:
    import torch

    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def empty_host_cache() -> None:
    """Hands cached pinned blocks back, so that each probe of an offloading variant pins only what it needs
    (the host allocator otherwise keeps every block an earlier, other-sized batch pinned)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


class Trainer:
    """One ResNet-50 and its optimizer, trained the variant's way at any batch size."""

    def __init__(self, variant: str, device: str, image_size: int, offloader: Callable | None):
        import torch
        import torchvision

        torch.manual_seed(42)
        self.device = torch.device(device)
        self.image_size = image_size
        self.model = torchvision.models.resnet50(weights=None, num_classes=1000).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.forward = variant_forward(variant, self.model, self.loss_fn, offloader)
        self.batch: tuple | None = None  # (size, images, labels)

    def data(self, batch: int):
        """Random images and labels, made on the device once per batch size."""
        import torch

        if self.batch is None or self.batch[0] != batch:
            self.batch = None  # the old batch goes before the new one is made
            shape = (batch, 3, self.image_size, self.image_size)
            self.batch = (batch, torch.randn(shape, device=self.device),
                          torch.randint(0, 1000, (batch,), device=self.device))
        return self.batch[1], self.batch[2]

    def step(self, images, labels) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward(images, labels).backward()
        self.optimizer.step()

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def release(self) -> None:
        """After an out-of-memory error, and before an answer is confirmed: the batch, the gradients and
        every cached block go back (the momentum buffers stay: they are part of any step)."""
        import torch

        self.batch = None
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            empty_host_cache()


def variant_forward(variant: str, model, loss_fn, offloader: Callable | None) -> Callable:
    """The forward pass and loss of one variant; the caller runs backward outside any context."""
    import torch
    from torch.utils.checkpoint import checkpoint

    if variant == "plain":
        return lambda images, labels: loss_fn(model(images), labels)
    if variant in ("ckpt-block", "ckpt-stage"):
        stages = [model.layer1, model.layer2, model.layer3, model.layer4]
        units = [block for stage in stages for block in stage] if variant == "ckpt-block" else stages

        def checkpointed(images, labels):  # torchvision's ResNet._forward_impl, each unit recomputed
            x = model.maxpool(model.relu(model.bn1(model.conv1(images))))
            for unit in units:
                x = checkpoint(unit, x, use_reentrant=False)
            return loss_fn(model.fc(torch.flatten(model.avgpool(x), 1)), labels)

        return checkpointed
    if variant == "save-on-cpu":
        def saved_on_cpu(images, labels):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return loss_fn(model(images), labels)

        return saved_on_cpu
    context = offloader()  # built once: the offloaders keep their streams and state across steps

    def offloaded(images, labels):
        with context:
            return loss_fn(model(images), labels)

    return offloaded


def find_offloader() -> tuple[str | None, Callable | None, list[str]]:
    """The first side-stream offloader that imports: (its name, a factory, what was tried and why it failed)."""
    tried = []
    for module_name, attribute in OFFLOADERS:
        name = f"{module_name}.{attribute}"
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except Exception as err:  # noqa: BLE001 - any import failure means: not usable here
            tried.append(f"{name}: {type(err).__name__}: {err}".splitlines()[0][:160])
            continue

        def factory(cls=cls):
            try:
                return cls(use_pin_memory=True, use_streams=True)
            except TypeError:  # an older signature: its defaults already use streams where it has them
                return cls()

        return name, factory, tried
    return None, None, tried


def run_steps(trainer: Trainer, batch: int, steps: int) -> None:
    images, labels = trainer.data(batch)
    for _ in range(steps):
        trainer.step(images, labels)
    trainer.sync()


def trains(trainer: Trainer, batch: int) -> bool:
    """Whether `batch` trains FIT_STEPS steps. The clean-up runs after the except block, once the traceback
    (whose frames hold the failed step's tensors) is gone."""
    try:
        run_steps(trainer, batch, FIT_STEPS)
        return True
    except out_of_memory_error():
        pass
    trainer.release()
    return False


def memory_peaks(trainer: Trainer) -> dict:
    import torch

    if trainer.device.type != "cuda":
        return {}
    peaks = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
             "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    try:
        peaks["host_pinned_peak_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.peak")
    except (AttributeError, RuntimeError):
        pass
    return peaks


def reset_peaks(trainer: Trainer) -> None:
    import torch

    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()


def measure_speed(trainer: Trainer, batch: int, clock: Clock) -> dict:
    """Mean step time after WARMUP_STEPS, over up to TIMED_STEPS (fewer when the share would not hold them),
    with the peak memory of all of them."""
    reset_peaks(trainer)
    try:
        images, labels = trainer.data(batch)
        for _ in range(WARMUP_STEPS):
            started = time.perf_counter()
            trainer.step(images, labels)
            trainer.sync()
        warm_step_s = time.perf_counter() - started  # the last warm-up step: past the first step's set-up
        timed = max(1, min(TIMED_STEPS, int((clock.share_s - clock.elapsed()) / max(warm_step_s, 1e-6)) - 1))
        started = time.perf_counter()
        for _ in range(timed):
            trainer.step(images, labels)
        trainer.sync()
        step_s = (time.perf_counter() - started) / timed
    except out_of_memory_error():
        step_s = None
    if step_s is None:
        trainer.release()
        return {"batch": batch, "trains": False, "why": "out of memory"}
    return {"batch": batch, "trains": True, "step_ms": step_s * 1000, "samples_per_s": batch / step_s,
            "timed_steps": timed, **memory_peaks(trainer)}


@dataclasses.dataclass(frozen=True)
class HostGuard:
    """What an offloading variant would pin: autograd's saved bytes, fitted at two small batches (what
    save_on_cpu copies, each saved tensor on its own), times PINNED_ROUNDING."""

    fixed_bytes: float
    per_sample_bytes: float

    @staticmethod
    def measure(trainer: Trainer) -> HostGuard:
        small, large = (saved_bytes(trainer, batch) for batch in SAVED_BYTES_BATCHES)
        per_sample = max((large - small) / (SAVED_BYTES_BATCHES[1] - SAVED_BYTES_BATCHES[0]), 1.0)
        return HostGuard(fixed_bytes=max(small - per_sample * SAVED_BYTES_BATCHES[0], 0.0), per_sample_bytes=per_sample)

    def pinned_bytes(self, batch: int) -> float:
        return PINNED_ROUNDING * (self.fixed_bytes + self.per_sample_bytes * batch)

    def cap(self, available_bytes: int) -> int:
        return max(round_down((HOST_FRACTION * available_bytes / PINNED_ROUNDING - self.fixed_bytes)
                              / self.per_sample_bytes), 0)

    def refuses(self, batch: int) -> str | None:
        """Why `batch` must not be tried now, re-read against the memory available now; None when it may."""
        empty_host_cache()
        available = host_memory()[1]
        if available is None or self.pinned_bytes(batch) <= HOST_FRACTION * available:
            return None
        return (f"capped by host memory: ~{self.pinned_bytes(batch) / GIB:.1f} GiB pinned estimated, "
                f"{HOST_FRACTION:.0%} of {available / GIB:.1f} GiB available allowed")


def saved_bytes(trainer: Trainer, batch: int) -> int:
    """Bytes autograd saves in one plain forward pass and loss at `batch` (counted, not moved)."""
    import torch

    total = 0

    def count(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    images, labels = trainer.data(batch)
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        loss = trainer.loss_fn(trainer.model(images), labels)
    del loss
    trainer.release()
    return total


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host memory: /proc/meminfo, or psutil where that is missing."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil

        memory = psutil.virtual_memory()
        return memory.total, memory.available
    except ImportError:
        return None, None


def hold_device(settings: Settings) -> dict:
    """Holds the GPU to --hold; says what it did."""
    import torch

    if settings.device != "cuda":
        return {"name": platform.processor() or "CPU", "hold": "none (CPU: the hold does not apply)"}
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, settings.hold_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return {"name": torch.cuda.get_device_name(0), "total_bytes": total, "fraction": fraction,
            "hold": f"{settings.hold_bytes / GIB:g} GiB of {total / GIB:.1f} GiB (fraction {fraction:.4f})"}


def make_probe(trainer: Trainer, clock: Clock, guard: HostGuard | None) -> Callable[[int], bool | None]:
    """trains(), told what it found, timed, guarded; None when the share has no room for this batch."""
    pace = {"seconds_per_sample": 0.0}  # from the slowest probe that trained: a batch costs at least this

    def probe(batch: int) -> bool | None:
        if not clock.allows(pace["seconds_per_sample"] * batch):
            return None
        refusal = guard.refuses(batch) if guard else None
        if refusal:
            emit("probe", batch=batch, trains=False, seconds=0.0, why=refusal)
            return False
        started = time.monotonic()
        fits = trains(trainer, batch)
        seconds = time.monotonic() - started
        if fits:
            pace["seconds_per_sample"] = max(pace["seconds_per_sample"], seconds / batch)
        emit("probe", batch=batch, trains=fits, seconds=seconds, why=None if fits else "out of memory")
        return fits

    return probe


class OutOfTime(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Search:
    """Where a search ended: the largest batch seen to train, the smallest seen to fail, and how sure."""

    largest: int  # 0 when not even GRANULARITY trains (or nothing was tried)
    first_failure: int | None  # None when the limit itself trains
    bound: str  # "exact": bisected to GRANULARITY; "limit": the limit trains; "time": a lower bound


def search_largest(probe: Callable[[int], bool | None], start: int, limit: int, known: dict[int, bool]) -> Search:
    """Doubling up from `start` while batches train (halving down while they fail), then bisecting between
    the last that trained and the first that failed. `known` answers are not probed again."""
    answers = dict(known)

    def fits(batch: int) -> bool:
        if batch not in answers:
            answer = probe(batch)
            if answer is None:
                raise OutOfTime
            answers[batch] = answer
        return answers[batch]

    try:
        low, high = bracket(fits, min(start, limit), limit)
        while high is not None and high - low > GRANULARITY:
            middle = max(round_down((low + high) // 2), low + GRANULARITY)
            low, high = (middle, high) if fits(middle) else (low, middle)
    except OutOfTime:
        fitting = [batch for batch, ok in answers.items() if ok]
        failing = [batch for batch, ok in answers.items() if not ok]
        return Search(max(fitting, default=0), min(failing, default=None), "time")
    return Search(low, high, "limit" if high is None else "exact")


def bracket(fits: Callable[[int], bool], start: int, limit: int) -> tuple[int, int | None]:
    """(a batch that trains or 0, the next that fails or None when `limit` trains)."""
    batch = start
    if fits(batch):
        while batch < limit:
            bigger = min(batch * 2, limit)
            if not fits(bigger):
                return batch, bigger
            batch = bigger
        return batch, None
    while batch > GRANULARITY:
        smaller = max(round_down(batch // 2), GRANULARITY)
        if fits(smaller):
            return smaller, batch
        batch = smaller
    return 0, batch


def confirm(trainer: Trainer, probe: Callable[[int], bool | None], largest: int) -> tuple[int, str]:
    """Re-runs the answer after every cached block went back: a batch that fit only into blocks an earlier
    probe left behind is no answer. Steps down by GRANULARITY while the re-run fails."""
    trainer.release()
    batch = largest
    while batch >= GRANULARITY:
        answer = probe(batch)
        if answer is None:
            return batch, "not confirmed (no time left)"
        if answer:
            return batch, "confirmed" if batch == largest else f"confirmed lower ({largest} failed when re-run)"
        trainer.release()
        batch -= GRANULARITY
    return 0, f"{largest} failed when re-run, and nothing below it trained"


def child_search(settings: Settings, trainer: Trainer, guard: HostGuard | None, clock: Clock,
                 known: dict[int, bool]) -> None:
    limit, capped_by = settings.max_batch, "--max-batch"
    if guard is not None:
        available = host_memory()[1]
        host_cap = guard.cap(available) if available else limit
        if host_cap < limit:
            limit, capped_by = host_cap, "host memory"
    if limit < GRANULARITY:
        emit("search", largest=0, first_failure=None, bound="limit", capped_by=capped_by, confirmed=None)
        return
    probe = make_probe(trainer, clock, guard)
    search = search_largest(probe, min(settings.start_batch, limit), limit, known)
    largest, confirmed = search.largest, None
    if search.bound != "time" and largest:
        largest, confirmed = confirm(trainer, probe, largest)
    emit("search", largest=largest, first_failure=search.first_failure, bound=search.bound,
         capped_by=capped_by if search.bound == "limit" else None, limit=limit, confirmed=confirmed)
    if largest and not known.get(largest) and clock.allows(0.0):  # a known batch was measured at 256 already
        emit("speed_largest", **measure_speed(trainer, largest, clock))


def child_main(settings: Settings, variant: str, task: str, share_s: float, known: dict[int, bool]) -> int:
    """One variant's stage, in its own process: the figures at 256 (`speed`) or the search (`search`)."""
    clock = Clock(share_s)
    emit("device", **hold_device(settings))
    offloader = None
    if variant == "offload-overlap":
        name, offloader, tried = find_offloader()
        if offloader is None:
            emit("unavailable", why="none of the side-stream offloaders imports: " + "; ".join(tried))
            return 0
        emit("offloader", name=name)
    trainer = Trainer(variant, settings.device, settings.image_size, offloader)
    guard = HostGuard.measure(trainer) if variant in OFFLOADING else None
    if guard is not None:
        available = host_memory()[1]
        emit("host_guard", per_sample_bytes=guard.per_sample_bytes, fixed_bytes=guard.fixed_bytes,
             available_bytes=available, cap=guard.cap(available) if available else None)
    if task == "search":
        child_search(settings, trainer, guard, clock, known)
        return 0
    batch = min(SPEED_BATCH, settings.max_batch)
    refusal = guard.refuses(batch) if guard else None
    emit("speed", **({"batch": batch, "trains": False, "why": refusal} if refusal
                     else measure_speed(trainer, batch, clock)))
    return 0


# ---- the driver: stages in fresh processes, the header, the rows ----

class Log:
    """Prints to the terminal and to the text file, flushing both at every line."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


class Results:
    """The JSON file, rewritten whole (through a temporary file) whenever a figure comes in."""

    def __init__(self, path: Path, header: dict, settings: Settings):
        self.path = path
        self.data = {"header": header, "settings": {**dataclasses.asdict(settings), "out": str(settings.out)},
                     "variants": {name: {"variant": name, "stages": {}} for name in settings.variants}}
        self.save()

    def variant(self, name: str) -> dict:
        return self.data["variants"][name]

    def save(self) -> None:
        scratch = self.path.with_suffix(".json.tmp")
        scratch.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        scratch.replace(self.path)


def tf32_settings() -> dict:
    """PyTorch's TF32 switches as they are by default (this script leaves them so)."""
    import torch

    with warnings.catch_warnings():  # newer PyTorch warns that these switches have successors; they still read
        warnings.simplefilter("ignore")
        found = {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                 "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                 "float32_matmul_precision": torch.get_float32_matmul_precision()}
        for name, owner in (("cudnn.conv.fp32_precision", getattr(torch.backends.cudnn, "conv", None)),
                            ("cuda.matmul.fp32_precision", torch.backends.cuda.matmul)):
            if owner is not None and hasattr(owner, "fp32_precision"):
                found[name] = owner.fp32_precision
    return found


def package_version(name: str) -> str:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # noqa: BLE001 - absent or broken: either way not there
        return "not installed"


def describe_machine(settings: Settings) -> dict:
    import torch

    total, available = host_memory()
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hostname": platform.node(), "cpu_cores": os.cpu_count(), "python": platform.python_version(),
        "host_memory_bytes": total, "host_available_bytes": available,
        "gpu": nvidia_smi("name,memory.total") if settings.device == "cuda" else None,
        "driver": nvidia_smi("driver_version") if settings.device == "cuda" else None,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "torchvision": package_version("torchvision"), "timm": package_version("timm"),
        "cudnn_benchmark": torch.backends.cudnn.benchmark, "tf32": tf32_settings(),
        "command": "python3 benchmarks/peers/resnet50_torch.py " + shlex.join(sys.argv[1:]),
    }


def write_header(log: Log, header: dict, settings: Settings) -> None:
    log(f"date: {header['date_utc']}")
    log(f"command: {header['command']}")
    memory = (f", {header['host_memory_bytes'] / GIB:.1f} GiB RAM ({header['host_available_bytes'] / GIB:.1f} "
              "available)" if header["host_memory_bytes"] else "")
    log(f"machine: {header['hostname']}, {header['cpu_cores']} CPU cores{memory}, Python {header['python']}")
    if settings.device == "cuda":
        log(f"GPU (nvidia-smi): {header['gpu'] or 'unknown'}; driver {header['driver'] or 'unknown (no nvidia-smi)'}")
    else:
        log("NO GPU: --device cpu checks this script's logic; its figures are not GPU figures, and the hold "
            "does not apply")
    log(f"PyTorch {header['torch']} (CUDA {header['torch_cuda'] or '-'}, cuDNN {header['cudnn'] or '-'}), "
        f"torchvision {header['torchvision']}, timm {header['timm']}")
    log("TF32, PyTorch's defaults left as they are: " + ", ".join(f"{k}={v}" for k, v in header["tf32"].items())
        + f"; cudnn.benchmark={header['cudnn_benchmark']}. TensorFlow uses TF32 for both convolutions and "
        "matmuls by default: the convolutions, nearly all of ResNet-50's work, are TF32 in both")
    log(f"step: torchvision resnet50(weights=None, num_classes=1000), {settings.image_size}x{settings.image_size}x3 "
        "float32 (NCHW), SGD(lr=0.1, momentum=0.9), CrossEntropyLoss, random data made on the device once per batch")
    log(f"device: {settings.device}" + (f", held to {settings.hold_bytes / GIB:g} GiB "
                                        "(torch.cuda.set_per_process_memory_fraction)" if settings.device == "cuda"
                                        else ""))
    log(f"largest batch: {FIT_STEPS} steps train; doubling/halving from {settings.start_batch}, bisected to "
        f"{GRANULARITY}, re-run once after empty_cache; at most {settings.max_batch}; offloading variants at most "
        f"what {HOST_FRACTION:.0%} of available host memory pins (autograd's saved bytes x{PINNED_ROUNDING:g})")
    log(f"samples/s: {WARMUP_STEPS} warm-up steps, then up to {TIMED_STEPS} timed (torch.cuda.synchronize); "
        "peaks: max_memory_allocated / max_memory_reserved over those steps, reset per batch")
    log(f"deadline: {settings.deadline_s:g} s: {SPEED_PHASE_FRACTION:.0%} for the figures at {SPEED_BATCH}, the "
        "rest for the searches; each variant and stage in a fresh process")
    log()


def offloader_note() -> str | None:
    """None when an offloader's package is there (its child imports it); else the row's text."""
    if any(importlib.util.find_spec(module.split(".")[0]) for module, _ in OFFLOADERS):
        return None
    looked_for = [f"{module}.{attribute}" for module, attribute in OFFLOADERS]
    looked_for += [text if not importlib.util.find_spec(package) else f"{text}: installed, not wired"
                   for package, text in NOT_WIRED]
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "activation_offload_separate_stream"):
        looked_for.append("in torch itself only torch.compile's private flags torch._functorch.config."
                          "enable_activation_offloading / activation_offload_separate_stream (marked 'testing "
                          "purpose'), not used")
    looked_for.append("accelerate and transformers wrap save_on_cpu (compute stream); Lightning offers DeepSpeed's")
    return "none ships with this machine's packages (looked for: " + "; ".join(looked_for) + ")"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One child's run: its events, its wall time, and how it ended."""

    events: tuple[dict, ...]
    wall_s: float
    returncode: int | None
    timed_out: bool
    stderr_tail: str


def run_stage(settings: Settings, variant: str, task: str, timeout_s: float, known: dict[int, bool],
              on_event: Callable[[dict], None]) -> Stage:
    """Runs this script for one variant and task in a fresh process, passing on its events as they come;
    kills it at `timeout_s`. Its share is a little less, so that it stops probing before it is killed."""
    share_s = timeout_s - min(10.0, 0.25 * timeout_s)
    command = [sys.executable, str(Path(__file__).resolve()), *settings.child_argv(), "--variant", variant,
               "--task", task, "--share-s", f"{share_s:.1f}",
               *[arg for batch, ok in known.items() for arg in ("--known", f"{batch}:{'fits' if ok else 'fails'}")]]
    started, events, timed_out = time.monotonic(), [], False
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [*map(lines.put, process.stdout), lines.put(None)], daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=max(0.05, started + timeout_s - time.monotonic()))
            except queue.Empty:
                timed_out = True
                process.kill()
                break
            if line is None:
                break
            if line.startswith(EVENT):
                events.append(json.loads(line[len(EVENT):]))
                on_event(events[-1])
        returncode = process.wait()
        stderr.seek(0)
        tail = "\n".join(stderr.read().strip().splitlines()[-6:])
    return Stage(tuple(events), time.monotonic() - started, None if timed_out else returncode, timed_out, tail)


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def describe_event(event: dict) -> str:
    """One progress line for one child event."""
    kind = event["event"]
    if kind == "device":
        return f"device: {event['name']}, hold {event['hold']}"
    if kind == "offloader":
        return f"offloader: {event['name']}"
    if kind == "unavailable":
        return f"unavailable: {event['why']}"
    if kind == "host_guard":
        cap = "-" if event["cap"] is None else event["cap"]
        return (f"host guard: autograd saves {event['per_sample_bytes'] / MIB:.2f} MiB/sample + "
                f"{event['fixed_bytes'] / MIB:.1f} MiB; x{PINNED_ROUNDING:g} pinned within {HOST_FRACTION:.0%} of "
                f"{gib(event['available_bytes'])} GiB available: at most batch {cap}")
    if kind == "probe":
        return f"batch {event['batch']}: {'trains' if event['trains'] else event['why']} ({event['seconds']:.1f} s)"
    if kind == "search":
        return f"search: {largest_text(event)}" + (f"; {event['confirmed']}" if event.get("confirmed") else "")
    if kind in ("speed", "speed_largest"):
        return f"speed at batch {event['batch']}: {speed_text(event)}"
    if kind == "error":
        return f"error: {event['text']}"
    return json.dumps(event)


def speed_text(speed: dict) -> str:
    if not speed.get("trains"):
        return speed.get("why") or "-"
    pinned = speed.get("host_pinned_peak_bytes")
    return (f"{speed['step_ms']:.1f} ms/step ({speed['timed_steps']} timed), {speed['samples_per_s']:.1f} samples/s, "
            f"peak {gib(speed.get('peak_allocated_bytes'))}/{gib(speed.get('peak_reserved_bytes'))} GiB "
            "allocated/reserved" + (f", {gib(pinned)} GiB pinned on the host" if pinned else ""))


def largest_text(search: dict) -> str:
    largest = search["largest"]
    if search["bound"] == "time":
        return f">= {largest} (lower bound: time ran out" + (
            f"; {search['first_failure']} failed)" if search.get("first_failure") else ")")
    if search["bound"] == "limit":
        return f"{largest} (capped by {search['capped_by']})"
    return f"{largest}" if largest else f"0 (not even {GRANULARITY} trains)"


def record_stage(results: Results, variant: str, task: str, stage: Stage) -> None:
    """Files the stage's events under the variant: its speed, search and speed at the largest batch."""
    record = results.variant(variant)
    for event in stage.events:
        if event["event"] in ("speed", "search", "speed_largest", "host_guard", "device", "offloader"):
            record[event["event"]] = event
        elif event["event"] == "unavailable":
            record["unavailable"] = event["why"]
        elif event["event"] == "probe":
            record.setdefault("probes", []).append(event)
    ended = ("timed out (killed)" if stage.timed_out else "ok" if stage.returncode == 0
             else f"failed (exit {stage.returncode})")
    record["stages"][task] = {"wall_s": round(stage.wall_s, 1), "ended": ended,
                              **({"stderr_tail": stage.stderr_tail} if ended.startswith("failed") else {})}
    if stage.timed_out and task == "search" and "search" not in record:  # killed mid-search: what it had seen
        fitting = [p["batch"] for p in record.get("probes", []) if p["trains"]]
        failing = [p["batch"] for p in record.get("probes", []) if not p["trains"]]
        record["search"] = {"largest": max(fitting, default=0), "first_failure": min(failing, default=None),
                            "bound": "time"}
    results.save()


ROW_FORMAT = "{:<16} {:<44} {:>22} {:>22} {:>19} {:>19} {:>13}"
ROW_TITLES = ("variant", "largest batch", "samples/s @256|largest", "samples/s @largest", "GiB alloc/res @256",
              "GiB alloc/res @lgst", "wall s sp/se")


def row(name: str, record: dict) -> str:
    """One variant's row: largest batch, samples/s at 256 (or at its largest when that is lower), samples/s
    at its largest, the peaks at each, and each stage's wall time."""
    if "unavailable" in record:
        return f"{name:<16} {record['unavailable']}"
    search, at_256, at_largest = record.get("search"), record.get("speed"), record.get("speed_largest")
    if search and at_256 and at_256.get("trains") and search["largest"] == at_256["batch"]:
        at_largest = at_256  # measured once, at 256
    below_256 = search and search["bound"] != "time" and search["largest"] < SPEED_BATCH
    first = at_256 if at_256 and at_256.get("trains") else at_largest if below_256 else None

    def throughput(speed):
        return f"{speed['samples_per_s']:.1f} (b{speed['batch']})" if speed and speed.get("trains") else "-"

    def peaks(speed):
        if not speed or not speed.get("trains") or "peak_allocated_bytes" not in speed:
            return "-"
        return f"{gib(speed['peak_allocated_bytes'])}/{gib(speed['peak_reserved_bytes'])}"

    walls = "/".join(str(record["stages"].get(task, {}).get("wall_s", "-")) for task in ("speed", "search"))
    return ROW_FORMAT.format(name, largest_text(search) if search else "-", throughput(first), throughput(at_largest),
                             peaks(first), peaks(at_largest), walls)


def stage_timeout(phase_end: float, stages_left: int) -> float:
    return max(0.0, (phase_end - time.monotonic()) / max(stages_left, 1))


def run_phase(settings: Settings, log: Log, results: Results, names: list[str], task: str, phase_end: float) -> int:
    """One stage per variant, each given an equal part of what is left of the phase. Returns the failures."""
    failures = 0
    names = [name for name in names if "unavailable" not in results.variant(name)]
    for index, name in enumerate(names):
        timeout_s = stage_timeout(phase_end, len(names) - index)
        record = results.variant(name)
        if timeout_s < MIN_STAGE_S:
            log(f"[{name} {task}] skipped: {timeout_s:.1f} s left for it")
            record["stages"][task] = {"wall_s": 0.0, "ended": "skipped: no time left"}
            if task == "search":
                log("row: " + row(name, record))
            continue
        speed = record.get("speed") or {}
        known = {speed["batch"]: True} if speed.get("trains") else (
            {speed["batch"]: False} if speed.get("why") == "out of memory" else {})
        stage = run_stage(settings, name, task, timeout_s, known,
                          lambda event, name=name: log(f"[{name} {task}] {describe_event(event)}"))
        record_stage(results, name, task, stage)
        log(f"[{name} {task}] {record['stages'][task]['ended']} in {stage.wall_s:.1f} s (given {timeout_s:.0f} s)")
        if stage.returncode not in (0, None):
            failures += 1
            log(f"[{name} {task}] stderr: " + stage.stderr_tail.replace("\n", "\n    "))
        if task == "search":
            log("row: " + row(name, record))
    return failures


def driver_main(settings: Settings) -> int:
    """The header, then every stage; `peers: done` and the marker come whatever happened, since another
    script waits on the marker."""
    started = time.monotonic()
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / MARKER).unlink(missing_ok=True)
    log = Log(settings.out / TXT)
    failures, status = 0, "stopped by an error in the driver"
    try:
        header = describe_machine(settings)
        results = Results(settings.out / JSON_NAME, header, settings)
        write_header(log, header, settings)
        failures = run_all(settings, log, results, started)
        status = f"{failures} stage(s) failed"
        results.data["done_in_s"] = round(time.monotonic() - started, 1)
        results.save()
    finally:
        elapsed = time.monotonic() - started
        log(f"peers: done in {elapsed:.0f} s")
        (settings.out / MARKER).write_text(f"done in {elapsed:.0f} s, {status}\n")
    return 1 if failures else 0


def run_all(settings: Settings, log: Log, results: Results, started: float) -> int:
    """The figures at 256 for every variant first (the most telling), then the searches; returns the failures."""
    if "offload-overlap" in settings.variants and (note := offloader_note()):
        results.variant("offload-overlap")["unavailable"] = note
        results.save()
        log(f"[offload-overlap] {note}")
    budget = settings.deadline_s - RESERVE_S
    failures = run_phase(settings, log, results, list(settings.variants), "speed",
                         started + SPEED_PHASE_FRACTION * budget)
    log()
    log("row: " + ROW_FORMAT.format(*ROW_TITLES))
    for name in settings.variants:  # no search for these: their rows are whole already
        if "unavailable" in results.variant(name):
            log("row: " + row(name, results.variant(name)))
    return failures + run_phase(settings, log, results, list(settings.variants), "search", started + budget)


# ---- flags ----

def parse_args(argv: list[str]) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder for the .txt, the .json and peers.done")
    parser.add_argument("--deadline-s", type=float, default=200.0, help="the whole run's time, seconds (200)")
    parser.add_argument("--hold", default="16GiB", help="the GPU memory each variant may use (16GiB)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu checks the logic only")
    parser.add_argument("--image-size", type=int, default=224, help="square image side (224)")
    parser.add_argument("--max-batch", type=int, default=2048, help="no search goes past this batch (2048)")
    parser.add_argument("--start-batch", type=int, help="the search's first guess (256, or --max-batch if lower)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child's: one variant
    parser.add_argument("--task", choices=("speed", "search"), help=argparse.SUPPRESS)
    parser.add_argument("--share-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--known", action="append", default=[], help=argparse.SUPPRESS)  # BATCH:fits|fails
    args = parser.parse_args(argv)
    return validate(parser, args), args


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """Every flag checked here, each error naming its flag."""
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out: {args.out} exists and is not a folder")
    if not args.deadline_s > 0:
        parser.error(f"--deadline-s: {args.deadline_s:g} is not a positive number of seconds")
    try:
        hold = parse_bytes(args.hold)
    except ValueError as err:
        parser.error(f"--hold: {err}")
    variants = tuple(name.strip() for name in args.variants.split(",") if name.strip())
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown or not variants or len(set(variants)) != len(variants):
        parser.error(f"--variants: {args.variants!r}: give each of {', '.join(VARIANTS)} at most once"
                     + (f" ({', '.join(unknown)} unknown)" if unknown else ""))
    if args.image_size < 32:
        parser.error(f"--image-size: {args.image_size} is below 32, ResNet-50's total stride")
    if args.start_batch is None:
        args.start_batch = min(SPEED_BATCH, args.max_batch)
    for flag, value in (("--max-batch", args.max_batch), ("--start-batch", args.start_batch)):
        if value < GRANULARITY or value % GRANULARITY:
            parser.error(f"{flag}: {value} is not a positive multiple of {GRANULARITY}, the search's granularity")
    if args.start_batch > args.max_batch:
        parser.error(f"--start-batch: {args.start_batch} is above --max-batch {args.max_batch}")
    for known in args.known:
        batch, _, answer = known.partition(":")
        if not batch.isdigit() or answer not in ("fits", "fails"):
            parser.error(f"--known: {known!r} is not BATCH:fits or BATCH:fails")
    return Settings(out=Path(args.out), deadline_s=args.deadline_s, hold_bytes=hold, variants=variants,
                    device=args.device, image_size=args.image_size, max_batch=args.max_batch,
                    start_batch=args.start_batch)


def main(argv: list[str]) -> int:
    settings, args = parse_args(argv)
    try:
        import torch
        import torchvision  # noqa: F401
    except ImportError as err:
        print(f"resnet50_torch.py only runs where PyTorch and torchvision are installed ({err})", file=sys.stderr)
        return 2
    if settings.device == "cuda" and not torch.cuda.is_available():
        print("--device: cuda, but PyTorch sees no CUDA device here (use --device cpu to check the logic)",
              file=sys.stderr)
        return 2
    if args.variant is None:
        return driver_main(settings)
    known = {int(batch): answer == "fits" for batch, _, answer in (k.partition(":") for k in args.known)}
    try:
        return child_main(settings, args.variant, args.task or "speed", args.share_s or settings.deadline_s, known)
    except Exception as err:  # noqa: BLE001 - the driver gets the reason as an event; the traceback goes to stderr
        emit("error", text=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
