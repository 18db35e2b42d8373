"""ImageNet TFRecords as tensorflow/models and TFDS write them: JPEG bytes (TensorFlow's own encoder)
and a label, read without conversion, with the training crop and flip, seeded, and trained on.

The images are gradients: red grows with the column and green with the row, so each decoded sample
tells which part of the image it shows and whether it was flipped, with no reference implementation
of the crop to compare against.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from launcher.rank.data import imagenet
from launcher.rank.data.tfrecord import read_dataset, write_records
from launcher.recipe import RecipeError, load_recipe
from tests.fixtures import RECIPES, lms_launch_argv

tf = pytest.importorskip("tensorflow")

HEIGHT, WIDTH = 48, 64


def gradient_image(blue: int) -> np.ndarray:
    """Red = column / (W-1), green = row / (H-1), blue a constant that tells images apart."""
    red = np.broadcast_to(np.linspace(0, 255, WIDTH), (HEIGHT, WIDTH))
    green = np.broadcast_to(np.linspace(0, 255, HEIGHT)[:, None], (HEIGHT, WIDTH))
    return np.stack([red, green, np.full((HEIGHT, WIDTH), blue)], axis=-1).round().astype(np.uint8)


def write_imagenet(folder: Path, labels: list[int], layout: str = "tensorflow/models", shards: int = 2,
                   name: str = "train") -> Path:
    """Shards named as tensorflow/models names them (train-00000-of-00002), image i's blue = 8 * i."""
    folder.mkdir(parents=True, exist_ok=True)
    writers = [tf.io.TFRecordWriter(str(folder / f"{name}-{s:05d}-of-{shards:05d}")) for s in range(shards)]
    for index, label in enumerate(labels):
        jpeg = tf.io.encode_jpeg(gradient_image(8 * index), quality=95).numpy()
        writers[index % shards].write(imagenet.encode_example(jpeg, label, HEIGHT, WIDTH, layout, f"{index}.JPEG"))
    for writer in writers:
        writer.close()
    return folder


def read(path, classes: int = 10, size: int = 16, batch_size: int = 8, seed: int = 0, rank: int = 0,
         ranks: int = 1, **keys) -> tf.data.Dataset:
    return read_dataset(str(path), "images", [size, size, 3], classes=classes, batch_size=batch_size, rank=rank,
                        size=ranks, seed=seed, shuffle_buffer=64, prefetch=1, **keys)


def test_both_writers_layouts_are_read_without_conversion(tmp_path):
    labels = list(range(1, 9))  # build_imagenet_data.py counts from 1
    models = write_imagenet(tmp_path / "models", labels)
    tfds = write_imagenet(tmp_path / "tfds", [label - 1 for label in labels], layout="TFDS")
    for path, offset in ((models / "train-*", 1), (tfds / "train-*", 0)):
        x, y = next(iter(read(path, batch_size=8, label_offset=offset)))
        assert (x.dtype, y.dtype, x.shape, y.shape) == (tf.float32, tf.int32, (8, 16, 16, 3), (8,))
        assert 0.0 <= float(tf.reduce_min(x)) and float(tf.reduce_max(x)) <= 1.0
        # Each sample's label is its image's: blue = 8 * index and label = index (after the offset).
        blue = np.round(x.numpy()[..., 2].mean(axis=(1, 2)) * 255 / 8).astype(int)
        np.testing.assert_array_equal(y.numpy(), blue)
        assert sorted(y.numpy().tolist()) == list(range(8))  # one epoch of 8 in one batch: each image once


def test_crops_cover_8_to_100_percent_and_half_the_images_are_flipped(tmp_path):
    path = write_imagenet(tmp_path, list(range(8)), shards=1) / "train-*"
    samples = np.concatenate([x.numpy() for x, _ in read(path, size=32).take(16)])  # 128 crops
    columns, rows = np.arange(32), np.arange(32)
    red_trend = [np.polyfit(columns, sample[..., 0].mean(axis=0), 1)[0] for sample in samples]
    green_trend = [np.polyfit(rows, sample[..., 1].mean(axis=1), 1)[0] for sample in samples]
    assert all(trend > 0 for trend in green_trend)  # never flipped upside down
    flipped = sum(trend < 0 for trend in red_trend)
    assert 32 <= flipped <= 96, flipped  # p = 1/2 over 128 draws
    # The share of the image a crop shows, from the spans of red (columns) and green (rows) it holds: a
    # crop w pixels wide resized to 32 samples source pixels 0.5 w/32 - 0.5 to w - 0.5 w/32 - 0.5 (half-
    # pixel centres), a span of w 31/32 pixels, of red (w 31/32) / (W - 1).
    width_share = np.ptp(samples[..., 0].mean(axis=1), axis=1) * (WIDTH - 1) / WIDTH * 32 / 31
    height_share = np.ptp(samples[..., 1].mean(axis=2), axis=1) * (HEIGHT - 1) / HEIGHT * 32 / 31
    area = width_share * height_share
    assert area.min() > imagenet.AREA_RANGE[0] * 0.8 and area.max() < 1.05
    assert (area < 0.5).sum() > 20 and (area > 0.8).sum() > 5  # drawn across the range, not fixed
    aspect = width_share * WIDTH / (height_share * HEIGHT)
    assert aspect.min() > 0.75 * 0.9 and aspect.max() < 4 / 3 * 1.1


