"""Checkpoints, --resume and the trained model.

What must hold: a checkpoint gives back every tensor bit for bit; a save cut short (an injected
failure before the manifest, or the saving process killed with SIGKILL while it writes) never
yields a checkpoint that loads, and the previous one is loaded instead; damaged files are passed over;
`keep` prunes; and a run of 6 steps ends with the same weights and optimizer state as a run stopped
after 3 and resumed for 3 more, on one rank and on two Gloo ranks. The trained model is written in
Keras format and loads with the final weights (checked on the uninterrupted runs).
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from launcher.rank import checkpoint as ck
from launcher.config import CheckpointConfig
from launcher.recipe import RecipeError, load_recipe
from launcher.rank.collectives import RankContext
from tests.fixtures import REPO, RECIPES, lms_launch_argv

ALONE = RankContext(rank=0, size=1, local_rank=0, local_size=1, host="here", device="CPU:0")

TINY_UNET = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
             "--set", "logging.interval=2", "--set", "lms.enabled=false"]


def sample_tensors(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        ("model/dense/kernel", rng.standard_normal((7, 5)).astype(np.float32)),
        ("model/bn/moving_mean", rng.standard_normal(5).astype(np.float32)),
        ("model/empty", np.zeros((0, 3), np.float32)),
        ("optimizer/iteration", np.asarray(seed * 10, np.int64)),  # a scalar stays a scalar
        ("optimizer/flags", rng.integers(0, 2, 6).astype(bool)),
        ("optimizer/half", rng.standard_normal((2, 2)).astype(np.float16)),
    ]


def assert_same_tensors(got, expected):
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


# --- the files -------------------------------------------------------------------------------------


def test_a_checkpoint_gives_back_every_tensor_bit_for_bit(tmp_path):
    tensors = sample_tensors(3)
    path = ck.write_checkpoint(tmp_path, 3, tensors, {"ranks": 2})
    assert path == tmp_path / "step-00000003"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.bin"]
    found, tensors_back = ck.load_newest(tmp_path)
    assert found.step == 3 and found.manifest["ranks"] == 2
    assert_same_tensors(tensors_back, tensors)
    assert found.manifest["state_bytes"] == sum(a.nbytes for _, a in tensors)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_the_newest_complete_checkpoint_is_loaded(tmp_path):
    for step in (2, 10, 7):
        ck.write_checkpoint(tmp_path, step, sample_tensors(step))
    found, tensors = ck.load_newest(tmp_path)
    assert found.step == 10  # by step number, not by name order or write order
    assert_same_tensors(tensors, sample_tensors(10))


def test_no_checkpoint_at_all_is_none(tmp_path):
    assert ck.load_newest(tmp_path / "missing") is None
    assert ck.load_newest(tmp_path) is None


def test_a_save_that_fails_before_its_manifest_leaves_nothing_that_loads(tmp_path, monkeypatch):
    ck.write_checkpoint(tmp_path, 1, sample_tensors(1))

    def disk_full(path, manifest):
        raise OSError(28, "No space left on device")

    # The failure is injected between the state file and the manifest, the last moment a save can die.
    monkeypatch.setattr(ck, "_write_manifest", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ck.write_checkpoint(tmp_path, 2, sample_tensors(2))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    found, tensors = ck.load_newest(tmp_path)
    assert found.step == 1
    assert_same_tensors(tensors, sample_tensors(1))


KILLED_SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from launcher.rank.checkpoint import write_checkpoint

    directory = sys.argv[1]
    write_checkpoint(directory, 1, [("w", np.arange(10, dtype=np.float32))])
    print("first saved", flush=True)
    # 96 tensors of 4 MiB: long enough to be caught mid-write by a test polling every millisecond.
    big = [(f"t{i}", np.full(1 << 20, i, np.float32)) for i in range(96)]
    write_checkpoint(directory, 2, big)
    print("second saved", flush=True)
""")


def test_a_save_killed_mid_write_is_ignored_and_its_leftovers_removed(tmp_path):
    saver = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline().strip() == "first saved"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = list(tmp_path.glob(".step-00000002.tmp-*/state.bin"))
            if partial and partial[0].stat().st_size > 0:
                saver.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        saver.wait(timeout=30)
    finally:
        saver.kill()
    assert saver.returncode == -signal.SIGKILL, "the save finished before the test could interrupt it"
    leftovers = list(tmp_path.glob(".step-00000002.tmp-*"))
    assert len(leftovers) == 1 and not (tmp_path / "step-00000002").exists()
    assert not (leftovers[0] / "manifest.json").exists()

    found, tensors = ck.load_newest(tmp_path)
    assert found.step == 1
    assert_same_tensors(tensors, [("w", np.arange(10, dtype=np.float32))])
    assert ck.remove_interrupted_saves(tmp_path) == leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


