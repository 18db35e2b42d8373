"""TFRecord files of training samples: one documented schema, a writer, and a per-rank reader.

Each record is a `tf.train.Example` holding one sample, stored raw (no JPEG: decoding would make the
input pipeline, not the model, the thing being measured):

    kind      feature   type         content
    images    image     bytes        uint8, H*W*C values, row-major (C fastest)
              label     int64        the class, in [0, model.classes)
              shape     int64 list   [H, W, C]
    volumes   volume    bytes        float32 (little-endian), D*H*W*C values, row-major (C fastest)
              mask      bytes        uint8, D*H*W*L values, row-major (L fastest): L = model.labels
                                     binary label maps, each voxel 0 or 1 in each
              shape     int64 list   [D, H, W, C] (the volume's; the mask's L follows from its length)
    sequences source    int64 list   the source sentence's token ids, no padding (launcher.rank.data.sequences)
              target    int64 list   the target sentence's token ids, no padding

Files are named `<prefix>-00000-of-00004.tfrecord`; samples are dealt round-robin over the shards.
The reader also takes ImageNet's usual JPEG records (launcher.rank.data.imagenet).
docs/data.md is the user-facing version of this page.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from launcher.rank.data import imagenet
from launcher.rank.data.sequences import (
    check_first_sentences, check_sentences, sentence_decoder, sentence_features,
)

if TYPE_CHECKING:  # TensorFlow is imported lazily: `lms-launch --help` and recipe checks stay fast.
    import tensorflow as tf


@dataclass(frozen=True)
class RecordSchema:
    """The features of one kind of record."""

    kind: str
    input_key: str
    input_dtype: type
    label_key: str
    layout: str
    """One sample's axes, as users write them in messages: `[H, W, C]`, `[D, H, W, C]`, or for
    sentences the two lengths `[S, T]`."""
    shape_key: str | None = "shape"
    """The feature holding the sample's shape; sentences have none (their length is their list's)."""

    @property
    def sample_rank(self) -> int:
        return self.layout.count(",") + 1

    @property
    def features(self) -> tuple[str, ...]:
        return (self.input_key, self.label_key) + ((self.shape_key,) if self.shape_key else ())


SCHEMAS = {
    "images": RecordSchema("images", "image", np.uint8, "label", "[H, W, C]"),
    "volumes": RecordSchema("volumes", "volume", np.float32, "mask", "[D, H, W, C]"),
    "sequences": RecordSchema("sequences", "source", np.int64, "target", "[S, T]", shape_key=None),
}
KINDS = tuple(SCHEMAS)
BRATS_LABELS = (1, 2, 4)  # BraTS: necrotic and non-enhancing core, oedema, enhancing tumour (0: background)


def schema_of(kind: str) -> RecordSchema:
    if kind not in SCHEMAS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    return SCHEMAS[kind]


# ----------------------------------------------------------------------------------------------------
# Writing


def check_arrays(kind: str, inputs: np.ndarray, labels: np.ndarray) -> None:
    """Raises ValueError naming what is wrong with `inputs` ([N, *sample]) and `labels` for `kind`
    (for sequences: padded source sentences [N, S] and target sentences [N, T])."""
    schema = schema_of(kind)
    if kind == "sequences":
        check_sentences(inputs, labels)
        return
    batch_layout = "[N, " + schema.layout[1:]
    if inputs.ndim != schema.sample_rank + 1:
        hint = " (add a channel axis with x[..., None])" if inputs.ndim == schema.sample_rank else ""
        raise ValueError(f"{kind}: inputs must be {batch_layout}; got shape {list(inputs.shape)}{hint}")
    if inputs.dtype != schema.input_dtype:
        raise ValueError(f"{kind}: inputs must be {np.dtype(schema.input_dtype).name}; got {inputs.dtype}"
                         + _dtype_hint(kind))
    if kind == "volumes" and not np.isfinite(inputs).all():
        raise ValueError("volumes: inputs hold NaN or infinite values, which would poison the loss")
    _check_labels(kind, inputs.shape, labels)


def _dtype_hint(kind: str) -> str:
    if kind == "images":
        return " (from floats in [0, 1]: (x * 255).round().astype(np.uint8))"
    return " (convert with x.astype(np.float32), normalised as the model should see it)"


def _check_labels(kind: str, input_shape: tuple[int, ...], labels: np.ndarray) -> None:
    if kind == "images":
        if labels.shape != input_shape[:1]:
            raise ValueError(f"images: labels must be [N] = [{input_shape[0]}]; got {list(labels.shape)}")
        if not (np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_):
            raise ValueError(f"images: labels must be integers; got {labels.dtype}")
        if labels.size and labels.min() < 0:
            raise ValueError(f"images: labels must be >= 0; got {labels.min()}")
        return
    voxels = list(input_shape[:4])
    if labels.ndim != 5 or list(labels.shape[:4]) != voxels or labels.shape[4] < 1:
        hint = ""
        if list(labels.shape) == voxels:
            hint = (": one binary map per label on the last axis; a single binary mask is masks[..., None], "
                    "a BraTS label map (0, 1, 2, 4) becomes three nested maps with brats_regions(masks)")
        want = ", ".join(str(d) for d in voxels)
        raise ValueError(f"volumes: masks must be [N, D, H, W, L] = [{want}, L] (L binary label maps); "
                         f"got {list(labels.shape)}{hint}")
    if not (labels.dtype == np.bool_ or np.issubdtype(labels.dtype, np.integer)
            or np.issubdtype(labels.dtype, np.floating)):
        raise ValueError(f"volumes: masks must be 0/1 numbers or booleans; got {labels.dtype}")
    stray = labels[(labels != 0) & (labels != 1)] if labels.dtype != np.bool_ else labels[:0]
    if stray.size:
        raise ValueError(f"volumes: masks must hold only 0 and 1 (one binary map per label); found "
                         f"{stray.flat[0].item()!r}; a BraTS label map (0, 1, 2, 4) becomes three nested maps "
                         f"with brats_regions()")


def brats_regions(segmentation: np.ndarray) -> np.ndarray:
    """A BraTS label map [..., D, H, W] (0 background, 1 necrotic and non-enhancing tumour core,
    2 oedema, 4 enhancing tumour) as the three nested regions the challenge scores, [..., D, H, W, 3]
    uint8: whole tumour (1, 2, 4), tumour core (1, 4), enhancing tumour (4)."""
    segmentation = np.asarray(segmentation)
    unknown = np.setdiff1d(np.unique(segmentation), (0, *BRATS_LABELS))
    if unknown.size:
        raise ValueError(f"a BraTS label map holds 0, 1, 2 and 4 only; found {unknown.tolist()}")
    whole = segmentation != 0
    core = (segmentation == 1) | (segmentation == 4)
    return np.stack([whole, core, segmentation == 4], axis=-1).astype(np.uint8)


def shard_names(prefix: str, shards: int) -> list[str]:
    return [f"{prefix}-{index:05d}-of-{shards:05d}.tfrecord" for index in range(shards)]


def records_per_shard(samples: int, shards: int) -> list[int]:
    """How many samples each shard gets when `samples` are dealt round-robin."""
    return [samples // shards + (index < samples % shards) for index in range(shards)]


def existing_shards(out_dir: str | Path, prefix: str) -> list[Path]:
    """Shards of any count already written with `prefix`: a reader of the directory would mix them in."""
    return sorted(Path(out_dir).glob(f"{glob.escape(prefix)}-*-of-*.tfrecord"))


def write_records(out_dir: str | Path, kind: str, inputs: np.ndarray, labels: np.ndarray, shards: int = 1,
                  prefix: str = "data") -> list[Path]:
    """Writes `inputs` ([N, *sample]) and `labels` as `shards` TFRecord files in `out_dir`; returns them.

    All files are written under temporary names and renamed only once every one is complete, so a
    failure leaves no file (and no directory this call created). Refuses, with FileExistsError, to
    write where shards with the same prefix exist: a reader of the directory would mix the two sets.
    """
    check_arrays(kind, inputs, labels)
    return write_sample_stream(out_dir, kind, zip(inputs, labels), len(inputs), shards, prefix)


def write_sample_stream(out_dir: str | Path, kind: str, samples, count: int, shards: int = 1,
                        prefix: str = "data") -> list[Path]:
    """`write_records` for `count` (sample, label) pairs made one at a time, as a converter reads them
    from files too many to hold in memory at once; each is checked as it comes. Nothing is left when
    the iterator raises: its error comes out as it is."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1; got {shards}")
    if count < shards:
        raise ValueError(f"{count} samples cannot fill {shards} shards; use fewer shards")
    out_dir = Path(out_dir)
    clash = existing_shards(out_dir, prefix)
    if clash:
        raise FileExistsError(f"{out_dir} already holds {clash[0].name}; remove the old shards or use another prefix")

    def checked(sample: np.ndarray, label: np.ndarray) -> bytes:
        check_arrays(kind, sample[None], np.asarray(label)[None])
        return _encode(kind, sample, label)

    created_dir = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in shard_names(prefix, shards)]
    try:
        _write_atomically(paths, (checked(sample, label) for sample, label in samples))
    except BaseException:
        if created_dir and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    return paths


