"""TFRecord sentence pairs for the Seq2Seq task (launcher/rank/data/sequences.py): stored without
padding, read back as the model's teacher-forced input, and every mistake named."""
from __future__ import annotations

import numpy as np
import pytest

from launcher.rank.data import convert
from launcher.rank.data.tfrecord import read_dataset, write_records

tf = pytest.importorskip("tensorflow")

# Two sentence pairs by hand, padded with 0 to S = 4 and T = 3 (ids 0 and 1 are reserved).
SOURCES = np.array([[5, 6, 7, 0],
                    [9, 0, 0, 0]])
TARGETS = np.array([[7, 6, 5],
                    [9, 0, 0]])


def read_sentences(path, shape=(4, 3), vocabulary: int = 10, batch_size: int = 2, rank: int = 0, size: int = 1):
    return read_dataset(str(path), "sequences", list(shape), classes=vocabulary, batch_size=batch_size, rank=rank,
                        size=size, seed=0, shuffle_buffer=1, prefetch=0)


def test_a_sentence_pair_reads_back_as_the_source_then_the_teacher_forced_target(tmp_path):
    write_records(tmp_path, "sequences", SOURCES, TARGETS)
    x, y = next(iter(read_sentences(tmp_path)))
    assert (x.dtype, y.dtype) == (tf.int32, tf.int32)
    # The source padded to S = 4, then the decoder's input: the start token (1), then the target
    # without its last position.
    np.testing.assert_array_equal(x.numpy(), [[5, 6, 7, 0, 1, 7, 6],
                                              [9, 0, 0, 0, 1, 9, 0]])
    np.testing.assert_array_equal(y.numpy(), TARGETS)


def test_records_hold_the_words_without_padding_so_a_longer_recipe_reads_them_too(tmp_path):
    [path] = write_records(tmp_path, "sequences", SOURCES, TARGETS)
    first = tf.train.Example.FromString(next(iter(tf.data.TFRecordDataset(str(path)))).numpy())
    assert list(first.features.feature["source"].int64_list.value) == [5, 6, 7]
    assert list(first.features.feature["target"].int64_list.value) == [7, 6, 5]
    x, y = next(iter(read_sentences(tmp_path, shape=(6, 5))))
    np.testing.assert_array_equal(x.numpy()[1], [9, 0, 0, 0, 0, 0, 1, 9, 0, 0, 0])
    np.testing.assert_array_equal(y.numpy()[1], [9, 0, 0, 0, 0])


@pytest.mark.parametrize("sources, targets, message", [
    (SOURCES, TARGETS[:1], "the same number of sentences; got 2 and 1"),
    (SOURCES[0], TARGETS, "sources must be [N, length] token ids padded with 0"),
    (SOURCES.astype(np.float32), TARGETS, "sources must be integer token ids; got float32"),
    (np.array([[5, 1, 7, 0], [9, 0, 0, 0]]), TARGETS, "sources[0, 1] is 1; word ids start at 2"),
    (SOURCES, np.array([[7, 6, -3], [9, 0, 0]]), "targets[0, 2] is -3"),
    (np.array([[5, 0, 7, 0], [9, 0, 0, 0]]), TARGETS, "sources[0] has a word at position 2 after padding"),
    (SOURCES, np.array([[7, 6, 5], [0, 0, 0]]), "targets[1] is empty"),
])
def test_the_writer_names_what_is_wrong_with_the_sentences_and_writes_nothing(tmp_path, sources, targets, message):
    with pytest.raises(ValueError) as err:
        write_records(tmp_path / "out", "sequences", sources, targets)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape, vocabulary, message", [
    ((2, 3), 10, "has a source of 3 tokens; model.input_shape allows 1 to 2 (S)"),
    ((4, 2), 10, "has a target of 3 tokens; model.input_shape allows 1 to 2 (T)"),
    ((4, 3), 7, "has the token 7 in its source; words must be in [2, model.vocabulary = 7)"),
])
def test_a_first_record_the_recipe_cannot_hold_fails_at_once(tmp_path, shape, vocabulary, message):
    write_records(tmp_path, "sequences", SOURCES, TARGETS)
    with pytest.raises(ValueError) as err:
        read_sentences(tmp_path, shape=shape, vocabulary=vocabulary)
    assert message in str(err.value)


