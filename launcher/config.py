"""The recipe schema: one typed dataclass per section, a docstring on every field.

Each dataclass checks its own fields in `__post_init__` and raises `SettingError(key, rule)` with the
field's name; the loader (`launcher.recipe`) prefixes the section, so users see `train.batch_size`.
Checks that span sections live in `Recipe.__post_init__` and name full key paths themselves.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from lms_core.config import LMSConfig, SettingError

MODELS = ("resnet50", "unet3d", "seq2seq")
BATCH_NORMS = ("keras", "fused")  # how resnet50 trains batch norm (ModelConfig.batch_norm)
DATA_SOURCES = ("synthetic", "tfrecord")
OPTIMIZERS = ("sgd", "adam")
PRECISIONS = ("float32", "mixed_float16")
BACKENDS = ("gloo", "mpi", "srun")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SettingError(key, f"must be one of {', '.join(allowed)}; got {value!r}")


@dataclass
class ModelConfig:
    """The network and its input: one of the built-in networks (`name`), or your own (`builder`).
    Keys that belong to one built-in network only (marked so) are refused for the others; left out,
    they take that network's default, shown in brackets."""

    name: str | None = None
    """Which built-in network [resnet50]: `resnet50` (Keras ResNet-50, He et al. 2016), `unet3d` (the
    3D U-Net of Isensee et al. 2017 that the LMS papers trained; launcher/rank/tasks/unet3d.py) or
    `seq2seq` (an LSTM encoder-decoder with attention, Meng et al. 2017's case;
    launcher/rank/tasks/seq2seq.py). With `builder`, any label for logs and the summary [the builder's
    `module:function`]."""

    builder: str | None = None
    """Your own model instead of a built-in one: `module:function`, e.g. `my_package.models:build`.
    The module is imported from the recipe file's folder first, then from the Python path; the
    function gets a `ModelSpec` and `options` as keyword arguments and returns a `BuiltModel`
    (launcher/rank/tasks/builder.py; docs/own-model.md has the contract and an example)."""

    options: dict[str, Any] = field(default_factory=dict)
    """builder only: keyword arguments for the builder function, e.g. `{depth: 4, classes: 10}`;
    each must be one of its parameters."""

    builder_dir: str | None = None
    """builder only: the folder searched first for the builder's module. Leave it out: the loader
    sets it to the recipe file's folder (the resolved recipe.yaml of a run keeps it)."""

    input_shape: list[int] = field(default_factory=lambda: [224, 224, 3])
    """One sample's shape, channels last: [H, W, C] for resnet50, [D, H, W, C] for unet3d (D, H and
    W multiples of 2^(levels-1), e.g. 16 for 5 levels), [source length, target length] in tokens for
    seq2seq; for a builder, what its `ModelSpec.input_shape` says (the model's input without the
    batch)."""

    classes: int | None = None
    """resnet50 only [1000]: output classes; each image has one label in [0, classes)."""

    batch_norm: str | None = None
    """resnet50 only [keras]: how batch norm trains. `keras`: Keras 3's layer, moments and element-wise
    ops, whose gradient is a chain of full-size element-wise ops. `fused`: TensorFlow's fused kernel,
    one `FusedBatchNormV3` and one `FusedBatchNormGradV3` per layer, as TF 1.x Keras computed the
    LMS papers' ResNet-50 (launcher/rank/tasks/fused_batch_norm.py). The same normalization to float
    rounding; fused runs fewer ops, yet lms-launch's plans reach a smaller batch with it by Grappler's
    estimate (1062 against 1317 on 16 GiB: docs/benchmarks.md)."""

    labels: int | None = None
    """unet3d only [3]: binary label maps per voxel, one sigmoid output each; 3 for BraTS's nested
    regions (whole tumour, tumour core, enhancing tumour)."""

    levels: int | None = None
    """unet3d only [5]: resolution levels; level l has base_filters x 2^l filters at 1/2^l of the
    input's side (each level below the first starts with a stride-2 convolution). At least 2."""

    base_filters: int | None = None
    """unet3d only [16]: filters of the first level; each deeper level doubles them."""

    dropout: float | None = None
    """unet3d only [0.3]: the SpatialDropout3D rate in every context module (whole channels are
    dropped); 0 turns dropout off."""

    vocabulary: int | None = None
    """seq2seq only [32000]: tokens in the (shared-size) source and target vocabularies; 0 is padding
    and 1 the decoder's start token."""

    embedding: int | None = None
    """seq2seq only [512]: width of the source and target token embeddings."""

    units: int | None = None
    """seq2seq only [1024]: LSTM units of every encoder layer (the bidirectional first layer has
    units/2 per direction) and of the attention decoder."""

    encoder_layers: int | None = None
    """seq2seq only [4]: encoder LSTM layers, the first bidirectional. At least 1."""

    softmax_samples: int | None = None
    """seq2seq only [0]: 0 trains the projection to the vocabulary with the full softmax; N > 0 with a
    sampled softmax over the step's targets and N words drawn per step (Jean et al. 2015; TensorFlow's
    seq2seq tutorial of the papers' time drew 512), as NMT systems with large vocabularies trained. Less
    than the vocabulary."""

    steps_per_loop: int | None = None
    """seq2seq only [0]: 0 runs every recurrent layer as one loop over its whole sequence. N > 0 runs
    it as consecutive loops of N steps, each from the state the last one ended with: the same
    computation, but each loop keeps only its own steps' activations for the backward pass, so LMS
    swaps them a chunk at a time and the largest set back on the device at once shrinks with N
    (docs/benchmarks.md). The decoder may run at most 5 loops: N >= target length / 5."""

    def __post_init__(self) -> None:
        if self.builder is not None:
            self._check_builder()
            return
        for key in ("options", "builder_dir"):
            if getattr(self, key):
                raise SettingError(key, "applies to model.builder only; give model.builder, or remove it")
        self.name = "resnet50" if self.name is None else self.name
        _one_of("name", self.name, MODELS)
        layout = {"resnet50": "[H, W, C]", "unet3d": "[D, H, W, C]", "seq2seq": "[source length, target length]"}
        want = layout[self.name].count(",") + 1
        if len(self.input_shape) != want or any(d < 1 for d in self.input_shape):
            raise SettingError("input_shape", f"{self.name} takes {want} positive sizes {layout[self.name]}; "
                                              f"got {self.input_shape}")
        own = _MODEL_DEFAULTS[self.name]
        for key, other in ((k, m) for m, keys in _MODEL_DEFAULTS.items() if m != self.name for k in keys):
            if getattr(self, key) is not None and key not in own:
                raise SettingError(key, f"applies to {other} only; remove it for model.name {self.name}"
                                        + (" (its outputs are model.labels)" if key == "classes" and self.name == "unet3d" else ""))
        for key, default in own.items():
            if getattr(self, key) is None:
                setattr(self, key, default)
        if self.name == "resnet50":
            if self.classes < 2:
                raise SettingError("classes", f"must be >= 2; got {self.classes}")
            _one_of("batch_norm", self.batch_norm, BATCH_NORMS)
            return
        if self.name == "seq2seq":
            self._check_seq2seq()
            return
        if self.labels < 1:
            raise SettingError("labels", f"must be >= 1 binary label map; got {self.labels}")
        if self.levels < 2:
            raise SettingError("levels", f"must be >= 2 (the decoder starts one level above the bottom); "
                                         f"got {self.levels}")
        if self.base_filters < 1:
            raise SettingError("base_filters", f"must be >= 1; got {self.base_filters}")
        if not 0 <= self.dropout < 1:
            raise SettingError("dropout", f"must be in [0, 1) (0: no dropout); got {self.dropout}")
        step = 2 ** (self.levels - 1)
        if any(d % step for d in self.input_shape[:3]):
            fits = [max(step, round(d / step) * step) for d in self.input_shape[:3]]
            raise SettingError(
                "input_shape",
                f"D, H and W must be multiples of 2^(levels-1) = {step} so that every level halves them "
                f"exactly and the decoder meets the skips; got {self.input_shape[:3]} with {self.levels} levels "
                f"(e.g. {fits + self.input_shape[3:]}, or fewer model.levels)",
            )


    def _check_builder(self) -> None:
        module, sep, function = self.builder.partition(":")
        if not sep or not module.strip() or not function.isidentifier() \
                or not all(part.isidentifier() for part in module.split(".")):
            raise SettingError("builder", f"must be module:function, e.g. my_package.models:build; got {self.builder!r}")
        for key in (k for keys in _MODEL_DEFAULTS.values() for k in keys):
            if getattr(self, key) is not None:
                raise SettingError(key, f"belongs to a built-in network; for model.builder give it to your builder "
                                        f"as model.options.{key}")
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise SettingError("input_shape", f"must be one or more positive sizes; got {self.input_shape}")
        if any(not isinstance(key, str) or not key.isidentifier() for key in self.options):
            raise SettingError("options", f"keys must be the builder's parameter names; got {list(self.options)}")
        self.name = self.builder if self.name is None else self.name

    def _check_seq2seq(self) -> None:
        if self.vocabulary < 3:
            raise SettingError("vocabulary", f"must be >= 3 (0 is padding, 1 the start token); got {self.vocabulary}")
        for key in ("embedding", "encoder_layers"):
            if getattr(self, key) < 1:
                raise SettingError(key, f"must be >= 1; got {getattr(self, key)}")
        if self.steps_per_loop < 0:
            raise SettingError("steps_per_loop", f"must be 0 (one loop per layer) or a number of time steps; "
                                                 f"got {self.steps_per_loop}")
        target = self.input_shape[1]
        if self.steps_per_loop and math.ceil(target / self.steps_per_loop) > MAX_DECODER_LOOPS:
            raise SettingError(
                "steps_per_loop",
                f"gives the decoder {math.ceil(target / self.steps_per_loop)} loops over {target} target steps; at most "
                f"{MAX_DECODER_LOOPS}, so use {math.ceil(target / MAX_DECODER_LOOPS)} or more (each loop reads the "
                f"encoder's outputs, and with more of them TensorFlow sums their gradients differently at a large "
                f"batch than on the small twin the gating check runs: launcher/rank/tasks/seq2seq.py)")
        if not 0 <= self.softmax_samples < self.vocabulary - 1:
            raise SettingError("softmax_samples", f"must be 0 (the full softmax) or between 1 and vocabulary - 2 = "
                                                  f"{self.vocabulary - 2} words sampled per step; got {self.softmax_samples}")
        if self.units < 2 or self.units % 2:
            raise SettingError("units", f"must be even and >= 2 (the bidirectional first layer has units/2 per "
                                        f"direction); got {self.units}")