@pytest.mark.parametrize("damage, reason", [
    ("flip a byte", "does not match the sha256"),
    ("truncate", "has 100 bytes, the manifest"),
    ("remove the manifest", "no manifest.json"),
    ("garble the manifest", "manifest.json is unreadable"),
])
def test_a_damaged_checkpoint_is_passed_over_for_the_previous_one(tmp_path, damage, reason):
    ck.write_checkpoint(tmp_path, 4, sample_tensors(4))
    newest = ck.write_checkpoint(tmp_path, 8, sample_tensors(8))
    state, manifest = newest / "state.bin", newest / "manifest.json"
    if damage == "flip a byte":
        data = bytearray(state.read_bytes())
        data[17] ^= 0x01
        state.write_bytes(bytes(data))
    elif damage == "truncate":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "remove the manifest":
        manifest.unlink()
    else:
        manifest.write_text(manifest.read_text()[:40])
    logged = []
    found, tensors = ck.load_newest(tmp_path, log=logged.append)
    assert found.step == 4
    assert_same_tensors(tensors, sample_tensors(4))
    assert len(logged) == 1 and reason in logged[0] and "step-00000008" in logged[0]


def test_keep_deletes_the_oldest_complete_checkpoints(tmp_path):
    for step in range(1, 6):
        ck.write_checkpoint(tmp_path, step, sample_tensors(step))
    assert ck.prune(tmp_path, keep=0) == []  # 0 keeps all
    removed = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000002", "step-00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]


# --- the recipe section ----------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("checkpoint.every_steps=-1", "checkpoint.every_steps: must be >= 0"),
    ("checkpoint.keep=-2", "checkpoint.keep: must be >= 0"),
    ("checkpoint.dir=' '", "checkpoint.dir: must be a folder path"),
    ("checkpoint.every_step=5", "unknown key 'checkpoint.every_step'; did you mean 'checkpoint.every_steps'?"),
    ("checkpoint.keep=two", "checkpoint.keep: expected an integer"),
])
def test_a_bad_checkpoint_section_names_the_key(override, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPES / "unet3d-cpu.yaml", [override])
    assert message in str(err.value)


def test_checkpoints_are_off_unless_a_folder_is_given():
    recipe = load_recipe(RECIPES / "unet3d-cpu.yaml", ["checkpoint.every_steps=5"])
    assert recipe.checkpoint == CheckpointConfig(dir=None, every_steps=5, keep=3)


# --- training state in and out of Keras ------------------------------------------------------------


def small_model_and_optimizer(seed: int, units: int = 3):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units), keras.layers.BatchNormalization()])
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def train_a_little(model, optimizer, steps: int) -> None:
    import tensorflow as tf

    x = tf.random.stateless_normal([8, 4], seed=[1, 2])
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)


def values(model, optimizer) -> list[np.ndarray]:
    return [np.array(v.value) for _, v in ck.state_variables(model, optimizer)]


def test_the_training_state_restores_into_a_fresh_model(tmp_path):
    config = CheckpointConfig(dir=str(tmp_path), every_steps=1)
    model, optimizer = small_model_and_optimizer(seed=1)
    train_a_little(model, optimizer, steps=3)
    ck.Checkpointer(config, model, optimizer, ALONE, log=None).save(3)
    saved = values(model, optimizer)

    fresh_model, fresh_optimizer = small_model_and_optimizer(seed=2)
    assert any(not np.array_equal(a, b) for a, b in zip(values(fresh_model, fresh_optimizer), saved))
    point = ck.restore_on_rank0(config, fresh_model, fresh_optimizer, total_steps=10, resume=True, ranks=1,
                                log=lambda _: None)
    assert point.step == 3
    restored = values(fresh_model, fresh_optimizer)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(restored, saved))
    assert int(fresh_optimizer.iterations.numpy()) == 3  # the learning-rate schedule goes on from here
    momentum_slots = [v for v in fresh_optimizer.variables if "momentum" in v.path]
    assert momentum_slots and any(np.any(np.array(v.value) != 0) for v in momentum_slots)


