"""benchmarks/gpu_measurements.py, the harness a GPU session runs (issue 14), checked on this CPU: each
figure it prints is the one the run measured or the plan said, and bad input is refused by name."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.fixtures import REPO as ROOT

HARNESS = ROOT / "benchmarks" / "gpu_measurements.py"
GIB = 1 << 30


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HARNESS), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def figures(line: str) -> list[float]:
    """The GiB figures of a peaks row: measured, then each model's, with its error left out."""
    words = line.replace("(", " ").replace(")", " ").split()
    numbers = [w for w in words if w.replace(".", "", 1).isdigit()]
    return [float(n) for n in numbers]


def test_peaks_prints_what_each_case_measured_and_what_its_plan_said(tmp_path):
    done = harness("peaks", "--models", "unet3d-cpu", "--device-memory", "2GiB", "--out", str(tmp_path),
                   "--workdir", str(tmp_path / "cases"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "gpu-peaks-unet3d-cpu.txt").read_text()
    assert "NO GPU: this run checks the harness on the CPU allocator" in text  # never passed off as a GPU figure
    assert "the CPU allocator held to 2 GiB" in text
    rows = {line.split()[2]: line for line in text.splitlines() if line.startswith("unet3d-cpu ")}
    assert set(rows) == {"no", "LMS"}

    # The LMS case: measured = the run's summary, the models' figures = the rank's own plan.
    run = tmp_path / "cases" / "lms-launch-48"
    summary = json.loads((run / "summary.json").read_text())
    plan = json.loads((run / "lms" / "plan-rank0.json").read_text())
    measured, grappler, simulated, live, bfc = figures(rows["LMS"].split("LMS", 1)[1])[:5]
    assert measured == round(summary["max_peak_memory_bytes"] / GIB, 2)
    assert grappler == round(plan["estimated_peak_bytes"]["lms"] / GIB, 2)
    assert simulated == round(plan["prediction"]["peak_device_bytes"] / GIB, 2)
    assert live == round(plan["device_memory"]["live_peak_bytes"] / GIB, 2)
    assert bfc == round(plan["device_memory"]["bfc_bytes"] / GIB, 2)
    # The no-swap case ran without LMS (no plan), and still has every model's figure.
    assert not (tmp_path / "cases" / "none-32" / "lms").exists()
    assert len(figures(rows["no"].split("swap", 1)[1])) >= 5


def test_env_says_when_there_is_no_gpu_and_bad_input_is_named(tmp_path):
    done = harness("env", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    text = (tmp_path / "gpu-env.txt").read_text()
    assert text.startswith("date: ") and "command: python3 benchmarks/gpu_measurements.py env" in text
    assert "TensorFlow 2.18.1" in text and "GPUs it sees: 0" in text and "NO GPU" in text

    unknown = harness("peaks", "--models", "vgg16", "--out", str(tmp_path / "x"))
    assert unknown.returncode == 2 and "--models: no cases for vgg16; choose from resnet50, unet3d" in unknown.stderr
    size = harness("peaks", "--device-memory", "lots", "--out", str(tmp_path / "x"))
    assert size.returncode == 2 and "--device-memory" in size.stderr
    assert not (tmp_path / "x").exists()  # nothing written for bad input


def test_ops_sums_measured_and_modelled_time_by_op_type(tmp_path):
    done = harness("ops", "--models", "unet3d-cpu", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "gpu-ops-unet3d-cpu.txt").read_text().splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("op type"))) + 1:]
    rows = [l.split() for l in table if l and not l.startswith(("all timed ops", "step:"))]
    total = next(l.split() for l in table if l.startswith("all timed ops"))
    # Each row: type, ops, measured ms, roofline ms, ratio = measured / roofline, each printed rounded
    # to 2 decimals: the ratio lies between the bounds the rounded times allow.
    for _, count, measured, modelled, ratio in rows:
        m, r, q = float(measured), float(modelled), float(ratio)
        assert int(count) > 0 and (m - 0.005) / (r + 0.005) - 0.005 <= q <= (m + 0.005) / max(r - 0.005, 1e-9) + 0.005
    assert sum(float(r[2]) for r in rows) <= float(total[4]) + 0.01  # the listed types are part of the whole
    assert any(l.startswith("step: measured ") and "simulator" in l for l in table)


def session(out, tf_dir, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/gpu_session.sh as the device tool runs it, with OUT and the unpacked TensorFlow's
    folder given: here a stand-in env.sh that puts this repository's .venv first on the PATH."""
    import os

    env = {**os.environ, "OUT": str(out), "LMS_TF_DIR": str(tf_dir)}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_gpu_session_runs_the_stages_asked_for_and_stops_at_a_failed_unpack(tmp_path):
    tf_dir, out = tmp_path / "tf", tmp_path / "out"
    tf_dir.mkdir()
    out.mkdir()
    (tf_dir / "env.sh").write_text(f"export PATH={ROOT / '.venv' / 'bin'}:$PATH\n")
    done = session(out, tf_dir, str(tmp_path / "parts"), "env", "no-such-stage")
    assert done.returncode == 2 and "unknown stage no-such-stage" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu-env.txt", "session.log"]  # what came before it ran
    assert "== env: exit 0" in (out / "session.log").read_text()
    # No parts: the unpack refuses, and nothing is measured after it (the stages need its TensorFlow).
    failed = session(out, tf_dir, str(tmp_path / "parts"), "unpack", "env")
    assert failed.returncode == 1 and "the bundle's check failed: no measurements" in failed.stdout
    assert failed.stdout.count("== env:") == 0


def test_variants_train_one_size_several_ways_each_beside_its_own_plan(tmp_path):
    """`variants` (the comparisons a GPU session makes at one size: sync modes, fit judges), checked
    on the CPU: each row is its own run, its models' figures come from the plan that run made, and
    that plan has the settings the row names."""
    done = harness("variants", "--models", "swapouts-cpu", "--device-memory", "2GiB", "--out", str(tmp_path),
                   "--workdir", str(tmp_path / "cases"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "gpu-variants-swapouts-cpu.txt").read_text()
    rows = [line for line in text.splitlines() if line.startswith("unet3d-cpu 48^3 ")]
    assert [row.split(",")[0] for row in rows] == ["unet3d-cpu 48^3 sync 0", "unet3d-cpu 48^3 sync 1"]
    assert all(", no hold" in row for row in rows)  # the peak shows whatever it is
    for sync_mode, row in enumerate(rows):
        plan = json.loads((tmp_path / "cases" / "swapouts-cpu" / f"sync-{sync_mode}" / "lms-launch-48" / "lms" /
                           "plan-rank0.json").read_text())
        assert plan["settings"]["sync_mode"] == sync_mode and plan["settings"]["mode"] == "manual"
        assert plan["swap_count"] > 0
        simulated = figures(row.split("no hold", 1)[1])[2]  # measured, Grappler, then this (errors left out)
        assert simulated == round(plan["prediction"]["peak_device_bytes"] / GIB, 2)
