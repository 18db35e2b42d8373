"""Sequence-to-sequence translation with attention (Meng et al. 2017's Seq2Seq case; Luong et al. 2015).

The network, as NMT systems of the paper's time built it:
- encoder: token embedding, a bidirectional LSTM as the first layer, then unidirectional LSTMs;
- decoder: token embedding and one LSTM whose cell attends to the encoder's outputs at every step
  (Luong's "general" score, input feeding of the attentional state): a custom Keras cell, so the
  decoder is a `While` loop on any device (no cuDNN kernel exists for it), and so are the encoder's
  LSTMs on a CPU; their per-step activations reach the backward pass as loop accumulators, which
  LMS swaps (lms_core.loops);
- a projection to the (large) vocabulary after the loop, over all target steps at once, trained
  either with the full softmax (`model.softmax_samples: 0`) or with a sampled softmax (Jean et al.
  2015; TensorFlow's own seq2seq translation tutorial of the papers' time sampled 512 words of 40,000),
  which scores the step's targets and a few sampled words instead of the whole vocabulary;
- teacher forcing: the decoder reads the target shifted right, after a start token;
- masked cross-entropy: padding (token 0) counts for nothing.

The full softmax's logits and their gradient, B x T x vocabulary each, are one op's inputs and
outputs, so no swap can move them: at 32,000 words they cap what LMS can reach (docs/benchmarks.md).
With a sampled softmax the loss holds B x T x (samples + 1) scores instead, and what the recurrent
loops keep for the backward pass, which LMS swaps, is most of the step's memory.

One input tensor per sample carries both token sequences, int32 [source_length + target_length]: the
source, then the decoder's input; the labels are the target tokens, int32 [target_length].
"""
from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import layers

from launcher.rank.data.sequences import PAD, START  # token ids with a meaning; words are 2 .. vocabulary-1
from launcher.rank.tasks.base import Task


@keras.saving.register_keras_serializable(package="lms_launch")
class AttentionLSTMCell(layers.Layer):
    """An LSTM cell whose input is the step's embedding and the previous attentional state, and
    whose output is the new attentional state tanh(W_c [context; h]), with the context attended over
    the encoder's outputs. The encoder's outputs ride along as a state the cell passes on unchanged
    (Keras 3's RNN takes no constants): the loop keeps one copy, not one per step."""

    def __init__(self, units: int, source_length: int, memory_width: int, **kwargs):
        super().__init__(**kwargs)
        self.units, self.source_length, self.memory_width = units, source_length, memory_width
        self.lstm = layers.LSTMCell(units, name="lstm")
        self.score = layers.Dense(memory_width, use_bias=False, name="score")  # Luong's general score
        self.combine = layers.Dense(units, activation="tanh", use_bias=False, name="combine")
        # h, c of the LSTM, the attentional state fed to the next step, the encoder's outputs.
        self.state_size = [units, units, units, (source_length, memory_width)]
        self.output_size = units

    def build(self, input_shape):
        self.lstm.build((input_shape[0], input_shape[-1] + self.units))
        self.score.build((input_shape[0], self.units))
        self.combine.build((input_shape[0], self.memory_width + self.units))
        self.built = True

    def call(self, inputs, states, training=False):
        h, c, attentional, memory = states
        output, (h, c) = self.lstm(tf.concat([inputs, attentional], axis=-1), [h, c], training=training)
        scores = tf.einsum("bsd,bd->bs", memory, self.score(output))
        weights = tf.nn.softmax(scores, axis=-1)
        context = tf.einsum("bs,bsd->bd", weights, memory)
        attentional = self.combine(tf.concat([context, output], axis=-1))
        return attentional, [h, c, attentional, memory]

    def get_config(self):
        return {**super().get_config(), "units": self.units, "source_length": self.source_length,
                "memory_width": self.memory_width}


@keras.saving.register_keras_serializable(package="lms_launch")
class TokenSlice(layers.Layer):
    """Tokens [start, stop) of every sample: the source or the decoder's input from the one input
    tensor. A layer of its own, not a Lambda, so that model.keras loads in Keras's safe mode."""

    def __init__(self, start: int, stop: int, **kwargs):
        super().__init__(**kwargs)
        self.start, self.stop = start, stop

    def call(self, tokens):
        return tokens[:, self.start:self.stop]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.stop - self.start)

    def get_config(self):
        return {**super().get_config(), "start": self.start, "stop": self.stop}


@keras.saving.register_keras_serializable(package="lms_launch")
class ZeroState(layers.Layer):
    """Zeros [B, units] shaped like one step of the encoder's outputs [B, S, units]: a start state."""

    def call(self, memory):
        return tf.zeros_like(memory[:, 0, :])

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])


