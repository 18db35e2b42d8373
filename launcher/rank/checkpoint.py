"""What training leaves on disk: checkpoints to resume from, and the trained model.

A checkpoint is a folder in `checkpoint.dir`, written by rank 0:

    step-00000300/
        state.bin       every variable's bytes, one after another (model variables, then optimizer's)
        manifest.json   written last: format, step, each tensor's name, dtype, shape and offset, and
                        the size and sha256 of state.bin

A save is atomic. It writes into a hidden folder (`.step-00000300.tmp-<pid>`), fsyncs both files
(the manifest last) and the folder, then renames the folder to its final name and fsyncs the parent.
A loader considers only `step-*` folders whose manifest parses and whose state.bin has the recorded
size and sha256, newest step first, so a save cut short anywhere (killed process, full disk, a copy
stopped half-way) is never loaded: the previous complete checkpoint is. Hidden folders left by an
interrupted save are deleted when the next run starts writing.

The optimizer's variables include its step counter (`iterations`), so the learning-rate schedule
continues from the restored step, and its slots (momentum, Adam's moments).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from launcher.config import CheckpointConfig
from launcher.rank.collectives import RankContext, allgather_object, broadcast_object

FORMAT = "lms-launch-checkpoint/1"
STATE_FILE = "state.bin"
MANIFEST_FILE = "manifest.json"
TRAINED_MODEL_FILE = "model.keras"
_FINAL_NAME = re.compile(r"^step-(\d{8,})$")
_TEMP_PREFIX = "."  # temporary and retired folders are hidden: no loader or user mistakes them for a checkpoint
_WRITE_CHUNK = 64 << 20
_RANK_STATE = re.compile(r"^rank\d+/")  # another rank's own state: `rank_prefix`


class CheckpointError(Exception):
    """A checkpoint cannot be written or resumed from; the message says what to change."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    step: int
    manifest: dict


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# --- files: numpy arrays in, numpy arrays out --------------------------------------------------


def write_checkpoint(directory: str | Path, step: int, tensors: Sequence[tuple[str, np.ndarray]],
                     metadata: dict | None = None) -> Path:
    """Writes `tensors` (name, array) as the checkpoint of `step` in `directory`; returns its path.
    Nothing named `step-*` exists until every byte is on disk."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    temp = directory / f"{_TEMP_PREFIX}{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        entries, size, digest = _write_state(temp / STATE_FILE, tensors)
        manifest = {
            "format": FORMAT, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "state_file": STATE_FILE, "state_bytes": size, "state_sha256": digest, "tensors": entries,
            **(metadata or {}),
        }
        _write_manifest(temp / MANIFEST_FILE, manifest)
        _fsync_dir(temp)
        if final.exists():  # the same step saved again (a resumed run stopped right after its start)
            retired = directory / f"{_TEMP_PREFIX}{final.name}.old-{os.getpid()}"
            os.rename(final, retired)
            os.rename(temp, final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(temp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def _write_state(path: Path, tensors: Sequence[tuple[str, np.ndarray]]) -> tuple[list[dict], int, str]:
    digest = hashlib.sha256()
    entries, offset = [], 0
    with open(path, "wb") as f:
        for name, value in tensors:
            array = np.asarray(value)
            if not array.flags.c_contiguous:
                array = array.copy(order="C")  # (np.ascontiguousarray would turn a scalar into shape [1])
            flat = array.reshape(-1).view(np.uint8)
            for start in range(0, flat.size, _WRITE_CHUNK):
                chunk = flat[start:start + _WRITE_CHUNK]
                f.write(chunk)
                digest.update(chunk)
            entries.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape), "offset": offset})
            offset += array.nbytes
        f.flush()
        os.fsync(f.fileno())
    return entries, offset, digest.hexdigest()


def _write_manifest(path: Path, manifest: dict) -> None:
    """The manifest is the last file of a save: its presence with a matching state.bin is what
    makes a folder a checkpoint."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan(directory: str | Path) -> tuple[list[Checkpoint], list[tuple[Path, str]]]:
    """The checkpoints in `directory` whose manifest is whole and whose state.bin has the recorded
    size, oldest first, and the `step-*` folders that are not, each with the reason. (The sha256 is
    checked when one is loaded: that reads the whole file.)"""
    directory = Path(directory)
    complete, skipped = [], []
    if not directory.is_dir():
        return complete, skipped
    for child in directory.iterdir():
        match = _FINAL_NAME.match(child.name)
        if not match or not child.is_dir():
            continue
        manifest, reason = _read_manifest(child, int(match.group(1)))
        if manifest is None:
            skipped.append((child, reason))
        else:
            complete.append(Checkpoint(child, manifest["step"], manifest))
    complete.sort(key=lambda c: c.step)
    skipped.sort()
    return complete, skipped


