"""The recipe schema: one typed dataclass per section, a docstring on every field.

Each dataclass checks its own fields in `__post_init__` and raises `SettingError(key, rule)` with the
field's name; the loader (`launcher.recipe`) prefixes the section, so users see `train.batch_size`.
Checks that span sections live in `Recipe.__post_init__` and name full key paths themselves.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from lms_core.config import LMSConfig, SettingError

MODELS = ("resnet50", "unet3d")
DATA_SOURCES = ("synthetic", "tfrecord")
OPTIMIZERS = ("sgd", "adam")
PRECISIONS = ("float32", "mixed_float16")
BACKENDS = ("gloo", "mpi")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SettingError(key, f"must be one of {', '.join(allowed)}; got {value!r}")


@dataclass
class ModelConfig:
    """The network and its input."""

    name: str = "resnet50"
    """Which network: `resnet50` (Keras ResNet-50, He et al. 2016) or `unet3d` (Cicek et al. 2016)."""

    input_shape: list[int] = field(default_factory=lambda: [224, 224, 3])
    """One sample's shape, channels last: [H, W, C] for resnet50, [D, H, W, C] for unet3d."""

    classes: int = 1000
    """Output classes (resnet50) or segmentation labels per voxel (unet3d)."""

    depth: int = 4
    """unet3d only: resolution levels of the encoder (each halves D, H and W)."""

    base_filters: int = 32
    """unet3d only: filters of the first level; each deeper level doubles them."""

    batch_norm: bool = True
    """unet3d only: batch normalization after every convolution."""

    def __post_init__(self) -> None:
        _one_of("name", self.name, MODELS)
        want = 3 if self.name == "resnet50" else 4
        if len(self.input_shape) != want or any(d < 1 for d in self.input_shape):
            layout = "[H, W, C]" if want == 3 else "[D, H, W, C]"
            raise SettingError("input_shape", f"{self.name} takes {want} positive sizes {layout}; got {self.input_shape}")
        if self.classes < 2:
            raise SettingError("classes", f"must be >= 2; got {self.classes}")
        if self.depth < 1:
            raise SettingError("depth", f"must be >= 1; got {self.depth}")
        if self.base_filters < 1:
            raise SettingError("base_filters", f"must be >= 1; got {self.base_filters}")
        if self.name == "unet3d":
            step = 2 ** (self.depth - 1)
            if any(d % step for d in self.input_shape[:3]):
                raise SettingError(
                    "input_shape",
                    f"D, H and W must be divisible by 2^(depth-1) = {step} so the decoder meets the skips; "
                    f"got {self.input_shape[:3]} with depth {self.depth}",
                )


@dataclass
class DataConfig:
    """Where training samples come from."""

    source: str = "synthetic"
    """`synthetic`: random tensors made once on the device (no input bottleneck; for memory and speed
    studies). `tfrecord`: files written by `lms-launch tfrecord` (schema in docs/data.md)."""

    path: str | None = None
    """tfrecord only: a file, a directory of `*.tfrecord` files, or a glob pattern."""

    shuffle_buffer: int = 1024
    """tfrecord only: samples held in the shuffle buffer of each rank."""

    prefetch: int = 2
    """Batches prepared ahead of the training step (0: none)."""

    def __post_init__(self) -> None:
        _one_of("source", self.source, DATA_SOURCES)
        if self.source == "tfrecord" and not self.path:
            raise SettingError("path", "is required when data.source is tfrecord")
        if self.shuffle_buffer < 1:
            raise SettingError("shuffle_buffer", f"must be >= 1; got {self.shuffle_buffer}")
        if self.prefetch < 0:
            raise SettingError("prefetch", f"must be >= 0; got {self.prefetch}")