def _write_atomically(paths: list[Path], records) -> None:
    """Deals `records` round-robin into `paths`: temporary files first, then all renamed at once."""
    import tensorflow as tf

    temps = [path.with_name(f".{path.name}.partial") for path in paths]
    renamed: list[Path] = []
    writers = []
    try:
        writers = [tf.io.TFRecordWriter(str(temp)) for temp in temps]
        for index, record in enumerate(records):
            writers[index % len(writers)].write(record)
        for writer in writers:
            writer.close()  # flushes; a full disk fails here, before anything is renamed
        for temp, path in zip(temps, paths):
            os.replace(temp, path)
            renamed.append(path)
    except BaseException:
        for path in renamed:  # a rename failed half-way: no set of shards is better than part of one
            path.unlink(missing_ok=True)
        raise
    finally:
        for writer in writers:
            writer.close()  # closing twice is harmless; an open handle would keep a deleted file alive
        for temp in temps:
            temp.unlink(missing_ok=True)


def _encode(kind: str, sample: np.ndarray, label: np.ndarray | np.integer) -> bytes:
    import tensorflow as tf

    def int64s(values) -> tf.train.Feature:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))

    def raw(array: np.ndarray, dtype: type) -> tf.train.Feature:
        # Fixed little-endian bytes, so files move between machines; decode_raw reads little-endian.
        data = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))

    schema = SCHEMAS[kind]
    if kind == "sequences":
        return tf.train.Example(features=tf.train.Features(feature=sentence_features(sample, label))
                                ).SerializeToString()
    feature = {schema.input_key: raw(sample, schema.input_dtype), "shape": int64s(sample.shape)}
    feature[schema.label_key] = int64s([label]) if kind == "images" else raw(label, np.uint8)
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