@pytest.mark.parametrize("later_source, later_target, message", [
    ([5, 6, 7, 8, 9], [9, 0, 0], "source sentences of 3 to 5 tokens; model.input_shape allows 1 to 4 (S)"),
    ([5, 0, 0, 0, 0], [9, 12, 0],
     "target words must be in [2, model.vocabulary = 10); a batch has target tokens from 5 to 12"),
])
def test_a_later_record_the_recipe_cannot_hold_stops_training(tmp_path, later_source, later_target, message):
    sources = np.array([[5, 6, 7, 0, 0], later_source])
    targets = np.array([[7, 6, 5], later_target])
    write_records(tmp_path, "sequences", sources, targets)
    batches = iter(read_sentences(tmp_path, vocabulary=10))  # the first record is fine
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        next(batches)
    assert message in str(err.value)


def test_images_read_as_sentences_are_named_as_images(tmp_path):
    write_records(tmp_path, "images", np.zeros((2, 4, 4, 3), np.uint8), np.zeros(2, np.int64))
    with pytest.raises(ValueError) as err:
        read_sentences(tmp_path)
    assert "lack feature(s) source, target that sequences need" in str(err.value)
    assert "they look like images" in str(err.value)


def test_the_converter_writes_a_learnable_reversal_task(tmp_path, capsys):
    out = tmp_path / "sentences"
    args = ["--kind", "sequences", "--out", str(out), "--synthetic", "16", "--shape", "6,5", "--vocabulary", "30",
            "--shards", "2"]
    assert convert.main(args) == 0
    assert "wrote 16 sequences (source up to 6 tokens, target up to 5) to 2 file(s)" in capsys.readouterr().out
    x, y = next(iter(read_sentences(out, shape=(6, 5), vocabulary=30, batch_size=8)))
    for tokens, target in zip(x.numpy(), y.numpy()):
        source = tokens[:6][tokens[:6] != 0]
        assert 2 <= len(source) <= 5 and source.min() >= 2 and source.max() < 30
        np.testing.assert_array_equal(target[:len(source)], source[::-1])
        assert not target[len(source):].any()
        np.testing.assert_array_equal(tokens[6:], np.concatenate([[1], target[:-1]]))


def test_the_converter_reads_padded_sentences_from_npz(tmp_path, capsys):
    np.savez(tmp_path / "pairs.npz", sources=SOURCES, targets=TARGETS)
    assert convert.main(["--kind", "sequences", "--out", str(tmp_path / "out"),
                         "--from-npz", str(tmp_path / "pairs.npz")]) == 0
    _, y = next(iter(read_sentences(tmp_path / "out")))
    np.testing.assert_array_equal(y.numpy(), TARGETS)


@pytest.mark.parametrize("flags, message", [
    (["--synthetic", "4", "--shape", "6,5", "--classes", "3"], "--classes does not apply to sequences"),
    (["--synthetic", "4", "--shape", "6,5,1"], "sequences take 2 positive sizes [S, T]"),
    (["--synthetic", "4", "--shape", "6,5", "--vocabulary", "2"], "--vocabulary must be >= 3"),
    (["--from-npz", "{tmp}/images.npz"], "has no array(s) sources, targets"),
])
def test_the_converter_refuses_bad_sentence_input_with_exit_2(tmp_path, capsys, flags, message):
    np.savez(tmp_path / "images.npz", images=np.zeros((2, 4, 4, 3), np.uint8), labels=np.zeros(2, np.int64))
    out = tmp_path / "out"
    args = ["--kind", "sequences", "--out", str(out)] + [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert convert.main(args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_seq2seq_task_trains_on_sentence_files(tmp_path):
    """The recipe's path end to end in one process: the task's batches come from the files, and the
    model's masked loss of them is the loss of the same batch made by hand."""
    from launcher.recipe import load_recipe
    from launcher.rank.tasks import build_task
    from launcher.rank.tasks.seq2seq import masked_cross_entropy

    write_records(tmp_path, "sequences", SOURCES, TARGETS)
    recipe = load_recipe("recipes/seq2seq-cpu.yaml", [
        "data.source=tfrecord", f"data.path={tmp_path}", "data.shuffle_buffer=1", "model.input_shape=[4,3]",
        "model.vocabulary=10", "model.units=8", "model.embedding=4"])
    task = build_task(recipe)
    x, y = next(task.batches(batch_size=2, rank=0, size=1, device="/CPU:0"))
    model = task.build_model()
    by_hand = tf.constant([[5, 6, 7, 0, 1, 7, 6], [9, 0, 0, 0, 1, 9, 0]], tf.int32)
    assert float(task.loss(y, model(x))) == pytest.approx(float(masked_cross_entropy(tf.constant(TARGETS, tf.int32),
                                                                                      model(by_hand))), rel=1e-6)
