"""BraTS folders of NIfTI volumes -> the 3D U-Net's `volumes` records (`lms-launch tfrecord --kind
volumes --from-brats DIR --shape D,H,W`).

A BraTS training set is one folder per subject (BraTS 2017 groups them under HGG/ and LGG/, later
years do not), each holding `<subject>_t1.nii.gz`, `_t1ce.nii.gz`, `_flair.nii.gz`, `_t2.nii.gz` and
the segmentation `_seg.nii.gz` (0 background, 1 necrotic and non-enhancing tumour core, 2 oedema, 4
enhancing tumour), co-registered, skull-stripped, 1 mm voxels, 240 x 240 x 155. Every folder below DIR
that holds any of these files is a subject.

Each subject becomes one record, as Isensee et al. 2017 prepared BraTS for this network:

- channels t1, t1ce (t1Gd), flair, t2, the order of their network and of the 3DUnetCNN project the
  LMS papers trained;
- each channel normalised on its own, over the brain only: minus the mean and divided by the standard
  deviation of the brain's voxels, and 0 outside the brain, as Isensee et al. normalised each modality
  of each patient (their section on preprocessing: statistics of the brain region, so the size of the
  background does not shift them). The brain is where any channel is non-zero (the skull-stripped
  background is 0 in all four);
- the D x H x W window centred on the brain's bounding box (axes in the files' own order), padded
  with zeros where the window reaches past the volume: no resampling, so voxels stay 1 mm. A window
  smaller than a brain cuts it; the converter says how many brain and tumour voxels each subject
  lost;
- the three nested regions the challenge scores, as binary maps: whole tumour (1, 2, 4), tumour core
  (1, 4), enhancing tumour (4) (`brats_regions`).

Every subject's files are found before anything is read, and a subject whose files are missing,
duplicated, of different grids or with labels other than 0, 1, 2 and 4 stops the conversion with a
ValueError that names the subject and the file; the writer then leaves no file behind.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from launcher.rank.data.tfrecord import BRATS_LABELS, brats_regions

MODALITIES = ("t1", "t1ce", "flair", "t2")
SEGMENTATION = "seg"
SUFFIXES = (".nii.gz", ".nii")
AFFINE_TOLERANCE_MM = 1e-3


@dataclass(frozen=True)
class Subject:
    """One subject's folder and its five files, modalities first, in channel order."""

    name: str
    folder: Path
    files: dict[str, Path]


def _role(file_name: str) -> str | None:
    """Which of the five files `file_name` is (t1, t1ce, flair, t2, seg), or None."""
    for suffix in SUFFIXES:
        if file_name.endswith(suffix):
            stem = file_name[: -len(suffix)]
            role = stem.rsplit("_", 1)[-1].lower() if "_" in stem else None
            return role if role in (*MODALITIES, SEGMENTATION) else None
    return None


def find_subjects(root: Path) -> list[Subject]:
    """Every subject below `root`, sorted by name; ValueError naming each folder with a file missing
    or twice."""
    if not root.is_dir():
        raise ValueError(f"--from-brats {root}: not a folder")
    subjects, problems = [], []
    for folder, _, names in sorted(os.walk(root)):
        found: dict[str, list[str]] = {}
        for name in sorted(names):
            if (role := _role(name)) is not None:
                found.setdefault(role, []).append(name)
        if not found:
            continue
        subject = Path(folder).name
        missing = [role for role in (*MODALITIES, SEGMENTATION) if role not in found]
        twice = [f"{', '.join(files)}" for files in found.values() if len(files) > 1]
        if missing:
            problems.append(f"BraTS subject {subject} ({folder}): no *_{'.nii.gz, no *_'.join(missing)}.nii.gz "
                            f"(it has: {', '.join(sorted(n for files in found.values() for n in files))})")
        elif twice:
            problems.append(f"BraTS subject {subject} ({folder}): more than one file for one role: {'; '.join(twice)}")
        else:
            subjects.append(Subject(subject, Path(folder), {role: Path(folder) / found[role][0]
                                                              for role in (*MODALITIES, SEGMENTATION)}))
    if problems:
        raise ValueError("\n".join(problems))
    if not subjects:
        raise ValueError(f"--from-brats {root}: no BraTS subjects below it (folders holding <subject>_t1.nii.gz, "
                         f"_t1ce, _flair, _t2 and _seg)")
    return sorted(subjects, key=lambda s: s.name)


