"""TFRecord sentence pairs for the Seq2Seq task: checking, encoding and decoding (kind `sequences`).

A record holds one sentence pair as token ids, without padding:

    feature   type         content
    source    int64 list   the source sentence, 1 to S tokens
    target    int64 list   the target sentence, 1 to T tokens

S and T are the recipe's `model.input_shape`. Ids 0 (padding) and 1 (the decoder's start token) are
reserved: words are 2 .. model.vocabulary - 1. Storing sentences at their own length keeps the files
independent of the recipe: the reader pads each batch to S and T, and refuses a longer sentence
rather than cutting it (a cut target would train the model on a truncated translation).

The reader builds what the model and loss of launcher.rank.tasks.seq2seq take: x = the padded source,
then the decoder's input (the start token, then the target without its last position: teacher
forcing), int32 [S + T]; y = the padded target, int32 [T].

In memory (the writer's and the converter's input) a batch of sentences is two integer arrays,
sources [N, S] and targets [N, T], each sentence followed by zeros: the usual padded layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

PAD, START = 0, 1  # token ids with a meaning, here and in the model (launcher.rank.tasks.seq2seq)
FIRST_WORD = 2


# ----------------------------------------------------------------------------------------------------
# Writing


def check_sentences(sources: np.ndarray, targets: np.ndarray) -> None:
    """ValueError naming the first problem with padded sentence arrays sources [N, S], targets [N, T]."""
    for name, tokens in (("sources", sources), ("targets", targets)):
        if tokens.ndim != 2:
            raise ValueError(f"sequences: {name} must be [N, length] token ids padded with 0; got shape "
                             f"{list(tokens.shape)}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"sequences: {name} must be integer token ids; got {tokens.dtype}")
    if len(sources) != len(targets):
        raise ValueError(f"sequences: sources and targets must hold the same number of sentences; got "
                         f"{len(sources)} and {len(targets)}")
    for name, tokens in (("sources", sources), ("targets", targets)):
        _check_padded(name, tokens)


def _check_padded(name: str, tokens: np.ndarray) -> None:
    if not tokens.size:
        return
    reserved = (tokens < 0) | (tokens == START)
    if reserved.any():
        row, column = np.argwhere(reserved)[0]
        raise ValueError(f"sequences: {name}[{row}, {column}] is {tokens[row, column]}; word ids start at "
                         f"{FIRST_WORD} (0 is padding, 1 the decoder's start token, which the reader adds)")
    padding = tokens == PAD
    # Padding only after the sentence: a 0 followed by a word would be read as the sentence's end.
    word_after_pad = ~padding[:, 1:] & np.logical_or.accumulate(padding, axis=1)[:, :-1]
    if word_after_pad.any():
        row, column = np.argwhere(word_after_pad)[0]
        raise ValueError(f"sequences: {name}[{row}] has a word at position {column + 1} after padding (0); "
                         f"0 may only follow the sentence's last word")
    empty = padding[:, 0]
    if empty.any():
        raise ValueError(f"sequences: {name}[{np.flatnonzero(empty)[0]}] is empty; every sentence needs a word")


def sentence_features(source: np.ndarray, target: np.ndarray) -> dict[str, "tf.train.Feature"]:
    """The features of one padded sentence pair, padding removed."""
    import tensorflow as tf

    def tokens(row: np.ndarray) -> tf.train.Feature:
        words = row[:np.count_nonzero(row)]  # checked: the words come first, then only padding
        return tf.train.Feature(int64_list=tf.train.Int64List(value=words.tolist()))

    return {"source": tokens(source), "target": tokens(target)}


def synthetic_sentences(count: int, shape: list[int], vocabulary: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A learnable task on sentences of random length (2 .. min(S, T) words): the target is the
    source reversed, the reversal task the synthetic batches of launcher.rank.tasks.seq2seq use."""
    source_length, target_length = shape
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, min(source_length, target_length) + 1, size=count)
    words = rng.integers(FIRST_WORD, vocabulary, size=(count, source_length), dtype=np.int64)
    sources = np.where(np.arange(source_length) < lengths[:, None], words, PAD)
    targets = np.zeros((count, target_length), np.int64)
    for row, length in enumerate(lengths):
        targets[row, :length] = sources[row, :length][::-1]
    return sources, targets


# ----------------------------------------------------------------------------------------------------
# Reading


def check_first_sentences(features, input_shape: list[int], vocabulary: int, path: str) -> None:
    """ValueError for a first record that no batch of this recipe can hold."""
    for key, limit, axis in (("source", input_shape[0], "S"), ("target", input_shape[1], "T")):
        words = np.asarray(features[key].int64_list.value, np.int64)
        if not 1 <= words.size <= limit:
            raise ValueError(f"data.path: a record in {path!r} has a {key} of {words.size} tokens; model.input_shape "
                             f"allows 1 to {limit} ({axis}); raise it or leave longer sentences out")
        outside = words[(words < FIRST_WORD) | (words >= vocabulary)]
        if outside.size:
            raise ValueError(f"data.path: a record in {path!r} has the token {outside[0]} in its {key}; words must "
                             f"be in [{FIRST_WORD}, model.vocabulary = {vocabulary})")


def sentence_decoder(input_shape: list[int], vocabulary: int):
    """A function from a batch of serialized records to `(x, y)`, checking every record on the way."""
    import tensorflow as tf

    source_length, target_length = input_shape
    spec = {"source": tf.io.RaggedFeature(tf.int64), "target": tf.io.RaggedFeature(tf.int64)}

    def decode(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        example = tf.io.parse_example(serialized, spec)
        checks = [_assert_lengths(example["source"], source_length, "source", "S"),
                  _assert_lengths(example["target"], target_length, "target", "T"),
                  _assert_words(example["source"].flat_values, vocabulary, "source"),
                  _assert_words(example["target"].flat_values, vocabulary, "target")]
        with tf.control_dependencies(checks):
            source = example["source"].to_tensor(PAD, shape=[None, source_length])
            target = example["target"].to_tensor(PAD, shape=[None, target_length])
        start = tf.fill([tf.shape(target)[0], 1], tf.constant(START, tf.int64))
        decoder_input = tf.concat([start, target[:, :-1]], axis=1)
        x = tf.cast(tf.concat([source, decoder_input], axis=1), tf.int32)
        return x, tf.cast(target, tf.int32)

    return decode


def _assert_lengths(sentences: "tf.RaggedTensor", limit: int, key: str, axis: str) -> "tf.Operation":
    import tensorflow as tf

    lengths = sentences.row_lengths()
    shortest, longest = tf.reduce_min(lengths), tf.reduce_max(lengths)
    message = tf.strings.format(f"data.path: a batch has {key} sentences of {{}} to {{}} tokens; model.input_shape "
                                f"allows 1 to {limit} ({axis})", (shortest, longest))
    return tf.debugging.Assert(tf.logical_and(shortest >= 1, longest <= limit), [message])


def _assert_words(words: "tf.Tensor", vocabulary: int, key: str) -> "tf.Operation":
    import tensorflow as tf

    # The bounds of an empty batch are the identities of min and max, which pass.
    low, high = tf.reduce_min(words), tf.reduce_max(words)
    message = tf.strings.format(f"data.path: {key} words must be in [{FIRST_WORD}, model.vocabulary = {vocabulary}); "
                                f"a batch has {key} tokens from {{}} to {{}}", (low, high))
    return tf.debugging.Assert(tf.logical_and(low >= FIRST_WORD, high < vocabulary), [message])