@keras.saving.register_keras_serializable(package="lms_launch")
class SampledSoftmax(layers.Layer):
    """The projection to the vocabulary, trained by a sampled softmax (Jean et al. 2015).

    Its weights are laid out [vocabulary, units], one row per word, so that the loss gathers the rows
    of the step's targets and of the sampled words without transposing the whole matrix every step.
    `call` gives the full logits, for evaluation; training calls `loss`. Words are sampled from
    TensorFlow's log-uniform (Zipfian) sampler, which assumes word ids sorted by frequency, as
    vocabularies built from a corpus are, and the loss corrects for the sampling probabilities."""

    def __init__(self, vocabulary: int, samples: int, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary, self.samples = vocabulary, samples

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(self.vocabulary, input_shape[-1]), initializer="glorot_uniform",
                                      name="kernel")
        self.bias = self.add_weight(shape=(self.vocabulary,), initializer="zeros", name="bias")
        self.built = True

    def call(self, states):
        return tf.einsum("btu,vu->btv", states, self.kernel) + self.bias

    def loss(self, labels: tf.Tensor, states: tf.Tensor, sampled=None) -> tf.Tensor:
        """Mean sampled-softmax cross-entropy over the target tokens that are not padding; states are
        the decoder's outputs [B, T, units], labels [B, T]. `sampled`: the sampler's (candidates,
        expected count of each target, expected count of each candidate), drawn here when not given."""
        states = tf.cast(states, tf.float32)
        targets = tf.reshape(tf.cast(labels, tf.int64), [-1, 1])
        if sampled is None:
            sampled = tf.random.log_uniform_candidate_sampler(
                targets, num_true=1, num_sampled=self.samples, unique=True, range_max=self.vocabulary)[:3]
        per_token = tf.nn.sampled_softmax_loss(
            weights=self.kernel, biases=self.bias, labels=targets, inputs=tf.reshape(states, [-1, states.shape[-1]]),
            num_sampled=self.samples, num_classes=self.vocabulary, sampled_values=sampled)
        mask = tf.cast(tf.not_equal(tf.reshape(labels, [-1]), PAD), tf.float32)
        return tf.reduce_sum(per_token * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)

    def get_config(self):
        return {**super().get_config(), "vocabulary": self.vocabulary, "samples": self.samples}