def load_subject(subject: Subject) -> tuple[np.ndarray, np.ndarray]:
    """The four modalities [X, Y, Z, 4] float32 and the label map [X, Y, Z] uint8, checked to share
    one voxel grid and to hold BraTS's labels only."""
    import nibabel

    images = {}
    for role, path in subject.files.items():
        try:
            images[role] = nibabel.load(path)
        except Exception as err:  # nibabel raises several kinds for unreadable files
            raise ValueError(f"BraTS subject {subject.name}: cannot read {path}: {err}") from None
    reference = images["t1"]
    for role, image in images.items():
        if image.ndim != 3:
            raise ValueError(f"BraTS subject {subject.name}: {subject.files[role].name} has {image.ndim} axes "
                             f"{list(image.shape)}; BraTS volumes have 3")
        if image.shape != reference.shape:
            raise ValueError(f"BraTS subject {subject.name}: {subject.files[role].name} is {_dims(image.shape)} but "
                             f"{subject.files['t1'].name} is {_dims(reference.shape)}: a subject's files must share "
                             f"one voxel grid")
        if not np.allclose(image.affine, reference.affine, atol=AFFINE_TOLERANCE_MM):
            raise ValueError(f"BraTS subject {subject.name}: {subject.files[role].name} is placed in space otherwise "
                             f"than {subject.files['t1'].name} (different affine): register them to one grid first")
    channels = np.stack([images[m].get_fdata(dtype=np.float32) for m in MODALITIES], axis=-1)
    for index in np.flatnonzero(~np.isfinite(channels).all(axis=(0, 1, 2))):
        raise ValueError(f"BraTS subject {subject.name}: {subject.files[MODALITIES[index]].name} holds NaN or "
                         f"infinite values")
    return channels, _label_map(subject, np.asanyarray(images[SEGMENTATION].dataobj))


def _label_map(subject: Subject, values: np.ndarray) -> np.ndarray:
    labels = np.rint(values)
    found = np.unique(labels)
    stray = np.setdiff1d(found, (0, *BRATS_LABELS))
    if stray.size or not np.array_equal(labels, values):
        what = f"labels {stray.astype(int).tolist()}" if stray.size else "values that are not whole numbers"
        raise ValueError(f"BraTS subject {subject.name}: {subject.files[SEGMENTATION].name} holds {what}; BraTS label "
                         f"maps hold 0, 1, 2 and 4 (BraTS 2023 marks enhancing tumour 3: map it to 4 first)")
    return labels.astype(np.uint8)


def _dims(shape) -> str:
    return " x ".join(str(size) for size in shape)


def normalize_brain(channels: np.ndarray) -> np.ndarray:
    """Each channel minus its brain mean, over its brain standard deviation; 0 outside the brain."""
    brain = np.any(channels != 0, axis=-1)
    if not brain.any():
        raise ValueError("every channel is 0 everywhere: no brain to normalise")
    inside = channels[brain]  # [voxels, 4]
    mean, std = inside.mean(axis=0, dtype=np.float64), inside.std(axis=0, dtype=np.float64)
    if np.any(std == 0):
        flat = [MODALITIES[i] for i in np.flatnonzero(std == 0)]
        raise ValueError(f"{', '.join(flat)} is constant over the brain: nothing to normalise")
    return np.where(brain[..., None], (channels - mean) / std, 0).astype(np.float32)


def brain_window(brain: np.ndarray, shape: list[int]) -> list[tuple[int, int]]:
    """For each axis, the first index of the `shape` window centred on the brain's bounding box
    (it may start before 0 or end past the volume, which padding fills) and the volume's size."""
    window = []
    for axis, size in enumerate(shape):
        present = np.flatnonzero(np.any(brain, axis=tuple(a for a in range(brain.ndim) if a != axis)))
        low, high = int(present[0]), int(present[-1]) + 1
        window.append(((low + high - size) // 2, brain.shape[axis]))
    return window


def cut(values: np.ndarray, window: list[tuple[int, int]], shape: list[int]) -> np.ndarray:
    """The window of `values` ([X, Y, Z, ...]), zeros where it reaches past the volume."""
    out = np.zeros((*shape, *values.shape[3:]), values.dtype)
    source, target = [], []
    for (start, length), size in zip(window, shape):
        begin, end = max(start, 0), min(start + size, length)
        source.append(slice(begin, end))
        target.append(slice(begin - start, end - start))
    out[tuple(target)] = values[tuple(source)]
    return out


def convert_subject(subject: Subject, shape: list[int]) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(volume [D, H, W, 4] float32, regions [D, H, W, 3] uint8, a note on voxels the window cut or None)."""
    channels, labels = load_subject(subject)
    try:
        normalized = normalize_brain(channels)
    except ValueError as err:
        raise ValueError(f"BraTS subject {subject.name}: {err}") from None
    brain = np.any(channels != 0, axis=-1)
    window = brain_window(brain, shape)
    volume, regions = cut(normalized, window, shape), cut(brats_regions(labels), window, shape)
    lost_brain = int(brain.sum() - cut(brain, window, shape).sum())
    lost_tumour = int((labels > 0).sum() - regions[..., 0].sum())
    note = None
    if lost_brain:
        note = (f"the {_dims(shape)} window cuts {lost_brain} of {int(brain.sum())} brain "
                f"voxels, {lost_tumour} of {int((labels > 0).sum())} tumour voxels (brain box "
                f"{_dims(_box(brain))}); a larger --shape keeps them")
    return volume, regions, note


def _box(mask: np.ndarray) -> list[int]:
    return [int(np.ptp(np.flatnonzero(np.any(mask, axis=tuple(a for a in range(3) if a != axis))))) + 1
            for axis in range(3)]


def samples(subjects: list[Subject], shape: list[int], say: Callable[[str], None]) -> Iterator[tuple]:
    """(volume, regions) for each subject in turn, saying each one's name and any cut."""
    for index, subject in enumerate(subjects, start=1):
        volume, regions, note = convert_subject(subject, shape)
        say(f"  {index}/{len(subjects)} {subject.name}" + (f"  note: {note}" if note else ""))
        yield volume, regions