def _read_manifest(folder: Path, step: int) -> tuple[dict | None, str]:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None, "no manifest.json (a save that did not finish)"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return None, f"manifest.json is unreadable ({err})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"manifest.json is not an {FORMAT} manifest"
    if manifest.get("step") != step:
        return None, f"manifest.json says step {manifest.get('step')}, the folder name step {step}"
    state = folder / manifest.get("state_file", STATE_FILE)
    if not state.is_file():
        return None, f"{state.name} is missing"
    if state.stat().st_size != manifest.get("state_bytes"):
        return None, f"{state.name} has {state.stat().st_size} bytes, the manifest {manifest.get('state_bytes')}"
    return manifest, ""


def read_tensors(checkpoint: Checkpoint) -> list[tuple[str, np.ndarray]]:
    """The checkpoint's (name, array) pairs, after checking state.bin against the manifest's sha256."""
    manifest = checkpoint.manifest
    data = (checkpoint.path / manifest["state_file"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["state_sha256"]:
        raise CheckpointError(f"{checkpoint.path}: {manifest['state_file']} does not match the sha256 in its "
                              f"manifest (the file was changed or damaged after the save)")
    tensors = []
    for entry in manifest["tensors"]:
        dtype = np.dtype(entry["dtype"])
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if count == 0:
            array = np.empty(entry["shape"], dtype)
        else:
            array = np.frombuffer(data, dtype=dtype, count=count, offset=entry["offset"]).reshape(entry["shape"])
        tensors.append((entry["name"], array))
    return tensors


def load_newest(directory: str | Path, log: Callable[[str], None] = print
                ) -> tuple[Checkpoint, list[tuple[str, np.ndarray]]] | None:
    """The newest checkpoint that is complete and intact, with its tensors; None when there is none.
    Every folder passed over is logged with the reason."""
    complete, skipped = scan(directory)
    for path, reason in skipped:
        log(f"skipping {path}: {reason}")
    for checkpoint in reversed(complete):
        try:
            return checkpoint, read_tensors(checkpoint)
        except CheckpointError as err:
            log(f"skipping {err}")
    return None


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Deletes all but the newest `keep` complete checkpoints (keep 0: none); returns what it deleted.
    The manifest goes first, so a deletion cut short leaves a folder no loader takes."""
    if keep <= 0:
        return []
    complete, _ = scan(directory)
    removed = []
    for checkpoint in complete[:-keep]:
        (checkpoint.path / MANIFEST_FILE).unlink(missing_ok=True)
        shutil.rmtree(checkpoint.path, ignore_errors=True)
        removed.append(checkpoint.path)
    return removed


def remove_interrupted_saves(directory: str | Path) -> list[Path]:
    """Deletes the hidden folders that saves cut short left behind. Only rank 0 of one run writes
    to a checkpoint folder, so any found when a run starts are from a process that died."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    leftovers = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_TEMP_PREFIX + "step-")
                 and (".tmp-" in p.name or ".old-" in p.name)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


# --- training state: Keras variables <-> checkpoints ----------------------------------------------


def state_variables(model, optimizer) -> list[tuple[str, object]]:
    """Everything a resumed run needs, named: the model's variables (weights and batch-norm
    statistics), then the optimizer's (its step counter and slots)."""
    return ([(f"model/{v.path}", v) for v in model.variables]
            + [(f"optimizer/{v.path}", v) for v in optimizer.variables])


def check_compatible(checkpoint: Checkpoint, tensors: list[tuple[str, np.ndarray]],
                     variables: list[tuple[str, object]]) -> None:
    """Variables are matched by position; the shapes and dtypes must agree, or the recipe's model or
    optimizer is not the one the checkpoint was written for. (Other ranks' own state, saved after
    them under `rank<r>/`, is checked when it is handed out: `ResumePoint.restore_own_state`.)"""
    shared = [t for t in tensors if not _RANK_STATE.match(t[0])]
    if len(shared) != len(variables):
        raise CheckpointError(
            f"{checkpoint.path} holds {len(shared)} tensors, this model and optimizer have {len(variables)} "
            f"variables: resume with the model.* and train.optimizer settings the checkpoint was written with")
    for (saved_name, array), (name, variable) in zip(shared, variables):
        shape, dtype = tuple(variable.shape), np.dtype(variable.dtype)
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise CheckpointError(
                f"{checkpoint.path}: {saved_name} is {array.dtype}{list(array.shape)} in the checkpoint but "
                f"{name} is {dtype}{list(shape)} here: resume with the model.* and train.optimizer settings "
                f"the checkpoint was written with")


class Checkpointer:
    """Saves the training state at the steps `checkpoint` asks for; rank 0 alone writes.

    Every rank keeps its own batch-norm moving statistics (each updates them from its own batches;
    only the trained model, at the end, takes their mean). So a save gathers every rank's own
    non-trainable state, and a checkpoint holds rank 0's in `model/...` and rank r's in
    `rank<r>/model/...`: a run resumed on as many ranks then equals an uninterrupted one bit for bit.
    `save` is a collective: every rank calls it at the same steps."""

    def __init__(self, config: CheckpointConfig, model, optimizer, ctx: RankContext,
                 log: Callable[[str], None] | None, metadata: dict | None = None):
        self.config = config
        self.directory = Path(config.dir) if config.dir else None
        self.ctx = ctx
        self.log = log or (lambda line: None)
        self.metadata = metadata or {}
        self.last_saved: Path | None = None
        self._variables = state_variables(model, optimizer)
        self._own = own_state_variables(model)
        if self.enabled and ctx.is_root:
            for path in remove_interrupted_saves(self.directory):
                self.log(f"removed {path}, left by a save that was cut short")

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def due(self, step: int, last_step: bool) -> bool:
        every = self.config.every_steps
        return self.enabled and (last_step or (every > 0 and step % every == 0))

    def save(self, step: int) -> Path | None:
        """Collective. Returns the checkpoint's path on rank 0, None elsewhere."""
        import keras

        own = [keras.ops.convert_to_numpy(v.value) for _, v in self._own]
        everyone = allgather_object(self.ctx, own) if self._own else [own]
        if not self.ctx.is_root:
            return None
        started = time.perf_counter()
        tensors = [(name, keras.ops.convert_to_numpy(v.value)) for name, v in self._variables]
        tensors += [(f"{rank_prefix(rank)}{name}", value)
                    for rank, values in enumerate(everyone) if rank > 0
                    for (name, _), value in zip(self._own, values)]
        path = write_checkpoint(self.directory, step, tensors, {"ranks": self.ctx.size, **self.metadata})
        removed = prune(self.directory, self.config.keep)
        size = sum(a.nbytes for _, a in tensors)
        self.log(f"checkpoint {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - started:.2f} s)"
                 + (f"; removed {len(removed)} older" if removed else ""))
        self.last_saved = path
        return path


def own_state_variables(model) -> list[tuple[str, object]]:
    """The state each rank keeps for itself, named as in `state_variables`: the model's variables
    that are not trained (batch-norm moving statistics)."""
    trainable = {id(v) for v in model.trainable_variables}
    return [(f"model/{v.path}", v) for v in model.variables if id(v) not in trainable]


def rank_prefix(rank: int) -> str:
    """The prefix of rank `rank`'s own state in a checkpoint (rank 0's is the plain name)."""
    return f"rank{rank}/"


def check_folder(config: CheckpointConfig, resume: bool) -> None:
    """Raises CheckpointError when `checkpoint.dir` does not suit the run: --resume without a folder
    or without a complete checkpoint in it, or a new run into a folder that holds checkpoints (it
    would prune them, and a later --resume could pick them up). Reads manifests only, no TensorFlow:
    the launcher runs it before starting anything when rank 0 runs on its host."""
    directory = Path(config.dir) if config.dir else None
    if directory is None:
        if resume:
            raise CheckpointError("--resume needs checkpoint.dir: the folder the run to continue saved its "
                                  "checkpoints in (--set checkpoint.dir=DIR)")
        return
    complete, skipped = scan(directory)
    if resume and not complete:
        passed_over = "".join(f"; {path.name}: {reason}" for path, reason in skipped)
        raise CheckpointError(f"--resume: no complete checkpoint in checkpoint.dir {directory}{passed_over}")
    if not resume and complete:
        raise CheckpointError(
            f"checkpoint.dir {directory} already holds checkpoints (newest: {complete[-1].path.name}); "
            f"continue from it with --resume, or give a new checkpoint.dir")


@dataclass(frozen=True)
class ResumePoint:
    """Where training continues: after `step` (0 for a new run), and, when resumed, every rank's own
    non-trainable state as the checkpoint holds it (rank 0's first), or None when there is nothing
    of the ranks' own to give back (a new run, or a model without such state)."""

    step: int
    own_states: list[list[np.ndarray]] | None = None
    note: str = ""  # said once, on rank 0, when the ranks' own state cannot be given back as saved

    def restore_own_state(self, model, ctx: RankContext, log: Callable[[str], None]) -> None:
        """Gives this rank its own batch-norm statistics back. Call after the broadcast of rank 0's
        variables, which overwrote them with rank 0's."""
        if self.note:
            log(self.note)
        if self.own_states is None:
            return
        for (_, variable), value in zip(own_state_variables(model), self.own_states[ctx.rank]):
            variable.assign(value)


def restore_on_rank0(config: CheckpointConfig, model, optimizer, total_steps: int, resume: bool, ranks: int,
                     log: Callable[[str], None]) -> ResumePoint:
    """Rank 0's start: with `resume`, loads the newest complete checkpoint into the model and
    optimizer and returns where training continues, with the state of each of `ranks` ranks; without,
    checks that the folder holds no checkpoints of another run. (The worker then broadcasts rank 0's
    variables to every rank, and each rank takes its own state back.)"""
    check_folder(config, resume)
    if not resume:
        return ResumePoint(0)
    directory = Path(config.dir)
    found = load_newest(directory, log=log)
    if found is None:
        raise CheckpointError(f"--resume: no complete checkpoint in checkpoint.dir {directory}")
    checkpoint, tensors = found
    variables = state_variables(model, optimizer)
    check_compatible(checkpoint, tensors, variables)
    if checkpoint.step >= total_steps:
        raise CheckpointError(f"--resume: {checkpoint.path} is at step {checkpoint.step} and train.steps is "
                              f"{total_steps}: nothing left to train (raise train.steps to train further)")
    for (_, array), (_, variable) in zip(tensors, variables):
        variable.assign(array)
    log(f"resumed from {checkpoint.path}: training continues at step {checkpoint.step + 1} of {total_steps}")
    own = {id(v) for _, v in own_state_variables(model)}
    # Matched by position, as every variable is (`check_compatible`): the names the checkpoint gave them.
    own_names = [saved_name for (saved_name, _), (_, variable) in zip(tensors, variables) if id(variable) in own]
    own_states, note = saved_own_states(checkpoint, dict(tensors), own_names, ranks)
    return ResumePoint(checkpoint.step, own_states, note)


def saved_own_states(checkpoint: Checkpoint, saved: dict[str, np.ndarray], own_names: list[str],
                     ranks: int) -> tuple[list[list[np.ndarray]] | None, str]:
    """Each of `ranks` ranks' own state (`own_names`, as the checkpoint names rank 0's) from a
    checkpoint: as saved when it was written by as many ranks; otherwise every rank starts from the
    saved ranks' mean (what the trained model would hold), and the note says so."""
    if not own_names:
        return None, ""
    written_by = int(checkpoint.manifest.get("ranks", 1))
    states = [[saved[f"{rank_prefix(rank) if rank else ''}{name}"] for name in own_names] for rank in range(written_by)
              if all(f"{rank_prefix(rank) if rank else ''}{name}" in saved for name in own_names)]
    if len(states) == ranks:
        return states, ""
    mean = [np.mean(np.stack([state[i] for state in states]), axis=0).astype(states[0][i].dtype)
            for i in range(len(own_names))]
    how = (f"it was written by {written_by} rank(s) and this run has {ranks}" if written_by != ranks
           else "it holds one set for all ranks (written before each rank's own was kept)")
    return [mean] * ranks, (f"{checkpoint.path}: every rank starts from the mean of the saved batch-norm "
                            f"statistics, since {how}; the run is not bit-identical to an uninterrupted one")


def resume_point(config: CheckpointConfig, model, optimizer, ctx: RankContext, total_steps: int, resume: bool,
                 log: Callable[[str], None]) -> ResumePoint:
    """Collective: rank 0 restores (or checks the folder, see `restore_on_rank0`) and every rank
    learns where training continues, or rank 0's error as a CheckpointError, so all ranks stop
    together instead of some waiting in a collective for a rank that left."""
    outcome: tuple[ResumePoint | None, str | None] = (ResumePoint(0), None)
    if ctx.is_root:
        try:
            outcome = (restore_on_rank0(config, model, optimizer, total_steps, resume, ctx.size, log), None)
        except CheckpointError as err:
            outcome = (None, str(err))
    point, error = broadcast_object(ctx, outcome, name="lms_launch_resume_point")
    if error is not None:
        raise CheckpointError(error)
    return point


def save_trained_model(model, run_dir: str | Path) -> Path:
    """Writes the trained model in Keras format to RUN_DIR/model.keras (via a temporary folder and a
    rename, so a model.keras that exists is whole). Load it with keras.saving.load_model, after importing
    the task's module where the model has layers of its own (launcher.rank.tasks.unet3d, .seq2seq)."""
    run_dir = Path(run_dir)
    temp = run_dir / f".{TRAINED_MODEL_FILE}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        model.save(temp / TRAINED_MODEL_FILE)
        with open(temp / TRAINED_MODEL_FILE, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp / TRAINED_MODEL_FILE, run_dir / TRAINED_MODEL_FILE)
        _fsync_dir(run_dir)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return run_dir / TRAINED_MODEL_FILE