@dataclass
class TrainConfig:
    """The optimization loop."""

    batch_size: int = 32
    """Samples per step on each rank; the global batch is batch_size x ranks."""

    steps: int = 100
    """Training steps to run."""

    optimizer: str = "sgd"
    """`sgd` (with momentum, as in the ResNet paper) or `adam`."""

    learning_rate: float = 0.1
    """Learning rate for one rank; multiplied by the number of ranks when `scale_lr_by_ranks`."""

    scale_lr_by_ranks: bool = True
    """Linear scaling rule (Goyal et al. 2017): the global batch grows with the ranks, so does the rate."""

    momentum: float = 0.9
    """sgd only: momentum."""

    warmup_steps: int = 0
    """Learning-rate warm-up: the rate ramps linearly from 0 over this many steps."""

    precision: str = "float32"
    """`float32` or `mixed_float16` (float16 compute, float32 weights, dynamic loss scaling)."""

    seed: int = 42
    """Seed for weights (rank 0's are broadcast) and data (each rank adds its rank)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise SettingError("batch_size", f"must be >= 1; got {self.batch_size}")
        if self.steps < 1:
            raise SettingError("steps", f"must be >= 1; got {self.steps}")
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        if not self.learning_rate > 0:
            raise SettingError("learning_rate", f"must be > 0; got {self.learning_rate}")
        if not 0 <= self.momentum < 1:
            raise SettingError("momentum", f"must be in [0, 1); got {self.momentum}")
        if self.warmup_steps < 0:
            raise SettingError("warmup_steps", f"must be >= 0; got {self.warmup_steps}")
        _one_of("precision", self.precision, PRECISIONS)


@dataclass
class DistributedConfig:
    """How many ranks, where, and how they talk."""

    np: int = 1
    """Total ranks. 1 runs a single process without a Horovod launcher."""

    hosts: str | None = None
    """`host:slots,host:slots` as for horovodrun -H. Empty: all ranks on this machine."""

    hostfile: str | None = None
    """A file with one `host slots=N` (or `host:N`) per line, as for horovodrun --hostfile."""

    backend: str = "gloo"
    """`gloo` (horovodrun --gloo; needs nothing else) or `mpi` (mpirun; Horovod built with MPI)."""

    network_interface: str | None = None
    """Network interface(s) the ranks talk over, e.g. `eth0` or `ib0,eth0` (horovodrun
    --network-interfaces; mpirun btl_tcp_if_include and oob_tcp_if_include). The same name must exist
    on every host. Empty lets Horovod or Open MPI choose."""

    ssh_port: int | None = None
    """Port of the sshd on every other host, for horovodrun, mpirun and fetching results back.
    Empty: ssh's own default (22, or your ~/.ssh/config)."""

    ssh_identity_file: str | None = None
    """Private key for ssh to the other hosts (ssh -i), a path on the launcher's host. Empty: ssh's
    own defaults (~/.ssh/id_*, ssh-agent, ~/.ssh/config)."""

    start_timeout: int | None = None
    """Seconds the start may take before the launch is declared failed: horovodrun --start-timeout
    (its task servers and rendezvous; its own ssh check of each host keeps a fixed 10 s x 5 tries);
    for mpirun, and for fetching results back, ssh's ConnectTimeout, so a host that does not answer
    fails the launch instead of holding it. Empty: horovodrun's default (30 s, or HOROVOD_START_TIMEOUT),
    ssh's own for mpirun, 30 s for the fetch."""

    def __post_init__(self) -> None:
        if self.np < 1:
            raise SettingError("np", f"must be >= 1; got {self.np}")
        _one_of("backend", self.backend, BACKENDS)
        if self.hosts and self.hostfile:
            raise SettingError("hosts", "give hosts or hostfile, not both")
        if self.network_interface is not None and not re.fullmatch(r"[\w.:@-]+(,[\w.:@-]+)*", self.network_interface):
            raise SettingError("network_interface", f"must be interface names separated by commas, e.g. eth0 or "
                                                    f"ib0,eth0; got {self.network_interface!r}")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise SettingError("ssh_port", f"must be a port number 1..65535; got {self.ssh_port}")
        if self.ssh_identity_file is not None and (not self.ssh_identity_file.strip()
                                                   or re.search(r"\s", self.ssh_identity_file)):
            # horovodrun and mpirun both pass ssh options as one space-separated string.
            raise SettingError("ssh_identity_file", f"must be a path without spaces (horovodrun and mpirun split "
                                                    f"ssh options at spaces); got {self.ssh_identity_file!r}")
        if self.start_timeout is not None and self.start_timeout < 1:
            raise SettingError("start_timeout", f"must be >= 1 second; got {self.start_timeout}")


@dataclass
class LoggingConfig:
    """What every rank measures and where it goes."""

    interval: int = 10
    """Steps per metrics record: throughput, step time and peak memory are taken over each interval."""

    skip_steps: int = 2
    """Steps at the start not measured at all (tracing, graph rewrite, allocator warm-up)."""

    tensorboard: bool = True
    """Write TensorBoard scalars under RUN_DIR/tensorboard/rank<N>."""

    progress: bool = True
    """Show a progress bar with throughput and memory while training (only on a terminal)."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise SettingError("interval", f"must be >= 1; got {self.interval}")
        if self.skip_steps < 0:
            raise SettingError("skip_steps", f"must be >= 0; got {self.skip_steps}")


@dataclass
class CheckpointConfig:
    """Checkpoints of the training state (weights, optimizer state, step), written by rank 0, and
    what `lms-launch --resume` continues from. The layout is described in launcher/rank/checkpoint.py."""

    dir: str | None = None
    """Folder of this run's checkpoints, on rank 0's host (a relative path is taken from the
    directory lms-launch runs in). Empty: no checkpoints. A new run (without --resume) refuses a
    folder that already holds checkpoints, so one run never prunes or resumes another's."""

    every_steps: int = 500
    """Save after every this many steps; a checkpoint is also saved after the last step and when the
    run is stopped by SIGTERM or Ctrl-C. 0: only those two."""

    keep: int = 3
    """How many of the newest complete checkpoints to keep; older ones are deleted after each save.
    0 keeps them all."""

    def __post_init__(self) -> None:
        if self.dir is not None and not self.dir.strip():
            raise SettingError("dir", "must be a folder path, or left out for no checkpoints; got an empty string")
        if self.every_steps < 0:
            raise SettingError("every_steps", f"must be >= 0 (0: save only after the last step and when stopped); "
                                              f"got {self.every_steps}")
        if self.keep < 0:
            raise SettingError("keep", f"must be >= 0 (0: keep every checkpoint); got {self.keep}")


@dataclass
class Recipe:
    """A whole training run. Precedence: these defaults < the YAML recipe < `--set` and flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lms: LMSConfig = field(default_factory=LMSConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.logging.skip_steps >= self.train.steps:
            raise SettingError(
                "logging.skip_steps",
                f"must be below train.steps ({self.train.steps}) or nothing is measured; got {self.logging.skip_steps}",
            )