def test_resume_refusals_say_what_to_change(tmp_path):
    model, optimizer = small_model_and_optimizer(seed=1)
    quiet = lambda _: None  # noqa: E731
    with pytest.raises(ck.CheckpointError, match="--resume needs checkpoint.dir"):
        ck.restore_on_rank0(CheckpointConfig(), model, optimizer, 10, resume=True, ranks=1, log=quiet)
    config = CheckpointConfig(dir=str(tmp_path))
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint in checkpoint.dir"):
        ck.restore_on_rank0(config, model, optimizer, 10, resume=True, ranks=1, log=quiet)

    ck.Checkpointer(config, model, optimizer, ALONE, log=None).save(10)
    # A new run must not prune or later resume another run's checkpoints.
    with pytest.raises(ck.CheckpointError, match="already holds checkpoints .newest: step-00000010.; continue "
                                                 "from it with --resume, or give a new checkpoint.dir"):
        ck.restore_on_rank0(config, model, optimizer, 10, resume=False, ranks=1, log=quiet)
    with pytest.raises(ck.CheckpointError, match="at step 10 and train.steps is 10: nothing left to train"):
        ck.restore_on_rank0(config, model, optimizer, 10, resume=True, ranks=1, log=quiet)
    other_model, other_optimizer = small_model_and_optimizer(seed=1, units=5)
    with pytest.raises(ck.CheckpointError, match=r"model/.*kernel is float32\[4, 3\] in the checkpoint but .* is "
                                                 r"float32\[4, 5\] here"):
        ck.restore_on_rank0(config, other_model, other_optimizer, 20, resume=True, ranks=1, log=quiet)


def test_each_rank_gets_its_own_statistics_back_or_all_the_mean_when_the_ranks_changed(tmp_path):
    model, optimizer = small_model_and_optimizer(seed=1)
    train_a_little(model, optimizer, steps=2)  # rank 0's moving statistics move off their initial values
    own = ck.own_state_variables(model)  # the batch norm's moving mean and variance
    assert [name.rsplit("/", 1)[-1] for name, _ in own] == ["moving_mean", "moving_variance"]
    shared = [(name, np.asarray(v.value)) for name, v in ck.state_variables(model, optimizer)]
    rank1 = [(f"rank1/{name}", np.full(tuple(v.shape), 4.0, np.float32)) for name, v in own]
    ck.write_checkpoint(tmp_path, 5, shared + rank1, {"ranks": 2})
    checkpoint = ck.scan(tmp_path)[0][-1]
    saved = dict(ck.read_tensors(checkpoint))
    rank0 = [np.asarray(v.value) for _, v in own]

    names = [name for name, _ in own]
    states, note = ck.saved_own_states(checkpoint, saved, names, ranks=2)
    assert note == ""
    assert [a.tobytes() for a in states[0]] == [a.tobytes() for a in rank0]
    assert all((a == 4.0).all() for a in states[1])

    # Resumed on 3 ranks: no rank's own statistics fit, so every rank starts from the saved ranks' mean.
    states, note = ck.saved_own_states(checkpoint, saved, names, ranks=3)
    assert len(states) == 3 and all(state is states[0] for state in states)
    for got, mine in zip(states[0], rank0):
        np.testing.assert_array_equal(got, (mine + np.float32(4.0)) / np.float32(2.0))
    assert "written by 2 rank(s) and this run has 3" in note and "not bit-identical" in note


def test_resume_without_a_checkpoint_folder_is_a_usage_error(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(run_dir), "--resume"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--resume needs checkpoint.dir" in done.stderr
    assert not run_dir.exists()  # nothing started


@pytest.mark.parametrize("resume, setup, message", [
    (True, "empty", "--resume: no complete checkpoint in checkpoint.dir"),
    (True, "interrupted", "step-00000005: no manifest.json (a save that did not finish)"),
    (False, "complete", "already holds checkpoints (newest: step-00000005); continue from it with --resume"),
])
def test_the_launcher_checks_the_checkpoint_folder_before_starting(tmp_path, resume, setup, message):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    if setup != "empty":
        ck.write_checkpoint(folder, 5, sample_tensors(5))
    if setup == "interrupted":
        (folder / "step-00000005" / "manifest.json").unlink()
    run_dir = tmp_path / "run"
    argv = lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(run_dir), "--np", "2",
                           "--set", f"checkpoint.dir={folder}", *(["--resume"] if resume else []))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert not run_dir.exists()  # nothing started


# --- end to end: 6 steps == 3 steps + resume for 3 ------------------------------------------------


def launch(run_dir, *args: str) -> subprocess.CompletedProcess:
    argv = lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--run-dir", str(run_dir), "--no-progress",
                           *TINY_UNET, *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def model_fingerprint(model) -> str:
    from launcher.rank.training import weights_fingerprint

    return weights_fingerprint(model.weights)


