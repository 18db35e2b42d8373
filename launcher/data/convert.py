"""`lms-launch tfrecord`: write training data as TFRecord files in the schema of launcher.data.tfrecord.

    lms-launch tfrecord --kind images  --out DIR --from-npz data.npz            # arrays images, labels
    lms-launch tfrecord --kind volumes --out DIR --from-npz data.npz            # arrays volumes, masks
    lms-launch tfrecord --kind images  --out DIR --synthetic 256 --shape 64,64,3 --classes 10

Exit status 0 when the files are written, 2 for bad input (nothing is written then).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from launcher.data.tfrecord import KINDS, check_arrays, shard_names, write_records

NPZ_ARRAYS = {"images": ("images", "labels"), "volumes": ("volumes", "masks")}


class ConvertError(Exception):
    """Bad input to the converter; printed as it is, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConvertError(f"{message} (see lms-launch tfrecord --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lms-launch tfrecord", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--out", required=True, help="directory for the .tfrecord files")
    p.add_argument("--shards", type=int, default=1, help="files to spread the samples over (>= number of ranks "
                                                         "lets each rank read only its own files)")
    p.add_argument("--prefix", default="data", help="file name prefix")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-npz", metavar="FILE", help="NumPy .npz with images+labels or volumes+masks")
    source.add_argument("--synthetic", type=int, metavar="N", help="N learnable synthetic samples")
    p.add_argument("--shape", help="with --synthetic: one sample's shape, e.g. 64,64,3 or 32,32,32,4")
    p.add_argument("--classes", type=int, default=10, help="with --synthetic: number of labels")
    p.add_argument("--seed", type=int, default=0)
    return p


def load_npz(path: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    file = Path(path)
    if not file.is_file():
        raise ConvertError(f"--from-npz: {file} does not exist")
    try:
        arrays = np.load(file)
    except (OSError, ValueError) as err:
        raise ConvertError(f"--from-npz: {file} is not a NumPy .npz file ({err})") from None
    names = NPZ_ARRAYS[kind]
    missing = [name for name in names if name not in arrays.files]
    if missing:
        raise ConvertError(f"--from-npz: {file} has no array(s) {', '.join(missing)} (it has: "
                           f"{', '.join(arrays.files) or 'none'}); --kind {kind} needs {' and '.join(names)}")
    return arrays[names[0]], arrays[names[1]]


def synthetic(kind: str, count: int, shape: list[int], classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples whose labels follow from their content, so a model can learn them: an image's class is
    its brightness bin; a voxel's label is the bin of a smoothed first channel (blobs, like tumours)."""
    rng = np.random.default_rng(seed)
    if kind == "images":
        brightness = rng.uniform(0, 1, size=count)
        noise = rng.uniform(-0.2, 0.2, size=(count, *shape))
        images = np.clip(brightness.reshape(-1, 1, 1, 1) + noise, 0, 1)
        labels = np.minimum((brightness * classes).astype(np.int64), classes - 1)
        return (images * 255).astype(np.uint8), labels
    volumes = rng.uniform(0, 1, size=(count, *shape)).astype(np.float32)
    smooth = volumes[..., 0]
    for axis in (1, 2, 3):  # a box blur along each spatial axis
        smooth = (np.roll(smooth, 1, axis) + smooth + np.roll(smooth, -1, axis)) / 3
    lo, hi = smooth.min(), smooth.max()
    masks = np.minimum(((smooth - lo) / max(hi - lo, 1e-6) * classes).astype(np.uint8), classes - 1)
    return volumes, masks


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.shards < 1:
            raise ConvertError(f"--shards must be >= 1; got {args.shards}")
        if args.from_npz:
            inputs, labels = load_npz(args.from_npz, args.kind)
        else:
            if args.synthetic < 1:
                raise ConvertError(f"--synthetic must be >= 1; got {args.synthetic}")
            if not args.shape:
                raise ConvertError("--synthetic needs --shape, e.g. --shape 64,64,3 (images) or 32,32,32,4 (volumes)")
            try:
                shape = [int(d) for d in args.shape.split(",")]
            except ValueError:
                raise ConvertError(f"--shape {args.shape!r}: expected comma-separated integers") from None
            want = 3 if args.kind == "images" else 4
            if len(shape) != want or min(shape) < 1:
                raise ConvertError(f"--shape: {args.kind} take {want} positive sizes; got {args.shape}")
            if args.classes < 2:
                raise ConvertError(f"--classes must be >= 2; got {args.classes}")
            inputs, labels = synthetic(args.kind, args.synthetic, shape, args.classes, args.seed)
        try:
            check_arrays(args.kind, inputs, labels)
        except ValueError as err:
            raise ConvertError(str(err)) from None
        out = Path(args.out)
        clobbered = [name for name in shard_names(args.prefix, args.shards) if (out / name).exists()]
        if clobbered:
            raise ConvertError(f"--out {out} already has {clobbered[0]}; choose another --out or --prefix")
        try:
            paths = write_records(out, args.kind, inputs, labels, shards=args.shards, prefix=args.prefix)
        except (OSError, ValueError) as err:
            raise ConvertError(f"cannot write to --out {out}: {err}") from None
    except ConvertError as err:
        print(f"lms-launch tfrecord: error: {err}", file=sys.stderr)
        return 2
    total = sum(p.stat().st_size for p in paths)
    print(f"wrote {len(inputs)} {args.kind} ({list(inputs.shape[1:])}) to {len(paths)} file(s), "
          f"{total / 2**20:.1f} MiB:")
    for path in paths:
        print(f"  {path}")
    print(f"train on them with: --set data.source=tfrecord --set data.path={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