def seq2seq(source_length: int, target_length: int, vocabulary: int, embedding: int, units: int,
            encoder_layers: int, softmax_samples: int = 0, steps_per_loop: int = 0) -> keras.Model:
    """The network for one input of [source_length + target_length] tokens; logits [T, vocabulary].

    With `softmax_samples` > 0 the model ends at the decoder's outputs [T, units] and carries its
    projection to the vocabulary as `model.sampled_softmax` (a `SampledSoftmax`), which the loss
    calls: its weights are the model's (trained, broadcast and checkpointed with the rest).

    With `steps_per_loop` > 0 every recurrent layer runs as consecutive loops of that many steps, each
    starting from the state the last one ended with (the backward direction from the end): the same
    layers, weights and arithmetic, but each loop keeps only its own steps' activations for its own
    gradient loop (see `recurrent_chunks`)."""
    tokens = keras.Input((source_length + target_length,), dtype="int32", name="tokens")
    source = TokenSlice(0, source_length, name="source")(tokens)
    decoder_input = TokenSlice(source_length, source_length + target_length, name="decoder_input")(tokens)

    x = layers.Embedding(vocabulary, embedding, name="source_embedding")(source)
    if steps_per_loop:
        x = bidirectional_in_chunks(x, units // 2, steps_per_loop, name="encoder_0")
    else:
        x = layers.Bidirectional(layers.LSTM(units // 2, return_sequences=True), name="encoder_0")(x)
    state = None
    for index in range(1, encoder_layers):
        lstm = layers.LSTM(units, return_sequences=True, return_state=True, name=f"encoder_{index}")
        x, *state = recurrent_chunks(lstm, time_chunks(x, steps_per_loop, lstm.name), None)
    memory = x  # [B, S, units]
    if state is None:  # one encoder layer: start the decoder from zeros
        zeros = ZeroState(name="zero_state")(memory)
        state = [zeros, zeros]
    fed = ZeroState(name="first_attentional")(memory)

    y = layers.Embedding(vocabulary, embedding, name="target_embedding")(decoder_input)
    cell = AttentionLSTMCell(units, source_length, units, name="attention_cell")
    if steps_per_loop:
        decoder = layers.RNN(cell, return_sequences=True, return_state=True, name="decoder")
        pieces = time_chunks(y, steps_per_loop, decoder.name)
        y, *_ = recurrent_chunks(decoder, pieces, [*state, fed], constants=[memory] * len(pieces))
    else:
        y = layers.RNN(cell, return_sequences=True, name="decoder")(y, initial_state=[*state, fed, memory])
    if softmax_samples:
        model = keras.Model(tokens, y, name="seq2seq")
        model.sampled_softmax = SampledSoftmax(vocabulary, softmax_samples, name="projection")
        model.sampled_softmax.build((None, target_length, units))
        return model
    logits = layers.Dense(vocabulary, name="projection")(y)
    return keras.Model(tokens, logits, name="seq2seq")


# Why a sequence is cut into its chunks by one split, and why the decoder runs at most
# launcher.config.MAX_DECODER_LOOPS loops: TensorFlow's gradient tape sums a tensor's gradients early, once 5 are
# pending, when they hold over 128 MiB (kMinAggregateCount, kMinAggregateBytes in
# tensorflow/c/eager/tape.h), that is, at a large batch only. A tensor read by 6 ops or more then
# gives the paper-sized step an AddN (and renumbers every later one) that its small structural twin,
# on which the gating check runs the plan (launcher/lms/twin.py), does not have. A split is one
# reader; the encoder's outputs are read by every decoder loop. (Copies through Keras's Identity
# layer are the same tensor, and a real copy would be counted as memory by Grappler's estimate.)


def time_chunks(sequence, steps_per_loop: int, name: str) -> list:
    """`sequence` [B, T, ...] cut into consecutive pieces of `steps_per_loop` steps (the last may be
    shorter) by one split; the whole sequence, as one piece, at 0."""
    length = sequence.shape[1]
    if not steps_per_loop or steps_per_loop >= length:
        return [sequence]
    sizes = [min(steps_per_loop, length - start) for start in range(0, length, steps_per_loop)]
    return TimeSplit(sizes, name=f"{name}_chunks")(sequence)


def recurrent_chunks(layer: layers.RNN, pieces: list, initial_state, reverse: bool = False,
                     constants: list | None = None):
    """`layer` (return_sequences and return_state set) over consecutive `pieces` of a sequence, each
    call from the state the previous one ended with: one `While` loop per piece, whose accumulators
    hold that piece's steps only, so that LMS can park each chunk's activations and bring them back
    just before that chunk's gradient loop. With `reverse` (a `go_backwards` layer) the pieces run
    from the last, each backwards, and the outputs come back in forward order. `constants`, one per
    piece, is a state the cell passes on unchanged (the decoder's encoder outputs), given to each call
    afresh: Keras cannot run a model that feeds one call's pass-through state (a [S, units] one) into
    the next. Returns
    [outputs, *final state]."""
    outputs, state = [], initial_state
    order = list(enumerate(pieces))
    for index, piece in (reversed(order) if reverse else order):
        if constants is not None:
            state = [*state[:len(initial_state)], constants[index]]
        chunk, *state = layer(piece, initial_state=state)
        # Named by index: the structural twin has the same chunks, shorter, under the same names.
        outputs.append(TimeReverse(name=f"{layer.name}_chunk_{index}_in_order")(chunk) if reverse else chunk)
    if reverse:
        outputs.reverse()
    joined = outputs[0] if len(outputs) == 1 else layers.Concatenate(axis=1, name=f"{layer.name}_steps")(outputs)
    if constants is not None:
        state = state[:len(initial_state)]
    return [joined, *state]


def bidirectional_in_chunks(sequence, units: int, steps_per_loop: int, name: str):
    """Keras's Bidirectional(LSTM(units, return_sequences=True)) in chunks of time steps: the forward
    LSTM from the start, the backward one from the end, outputs concatenated per step."""
    forward = layers.LSTM(units, return_sequences=True, return_state=True, name=f"{name}_forward")
    backward = layers.LSTM(units, return_sequences=True, return_state=True, go_backwards=True, name=f"{name}_backward")
    pieces = time_chunks(sequence, steps_per_loop, name)
    ahead, *_ = recurrent_chunks(forward, pieces, None)
    behind, *_ = recurrent_chunks(backward, pieces, None, reverse=True)
    return layers.Concatenate(axis=-1, name=name)([ahead, behind])


@keras.saving.register_keras_serializable(package="lms_launch")
class TimeSplit(layers.Layer):
    """A sequence [B, T, ...] cut along time into pieces of the given numbers of steps, by one split."""

    def __init__(self, sizes: list[int], **kwargs):
        super().__init__(**kwargs)
        self.sizes = list(sizes)

    def call(self, sequence):
        return tf.split(sequence, self.sizes, axis=1)

    def compute_output_shape(self, input_shape):
        return [(input_shape[0], size, *input_shape[2:]) for size in self.sizes]

    def get_config(self):
        return {**super().get_config(), "sizes": self.sizes}


@keras.saving.register_keras_serializable(package="lms_launch")
class TimeReverse(layers.Layer):
    """A sequence [B, T, ...] in reverse time order (what a go_backwards layer returns, put right)."""

    def call(self, sequence):
        return tf.reverse(sequence, axis=[1])


def masked_cross_entropy(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Mean cross-entropy over the target tokens that are not padding."""
    logits = tf.cast(logits, tf.float32)
    per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    mask = tf.cast(tf.not_equal(labels, PAD), tf.float32)
    return tf.reduce_sum(per_token * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)


def real_tokens(labels: tf.Tensor) -> tf.Tensor:
    """Target tokens that are not padding: what the loss counts, and what tokens/s reports (the decoder
    also runs the padded positions, but they translate nothing)."""
    return tf.math.count_nonzero(tf.not_equal(labels, PAD), dtype=tf.int64)


def copy_task_batch(batch: int, source_length: int, target_length: int, vocabulary: int, seed: int):
    """A learnable synthetic batch: the target is the source reversed (a classic Seq2Seq test),
    sentences of random length padded with 0, the decoder's input the target after a start token."""
    length = tf.random.stateless_uniform([batch, 1], seed=[seed, 1], minval=2, maxval=min(source_length, target_length) + 1,
                                         dtype=tf.int32)
    words = tf.random.stateless_uniform([batch, source_length], seed=[seed, 2], minval=2, maxval=vocabulary,
                                        dtype=tf.int32)
    source = tf.where(tf.range(source_length)[None, :] < length, words, PAD)
    reversed_source = tf.reverse_sequence(source, tf.reshape(length, [-1]), seq_axis=1, batch_axis=0)
    target = reversed_source[:, :target_length]
    if target_length > source_length:
        target = tf.pad(target, [[0, 0], [0, target_length - source_length]])
    decoder_input = tf.concat([tf.fill([batch, 1], START), target[:, :-1]], axis=1)
    return tf.concat([source, decoder_input], axis=1), target


class Seq2SeqTask(Task):
    record_kind = "sequences"

    def __init__(self, recipe):
        super().__init__(recipe)
        self._sampled_softmax: SampledSoftmax | None = None  # the built model's, with model.softmax_samples

    @property
    def label_count(self) -> int:
        return self.model_cfg.vocabulary

    @property
    def source_length(self) -> int:
        return self.model_cfg.input_shape[0]

    @property
    def target_length(self) -> int:
        return self.model_cfg.input_shape[1]

    def build_model(self) -> keras.Model:
        cfg = self.model_cfg
        model = seq2seq(self.source_length, self.target_length, cfg.vocabulary, cfg.embedding, cfg.units,
                        cfg.encoder_layers, cfg.softmax_samples, cfg.steps_per_loop)
        self._sampled_softmax = getattr(model, "sampled_softmax", None)
        return model

    def loss(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        if self._sampled_softmax is not None:  # outputs are the decoder's states
            return self._sampled_softmax.loss(labels, outputs)
        return masked_cross_entropy(labels, outputs)

    def trained_model(self, model: keras.Model) -> keras.Model:
        softmax = getattr(model, "sampled_softmax", None)
        if softmax is None:
            return model
        # The same weights, ending at the full projection: what translation needs.
        return keras.Model(model.input, softmax(model.output), name=model.name)

    def input_spec(self, batch_size: int) -> tf.TensorSpec:
        return tf.TensorSpec([batch_size, self.source_length + self.target_length], tf.int32, name="inputs")

    def label_spec(self, batch_size: int) -> tf.TensorSpec:
        return tf.TensorSpec([batch_size, self.target_length], tf.int32, name="labels")

    def synthetic_batch(self, batch_size: int, seed: int) -> tuple[tf.Tensor, tf.Tensor]:
        return copy_task_batch(batch_size, self.source_length, self.target_length, self.model_cfg.vocabulary, seed)

    def target_tokens(self, labels: tf.Tensor) -> tf.Tensor:
        return real_tokens(labels)

    def smallest_input_shape(self) -> list[int]:
        # The same layers and loops under the same names; only the loops' trip counts shrink. With
        # model.steps_per_loop, the shortest sequences split into as many loops as the recipe's.
        steps = self.model_cfg.steps_per_loop
        if not steps:
            return [4, 4]
        return [max(4, (math.ceil(length / steps) - 1) * steps + 1) for length in self.model_cfg.input_shape]
