"""End to end: real ranks started by `lms-launch`, real Horovod, real training on the CPU.

Each run is shrunk with --set so the file takes about a minute; the recipes themselves are the ones
users run. What must hold: exit 0, identical weights on every rank after training, a loss that went
down, metrics from every rank, and totals that are the sums of the ranks' figures.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.fixtures import RECIPES, lms_launch_argv

pytestmark = pytest.mark.e2e

TINY_RESNET = ["--set", "model.input_shape=[32,32,3]", "--set", "train.batch_size=4", "--set", "train.steps=10",
               "--set", "train.learning_rate=0.001", "--set", "logging.interval=2"]
TINY_UNET = ["--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
             "--set", "train.steps=10", "--set", "logging.interval=2"]


def launch(recipe: str, run_dir, *args: str, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    argv = lms_launch_argv(str(RECIPES / recipe), "--run-dir", str(run_dir), "--no-progress", *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def read_run(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return records, summary


def check_trained_in_sync(records, summary, ranks: int) -> None:
    assert summary["np"] == ranks
    assert sorted({r["rank"] for r in records}) == list(range(ranks))
    assert all(r["samples_per_sec"] > 0 and r["peak_memory_bytes"] > 0 for r in records)
    per_rank = summary["ranks"]
    assert [r["rank"] for r in per_rank] == list(range(ranks))
    assert len({r["weights_sha256"] for r in per_rank}) == 1, "replicas diverged"
    assert summary["weights_in_sync"] is True
    assert summary["total_samples_per_sec"] == pytest.approx(sum(r["samples_per_sec"] for r in per_rank))
    assert summary["total_peak_memory_bytes"] == sum(r["peak_memory_bytes"] for r in per_rank)
    for rank in per_rank:
        assert rank["final_loss"] < rank["initial_loss"], f"loss did not decrease on rank {rank['rank']}"
        assert rank["peak_memory_bytes"] > 0 and rank["host_rss_bytes"] > 0


def test_one_rank_with_lms_trains_where_horovod_cannot_be_imported(tmp_path):
    """As on a GPU machine given TensorFlow alone (docs/gpu-bundle.md): a `horovod` package that
    refuses to import comes first on the path, and one rank, LMS on, still plans, checks and trains."""
    import os

    broken = tmp_path / "site" / "horovod"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("Horovod is not built on this machine")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(broken.parent), os.environ.get("PYTHONPATH")]))}
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "1", *TINY_UNET, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_run(run_dir)
    check_trained_in_sync(records, summary, ranks=1)
    assert "LMS rank 0: swap-ins gated:" in done.stdout


def test_resnet50_two_gloo_ranks(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("resnet50-cpu.yaml", run_dir, "--np", "2", *TINY_RESNET)
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_run(run_dir)
    check_trained_in_sync(records, summary, ranks=2)
    # logging.skip_steps=2, interval 2, 10 steps: intervals end at steps 4, 6, 8, 10 on each rank.
    assert sorted(r["step"] for r in records if r["rank"] == 1) == [4, 6, 8, 10]
    assert "weights identical on all ranks: yes" in done.stdout
    resolved = (run_dir / "recipe.yaml").read_text()
    assert "input_shape:\n  - 32\n  - 32\n  - 3" in resolved  # the resolved recipe, overrides applied
    assert list((run_dir / "tensorboard").glob("rank1/events.out.tfevents.*"))


def test_unet3d_two_gloo_ranks_reports_voxels(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "2", *TINY_UNET)
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_run(run_dir)
    check_trained_in_sync(records, summary, ranks=2)
    assert all(r["voxels_per_sec"] == pytest.approx(r["samples_per_sec"] * 16**3) for r in records)
    assert summary["total_voxels_per_sec"] == pytest.approx(summary["total_samples_per_sec"] * 16**3)


def test_unet3d_two_mpi_ranks(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "2", "--backend", "mpi", *TINY_UNET)
    assert done.returncode == 0, done.stdout + done.stderr
    check_trained_in_sync(*read_run(run_dir), ranks=2)


def test_one_rank_runs_without_a_launcher(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "1", *TINY_UNET)
    assert done.returncode == 0, done.stdout + done.stderr
    records, summary = read_run(run_dir)
    check_trained_in_sync(records, summary, ranks=1)
    assert "[0]<stdout>" not in done.stdout  # horovodrun prefixes rank output; a direct run does not


def test_a_failing_rank_makes_the_launch_fail(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "2", *TINY_UNET, "--set", "data.source=tfrecord",
                  "--set", f"data.path={tmp_path / 'no-such-files'}")
    assert done.returncode not in (0, 2)
    assert "a rank failed" in done.stderr
    assert not (run_dir / "summary.json").exists()


def test_unet3d_two_ranks_on_tfrecord_files(tmp_path):
    data = tmp_path / "data"
    written = subprocess.run(lms_launch_argv("tfrecord", "--kind", "volumes", "--out", str(data), "--synthetic", "8",
                                             "--shape", "16,16,16,4", "--labels", "3", "--shards", "2"),
                             capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "2", *TINY_UNET, "--set", "data.source=tfrecord",
                  "--set", f"data.path={data}", "--set", "data.shuffle_buffer=8")
    assert done.returncode == 0, done.stdout + done.stderr
    check_trained_in_sync(*read_run(run_dir), ranks=2)


def final_weights(run_dir) -> list:
    """The trained model rank 0 saved (summary.json names it), as arrays in the model's order."""
    import keras

    import launcher.rank.tasks.unet3d  # noqa: F401  (registers the model's upsampling layer with Keras)

    summary = json.loads((run_dir / "summary.json").read_text())
    return [v.numpy() for v in keras.saving.load_model(run_dir / summary["model_file"]).weights]