def tfrecord_data(tmp_path) -> list[str]:
    """8 volumes in 2 files: 4 batches of 2 per epoch, so 6 steps cross an epoch (and a reshuffle)."""
    data = tmp_path / "data"
    written = subprocess.run(lms_launch_argv("tfrecord", "--kind", "volumes", "--out", str(data), "--synthetic", "8",
                                             "--shape", "16,16,16,4", "--labels", "3", "--shards", "2"),
                             capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    return ["--set", "data.source=tfrecord", "--set", f"data.path={data}", "--set", "data.shuffle_buffer=4"]


@pytest.mark.e2e
@pytest.mark.parametrize("ranks, source, lms", [(1, "synthetic", "false"), (2, "synthetic", "true"),
                                               (1, "tfrecord", "false")])
def test_six_steps_equal_three_steps_then_resume_for_three(tmp_path, ranks, source, lms):
    full_dir, resumed_dir = tmp_path / "ck-full", tmp_path / "ck-resumed"
    data = tfrecord_data(tmp_path) if source == "tfrecord" else []
    data += ["--set", f"lms.enabled={lms}", "--set", "lms.mode=manual", "--set", "lms.swapout_threshold=1",
             "--set", "lms.min_tensor_bytes=0"]  # with LMS on, the rewritten step swaps: it trains and resumes too
    # The uninterrupted run saves after step 3 (every_steps) and after its last step, 6.
    full = launch(tmp_path / "full", "--np", str(ranks), "--set", "train.steps=6", *data,
                  "--set", "checkpoint.every_steps=3", "--set", f"checkpoint.dir={full_dir}")
    assert full.returncode == 0, full.stdout + full.stderr
    assert sorted(p.name for p in full_dir.iterdir()) == ["step-00000003", "step-00000006"]

    # The interrupted run: its checkpoint of step 3 is all the second run gets.
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "step-00000003", resumed_dir / "step-00000003")
    resumed = launch(tmp_path / "resumed", "--np", str(ranks), "--set", "train.steps=6", *data,
                     "--set", "checkpoint.every_steps=3", "--set", f"checkpoint.dir={resumed_dir}", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "training continues at step 4 of 6" in resumed.stdout

    # Synthetic data is one fixed batch per rank (seeded by train.seed + rank), so steps 4-6 see the
    # same batches in both runs. TFRecord input is shuffled with seeds, and the resumed rank reads past
    # the 3 batches it had used: steps 4-6 read the same records as in the full run. The optimizer's
    # restored step counter carries the learning-rate schedule on.
    full_metrics = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    resumed_metrics = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in resumed_metrics} == {6}  # nothing before step 4 ran again
    def at_six(records):
        return sorted((r["rank"], r["loss"], r["learning_rate"]) for r in records if r["step"] == 6)

    assert at_six(resumed_metrics) == at_six(full_metrics)

    full_state = ck.read_tensors(ck.scan(full_dir)[0][-1])
    resumed_state = ck.read_tensors(ck.scan(resumed_dir)[0][-1])
    assert [name for name, _ in resumed_state] == [name for name, _ in full_state]
    # Weights, the optimizer's step counter, its Adam moments, and every rank's own batch-norm
    # statistics (rank 1's under rank1/): bit for bit.
    for (name, got), (_, want) in zip(resumed_state, full_state):
        assert got.tobytes() == want.tobytes(), name
    own = [name for name, _ in full_state if name.startswith("rank1/")]
    assert len(own) == (0 if ranks == 1 else len(non_trainable_names(tmp_path / "full" / "model.keras")))
    iteration = dict(full_state)["optimizer/adam/iteration"]
    assert int(iteration) == 6

    full_summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    resumed_summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    check_trained_model(tmp_path / "full", full_summary, ranks)
    assert resumed_summary["resumed_from_step"] == 3 and full_summary["resumed_from_step"] is None
    assert resumed_summary["last_checkpoint"] == str(resumed_dir / "step-00000006")
    # Each rank resumed with its own statistics, so the trained model (their mean) is bit-identical too.
    assert [r["weights_sha256"] for r in resumed_summary["ranks"]] == [r["weights_sha256"] for r in full_summary["ranks"]]


def non_trainable_names(model_path) -> set[str]:
    import keras

    import launcher.rank.tasks.unet3d  # noqa: F401  (registers the model's upsampling layer with Keras)

    model = keras.saving.load_model(model_path)
    trainable = {id(v) for v in model.trainable_variables}
    return {v.path for v in model.variables if id(v) not in trainable}


def check_trained_model(run_dir, summary: dict, ranks: int) -> None:
    """RUN_DIR/model.keras loads with keras.saving.load_model and holds the final weights: every
    rank hashed its weights (after the batch-norm averaging) into summary.json."""
    import keras

    import launcher.rank.tasks.unet3d  # noqa: F401  (registers the model's upsampling layer with Keras)

    assert summary["model_file"] == "model.keras"
    model = keras.saving.load_model(run_dir / summary["model_file"])
    assert model.name == "unet3d" and model.input_shape == (None, 16, 16, 16, 4)
    assert [r["weights_sha256"] for r in summary["ranks"]] == [model_fingerprint(model)] * ranks
    fresh = keras.models.clone_model(model)  # the same architecture with new random weights hashes otherwise
    assert model_fingerprint(fresh) != summary["ranks"][0]["weights_sha256"]
