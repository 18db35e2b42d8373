"""TFRecord input: exact round trips, per-rank sharding, seeded shuffling, atomic writes, clear errors."""
from __future__ import annotations

import numpy as np
import pytest

from launcher.rank.data import convert, tfrecord
from launcher.rank.data.tfrecord import read_dataset, write_records

tf = pytest.importorskip("tensorflow")

IMAGE = [4, 4, 3]


def numbered_images(count: int, shape=IMAGE) -> tuple[np.ndarray, np.ndarray]:
    """Image i is filled with the value i, so a read sample tells which one it was."""
    images = np.stack([np.full(shape, i, dtype=np.uint8) for i in range(count)])
    return images, np.arange(count, dtype=np.int64) % 5


def read_images(path, rank: int = 0, size: int = 1, seed: int = 0, shuffle_buffer: int = 1, batch_size: int = 1,
                shape=IMAGE, classes: int = 5) -> tf.data.Dataset:
    return read_dataset(str(path), "images", list(shape), classes=classes, batch_size=batch_size, rank=rank,
                        size=size, seed=seed, shuffle_buffer=shuffle_buffer, prefetch=1)


def sample_ids(path, count: int, **read) -> list[int]:
    """The numbers of the first `count` samples a reader yields (see `numbered_images`)."""
    dataset = read_images(path, **read).unbatch().take(count)
    return [int(round(float(x[0, 0, 0]) * 255)) for x, _ in dataset]


# ----------------------------------------------------------------------------------------------------
# Round trips


def test_images_round_trip_exactly(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, size=(6, 8, 8, 3), dtype=np.uint8)
    labels = np.array([0, 1, 2, 3, 4, 0])
    write_records(tmp_path, "images", images, labels)
    x, y = next(iter(read_images(tmp_path, batch_size=6, shape=[8, 8, 3])))
    assert (x.dtype, y.dtype, x.shape, y.shape) == (tf.float32, tf.int32, (6, 8, 8, 3), (6,))
    np.testing.assert_array_equal(x.numpy(), images / np.float32(255))  # one file, no shuffle: written order
    np.testing.assert_array_equal(y.numpy(), labels)


def read_volumes(path, shape=(2, 2, 2, 1), labels: int = 1, batch_size: int = 1) -> tf.data.Dataset:
    return read_dataset(str(path), "volumes", list(shape), classes=labels, batch_size=batch_size, rank=0, size=1,
                        seed=0, shuffle_buffer=1, prefetch=0)


def test_volumes_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(1)
    volumes = rng.normal(size=(3, 4, 6, 8, 2)).astype(np.float32)
    masks = rng.integers(0, 2, size=(3, 4, 6, 8, 3), dtype=np.uint8)  # 3 binary label maps per voxel
    paths = write_records(tmp_path, "volumes", volumes, masks, shards=2)
    assert [p.name for p in paths] == ["data-00000-of-00002.tfrecord", "data-00001-of-00002.tfrecord"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]  # no temporary files left
    x, y = next(iter(read_volumes(tmp_path / "*.tfrecord", [4, 6, 8, 2], labels=3, batch_size=3)))
    assert (x.dtype, y.dtype, x.shape, y.shape) == (tf.float32, tf.float32, (3, 4, 6, 8, 2), (3, 4, 6, 8, 3))
    order = [int(np.flatnonzero(volumes[:, 0, 0, 0, 0] == value)[0]) for value in x.numpy()[:, 0, 0, 0, 0]]
    assert sorted(order) == [0, 1, 2]  # files are shuffled; match samples by content
    np.testing.assert_array_equal(x.numpy(), volumes[order])
    np.testing.assert_array_equal(y.numpy(), masks[order])


def test_samples_are_dealt_round_robin_over_the_shards(tmp_path):
    write_records(tmp_path, "images", *numbered_images(5), shards=2)
    assert sample_ids(tmp_path / "data-00000-of-00002.tfrecord", 3) == [0, 2, 4]
    assert sample_ids(tmp_path / "data-00001-of-00002.tfrecord", 2) == [1, 3]
    assert tfrecord.records_per_shard(5, 2) == [3, 2]


# ----------------------------------------------------------------------------------------------------
# Sharding, shuffling, batching


@pytest.mark.parametrize("shards", [4, 2, 1], ids=["by-file", "one-file-each", "by-record"])
def test_two_ranks_read_disjoint_halves_that_cover_everything(tmp_path, shards):
    write_records(tmp_path, "images", *numbered_images(8), shards=shards)
    rank0 = sample_ids(tmp_path, 4, rank=0, size=2)
    rank1 = sample_ids(tmp_path, 4, rank=1, size=2)
    assert set(rank0).isdisjoint(rank1)
    assert sorted(rank0 + rank1) == list(range(8))


