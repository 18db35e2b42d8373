"""BraTS NIfTI folders (written with nibabel) -> the 3D U-Net's records: channels normalised over the
brain, the window centred on it, the three nested tumour regions, errors naming subject and file, and
a 3-step training run from a converted folder.

Each test subject's brain is a box of known extent (BraTS's background is 0 in every channel), so the
expected window follows from the geometry alone, and the expected values from numpy on the files.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from launcher.rank.data import convert
from launcher.rank.data.tfrecord import read_dataset
from tests.fixtures import RECIPES, lms_launch_argv

nibabel = pytest.importorskip("nibabel")

GRID = (40, 44, 30)  # small stand-ins for BraTS's 240 x 240 x 155
BRAIN = (slice(6, 30), slice(8, 36), slice(4, 24))  # 24 x 28 x 20 voxels, even sizes: windows centre exactly
BRAIN_VOXELS = 24 * 28 * 20
TUMOUR_CENTRE = np.array([18, 22, 14])  # the centre of the brain box
MODALITIES = ("t1", "t1ce", "flair", "t2")


def subject_arrays(seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Four modalities (each its own mean and spread inside the brain, 0 outside) and a label map of
    nested spheres: oedema (2) around the core (1) around the enhancing tumour (4)."""
    rng = np.random.default_rng(seed)
    channels = {}
    for index, modality in enumerate(MODALITIES):
        values = np.zeros(GRID, np.float32)
        values[BRAIN] = rng.normal(300 + 200 * index, 40 + 10 * index, size=(24, 28, 20))
        channels[modality] = values
    distance = np.linalg.norm(np.indices(GRID).transpose(1, 2, 3, 0) - TUMOUR_CENTRE, axis=-1)
    labels = np.select([distance <= 2, distance <= 3.5, distance <= 5 + seed % 2], [4, 1, 2], 0).astype(np.uint8)
    return channels, labels


def write_subject(folder: Path, name: str, seed: int, skip: tuple[str, ...] = (), seg: np.ndarray | None = None):
    folder.mkdir(parents=True)
    channels, labels = subject_arrays(seed)
    affine = np.diag([1.0, 1.0, 1.0, 1.0])
    for role, values in (*channels.items(), ("seg", labels if seg is None else seg)):
        if role not in skip:
            nibabel.save(nibabel.Nifti1Image(values, affine), folder / f"{name}_{role}.nii.gz")


def brats_folder(root: Path, count: int = 2) -> Path:
    """BraTS 2017's layout: HGG/ and LGG/ of subject folders."""
    for index in range(count):
        name = f"Brats17_TCIA_{index:03d}_1"
        write_subject(root / ("HGG" if index % 2 == 0 else "LGG") / name, name, seed=index)
    return root


def expected(seed: int, window: tuple[slice, ...]) -> tuple[np.ndarray, np.ndarray]:
    """What a subject should become, before its cut to `window` of the source grid (which the caller
    finds from the geometry): channels normalised over the brain box, 0 elsewhere; the regions whole
    (1, 2, 4), core (1, 4), enhancing (4)."""
    channels, labels = subject_arrays(seed)
    volume = np.zeros((*GRID, 4), np.float32)
    for index, modality in enumerate(MODALITIES):
        brain = channels[modality][BRAIN].astype(np.float64)
        volume[BRAIN + (index,)] = (brain - brain.mean()) / brain.std()
    regions = np.stack([labels > 0, (labels == 1) | (labels == 4), labels == 4], axis=-1).astype(np.uint8)
    return volume[window], regions[window]


def convert_folder(source: Path, out: Path, shape: str, *extra: str) -> int:
    return convert.main(["--kind", "volumes", "--out", str(out), "--from-brats", str(source), "--shape", shape, *extra])