def test_the_seed_decides_the_batches_however_many_threads_decode(tmp_path):
    path = write_imagenet(tmp_path, list(range(8))) / "train-*"
    first = [x.numpy() for x, _ in read(path, seed=3).take(3)]
    again = [x.numpy() for x, _ in read(path, seed=3).take(3)]
    other = [x.numpy() for x, _ in read(path, seed=4).take(3)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], other[0])


def test_two_ranks_read_disjoint_images(tmp_path):
    path = write_imagenet(tmp_path, list(range(8)), shards=2) / "train-*"
    seen = [sorted(y.numpy().tolist()) for rank in (0, 1) for _, y in read(path, batch_size=4, rank=rank,
                                                                              ranks=2).take(1)]
    assert seen[0] + seen[1] != [] and sorted(seen[0] + seen[1]) == list(range(8))


def test_keys_named_in_the_recipe(tmp_path):
    folder = tmp_path / "custom"
    folder.mkdir()
    with tf.io.TFRecordWriter(str(folder / "a.tfrecord")) as writer:
        jpeg = tf.io.encode_jpeg(gradient_image(16), quality=95).numpy()
        features = {"jpeg": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
                    "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[7]))}
        writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
    _, y = next(iter(read(folder, batch_size=1, image_key="jpeg", label_key="class")))
    assert y.numpy().tolist() == [7]
    with pytest.raises(ValueError, match=r"have a data.label_key to be given too \(data.label_key\); they have: "
                                         r"class, jpeg"):
        read(folder, image_key="jpeg")


def test_mistakes_are_named_before_training(tmp_path):
    models = write_imagenet(tmp_path / "models", [1000, 1, 2, 3], shards=1)
    with pytest.raises(ValueError, match=r"has image/class/label 1000, which is outside \[data.label_offset, "
                                         r"data.label_offset \+ model.classes\) = \[0, 1000\) \(tensorflow/models' "
                                         r"build_imagenet_data.py counts from 1: set data.label_offset: 1\)"):
        read(models / "train-*", classes=1000)
    with pytest.raises(FileNotFoundError, match=r"holds no \*.tfrecord files but shards such as train-00000-of-00001:"
                                                r" give a glob of those to train on, e.g. .*/models/train-\*"):
        read(models)
    png = tmp_path / "png"
    png.mkdir()
    with tf.io.TFRecordWriter(str(png / "a.tfrecord")) as writer:
        writer.write(imagenet.encode_example(tf.io.encode_png(gradient_image(0)).numpy(), 1, HEIGHT, WIDTH))
    with pytest.raises(ValueError, match=r"\('image/encoded'\) are PNG; this reader decodes JPEG"):
        read(png)
    raw = tmp_path / "raw"
    write_records(raw, "images", np.zeros((2, 16, 16, 3), np.uint8), np.array([0, 1]))
    with pytest.raises(ValueError, match="data.label_offset: 1 applies to ImageNet JPEG records"):
        read(raw, label_offset=1)


def test_a_later_label_out_of_range_stops_training_with_the_offset_named(tmp_path):
    path = write_imagenet(tmp_path, [1, 2, 3, 0], shards=1) / "train-*"  # the last one counts from 0
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"labels from -1 to 2 after data.label_offset = 1"):
        for _ in read(path, batch_size=4, label_offset=1).take(1):
            pass


def test_jpeg_keys_belong_to_image_records():
    with pytest.raises(RecipeError, match="data.label_offset: applies to JPEG image records"):
        load_recipe(RECIPES / "unet3d-cpu.yaml", ["data.source=tfrecord", "data.path=x", "data.label_offset=1"])
    with pytest.raises(RecipeError, match="data.image_key: applies to JPEG image records .* data.source synthetic"):
        load_recipe(RECIPES / "resnet50-cpu.yaml", ["data.image_key=image/encoded"])


@pytest.mark.e2e
def test_resnet50_trains_3_steps_from_imagenet_format_records(tmp_path):
    path = write_imagenet(tmp_path / "imagenet", [1 + i % 10 for i in range(16)], shards=2)
    run_dir = tmp_path / "run"
    done = subprocess.run(lms_launch_argv(
        str(RECIPES / "resnet50-cpu.yaml"), "--np", "1", "--run-dir", str(run_dir), "--no-progress",
        "--set", "model.input_shape=[32,32,3]", "--set", "lms.enabled=false", "--set", "train.batch_size=4",
        "--set", "train.steps=3", "--set", "logging.interval=1", "--set", "logging.skip_steps=1",
        "--set", "logging.tensorboard=false", "--set", "data.source=tfrecord", "--set", f"data.path={path}/train-*",
        "--set", "data.label_offset=1"), capture_output=True, text=True, timeout=600)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [r["step"] for r in records] == [2, 3]
    assert all(np.isfinite(r["loss"]) for r in records)
