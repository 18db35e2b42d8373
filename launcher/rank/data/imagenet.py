"""ImageNet TFRecords as users already have them: one `tf.train.Example` per image, holding the JPEG
file's bytes and the class, as tensorflow/models' converters and TFDS write them.

    writer                                          image feature    label feature
    tensorflow/models (build_imagenet_data.py,      image/encoded    image/class/label  (+ image/height,
      official/vision's TFRecord converters)                            image/width, image/format, ...)
    TFDS (imagenet2012)                             image            label              (+ file_name)

Which one a set of files is comes from the features of its first record (`jpeg_layout`), or from
data.image_key and data.label_key. build_imagenet_data.py counts classes from 1 (0 was "background"):
data.label_offset = 1 turns its labels into [0, 1000).

Training input, per image, as ImageNet classifiers are trained (Inception's crop, which the ResNet
recipes of tensorflow/models and torchvision's RandomResizedCrop also use): a window of 8% to 100% of
the image's area with an aspect ratio between 3/4 and 4/3 is chosen at random, only that window is
decoded (`decode_and_crop_jpeg`, cheaper than decoding the whole image), resized to the model's
H x W (bilinear), flipped left-right with probability 1/2, and scaled to [0, 1] as the raw records
are. The random choices are stateless draws seeded with (train.seed + rank, the image's position in
the rank's stream), and tf.data keeps the stream's order: the same seed gives the same batches,
however many threads decode them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG"
AREA_RANGE = (0.08, 1.0)  # the crop's share of the image's area
ASPECT_RANGE = (3 / 4, 4 / 3)  # the crop's width / height
MIN_OBJECT_COVERED = 0.1  # the crop holds at least this much of the whole-image box (Inception's value)
CROP_ATTEMPTS = 10  # draws before the whole image is taken instead
KNOWN_LAYOUTS = (("image/encoded", "image/class/label", "tensorflow/models"), ("image", "label", "TFDS"))
LAYOUTS_TEXT = ("ImageNet JPEG records (image/encoded and image/class/label as tensorflow/models writes them, image "
                "and label as TFDS does; other names with data.image_key and data.label_key)")


@dataclass(frozen=True)
class JpegLayout:
    """Where a record keeps its encoded image and its class, and how the class is counted."""

    image_key: str
    label_key: str
    label_offset: int
    """Subtracted from every stored label (1 for build_imagenet_data.py's 1..1000)."""
    origin: str
    """Who writes records this way, for messages: tensorflow/models, TFDS, or the recipe's keys."""


def jpeg_layout(features, image_key: str | None, label_key: str | None, label_offset: int,
                path: str) -> JpegLayout | None:
    """The layout of encoded-image records from their first record's features (a `Features.feature`
    map), or None for lms-launch's own raw image records (which carry a `shape`) and for records of no
    known layout. Raises ValueError naming the features found when the recipe's keys do not fit."""
    if image_key or label_key:
        # One key named: its partner from the layout it belongs to, when it belongs to one.
        pair = next(((i, l) for i, l, _ in KNOWN_LAYOUTS if image_key in (None, i) and label_key in (None, l)),
                    (image_key, label_key))
        keys = {"data.image_key": image_key or pair[0], "data.label_key": label_key or pair[1]}
        for setting, key in keys.items():
            if key is None or key not in features:
                what = f"no feature {key!r}" if key else f"a {setting} to be given too"
                raise ValueError(f"data.path: records in {path!r} have {what} ({setting}); they have: "
                                 f"{', '.join(sorted(features))}")
        return JpegLayout(keys["data.image_key"], keys["data.label_key"], label_offset, "data.image_key/label_key")
    if "shape" in features:
        return None  # lms-launch's raw records: launcher.rank.data.tfrecord reads them
    for image, label, origin in KNOWN_LAYOUTS:
        if image in features and label in features:
            return JpegLayout(image, label, label_offset, origin)
    return None  # nothing known: the raw reader's check names what is missing (and these layouts)


def check_first_record(features, layout: JpegLayout, input_shape: list[int], classes: int, path: str) -> None:
    """ValueError for what shows in one record: an image that is not a JPEG, a model input of other
    than 1 or 3 channels, a label out of range."""
    encoded = features[layout.image_key].bytes_list.value
    labels = features[layout.label_key].int64_list.value
    if len(encoded) != 1 or len(labels) != 1:
        raise ValueError(f"data.path: records in {path!r} hold {len(encoded)} value(s) in {layout.image_key!r} and "
                         f"{len(labels)} integer(s) in {layout.label_key!r}; one encoded image and one class each")
    if not encoded[0].startswith(JPEG_MAGIC):
        kind = "PNG" if encoded[0].startswith(PNG_MAGIC) else "not JPEG"
        raise ValueError(f"data.path: the images in {path!r} ({layout.image_key!r}) are {kind}; this reader decodes "
                         f"JPEG (re-encode them, as tensorflow/models' build_imagenet_data.py does)")
    if input_shape[-1] not in (1, 3):
        raise ValueError(f"model.input_shape {input_shape}: JPEG images decode to 1 (grey) or 3 (RGB) channels")
    label = labels[0] - layout.label_offset
    if not 0 <= label < classes:
        raise ValueError(f"data.path: a record in {path!r} has {layout.label_key} {labels[0]}, which is "
                         + label_hint(classes, layout.label_offset))


def label_hint(classes: int, offset: int) -> str:
    """Why a stored label is out of range, and the usual fix."""
    hint = (" (tensorflow/models' build_imagenet_data.py counts from 1: set data.label_offset: 1)" if offset == 0
            else "")
    return (f"outside [data.label_offset, data.label_offset + model.classes) = [{offset}, {offset + classes})"
            + hint)


def decode_and_augment(records: "tf.data.Dataset", layout: JpegLayout, input_shape: list[int], classes: int,
                       batch_size: int, seed: int) -> "tf.data.Dataset":
    """Serialized records (shuffled and repeated) -> batches (x float32 [B, H, W, C] in [0, 1], y int32 [B])."""
    import tensorflow as tf

    spec = {layout.image_key: tf.io.FixedLenFeature([], tf.string),
            layout.label_key: tf.io.FixedLenFeature([], tf.int64)}
    height, width, channels = input_shape

    def one(index: tf.Tensor, serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        example = tf.io.parse_single_example(serialized, spec)
        draws = tf.stack([tf.constant(seed, tf.int64), 2 * index])  # the crop's; the flip's is draws + [0, 1]
        image = crop_and_flip(example[layout.image_key], height, width, channels, draws)
        return image, example[layout.label_key] - layout.label_offset

    # Decoding is per image (JPEGs differ in size), so it runs before batching, in parallel and in order.
    dataset = records.enumerate().map(one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.batch(batch_size, drop_remainder=True).map(
        lambda x, y: _checked_labels(x, y, classes, layout.label_offset))


def crop_and_flip(jpeg: tf.Tensor, height: int, width: int, channels: int, seed: tf.Tensor) -> tf.Tensor:
    """One training image from JPEG bytes: a random window decoded, resized, randomly flipped, in [0, 1].
    `seed` [2] seeds the window; seed + [0, 1] the flip, so the two draws are independent."""
    import tensorflow as tf

    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.image.extract_jpeg_shape(jpeg), bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
        min_object_covered=MIN_OBJECT_COVERED, aspect_ratio_range=ASPECT_RANGE, area_range=AREA_RANGE,
        max_attempts=CROP_ATTEMPTS, use_image_if_no_bounding_boxes=True)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = tf.image.decode_and_crop_jpeg(jpeg, window, channels=channels)
    image = tf.image.resize(image, [height, width], method=tf.image.ResizeMethod.BILINEAR)
    image = tf.image.stateless_random_flip_left_right(image, seed=seed + tf.constant([0, 1], seed.dtype))
    image = tf.clip_by_value(image, 0.0, 255.0) / 255.0  # bilinear stays in range; the clip makes it exact
    return tf.ensure_shape(image, [height, width, channels])


def _checked_labels(x: tf.Tensor, y: tf.Tensor, classes: int, offset: int) -> tuple[tf.Tensor, tf.Tensor]:
    import tensorflow as tf

    low, high = tf.reduce_min(y), tf.reduce_max(y)
    message = tf.strings.format("data.path: a batch has labels from {} to {} after data.label_offset = {}; they "
                                "must lie in [0, model.classes = {})", (low, high, offset, classes))
    with tf.control_dependencies([tf.debugging.Assert(tf.logical_and(low >= 0, high < classes), [message])]):
        return tf.identity(x), tf.cast(y, tf.int32)


def encode_example(jpeg: bytes, label: int, height: int, width: int, layout: str = "tensorflow/models",
                   name: str = "image.JPEG") -> bytes:
    """A serialized record as tensorflow/models' build_imagenet_data.py writes one (every feature it
    writes, with the whole image as the box) or as TFDS's imagenet2012 does (`layout="TFDS"`). The
    tests and benchmarks/input_pipeline.py make their ImageNet-format files with it."""
    import tensorflow as tf

    def ints(*values: int) -> tf.train.Feature:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))

    def data(*values: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=list(values)))

    def floats(*values: float) -> tf.train.Feature:
        return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))

    if layout == "TFDS":
        feature = {"image": data(jpeg), "label": ints(label), "file_name": data(name.encode())}
    else:
        feature = {
            "image/height": ints(height), "image/width": ints(width), "image/colorspace": data(b"RGB"),
            "image/channels": ints(3), "image/class/label": ints(label), "image/class/synset": data(b"n01440764"),
            "image/class/text": data(b"tench, Tinca tinca"), "image/object/bbox/xmin": floats(0.0),
            "image/object/bbox/xmax": floats(1.0), "image/object/bbox/ymin": floats(0.0),
            "image/object/bbox/ymax": floats(1.0), "image/object/bbox/label": ints(label),
            "image/format": data(b"JPEG"), "image/filename": data(name.encode()), "image/encoded": data(jpeg)}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