def test_shards_by_file_only_when_every_rank_gets_a_file():
    assert [tfrecord.shards_by_file(files, size=4) for files in (3, 4, 9)] == [False, True, True]


def test_shuffling_is_seeded_and_differs_every_epoch(tmp_path):
    write_records(tmp_path, "images", *numbered_images(32))
    two_epochs = sample_ids(tmp_path, 64, seed=7, shuffle_buffer=32)
    first, second = two_epochs[:32], two_epochs[32:]
    assert sorted(first) == sorted(second) == list(range(32))  # each epoch a permutation: nothing lost
    assert first != second and first != list(range(32))
    assert two_epochs == sample_ids(tmp_path, 64, seed=7, shuffle_buffer=32)
    assert first != sample_ids(tmp_path, 32, seed=8, shuffle_buffer=32)


def test_the_shuffle_seed_is_offset_by_the_rank(tmp_path):
    # One file per rank holding the same samples: only the seed can make their orders differ.
    images, labels = numbered_images(16)
    write_records(tmp_path / "a", "images", images, labels)
    write_records(tmp_path / "b", "images", images, labels)
    pattern = tmp_path / "*" / "*.tfrecord"
    rank1_seed3 = sample_ids(pattern, 16, rank=1, size=2, seed=3, shuffle_buffer=16)
    assert rank1_seed3 == sample_ids(pattern, 16, rank=0, size=2, seed=4, shuffle_buffer=16)
    assert rank1_seed3 != sample_ids(pattern, 16, rank=0, size=2, seed=3, shuffle_buffer=16)


def test_batches_are_full_and_repeat_forever(tmp_path):
    write_records(tmp_path, "images", *numbered_images(5))
    batches = list(read_images(tmp_path, batch_size=2).take(7))  # 14 samples from 5: it repeats
    assert [tuple(x.shape) for x, _ in batches] == [(2, 4, 4, 3)] * 7
    assert [tuple(y.shape) for _, y in batches] == [(2,)] * 7


def test_batch_shape_is_static_for_the_traced_step(tmp_path):
    write_records(tmp_path, "images", *numbered_images(5))
    x_spec, y_spec = read_images(tmp_path, batch_size=2).element_spec
    assert (x_spec.shape.as_list(), y_spec.shape.as_list()) == ([2, 4, 4, 3], [2])


# ----------------------------------------------------------------------------------------------------
# Reader errors


def test_no_files_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path: no TFRecord files at .*nothing-here"):
        read_images(tmp_path / "nothing-here")
    with pytest.raises(FileNotFoundError, match=r"no TFRecord files at .*\*\.tfrecord"):
        read_images(tmp_path / "*.tfrecord")


def test_records_of_another_shape_fail_at_once_naming_both_shapes(tmp_path):
    write_records(tmp_path, "images", *numbered_images(2))
    with pytest.raises(ValueError, match=r"have shape \[4, 4, 3\]; model.input_shape is \[4, 4, 1\]"):
        read_images(tmp_path, shape=[4, 4, 1])


def test_a_later_record_of_another_shape_stops_training_naming_both_shapes(tmp_path):
    write_records(tmp_path, "images", *numbered_images(2), prefix="a")
    write_records(tmp_path, "images", *numbered_images(2, shape=(4, 4, 1)), prefix="b")
    dataset = read_images(tmp_path, shape=[4, 4, 3], batch_size=4)  # 4 of 4 samples: one is from b
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"a record has shape \[4 4 1\] but model.input_shape is \[4 4 3\]"):
        next(iter(dataset))


