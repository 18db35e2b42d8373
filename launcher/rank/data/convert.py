"""`lms-launch tfrecord`: write training data as TFRecord files in the schema of launcher.rank.data.tfrecord.

    lms-launch tfrecord --kind images  --out DIR --from-npz data.npz      # arrays `images`, `labels`
    lms-launch tfrecord --kind volumes --out DIR --from-npz data.npz      # arrays `volumes`, `masks`
    lms-launch tfrecord --kind images  --out DIR --synthetic 256 --shape 64,64,3 --classes 10
    lms-launch tfrecord --kind volumes --out DIR --synthetic 8 --shape 32,32,32,4 --labels 3
    lms-launch tfrecord --kind volumes --out DIR --from-brats BRATS_DIR --shape 144,176,144   # NIfTI folders
    lms-launch tfrecord --kind sequences --out DIR --from-npz data.npz    # arrays `sources`, `targets`
    lms-launch tfrecord --kind sequences --out DIR --synthetic 1024 --shape 24,24 --vocabulary 1000

Exit status 0 when the files are written, 2 for bad input (nothing is written then).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from launcher.arguments import USAGE_STATUS, UsageError, UsageParser
from launcher.rank.data.sequences import synthetic_sentences
from launcher.rank.data.tfrecord import (
    KINDS, SCHEMAS, check_arrays, existing_shards, records_per_shard, write_records,
)

NPZ_ARRAYS = {"images": ("images", "labels"), "volumes": ("volumes", "masks"), "sequences": ("sources", "targets")}
"""The arrays an .npz must hold for each kind: the inputs, then the labels."""
LABEL_FLAGS = {"images": "--classes", "volumes": "--labels", "sequences": "--vocabulary"}
"""The flag that sizes each kind's synthetic labels: classes, binary label maps, or token ids."""


class ConvertError(UsageError):
    """Bad input to the converter; printed as it is, exit 2."""


def parser() -> UsageParser:
    p = UsageParser(prog="lms-launch tfrecord", description=__doc__)
    p.add_argument("--kind", required=True, choices=KINDS,
                   help="images (ResNet-50), volumes (3D U-Net) or sequences (Seq2Seq sentence pairs)")
    p.add_argument("--out", required=True, type=Path, help="directory for the .tfrecord files")
    p.add_argument("--shards", type=int, default=1, help="files to deal the samples over; at least the number of "
                                                         "ranks lets each rank read only its own files")
    p.add_argument("--prefix", default="data", help="file name prefix (default: data)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-npz", metavar="FILE", type=Path, help="NumPy .npz with images+labels or volumes+masks")
    source.add_argument("--synthetic", type=int, metavar="N", help="N learnable synthetic samples")
    source.add_argument("--from-brats", metavar="DIR", type=Path,
                        help="volumes: a BraTS training folder of NIfTI files (<subject>_t1, _t1ce, _flair, _t2, _seg"
                             ".nii.gz per subject), normalised per channel over the brain and cut to --shape D,H,W "
                             "around it (launcher/rank/data/brats.py)")
    p.add_argument("--shape", help="with --synthetic: one sample's shape, e.g. 64,64,3 or 32,32,32,4; for "
                                   "sequences the source and target lengths S,T (model.input_shape); with "
                                   "--from-brats the window D,H,W cut around each brain, e.g. 144,176,144")
    p.add_argument("--classes", type=int, help="with --synthetic images: number of classes (default 10)")
    p.add_argument("--labels", type=int, help="with --synthetic volumes: binary label maps per voxel, nested "
                                              "like BraTS's tumour regions (default 3)")
    p.add_argument("--vocabulary", type=int, help="with --synthetic sequences: token ids 0 .. V-1, model.vocabulary "
                                                  "(default 1000; 0 and 1 are padding and the start token)")
    p.add_argument("--seed", type=int, help="with --synthetic: random seed (default 0)")
    return p