# ----------------------------------------------------------------------------------------------------
# Reading


_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}$")  # train-00000-of-01024, as the sharded writers name files


def find_files(path: str) -> list[str]:
    """A file, a directory (its `*.tfrecord` files) or a glob, sorted so every rank sees one order."""
    if os.path.isdir(path):
        files = glob.glob(os.path.join(glob.escape(path), "*.tfrecord"))
    elif glob.has_magic(path):
        files = [name for name in glob.glob(path) if os.path.isfile(name)]
    else:
        files = [path] if os.path.isfile(path) else []
    if not files and os.path.isdir(path):
        # ImageNet's converters name shards train-00000-of-01024 or imagenet2012-train.tfrecord-00000-of-01024,
        # beside the validation shards: which to train on is the user's to say.
        sharded = sorted(name for name in os.listdir(path) if _SHARD_NAME.search(name))
        if sharded:
            raise FileNotFoundError(f"data.path: {path!r} holds no *.tfrecord files but shards such as {sharded[0]}: "
                                    f"give a glob of those to train on, e.g. "
                                    f"{os.path.join(path, _SHARD_NAME.sub('', sharded[0]))}-*")
    if not files:
        raise FileNotFoundError(f"data.path: no TFRecord files at {path!r} (a file, a directory of *.tfrecord, "
                                f"or a glob); write some with `lms-launch tfrecord`")
    return sorted(files)