def test_files_of_the_other_kind_are_named(tmp_path):
    write_records(tmp_path, "volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.zeros((1, 2, 2, 2, 3), np.uint8))
    with pytest.raises(ValueError, match="lack feature.* image, label .* they look like volumes"):
        read_images(tmp_path, shape=[2, 2, 2])


def test_a_rank_without_records_fails_at_once(tmp_path):
    write_records(tmp_path, "images", *numbered_images(1))
    with pytest.raises(ValueError, match="rank 1 of 2 gets no records"):
        read_images(tmp_path, rank=1, size=2)


@pytest.mark.parametrize("label", [9, -1])
def test_a_label_outside_the_classes_stops_training(tmp_path, label):
    # Written by hand: write_records itself refuses negative labels.
    with tf.io.TFRecordWriter(str(tmp_path / "foreign.tfrecord")) as writer:
        for image, good in zip(*numbered_images(2)):
            writer.write(tfrecord._encode("images", image, good))
        writer.write(tfrecord._encode("images", numbered_images(1)[0][0], label))
    dataset = read_images(tmp_path, batch_size=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"\[0, model.classes = 5\).* to {max(label, 1)}"):
        next(iter(dataset))


def write_masks_by_hand(path, masks: list[np.ndarray]) -> None:
    """Volumes of shape [2, 2, 2, 1] with these masks, bypassing write_records's own checks."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for mask in masks:
            writer.write(tfrecord._encode("volumes", np.zeros((2, 2, 2, 1), np.float32), mask))


@pytest.mark.parametrize("maps, message", [
    (2, r"masks in .* hold 2 label map\(s\) per volume of 8 voxels; model.labels is 3"),
    (1, r"hold 1 label map\(s\) .* model.labels is 3"),  # one label number per voxel, the old layout
])
def test_masks_with_another_number_of_label_maps_fail_at_once(tmp_path, maps, message):
    write_masks_by_hand(tmp_path / "a.tfrecord", [np.zeros((2, 2, 2, maps), np.uint8)])
    with pytest.raises(ValueError, match=message):
        read_volumes(tmp_path, labels=3)


def test_masks_with_label_numbers_instead_of_binary_maps_fail_at_once(tmp_path):
    write_masks_by_hand(tmp_path / "a.tfrecord", [np.full((2, 2, 2, 1), 4, np.uint8)])
    with pytest.raises(ValueError, match=r"hold the value 4; each of the model.labels = 1 maps must be 0 or 1"):
        read_volumes(tmp_path, labels=1)


def test_a_later_mask_with_other_maps_or_values_stops_training(tmp_path):
    good = np.zeros((2, 2, 2, 1), np.uint8)
    write_masks_by_hand(tmp_path / "size.tfrecord", [good, np.zeros((2, 2, 2, 2), np.uint8)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"a record has a mask of 16 bytes; model.labels = 1 maps "
                                                             r"of 8 voxels need 8"):
        next(iter(read_volumes(tmp_path / "size.tfrecord", batch_size=2)))
    write_masks_by_hand(tmp_path / "value.tfrecord", [good, np.full((2, 2, 2, 1), 2, np.uint8)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"masks must hold 0 or 1 .* a batch holds 2"):
        next(iter(read_volumes(tmp_path / "value.tfrecord", batch_size=2)))


# ----------------------------------------------------------------------------------------------------
# Writer


@pytest.mark.parametrize("kind, inputs, labels, message", [
    ("images", np.zeros((2, 4, 4), np.uint8), np.zeros(2, np.int64), r"\[N, H, W, C\].*add a channel axis"),
    ("images", np.zeros((2, 4, 4, 3), np.float32), np.zeros(2, np.int64), r"inputs must be uint8; got float32 \(from"),
    ("images", np.zeros((2, 4, 4, 3), np.uint8), np.zeros(3, np.int64), r"labels must be \[N\] = \[2\]; got \[3\]"),
    ("images", np.zeros((2, 4, 4, 3), np.uint8), np.zeros(2, np.float32), "labels must be integers"),
    ("images", np.zeros((2, 4, 4, 3), np.uint8), np.array([0, -3]), "labels must be >= 0; got -3"),
    ("volumes", np.zeros((1, 2, 2, 2, 1)), np.zeros((1, 2, 2, 2), np.uint8), "must be float32; got float64"),
    ("volumes", np.full((1, 2, 2, 2, 1), np.nan, np.float32), np.zeros((1, 2, 2, 2), np.uint8), "NaN"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.zeros((1, 2, 2, 3, 3), np.uint8), r"masks must be \[N, D"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.zeros((1, 2, 2, 2), np.uint8),
     r"= \[1, 2, 2, 2, L\] .* got \[1, 2, 2, 2\]: one binary map per label .* masks\[\.\.\., None\].* brats_regions"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.full((1, 2, 2, 2, 3), 2), r"only 0 and 1 .* found 2\b"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.full((1, 2, 2, 2, 3), 0.5), r"only 0 and 1 .* found 0\.5"),
    ("volumes", np.zeros((1, 2, 2, 2, 1), np.float32), np.zeros((1, 2, 2, 2, 3), "U1"), "must be 0/1 numbers"),
    ("pictures", np.zeros((1, 2, 2, 1), np.uint8), np.zeros(1, np.int64), "kind must be one of images, volumes"),
])
def test_writer_rejects_bad_arrays_and_writes_nothing(tmp_path, kind, inputs, labels, message):
    with pytest.raises(ValueError, match=message):
        write_records(tmp_path / "out", kind, inputs, labels)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.int64, np.float32])
def test_masks_of_booleans_integers_or_floats_are_maps_of_0_and_1(tmp_path, dtype):
    masks = np.random.default_rng(0).integers(0, 2, size=(1, 2, 2, 2, 3)).astype(dtype)
    write_records(tmp_path, "volumes", np.zeros((1, 2, 2, 2, 1), np.float32), masks)
    _, y = next(iter(read_volumes(tmp_path, labels=3)))
    np.testing.assert_array_equal(y.numpy(), masks.astype(np.float32))


def test_brats_label_maps_become_the_three_nested_regions():
    # Labels 0 background, 1 core, 2 oedema, 4 enhancing: whole tumour is 1, 2, 4; core 1, 4; enhancing 4.
    seg = np.array([[[[0, 1], [2, 4]]]])
    regions = tfrecord.brats_regions(seg)
    assert regions.shape == (1, 1, 2, 2, 3) and regions.dtype == np.uint8
    assert regions[0, 0].tolist() == [[[0, 0, 0], [1, 1, 0]], [[1, 0, 0], [1, 1, 1]]]
    with pytest.raises(ValueError, match=r"0, 1, 2 and 4 only; found \[3\]"):
        tfrecord.brats_regions(np.array([0, 3, 4]))


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    encode, written = tfrecord._encode, []

    def fail_on_the_third(*args):
        written.append(1)
        if len(written) == 3:
            raise OSError("disk full")
        return encode(*args)

    monkeypatch.setattr(tfrecord, "_encode", fail_on_the_third)
    with pytest.raises(OSError, match="disk full"):
        write_records(tmp_path / "new", "images", *numbered_images(4), shards=2)
    assert not (tmp_path / "new").exists()  # the directory it made is gone too
    written.clear()
    with pytest.raises(OSError):
        write_records(tmp_path, "images", *numbered_images(4), shards=2)
    assert list(tmp_path.iterdir()) == []  # the directory that was there stays, empty


def test_writer_refuses_to_mix_with_shards_of_the_same_prefix(tmp_path):
    write_records(tmp_path, "images", *numbered_images(4), shards=2)
    with pytest.raises(FileExistsError, match="already holds data-00000-of-00002.tfrecord"):
        write_records(tmp_path, "images", *numbered_images(4), shards=4)
    assert len(list(tmp_path.iterdir())) == 2


# ----------------------------------------------------------------------------------------------------
# The converter, `lms-launch tfrecord`


def test_converter_writes_learnable_synthetic_volumes(tmp_path, capsys):
    status = convert.main(["--kind", "volumes", "--out", str(tmp_path), "--synthetic", "3", "--shape", "8,8,8,2",
                           "--shards", "3"])  # 3 label maps by default
    assert status == 0
    paths = sorted(tmp_path.glob("data-*-of-00003.tfrecord"))
    assert len(paths) == 3
    out = capsys.readouterr().out
    assert "wrote 3 volumes ([8, 8, 8, 2]) to 3 file(s)" in out
    assert f"{paths[0]}  1 records  {paths[0].stat().st_size:,} bytes" in out
    _, y = next(iter(read_volumes(tmp_path, [8, 8, 8, 2], labels=3, batch_size=3)))
    shares = y.numpy().reshape(-1, 3).mean(axis=0)
    np.testing.assert_allclose(shares, [1 / 2, 1 / 4, 1 / 8], atol=0.01)  # a half, a quarter, an eighth


def test_synthetic_masks_are_nested_thresholds_of_each_voxels_neighbourhood():
    volumes, masks = convert.synthetic("volumes", 2, [6, 6, 6, 1], classes=3, seed=0)
    assert masks.shape == (2, 6, 6, 6, 3) and set(np.unique(masks)) == {0, 1}
    means = convert.box_blur_3d(volumes[..., 0])
    assert means[1, 2, 3, 4] == pytest.approx(volumes[1, 1:4, 2:5, 3:6, 0].mean(), rel=1e-5)
    for k in range(3):  # one threshold separates each map's voxels from the rest
        assert means[masks[..., k] == 1].min() > means[masks[..., k] == 0].max()
    assert (masks[..., 1] <= masks[..., 0]).all() and (masks[..., 2] <= masks[..., 1]).all()  # nested


def test_synthetic_image_labels_are_brightness_bins():
    images, labels = convert.synthetic("images", 200, [8, 8, 3], classes=4, seed=0)
    brightness = images.reshape(200, -1).mean(axis=1)
    per_label = [brightness[labels == label].mean() for label in range(4)]
    assert per_label == sorted(per_label) and np.bincount(labels).min() > 30


def test_converter_reads_npz(tmp_path, capsys):
    images, labels = numbered_images(4)
    np.savez(tmp_path / "d.npz", images=images, labels=labels)
    args = ["--kind", "images", "--out", str(tmp_path / "out"), "--from-npz", str(tmp_path / "d.npz"), "--shards", "2"]
    assert convert.main(args) == 0
    assert "  2 records  " in capsys.readouterr().out
    assert sorted(sample_ids(tmp_path / "out", 4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("args, message", [
    (["--kind", "images", "--from-npz", "{tmp}/d.npz"], "has no array(s) labels (it has: images, masks)"),
    (["--kind", "volumes", "--from-npz", "{tmp}/d.npz"], "has no array(s) volumes (it has: images, masks)"),
    (["--kind", "volumes", "--from-npz", "{tmp}/missing.npz"], "missing.npz does not exist"),
    (["--kind", "images", "--from-npz", "{tmp}/one.npy"], "holds a single array"),
    (["--kind", "images", "--from-npz", "{tmp}/float.npz"], "inputs must be uint8; got float64"),
    (["--kind", "images", "--from-npz", "{tmp}/d.npz", "--shape", "4,4,3"], "--shape only apply with --synthetic"),
    (["--kind", "images", "--synthetic", "4"], "--synthetic needs --shape"),
    (["--kind", "images", "--synthetic", "4", "--shape", "8,8"], "images take 3 positive sizes [H, W, C]"),
    (["--kind", "volumes", "--synthetic", "4", "--shape", "8,8,8,1", "--classes", "3"],
     "--classes does not apply to volumes; images take --classes, volumes take --labels"),
    (["--kind", "images", "--synthetic", "4", "--shape", "8,8,3", "--labels", "3"], "--labels does not apply to images"),
    (["--kind", "volumes", "--synthetic", "4", "--shape", "8,8,8,1", "--labels", "0"], "--labels must be >= 1"),
    (["--kind", "images", "--synthetic", "4", "--shape", "8,8,3", "--classes", "1"], "--classes must be >= 2"),
    (["--kind", "volumes", "--from-npz", "{tmp}/seg.npz"], "brats_regions"),
    (["--kind", "images", "--synthetic", "2", "--shape", "8,8,3", "--shards", "4"], "cannot fill 4 shards"),
    (["--kind", "pictures", "--synthetic", "4"], "invalid choice: 'pictures'"),
])
def test_converter_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, message):
    np.savez(tmp_path / "d.npz", images=np.zeros((2, 4, 4, 3), np.uint8), masks=np.zeros(2))
    np.savez(tmp_path / "float.npz", images=np.zeros((2, 4, 4, 3)), labels=np.zeros(2, np.int64))
    np.savez(tmp_path / "seg.npz", volumes=np.zeros((2, 4, 4, 4, 4), np.float32),
             masks=np.zeros((2, 4, 4, 4), np.uint8))  # one label number per voxel, not binary maps
    np.save(tmp_path / "one.npy", np.zeros(2))
    out = tmp_path / "out"
    assert convert.main([a.replace("{tmp}", str(tmp_path)) for a in args] + ["--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_converter_out_that_cannot_be_a_directory_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        args = ["--kind", "images", "--out", str(out), "--synthetic", "2", "--shape", "4,4,3"]
        assert convert.main(args) == 2
        assert f"--out {out}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_converter_does_not_mix_with_existing_files(tmp_path, capsys):
    args = ["--kind", "images", "--out", str(tmp_path), "--synthetic", "2", "--shape", "4,4,3"]
    assert convert.main(args) == 0
    before = (tmp_path / "data-00000-of-00001.tfrecord").read_bytes()
    assert convert.main(args + ["--shards", "2"]) == 2  # another shard count would still mix in
    assert "already has data-00000-of-00001.tfrecord" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["data-00000-of-00001.tfrecord"]
    assert (tmp_path / "data-00000-of-00001.tfrecord").read_bytes() == before
    assert convert.main(args + ["--prefix", "more"]) == 0


def test_converter_help_exits_0(capsys):
    assert convert.main(["--help"]) == 0
    assert "--from-npz" in capsys.readouterr().out
