"""TFRecord input: exact round trips, per-rank sharding, seeded shuffling, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest

from launcher.data import convert
from launcher.data.tfrecord import read_dataset, write_records

tf = pytest.importorskip("tensorflow")


def numbered_images(count: int, shape=(4, 4, 3)) -> tuple[np.ndarray, np.ndarray]:
    """Image i is filled with the value i, so a read sample tells which one it was."""
    images = np.stack([np.full(shape, i, dtype=np.uint8) for i in range(count)])
    return images, np.arange(count, dtype=np.int64) % 5


def sample_ids(path, rank: int, size: int, count: int, seed: int = 0, shuffle_buffer: int = 1) -> list[int]:
    dataset = read_dataset(str(path), "images", [4, 4, 3], classes=5, batch_size=1, rank=rank, size=size,
                           seed=seed, shuffle_buffer=shuffle_buffer)
    return [int(round(float(x[0, 0, 0, 0]) * 255)) for x, _ in dataset.take(count)]


def test_images_round_trip_exactly(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, size=(6, 8, 8, 3), dtype=np.uint8)
    labels = np.array([0, 1, 2, 3, 4, 0])
    write_records(tmp_path, "images", images, labels)
    x, y = next(iter(read_dataset(str(tmp_path), "images", [8, 8, 3], classes=5, batch_size=6, rank=0, size=1,
                                  seed=0, shuffle_buffer=1)))
    assert x.dtype == tf.float32 and y.dtype == tf.int32 and x.shape == (6, 8, 8, 3)
    np.testing.assert_array_equal(x.numpy(), images / np.float32(255))
    np.testing.assert_array_equal(y.numpy(), labels)


def test_volumes_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(1)
    volumes = rng.normal(size=(2, 4, 6, 8, 2)).astype(np.float32)
    masks = rng.integers(0, 3, size=(2, 4, 6, 8), dtype=np.uint8)
    write_records(tmp_path, "volumes", volumes, masks, shards=2)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["data-00000-of-00002.tfrecord", "data-00001-of-00002.tfrecord"]
    x, y = next(iter(read_dataset(str(tmp_path / "*.tfrecord"), "volumes", [4, 6, 8, 2], classes=3, batch_size=2,
                                  rank=0, size=1, seed=0, shuffle_buffer=1)))
    assert y.shape == (2, 4, 6, 8) and y.dtype == tf.int32
    # Round-robin over 2 shards: sample 0 in file 0, sample 1 in file 1; read in file order.
    np.testing.assert_array_equal(x.numpy(), volumes)
    np.testing.assert_array_equal(y.numpy(), masks)


@pytest.mark.parametrize("shards", [4, 1], ids=["by-file", "by-record"])
def test_two_ranks_read_disjoint_halves_that_cover_everything(tmp_path, shards):
    write_records(tmp_path, "images", *numbered_images(8), shards=shards)
    rank0 = sample_ids(tmp_path, 0, 2, 4)
    rank1 = sample_ids(tmp_path, 1, 2, 4)
    assert set(rank0).isdisjoint(rank1)
    assert sorted(rank0 + rank1) == list(range(8))


def test_shuffling_is_seeded(tmp_path):
    write_records(tmp_path, "images", *numbered_images(32))
    first = sample_ids(tmp_path, 0, 1, 32, seed=7, shuffle_buffer=32)
    assert first == sample_ids(tmp_path, 0, 1, 32, seed=7, shuffle_buffer=32)
    assert first != sample_ids(tmp_path, 0, 1, 32, seed=8, shuffle_buffer=32)
    assert sorted(first) == list(range(32))  # a permutation: nothing lost or repeated in an epoch


def test_batches_are_full_and_repeat_forever(tmp_path):
    write_records(tmp_path, "images", *numbered_images(5))
    dataset = read_dataset(str(tmp_path), "images", [4, 4, 3], classes=5, batch_size=2, rank=0, size=1, seed=0)
    shapes = [tuple(x.shape) for x, _ in dataset.take(7)]  # 14 samples from 5: it repeats
    assert shapes == [(2, 4, 4, 3)] * 7


def test_no_files_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path: no TFRecord files at .*nothing-here"):
        read_dataset(str(tmp_path / "nothing-here"), "images", [4, 4, 3], 5, 1, 0, 1, 0)


def test_a_record_of_another_shape_stops_with_both_shapes(tmp_path):
    write_records(tmp_path, "images", *numbered_images(2, shape=(4, 4, 3)))
    dataset = read_dataset(str(tmp_path), "images", [4, 4, 1], 5, 1, 0, 1, 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"differs from model.input_shape \[4, 4, 1\]"):
        next(iter(dataset))


def test_a_label_beyond_the_classes_stops_training(tmp_path):
    images, _ = numbered_images(2)
    write_records(tmp_path, "images", images, np.array([1, 9]))
    dataset = read_dataset(str(tmp_path), "images", [4, 4, 3], classes=5, batch_size=2, rank=0, size=1, seed=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not below model.classes = 5"):
        next(iter(dataset))


@pytest.mark.parametrize("kind, inputs, labels, message", [
    ("images", np.zeros((2, 4, 4), np.uint8), np.zeros(2, np.int64), r"inputs must be \[N, H, W, C\]"),
    ("images", np.zeros((2, 4, 4, 3), np.float32), np.zeros(2, np.int64), "inputs must be uint8"),
    ("images", np.zeros((2, 4, 4, 3), np.uint8), np.zeros(3, np.int64), r"labels must be \[N\] = \[2\]"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.zeros((1, 2, 2, 3), np.uint8), "masks must be"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.full((1, 2, 2, 2), 300), "must be <= 255"),
])
def test_writer_rejects_bad_arrays_and_writes_nothing(tmp_path, kind, inputs, labels, message):
    with pytest.raises(ValueError, match=message):
        write_records(tmp_path / "out", kind, inputs, labels)
    assert not (tmp_path / "out").exists()


def test_converter_writes_learnable_synthetic_volumes(tmp_path, capsys):
    status = convert.main(["--kind", "volumes", "--out", str(tmp_path), "--synthetic", "3", "--shape", "8,8,8,2",
                           "--classes", "3", "--shards", "3"])
    assert status == 0
    assert len(list(tmp_path.glob("data-*-of-00003.tfrecord"))) == 3
    assert "wrote 3 volumes ([8, 8, 8, 2]) to 3 file(s)" in capsys.readouterr().out
    x, y = next(iter(read_dataset(str(tmp_path), "volumes", [8, 8, 8, 2], 3, 3, 0, 1, 0)))
    assert sorted(np.unique(y.numpy())) == [0, 1, 2]  # every label occurs


def test_converter_reads_npz(tmp_path):
    images, labels = numbered_images(4)
    np.savez(tmp_path / "d.npz", images=images, labels=labels)
    assert convert.main(["--kind", "images", "--out", str(tmp_path / "out"), "--from-npz", str(tmp_path / "d.npz")]) == 0
    assert sorted(sample_ids(tmp_path / "out", 0, 1, 4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("args, message", [
    (["--kind", "images", "--from-npz", "{tmp}/d.npz"], "has no array(s) labels (it has: images, masks)"),
    (["--kind", "volumes", "--from-npz", "{tmp}/missing.npz"], "missing.npz does not exist"),
    (["--kind", "images", "--synthetic", "4"], "--synthetic needs --shape"),
    (["--kind", "images", "--synthetic", "4", "--shape", "8,8"], "images take 3 positive sizes"),
    (["--kind", "images", "--synthetic", "2", "--shape", "8,8,3", "--shards", "4"], "cannot fill 4 shards"),
    (["--kind", "pictures", "--synthetic", "4"], "invalid choice: 'pictures'"),
])
def test_converter_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, message):
    np.savez(tmp_path / "d.npz", images=np.zeros((2, 4, 4, 3), np.uint8), masks=np.zeros(2))
    out = tmp_path / "out"
    assert convert.main([a.replace("{tmp}", str(tmp_path)) for a in args] + ["--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_converter_does_not_overwrite_existing_files(tmp_path, capsys):
    args = ["--kind", "images", "--out", str(tmp_path), "--synthetic", "2", "--shape", "4,4,3"]
    assert convert.main(args) == 0
    before = (tmp_path / "data-00000-of-00001.tfrecord").read_bytes()
    assert convert.main(args + ["--seed", "5"]) == 2
    assert "already has data-00000-of-00001.tfrecord" in capsys.readouterr().err
    assert (tmp_path / "data-00000-of-00001.tfrecord").read_bytes() == before