def load_npz(path: Path, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and labels of `kind` from an .npz, or ConvertError naming what is missing."""
    if not path.is_file():
        raise ConvertError(f"--from-npz: {path} does not exist")
    try:
        arrays = np.load(path)  # allow_pickle stays off: an .npz of data needs no code
    except (OSError, ValueError) as err:
        raise ConvertError(f"--from-npz: {path} is not a NumPy .npz file ({err})") from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):
        raise ConvertError(f"--from-npz: {path} holds a single array; save both with "
                           f"np.savez(FILE, {'=..., '.join(NPZ_ARRAYS[kind])}=...)")
    with arrays:
        names = NPZ_ARRAYS[kind]
        missing = [name for name in names if name not in arrays.files]
        if missing:
            raise ConvertError(f"--from-npz: {path} has no array(s) {', '.join(missing)} (it has: "
                               f"{', '.join(arrays.files) or 'none'}); --kind {kind} needs {' and '.join(names)}")
        try:
            return arrays[names[0]], arrays[names[1]]
        except ValueError as err:  # object arrays, which would need pickle
            raise ConvertError(f"--from-npz: {path}: {err}") from None


def parse_shape(text: str, kind: str) -> list[int]:
    layout = SCHEMAS[kind].layout
    try:
        shape = [int(size) for size in text.split(",")]
    except ValueError:
        raise ConvertError(f"--shape {text!r}: expected comma-separated integers {layout}") from None
    if len(shape) != SCHEMAS[kind].sample_rank or min(shape) < 1:
        raise ConvertError(f"--shape: {kind} take {SCHEMAS[kind].sample_rank} positive sizes {layout}; got {text}")
    return shape


def synthetic(kind: str, count: int, shape: list[int], classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples whose labels follow from their content, so a model can learn them rather than memorise
    noise. Images: the class is the brightness bin (`classes` bins, equally likely). Volumes: `classes`
    binary label maps from the mean of each voxel's neighbourhood in the first channel: map k marks
    the top 2^-(k+1) of those means (a half, a quarter, ...), so each map lies inside the one before,
    like BraTS's enhancing tumour inside the tumour core inside the whole tumour. Sequences: `classes`
    is the vocabulary, and the target is the source reversed (`synthetic_sentences`)."""
    if kind == "sequences":
        return synthetic_sentences(count, shape, classes, seed)
    rng = np.random.default_rng(seed)
    if kind == "images":
        brightness = rng.random(count, dtype=np.float32)
        noise = rng.uniform(-0.2, 0.2, size=(count, *shape)).astype(np.float32)
        images = np.clip(brightness.reshape(-1, 1, 1, 1) + noise, 0, 1)
        labels = np.minimum((brightness * classes).astype(np.int64), classes - 1)
        return np.round(images * 255).astype(np.uint8), labels
    volumes = rng.random((count, *shape), dtype=np.float32)
    smooth = box_blur_3d(volumes[..., 0])
    # Cut points at quantiles give each map its share; cuts from the value range would leave the
    # smaller maps almost empty (a mean of 27 values clusters around 0.5).
    cuts = np.quantile(smooth, [1 - 0.5 ** (k + 1) for k in range(classes)])
    return volumes, (smooth[..., None] >= cuts).astype(np.uint8)


def box_blur_3d(values: np.ndarray) -> np.ndarray:
    """The mean over each voxel's 3x3x3 neighbourhood of [N, D, H, W] values, zeros beyond the edges:
    exactly what one Conv3D with `padding="same"` can compute, so the labels are learnable to the edge."""
    out = values
    for axis in (1, 2, 3):
        padding = [(0, 0)] * out.ndim
        padding[axis] = (1, 1)
        padded = np.pad(out, padding)
        size = out.shape[axis]
        out = sum(np.take(padded, np.arange(shift, shift + size), axis=axis) for shift in range(3)) / 3
    return out.astype(np.float32)


def samples_from(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The arrays to write, from --from-npz or --synthetic, checked against the schema."""
    if args.from_npz:
        given = [flag for flag, value in (("--shape", args.shape), ("--classes", args.classes),
                                          ("--labels", args.labels), ("--vocabulary", args.vocabulary),
                                          ("--seed", args.seed)) if value is not None]
        if given:
            raise ConvertError(f"{', '.join(given)} only apply with --synthetic")
        inputs, labels = load_npz(args.from_npz, args.kind)
    else:
        inputs, labels = synthetic(args.kind, *synthetic_settings(args))
    try:
        check_arrays(args.kind, inputs, labels)
    except ValueError as err:
        raise ConvertError(str(err)) from None
    return inputs, labels


def synthetic_settings(args: argparse.Namespace) -> tuple[int, list[int], int, int]:
    """(count, shape, classes for images, label maps for volumes or vocabulary for sequences, seed)
    from the flags."""
    if args.synthetic < 1:
        raise ConvertError(f"--synthetic must be >= 1; got {args.synthetic}")
    if not args.shape:
        raise ConvertError("--synthetic needs --shape, e.g. --shape 64,64,3 (images), 32,32,32,4 (volumes) or "
                           "24,24 (sequences)")
    shape = parse_shape(args.shape, args.kind)
    for kind, flag in LABEL_FLAGS.items():
        if kind != args.kind and getattr(args, flag[2:]) is not None:
            raise ConvertError(f"{flag} does not apply to {args.kind}; " + ", ".join(
                f"{other} take {other_flag}" for other, other_flag in LABEL_FLAGS.items()))
    if args.kind == "sequences":
        vocabulary = 1000 if args.vocabulary is None else args.vocabulary
        if vocabulary < 3:
            raise ConvertError(f"--vocabulary must be >= 3 (ids 0 and 1 are padding and the start token); got "
                               f"{vocabulary}")
        return args.synthetic, shape, vocabulary, 0 if args.seed is None else args.seed
    if args.kind == "images":
        classes = 10 if args.classes is None else args.classes
        if classes < 2:
            raise ConvertError(f"--classes must be >= 2; got {classes}")
    else:
        classes = 3 if args.labels is None else args.labels
        if classes < 1:
            raise ConvertError(f"--labels must be >= 1; got {classes}")
    return args.synthetic, shape, classes, 0 if args.seed is None else args.seed


def check_out(args: argparse.Namespace, samples: int) -> None:
    """Everything about --out and --shards that can be known before writing."""
    if args.shards < 1:
        raise ConvertError(f"--shards must be >= 1; got {args.shards}")
    if samples < args.shards:
        raise ConvertError(f"{samples} samples cannot fill {args.shards} shards; use fewer --shards")
    if not args.prefix or "/" in args.prefix or args.prefix.startswith("."):
        raise ConvertError(f"--prefix {args.prefix!r} must be a plain file name start (no '/', not hidden)")
    if args.out.exists() and not args.out.is_dir():
        raise ConvertError(f"--out {args.out} is a file, not a directory")
    clash = existing_shards(args.out, args.prefix) if args.out.is_dir() else []
    if clash:
        raise ConvertError(f"--out {args.out} already has {clash[0].name}; a reader of the directory would mix the "
                           f"old and new files: choose another --out or --prefix, or remove them")


def report(paths: list[Path], kind: str, count: int, sample: str, out: Path, train_with: str = "") -> None:
    counts = records_per_shard(count, len(paths))
    sizes = [path.stat().st_size for path in paths]
    print(f"wrote {count} {kind} ({sample}) to {len(paths)} file(s), {sum(sizes):,} bytes:")
    for path, records, size in zip(paths, counts, sizes):
        print(f"  {path}  {records} records  {size:,} bytes")
    print(f"train on them with: --set data.source=tfrecord --set data.path={out}{train_with}")


def sample_text(kind: str, inputs: np.ndarray, labels: np.ndarray) -> str:
    if kind == "sequences":
        return f"source up to {inputs.shape[1]} tokens, target up to {labels.shape[1]}"
    return str(list(inputs.shape[1:]))


def brats_shape(args: argparse.Namespace) -> list[int]:
    """--shape for --from-brats: D,H,W (or D,H,W,4: BraTS has four channels)."""
    from launcher.rank.data.brats import MODALITIES

    given = [flag for flag, value in (("--classes", args.classes), ("--labels", args.labels),
                                      ("--vocabulary", args.vocabulary), ("--seed", args.seed)) if value is not None]
    if args.kind != "volumes" or given:
        raise ConvertError(f"--from-brats writes --kind volumes with BraTS's 3 tumour regions; "
                           f"{'drop ' + ', '.join(given) if given else f'not --kind {args.kind}'}")
    if not args.shape:
        raise ConvertError("--from-brats needs --shape D,H,W: the window cut around each brain, in the files' axis "
                           "order (BraTS: 240 x 240 x 155), each a multiple of 2^(model.levels-1), e.g. "
                           "144,176,144; each subject whose brain it cuts is reported")
    try:
        shape = [int(size) for size in args.shape.split(",")]
    except ValueError:
        shape = []
    if len(shape) == 4 and shape[3] == len(MODALITIES):
        shape = shape[:3]
    if len(shape) != 3 or min(shape) < 1:
        raise ConvertError(f"--shape {args.shape!r}: --from-brats takes D,H,W (positive; channels are BraTS's "
                           f"{len(MODALITIES)}: {', '.join(MODALITIES)})")
    return shape


def convert_brats(args: argparse.Namespace) -> None:
    """Writes the records of every subject of --from-brats and says what it wrote."""
    from launcher.rank.data import brats
    from launcher.rank.data.tfrecord import write_sample_stream

    shape = brats_shape(args)
    try:
        subjects = brats.find_subjects(args.from_brats)
    except ValueError as err:
        raise ConvertError(str(err)) from None
    check_out(args, len(subjects))
    window = " x ".join(map(str, shape))
    print(f"converting {len(subjects)} BraTS subject(s) from {args.from_brats}: channels "
          f"{', '.join(brats.MODALITIES)}, normalised over the brain, in a {window} window around it", flush=True)
    try:
        paths = write_sample_stream(args.out, "volumes", brats.samples(subjects, shape, _say), len(subjects),
                                    args.shards, args.prefix)
    except ValueError as err:  # a subject's files: nothing was written
        raise ConvertError(f"{err}; nothing was written") from None
    except OSError as err:
        raise ConvertError(f"cannot write to --out {args.out}: {err}") from None
    dims = ",".join(map(str, shape))
    report(paths, "volumes", len(subjects), f"[{dims.replace(',', ', ')}, 4], 3 tumour regions", args.out,
           train_with=f" --set model.input_shape=[{dims},4]")


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.from_brats:
            convert_brats(args)
            return 0
        inputs, labels = samples_from(args)
        check_out(args, len(inputs))
        try:
            paths = write_records(args.out, args.kind, inputs, labels, shards=args.shards, prefix=args.prefix)
        except OSError as err:  # not writable, disk full, ...: write_records has removed what it wrote
            raise ConvertError(f"cannot write to --out {args.out}: {err}") from None
    except UsageError as err:  # the parser's and ours
        print(f"lms-launch tfrecord: error: {err}", file=sys.stderr)
        return USAGE_STATUS
    except SystemExit as done:  # --help
        return int(done.code or 0)
    report(paths, args.kind, len(inputs), sample_text(args.kind, inputs, labels), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
