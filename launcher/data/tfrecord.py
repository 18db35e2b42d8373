"""TFRecord files of training samples: one documented schema, a writer, and a per-rank reader.

Two kinds of record, raw bytes (no JPEG: decoding would make the input pipeline, not the model, the
thing being measured):

images   `image` bytes: uint8, H*W*C, row-major    `label` int64: the class    `shape` int64 [H, W, C]
volumes  `volume` bytes: float32, D*H*W*C          `mask` bytes: uint8, D*H*W, the label of each voxel
         `shape` int64 [D, H, W, C]

Files are named `<prefix>-00000-of-00004.tfrecord`; samples go round-robin over the shards.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

KINDS = ("images", "volumes")
_INPUT_KEY = {"images": "image", "volumes": "volume"}
_LABEL_KEY = {"images": "label", "volumes": "mask"}
_INPUT_DTYPE = {"images": np.uint8, "volumes": np.float32}
_SAMPLE_RANK = {"images": 3, "volumes": 4}


def check_arrays(kind: str, inputs: np.ndarray, labels: np.ndarray) -> None:
    """Raises ValueError naming what is wrong with a batch of samples for `kind`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    want_rank = _SAMPLE_RANK[kind] + 1
    if inputs.ndim != want_rank:
        layout = "[N, H, W, C]" if kind == "images" else "[N, D, H, W, C]"
        raise ValueError(f"{kind}: inputs must be {layout}; got shape {list(inputs.shape)}")
    if inputs.dtype != _INPUT_DTYPE[kind]:
        raise ValueError(f"{kind}: inputs must be {np.dtype(_INPUT_DTYPE[kind]).name}; got {inputs.dtype}")
    if kind == "images":
        if labels.shape != (inputs.shape[0],):
            raise ValueError(f"images: labels must be [N] = [{inputs.shape[0]}]; got {list(labels.shape)}")
    elif labels.shape != inputs.shape[:4]:
        raise ValueError(f"volumes: masks must be [N, D, H, W] = {list(inputs.shape[:4])}; got {list(labels.shape)}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{kind}: labels must be integers; got {labels.dtype}")
    if labels.size and labels.min() < 0:
        raise ValueError(f"{kind}: labels must be >= 0; got {labels.min()}")
    if kind == "volumes" and labels.size and labels.max() > 255:
        raise ValueError(f"volumes: mask labels are stored as uint8 and must be <= 255; got {labels.max()}")


def shard_names(prefix: str, shards: int) -> list[str]:
    return [f"{prefix}-{i:05d}-of-{shards:05d}.tfrecord" for i in range(shards)]


def write_records(out_dir: str | Path, kind: str, inputs: np.ndarray, labels: np.ndarray, shards: int = 1,
                  prefix: str = "data") -> list[Path]:
    """Writes the samples as `shards` TFRecord files in `out_dir` and returns their paths. Each file is
    written under a temporary name and renamed when complete, so a failure leaves no partial file."""
    import tensorflow as tf

    check_arrays(kind, inputs, labels)
    if shards < 1:
        raise ValueError(f"shards must be >= 1; got {shards}")
    if len(inputs) < shards:
        raise ValueError(f"{len(inputs)} samples cannot fill {shards} shards; use fewer shards")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in shard_names(prefix, shards)]
    temps = [path.with_name(f".{path.name}.partial") for path in paths]
    label_dtype = np.int64 if kind == "images" else np.uint8
    try:
        writers = [tf.io.TFRecordWriter(str(tmp)) for tmp in temps]
        for index, (sample, label) in enumerate(zip(inputs, labels)):
            writers[index % shards].write(_encode(kind, sample, np.asarray(label, dtype=label_dtype)))
        for writer in writers:
            writer.close()
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    return paths


def _encode(kind: str, sample: np.ndarray, label: np.ndarray) -> bytes:
    import tensorflow as tf

    def int64s(values) -> tf.train.Feature:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))

    def raw(array: np.ndarray) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[np.ascontiguousarray(array).tobytes()]))

    feature = {_INPUT_KEY[kind]: raw(sample), "shape": int64s(sample.shape)}
    feature[_LABEL_KEY[kind]] = int64s([label]) if kind == "images" else raw(label)
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def find_files(path: str) -> list[str]:
    """A file, a directory (its `*.tfrecord` files) or a glob, sorted so every rank sees one order."""
    if os.path.isdir(path):
        files = glob.glob(os.path.join(path, "*.tfrecord"))
    elif any(ch in path for ch in "*?["):
        files = glob.glob(path)
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise FileNotFoundError(f"data.path: no TFRecord files at {path!r} (a file, a directory of *.tfrecord, "
                                f"or a glob); write some with `lms-launch tfrecord`")
    return sorted(files)


def read_dataset(path: str, kind: str, input_shape: list[int], classes: int, batch_size: int, rank: int,
                 size: int, seed: int, shuffle_buffer: int = 1024, prefetch: int = 2):
    """Batches `(x, y)` for one rank, forever: x float32 (images scaled to [0, 1]), y int32 labels
    ([batch] for images, [batch, D, H, W] for volumes).

    Sharding: with at least as many files as ranks each rank reads its own files (no rank reads bytes
    it throws away); otherwise every rank reads all files and keeps every size-th record. A record
    whose shape differs from `input_shape`, or a label outside [0, classes), stops training with an
    error naming both.
    """
    import tensorflow as tf

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    files = find_files(path)
    dataset = tf.data.Dataset.from_tensor_slices(files)
    if len(files) >= size:
        dataset = dataset.shard(size, rank)
        dataset = tf.data.TFRecordDataset(dataset)
    else:
        dataset = tf.data.TFRecordDataset(dataset).shard(size, rank)
    input_key, label_key = _INPUT_KEY[kind], _LABEL_KEY[kind]
    spec = {
        input_key: tf.io.FixedLenFeature([], tf.string),
        "shape": tf.io.FixedLenFeature([len(input_shape)], tf.int64),
        label_key: tf.io.FixedLenFeature([], tf.int64 if kind == "images" else tf.string),
    }
    want_shape = tf.constant(input_shape, tf.int64)

    def decode(serialized):
        example = tf.io.parse_single_example(serialized, spec)
        check_shape = tf.debugging.assert_equal(
            example["shape"], want_shape,
            message=f"data.path: a record's shape differs from model.input_shape {input_shape}")
        with tf.control_dependencies([check_shape]):
            if kind == "images":
                x = tf.cast(tf.io.decode_raw(example[input_key], tf.uint8), tf.float32) / 255.0
                y = tf.cast(example[label_key], tf.int32)
            else:
                x = tf.io.decode_raw(example[input_key], tf.float32)
                y = tf.cast(tf.io.decode_raw(example[label_key], tf.uint8), tf.int32)
                y = tf.reshape(y, input_shape[:3])
            x = tf.reshape(x, input_shape)
        check_label = tf.debugging.assert_less(
            tf.reduce_max(y), classes, message=f"data.path: a label is not below model.classes = {classes}")
        with tf.control_dependencies([check_label]):
            return tf.identity(x), tf.identity(y)

    dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True).repeat()
    dataset = dataset.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = dataset.batch(batch_size, drop_remainder=True)
    return dataset.prefetch(prefetch if prefetch > 0 else tf.data.AUTOTUNE)