MAX_DECODER_LOOPS = 5
"""seq2seq: the most loops `steps_per_loop` may give the decoder (why: launcher/rank/tasks/seq2seq.py)."""

_MODEL_DEFAULTS = {
    "resnet50": {"classes": 1000, "batch_norm": "keras"},
    "unet3d": {"labels": 3, "levels": 5, "base_filters": 16, "dropout": 0.3},
    "seq2seq": {"vocabulary": 32000, "embedding": 512, "units": 1024, "encoder_layers": 4, "softmax_samples": 0,
                "steps_per_loop": 0},
}
"""The keys that belong to one network, and their defaults (ModelConfig's `[...]`)."""


@dataclass
class DataConfig:
    """Where training samples come from."""

    source: str = "synthetic"
    """`synthetic`: random tensors made once on the device (no input bottleneck; for memory and speed
    studies). `tfrecord`: files written by `lms-launch tfrecord` (schema in docs/data.md), or for
    resnet50 ImageNet's usual JPEG records, as tensorflow/models' converters and TFDS write them."""

    path: str | None = None
    """tfrecord only: a file, a directory of `*.tfrecord` files, or a glob pattern."""

    shuffle_buffer: int = 1024
    """tfrecord only: samples held in the shuffle buffer of each rank."""

    prefetch: int = 2
    """Batches prepared ahead of the training step (0: none)."""

    image_key: str | None = None
    """JPEG image records only: the feature holding the encoded image. Empty: found from the first
    record (`image/encoded` as tensorflow/models writes it, `image` as TFDS does)."""

    label_key: str | None = None
    """JPEG image records only: the feature holding the class (int64). Empty: found with the image
    (`image/class/label`, or TFDS's `label`)."""

    label_offset: int = 0
    """JPEG image records only: subtracted from every stored class, so classes reach the model in
    [0, model.classes). 1 for the records of tensorflow/models' build_imagenet_data.py, which counts
    ImageNet's classes from 1 (0 was "background"); 0 for TFDS's and official/vision's."""

    def __post_init__(self) -> None:
        _one_of("source", self.source, DATA_SOURCES)
        if self.source == "tfrecord" and not self.path:
            raise SettingError("path", "is required when data.source is tfrecord")
        if self.shuffle_buffer < 1:
            raise SettingError("shuffle_buffer", f"must be >= 1; got {self.shuffle_buffer}")
        if self.prefetch < 0:
            raise SettingError("prefetch", f"must be >= 0; got {self.prefetch}")
        if self.label_offset < 0:
            raise SettingError("label_offset", f"must be >= 0 (it is subtracted from stored labels); "
                                               f"got {self.label_offset}")
        for key in ("image_key", "label_key"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise SettingError(key, "must be a feature name, or left out to find it from the records")

    @property
    def names_jpeg_features(self) -> bool:
        """Whether a key that only JPEG image records use is set."""
        return bool(self.image_key or self.label_key or self.label_offset)


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
    """Total ranks. 1 runs a single process without a Horovod launcher. Inside a Slurm job whose hosts
    the launch takes from the job, every slot of the job unless --np or --set distributed.np says
    otherwise (a recipe's np is for machines of one's own)."""

    hosts: str | None = None
    """`host:slots,host:slots` as for horovodrun -H. Empty: all ranks on this machine, or inside a Slurm
    job (sbatch, salloc) the job's nodes with its tasks per node as slots (docs/clusters.md)."""

    hostfile: str | None = None
    """A file with one `host slots=N` (or `host:N`) per line, as for horovodrun --hostfile."""

    backend: str = "gloo"
    """`gloo` (horovodrun --gloo; needs nothing else), `mpi` (mpirun; Horovod built with MPI), both
    over ssh to other hosts, or `srun` (inside a Slurm job: srun starts the ranks as the tasks of a
    job step and they meet at a Gloo rendezvous lms-launch serves; no ssh between nodes)."""

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
        if self.data.names_jpeg_features and (self.model.name != "resnet50" or self.data.source != "tfrecord"):
            key = next(k for k in ("image_key", "label_key", "label_offset") if getattr(self.data, k))
            raise SettingError(f"data.{key}", f"applies to JPEG image records (model.name resnet50 with data.source "
                                              f"tfrecord); remove it for model.name {self.model.name} with "
                                              f"data.source {self.data.source}")
        if self.logging.skip_steps >= self.train.steps:
            raise SettingError(
                "logging.skip_steps",
                f"must be below train.steps ({self.train.steps}) or nothing is measured; got {self.logging.skip_steps}",
            )