def shards_by_file(files: int, size: int) -> bool:
    """Whether ranks split the files (each reads only its own) rather than the records of all files."""
    return files >= size


def read_dataset(path: str, kind: str, input_shape: list[int], classes: int, batch_size: int, rank: int,
                 size: int, seed: int, shuffle_buffer: int = 1024, prefetch: int = 2, image_key: str | None = None,
                 label_key: str | None = None, label_offset: int = 0) -> "tf.data.Dataset":
    """Batches `(x, y)` for one rank of `size`, forever: x float32 [batch, *input_shape] (images scaled
    to [0, 1], volumes as stored); y int32 [batch] for images, whose labels lie in [0, `classes`)
    (model.classes), or float32 0/1 [batch, D, H, W, `classes`] for volumes, whose masks hold
    `classes` binary label maps (model.labels). For sequences, input_shape is [S, T] and `classes`
    the vocabulary: x int32 [batch, S + T] (source, then the decoder's input), y int32 [batch, T]
    (the target), both padded with 0 (launcher.rank.data.sequences). Images may also be ImageNet JPEG
    records as tensorflow/models and TFDS write them (launcher.rank.data.imagenet: found from the
    first record, or named by `image_key` and `label_key`; `label_offset` is subtracted from their
    labels), decoded with a random crop and flip.

    Sharding: with at least `size` files, rank r reads files r, r+size, ... (no rank reads bytes it
    throws away) and shuffles their order every epoch; otherwise every rank reads all files in order
    and keeps records r, r+size, .... Then: shuffle (seeded with seed + rank, so ranks differ and runs
    repeat), repeat, batch dropping the remainder (every step has one shape), decode, prefetch
    `prefetch` batches (0: none).

    Reads this rank's first record now, so the common mistakes fail here with a ValueError: no
    record for this rank, files of the other kind, a shape other than `input_shape`, a mask with
    another number of label maps or with values other than 0 and 1, a PNG among JPEG records. A later
    record with any of these, or an image label outside [0, classes), stops iteration with
    InvalidArgumentError naming the record's value and the recipe's.
    """
    import tensorflow as tf

    schema = schema_of(kind)
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}); got {rank}")
    files = find_files(path)
    rank_seed = seed + rank
    records = _records_of_rank(files, rank, size)
    first = _first_record(records, path, rank, size, len(files))
    jpeg = imagenet.jpeg_layout(first, image_key, label_key, label_offset, path) if kind == "images" else None
    if jpeg is None:
        if label_offset:
            raise ValueError(f"data.label_offset: {label_offset} applies to ImageNet JPEG records; the records in "
                             f"{path!r} are lms-launch's own, whose labels count from 0: leave it out")
        _check_first_record(first, schema, input_shape, classes, path)
    else:
        imagenet.check_first_record(first, jpeg, input_shape, classes, path)

    if shards_by_file(len(files), size):
        records = _records_of_rank(files, rank, size, shuffle_files_seed=rank_seed)
    dataset = records.shuffle(shuffle_buffer, seed=rank_seed, reshuffle_each_iteration=True).repeat()
    if jpeg is not None:
        dataset = imagenet.decode_and_augment(dataset, jpeg, input_shape, classes, batch_size, rank_seed)
    else:
        # Decoding whole batches is one op per feature per batch instead of per sample (tf.data guide,
        # "vectorized mapping"); the serialized records are also what the shuffle buffer holds, which for
        # images is a quarter of their float32 size.
        dataset = dataset.batch(batch_size, drop_remainder=True)
        dataset = dataset.map(_batch_decoder(schema, input_shape, classes),
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.prefetch(prefetch) if prefetch > 0 else dataset


def _records_of_rank(files: list[str], rank: int, size: int, shuffle_files_seed: int | None = None
                     ) -> "tf.data.Dataset":
    """This rank's serialized records, by file or by record (see `read_dataset`)."""
    import tensorflow as tf

    names = tf.data.Dataset.from_tensor_slices(files)
    if not shards_by_file(len(files), size):
        # Every rank must see the records in one order for `shard` to split them, so files are read
        # one after another and never shuffled here.
        return tf.data.TFRecordDataset(names).shard(size, rank)
    names = names.shard(size, rank)
    if shuffle_files_seed is not None:
        # Records sit in files in the order they were written; shuffling files each epoch mixes
        # more than a shuffle buffer smaller than a file can.
        names = names.shuffle(len(files), seed=shuffle_files_seed, reshuffle_each_iteration=True)
    # Files of one rank are interleaved (deterministically): parallel reads, and more mixing.
    return tf.data.TFRecordDataset(names, num_parallel_reads=tf.data.AUTOTUNE)


def _first_record(records: "tf.data.Dataset", path: str, rank: int, size: int, files: int):
    """The features of this rank's first record (a `Features.feature` map); ValueError when it has none."""
    import tensorflow as tf

    first = next(iter(records.take(1)), None)
    if first is None:
        raise ValueError(f"data.path: rank {rank} of {size} gets no records from {path!r} ({files} file(s)); "
                         f"write at least {size} samples")
    return tf.train.Example.FromString(first.numpy()).features.feature


def _check_first_record(features, schema: RecordSchema, input_shape: list[int], classes: int, path: str) -> None:
    """ValueError for the mistakes that show in any one record, before training starts."""
    missing = [key for key in schema.features if key not in features]
    if missing:
        others = [s.kind for s in SCHEMAS.values() if s is not schema and all(k in features for k in s.features)]
        guess = f"; they look like {others[0]}" if others else ""
        if schema.kind == "images":
            guess += f". Images may also be {imagenet.LAYOUTS_TEXT}"
        raise ValueError(f"data.path: records in {path!r} lack feature(s) {', '.join(missing)} that {schema.kind} "
                         f"need (they have: {', '.join(sorted(features))}){guess}")
    if schema.kind == "sequences":
        check_first_sentences(features, input_shape, classes, path)
        return
    shape = list(features["shape"].int64_list.value)
    if shape != list(input_shape):
        raise ValueError(f"data.path: records in {path!r} have shape {shape}; model.input_shape is "
                         f"{list(input_shape)}")
    if schema.kind == "volumes":
        mask = np.frombuffer(features[schema.label_key].bytes_list.value[0], np.uint8)
        voxels = int(np.prod(input_shape[:3]))
        if mask.size != voxels * classes:
            held = f"{mask.size // voxels} label map(s)" if mask.size % voxels == 0 else f"{mask.size} bytes"
            raise ValueError(f"data.path: masks in {path!r} hold {held} per volume of {voxels} voxels; model.labels "
                             f"is {classes} (one uint8 per voxel and label map)")
        stray = mask[mask > 1]
        if stray.size:
            raise ValueError(f"data.path: masks in {path!r} hold the value {stray[0]}; each of the model.labels = "
                             f"{classes} maps must be 0 or 1 (write BraTS label maps with brats_regions())")


def _batch_decoder(schema: RecordSchema, input_shape: list[int], classes: int):
    """A function from a batch of serialized records to `(x, y)`, checking every record on the way."""
    import tensorflow as tf

    if schema.kind == "sequences":
        return sentence_decoder(input_shape, classes)
    spec = {
        schema.input_key: tf.io.FixedLenFeature([], tf.string),
        "shape": tf.io.FixedLenFeature([len(input_shape)], tf.int64),
        schema.label_key: tf.io.FixedLenFeature([], tf.int64 if schema.kind == "images" else tf.string),
    }
    want_shape = tf.constant(input_shape, tf.int64)

    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        example = tf.io.parse_example(serialized, spec)
        # The shape checks must run before decode_raw, whose own error (unequal byte counts) says nothing
        # about shapes.
        checks = [_assert_shapes(example["shape"], want_shape, input_shape)]
        if schema.kind == "volumes":
            checks.append(_assert_mask_sizes(example[schema.label_key], input_shape, classes))
        with tf.control_dependencies(checks):
            x = tf.io.decode_raw(example[schema.input_key], schema.input_dtype)
            if schema.kind == "images":
                x = tf.cast(x, tf.float32) / 255.0
                y = example[schema.label_key]
            else:
                y = tf.io.decode_raw(example[schema.label_key], tf.uint8)
        batch = tf.shape(serialized)[:1]
        x = tf.reshape(x, tf.concat([batch, input_shape], 0))
        if schema.kind == "images":
            # Checked before the cast, so an int64 label beyond int32 cannot wrap into range.
            with tf.control_dependencies([_assert_labels(y, classes)]):
                return tf.identity(x), tf.cast(y, tf.int32)
        y = tf.reshape(y, tf.concat([batch, input_shape[:3], [classes]], 0))
        with tf.control_dependencies([_assert_binary(y, classes)]):
            return tf.identity(x), tf.cast(y, tf.float32)

    return decode


def _assert_shapes(shapes: tf.Tensor, want: tf.Tensor, input_shape: list[int]) -> tf.Operation:
    import tensorflow as tf

    wrong = tf.reduce_any(tf.not_equal(shapes, want), axis=1)
    first_wrong = tf.concat([tf.boolean_mask(shapes, wrong), [want]], 0)[0]  # `want` pads the all-good case
    message = tf.strings.format("data.path: a record has shape {} but model.input_shape is {}",
                                (first_wrong, want), summarize=-1)
    return tf.debugging.Assert(tf.logical_not(tf.reduce_any(wrong)), [message])


def _assert_mask_sizes(masks: tf.Tensor, input_shape: list[int], classes: int) -> tf.Operation:
    import tensorflow as tf

    voxels = int(np.prod(input_shape[:3]))
    lengths = tf.strings.length(masks)
    wrong = tf.not_equal(lengths, voxels * classes)
    first_wrong = tf.concat([tf.boolean_mask(lengths, wrong), [voxels * classes]], 0)[0]
    message = tf.strings.format("data.path: a record has a mask of {} bytes; model.labels = {} maps of {} voxels "
                                "need {} (one uint8 per voxel and label map)",
                                (first_wrong, classes, voxels, voxels * classes))
    return tf.debugging.Assert(tf.logical_not(tf.reduce_any(wrong)), [message])


def _assert_labels(labels: tf.Tensor, classes: int) -> tf.Operation:
    import tensorflow as tf

    low, high = tf.reduce_min(labels), tf.reduce_max(labels)
    in_range = tf.logical_and(low >= 0, high < classes)
    message = tf.strings.format("data.path: labels must be in [0, model.classes = {}); a batch has labels from {} "
                                "to {}", (classes, low, high))
    return tf.debugging.Assert(in_range, [message])


def _assert_binary(masks: tf.Tensor, classes: int) -> tf.Operation:
    import tensorflow as tf

    high = tf.reduce_max(masks)
    message = tf.strings.format("data.path: masks must hold 0 or 1 in each of the model.labels = {} maps; a batch "
                                "holds {}", (classes, high))
    return tf.debugging.Assert(high <= 1, [message])