def read_back(out: Path, shape: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
    dataset = read_dataset(str(out), "volumes", [*shape, 4], classes=3, batch_size=count, rank=0, size=1, seed=0,
                           shuffle_buffer=1, prefetch=0)
    x, y = next(iter(dataset))  # one file, no shuffle: subjects in name order
    return x.numpy(), y.numpy()


def test_a_window_inside_the_brain_holds_its_normalised_centre(tmp_path, capsys):
    assert convert_folder(brats_folder(tmp_path / "brats"), tmp_path / "out", "16,16,16") == 0
    out = capsys.readouterr().out
    # The brain box 6..30 x 8..36 x 4..24; a 16^3 window centred on it starts at (6+30-16)/2 = 10, 14, 6.
    window = (slice(10, 26), slice(14, 30), slice(6, 22))
    volumes, masks = read_back(tmp_path / "out", [16, 16, 16], 2)
    for seed in (0, 1):
        want_volume, want_regions = expected(seed, window)
        np.testing.assert_allclose(volumes[seed], want_volume, atol=1e-5)
        np.testing.assert_array_equal(masks[seed], want_regions)
    assert (f"1/2 Brats17_TCIA_000_1  note: the 16 x 16 x 16 window cuts {BRAIN_VOXELS - 16 ** 3} of "
            f"{BRAIN_VOXELS} brain voxels, 0 of") in out
    assert "wrote 2 volumes ([16, 16, 16, 4], 3 tumour regions) to 1 file(s)" in out
    assert "--set model.input_shape=[16,16,16,4]" in out


def test_a_window_larger_than_the_volume_pads_it_and_keeps_every_voxel(tmp_path):
    assert convert_folder(brats_folder(tmp_path / "brats", 1), tmp_path / "out", "48,48,32,4") == 0
    (volume,), (regions,) = read_back(tmp_path / "out", [48, 48, 32], 1)
    # Starts of the window, centred on the brain box: (6+30-48)/2 = -6, (8+36-48)/2 = -2, (4+24-32)/2 = -2.
    want_volume, want_regions = expected(0, (slice(None),) * 3)
    np.testing.assert_allclose(volume[6:46, 2:46, 2:32], want_volume, atol=1e-5)
    np.testing.assert_array_equal(regions[6:46, 2:46, 2:32], want_regions)
    assert np.count_nonzero(np.any(volume != 0, axis=-1)) == BRAIN_VOXELS
    padding = np.ones(volume.shape[:3], bool)
    padding[6:46, 2:46, 2:32] = False
    assert not volume[padding].any() and not regions[padding].any()


@pytest.mark.parametrize("damage, message", [
    (lambda root: next(root.rglob("*_t1ce.nii.gz")).unlink(),
     r"BraTS subject Brats17_TCIA_000_1 \(.*HGG/Brats17_TCIA_000_1\): no \*_t1ce.nii.gz \(it has: "
     r"Brats17_TCIA_000_1_flair.nii.gz, Brats17_TCIA_000_1_seg.nii.gz, Brats17_TCIA_000_1_t1.nii.gz, "
     r"Brats17_TCIA_000_1_t2.nii.gz\)"),
    (lambda root: nibabel.save(nibabel.Nifti1Image(np.zeros((40, 44, 29), np.uint8), np.eye(4)),
                               next(root.rglob("Brats17_TCIA_001_1_seg.nii.gz"))),
     r"BraTS subject Brats17_TCIA_001_1: Brats17_TCIA_001_1_seg.nii.gz is 40 x 44 x 29 but "
     r"Brats17_TCIA_001_1_t1.nii.gz is 40 x 44 x 30: a subject's files must share one voxel grid; nothing was written"),
    (lambda root: nibabel.save(nibabel.Nifti1Image(np.full(GRID, 3, np.uint8), np.eye(4)),
                               next(root.rglob("Brats17_TCIA_001_1_seg.nii.gz"))),
     r"BraTS subject Brats17_TCIA_001_1: Brats17_TCIA_001_1_seg.nii.gz holds labels \[3\]; BraTS label maps hold "
     r"0, 1, 2 and 4 \(BraTS 2023 marks enhancing tumour 3: map it to 4 first\)"),
    (lambda root: nibabel.save(nibabel.Nifti1Image(np.zeros(GRID, np.float32), np.diag([2.0, 1, 1, 1])),
                               next(root.rglob("Brats17_TCIA_001_1_flair.nii.gz"))),
     r"Brats17_TCIA_001_1_flair.nii.gz is placed in space otherwise than Brats17_TCIA_001_1_t1.nii.gz"),
])
def test_a_bad_subject_is_named_with_its_file_and_nothing_is_written(tmp_path, capsys, damage, message):
    root = brats_folder(tmp_path / "brats")
    damage(root)
    out = tmp_path / "out"
    assert convert_folder(root, out, "16,16,16") == 2
    err = capsys.readouterr().err
    assert err.startswith("lms-launch tfrecord: error: ")
    assert re.search(message, err), err
    assert not out.exists()  # the second subject fails after the first was converted: its records are gone too


@pytest.mark.parametrize("args, message", [
    ([], "--from-brats needs --shape D,H,W"),
    (["--shape", "16,16"], "--shape '16,16': --from-brats takes D,H,W"),
    (["--shape", "16,16,16", "--labels", "3"], "--from-brats writes --kind volumes with BraTS's 3 tumour regions; "
                                               "drop --labels"),
])
def test_bad_options_are_named(tmp_path, capsys, args, message):
    status = convert.main(["--kind", "volumes", "--out", str(tmp_path / "out"), "--from-brats",
                           str(brats_folder(tmp_path / "brats", 1)), *args])
    assert status == 2 and message in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_folder(empty, tmp_path / "out", "16,16,16") == 2
    assert "no BraTS subjects below it" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_unet_trains_3_steps_from_a_converted_brats_folder(tmp_path):
    root = tmp_path / "brats"
    for index in range(4):  # BraTS 2020's layout: subject folders side by side
        write_subject(root / f"BraTS20_Training_{index:03d}", f"BraTS20_Training_{index:03d}", seed=index)
    data = tmp_path / "records"
    written = subprocess.run(lms_launch_argv("tfrecord", "--kind", "volumes", "--out", str(data), "--from-brats",
                                             str(root), "--shape", "16,16,16", "--shards", "2"),
                             capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    print(written.stdout)
    run_dir = tmp_path / "run"
    done = subprocess.run(lms_launch_argv(
        str(RECIPES / "unet3d-cpu.yaml"), "--np", "1", "--run-dir", str(run_dir), "--no-progress",
        "--set", "model.input_shape=[16,16,16,4]", "--set", "model.levels=2", "--set", "model.base_filters=4",
        "--set", "lms.enabled=false", "--set", "train.steps=3", "--set", "logging.interval=1",
        "--set", "logging.skip_steps=1", "--set", "logging.tensorboard=false", "--set", "data.source=tfrecord",
        "--set", f"data.path={data}"), capture_output=True, text=True, timeout=300)
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [r["step"] for r in records] == [2, 3]
    assert all(-1.0 <= r["loss"] <= 0.0 for r in records)  # minus a mean soft Dice