def test_two_ranks_train_the_same_with_lms_on_and_off(tmp_path):
    """2 Gloo ranks, 3 steps. With LMS on each rank trains on split devices (compute CPU:1, host
    CPU:0) with every swappable tensor swapped and every swap-in gated; the losses of every step and
    every trained weight match the run without LMS to 1e-6 (weights on the model's scale).
    SGD, not the recipe's Adam: Adam divides each update by the gradient's own running size, so a
    weight whose true gradient is zero takes a learning-rate-sized step in the direction of its
    rounding noise (measured: weights 4.3e-5 apart with Adam after 3 steps, within 1e-6 with SGD).
    The test judges the rewrite, not Adam's sensitivity to the order of float additions."""
    import numpy as np

    runs = {}
    for lms in ("false", "true"):
        run_dir = tmp_path / f"lms-{lms}"
        done = launch("unet3d-cpu.yaml", run_dir, "--np", "2", *TINY_UNET, "--set", "train.steps=3",
                      "--set", "train.optimizer=sgd", "--set", "logging.interval=1", "--set", "logging.skip_steps=0",
                      "--set", f"lms.enabled={lms}", "--set", "lms.mode=manual", "--set", "lms.min_tensor_bytes=0",
                      "--set", "lms.swapout_threshold=1")
        assert done.returncode == 0, done.stdout + done.stderr
        runs[lms] = (*read_run(run_dir), final_weights(run_dir), done.stdout)
    (records_off, off, weights_off, _), (records_on, on, weights_on, stdout) = runs["false"], runs["true"]
    assert [r["device"] for r in on["ranks"]] == ["CPU:1", "CPU:1"]  # LMS on: the split devices' compute side
    assert [r["device"] for r in off["ranks"]] == ["CPU:0", "CPU:0"]
    by_step = lambda records: [r["loss"] for r in sorted(records, key=lambda r: (r["step"], r["rank"]))]  # noqa: E731
    assert len(by_step(records_on)) == 6
    np.testing.assert_allclose(by_step(records_on), by_step(records_off), rtol=1e-6)
    scale = max(float(np.max(np.abs(w))) for w in weights_off)
    assert len(weights_on) == len(weights_off) > 10
    for on_value, off_value in zip(weights_on, weights_off):
        np.testing.assert_allclose(on_value, off_value, rtol=1e-6, atol=1e-6 * scale)
    plans = sorted((tmp_path / "lms-true" / "lms").glob("plan-rank*.json"))
    assert [p.name for p in plans] == ["plan-rank0.json", "plan-rank1.json"]
    for path in plans:
        plan = json.loads(path.read_text())
        swap_ins = sum(len(s["swap_ins"]) for s in plan["swaps"])
        assert plan["swap_count"] > 0
        assert plan["verification"]["gated"] == plan["verification"]["swap_ins"] == swap_ins
        assert plan["verification"]["devices"] == {"compute": "/device:CPU:1", "host": "/device:CPU:0"}
        assert f"LMS rank {plan['rank']}: swap-ins gated: {swap_ins}/{swap_ins}" in stdout
    assert set(plan["estimated_peak_bytes"]) == {"baseline", "lms"}


def test_mixed_precision_on_a_cpu_rank_falls_back_to_float32_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "1", *TINY_UNET, "--set", "train.precision=mixed_float16")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mixed_float16 needs a GPU" in done.stdout
    assert read_run(run_dir)[1]["precision"] == "float32"


def test_ranks_on_different_links_plan_for_their_own_link(tmp_path):
    run_dir = tmp_path / "run"
    done = launch("unet3d-cpu.yaml", run_dir, "--np", "2", *TINY_UNET, "--set", "train.steps=4",
                  "--set", "lms.enabled=true", "--set", "lms.rank_links=[nvlink2, pcie3]",
                  "--set", "lms.device_memory=2.5MiB", "--set", "lms.min_tensor_bytes=0",
                  "--set", "lms.measure_ops=true", "--set", "lms.measure_link=true")
    assert done.returncode == 0, done.stdout + done.stderr
    plans = [json.loads((run_dir / "lms" / f"plan-rank{r}.json").read_text()) for r in (0, 1)]
    assert plans[0]["link"].startswith("nvlink2") and plans[1]["link"].startswith("pcie3")
    # Tuned per rank: by the knobs' search, or the access-order strategy where it is faster.
    assert plans[0]["settings"]["mode"] == "auto" and plans[0]["tuning"].startswith(("auto-tuned", "access-order"))
    # Each rank's plan is the fastest its tuner found for its own link. Any plan runs no faster on
    # pcie3 than on nvlink2 (every copy takes longer, nothing else changes), so the pcie3 rank's best
    # can be no faster than the nvlink2 rank's.
    slow, fast = plans[1], plans[0]
    assert slow["prediction"]["step_time_s"] >= fast["prediction"]["step_time_s"]
    assert slow["prediction"]["transfer_time_s"] > 0 and fast["prediction"]["transfer_time_s"] > 0
    for plan in plans:  # and each fits the budget it was tuned for
        assert plan["prediction"]["peak_device_bytes"] <= 0.9 * 2.5 * 2**20
    assert "LMS rank 1: link (lms.rank_links) pcie3" in done.stdout
    # Measuring needs GPUs: CPU ranks say so and keep the cost model.
    assert "lms.measure_ops: op times are measured in calibration's steps on a GPU" in done.stdout
    assert plans[1]["cost_model"] == "costs: roofline model of v100"
