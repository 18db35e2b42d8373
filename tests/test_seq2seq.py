"""The Seq2Seq task (launcher/rank/tasks/seq2seq.py): its data and loss by hand, and LMS on its
loops: at a small size on split devices (compute /device:CPU:1, host /device:CPU:0) the accumulators
of all four loops (the bidirectional layer's two, the second encoder layer's, the attention
decoder's) are swapped, every swap-in is gated, and training matches the unswapped step."""
from __future__ import annotations

import keras
import pytest
import numpy as np
import tensorflow as tf

import lms_core.tf as lms_tf
from launcher.config import ModelConfig
from launcher.rank.tasks.seq2seq import PAD, START, SampledSoftmax, copy_task_batch, masked_cross_entropy, seq2seq
from lms_core.config import LMSConfig
from lms_core.loops import WHILE_TYPES, accumulators
from lms_core.tf.gating import verify_gating
from tests.fixtures import COMPUTE, HOST

SWAP_ALL = LMSConfig(enabled=True, mode="manual", swapout_threshold=1, swapin_ahead=1, min_tensor_bytes=0)
SOURCE, TARGET, VOCABULARY, EMBEDDING, UNITS, LAYERS = 6, 5, 50, 8, 8, 2


def test_the_copy_batch_reverses_each_sentence_and_teacher_forces_it():
    inputs, labels = copy_task_batch(4, SOURCE, TARGET, VOCABULARY, seed=7)
    inputs, labels = inputs.numpy(), labels.numpy()
    for source, decoder_input, target in zip(inputs[:, :SOURCE], inputs[:, SOURCE:], labels):
        words = source[source != PAD]
        assert 2 <= len(words) <= TARGET and (source[len(words):] == PAD).all()  # padded at the end
        assert list(target[:len(words)]) == list(words[::-1]) and (target[len(words):] == PAD).all()
        assert list(decoder_input) == [START, *target[:-1]]


def test_the_loss_counts_only_the_tokens_that_are_not_padding():
    labels = tf.constant([[3, 4, PAD], [5, PAD, PAD]])
    logits = tf.random.stateless_normal([2, 3, 7], seed=[1, 2])
    # By hand: the mean over the three real tokens of -log softmax(logits)[label].
    log_p = tf.nn.log_softmax(logits).numpy()
    expected = -(log_p[0, 0, 3] + log_p[0, 1, 4] + log_p[1, 0, 5]) / 3
    np.testing.assert_allclose(float(masked_cross_entropy(labels, logits)), expected, rtol=1e-6)


def test_the_sampled_softmax_loss_by_hand():
    """Jean et al.'s sampled softmax, computed here in numpy: each real token's logit for its target
    and for the sampled words, each less the log of its expected count under the sampler; a sampled
    word that is the token's own target (an "accidental hit") drops out; padding counts nothing."""
    vocabulary, units = 7, 3
    rng = np.random.default_rng(3)
    layer = SampledSoftmax(vocabulary, samples=3)
    layer.build((1, 3, units))
    kernel, bias = rng.normal(size=(vocabulary, units)), rng.normal(size=vocabulary)
    layer.kernel.assign(kernel.astype(np.float32))
    layer.bias.assign(bias.astype(np.float32))
    states = rng.normal(size=(1, 3, units)).astype(np.float32)
    labels = np.array([[3, 5, PAD]], np.int32)
    candidates, target_counts, candidate_counts = [1, 5, 6], [0.5, 0.25, 0.1], [0.2, 0.25, 0.3]

    def token_loss(h, target, target_count):
        true = kernel[target] @ h + bias[target] - np.log(target_count)
        others = [kernel[c] @ h + bias[c] - np.log(q) for c, q in zip(candidates, candidate_counts) if c != target]
        return -true + np.log(np.exp(true) + np.sum(np.exp(others)))

    # Token 2 is padding; token 1's target (5) was also sampled: an accidental hit.
    expected = (token_loss(states[0, 0], 3, 0.5) + token_loss(states[0, 1], 5, 0.25)) / 2
    sampled = (tf.constant(candidates, tf.int64), tf.constant(target_counts, shape=[3, 1]),
               tf.constant(candidate_counts))
    np.testing.assert_allclose(float(layer.loss(tf.constant(labels), tf.constant(states), sampled)), expected, rtol=1e-5)
    # Its full logits, the saved model's output, are the plain projection.
    np.testing.assert_allclose(layer(tf.constant(states)).numpy(), states @ kernel.T + bias, rtol=1e-5, atol=1e-6)


def build(device: str, vocabulary: int = VOCABULARY, layers: int = LAYERS, softmax_samples: int = 0,
          source: int = SOURCE, steps_per_loop: int = 0):
    keras.utils.set_random_seed(0)
    with tf.device(device):
        model = seq2seq(source, TARGET, vocabulary, EMBEDDING, UNITS, layers, softmax_samples, steps_per_loop)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    loss = model.sampled_softmax.loss if softmax_samples else masked_cross_entropy

    @tf.function
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            value = loss(labels, model(inputs, training=True))
        optimizer.apply(tape.gradient(value, model.trainable_variables), model.trainable_variables)
        return value

    return model, step


def test_a_sampled_softmax_step_holds_no_vocabulary_sized_tensor():
    """What the sampled softmax is for: the full softmax's step makes B x T x V float32 tensors (the
    logits and their gradient), the sampled one none: its largest loss tensors are B x T x (samples + 1)
    scores. Sizes read from the traced step's own shapes."""
    batch, vocabulary = 8, 4000
    logits_bytes = batch * TARGET * vocabulary * 4
    specs = (tf.TensorSpec([batch, SOURCE + TARGET], tf.int32), tf.TensorSpec([batch, TARGET], tf.int32))

    def vocabulary_sized(samples):
        _, step = build("/device:CPU:0", vocabulary=vocabulary, layers=1, softmax_samples=samples)
        graph = lms_tf.trace_step(step, *specs).graph
        return {f"{op.name}:{i}" for op in graph.ops.values() for i, out in enumerate(op.outputs)
                if (out.nbytes or 0) >= logits_bytes and out.tensor_list is None}

    assert len(vocabulary_sized(0)) >= 2
    assert vocabulary_sized(20) == set()


def test_lms_swaps_every_loops_accumulators_gated_and_training_is_unchanged_on_split_devices():
    rewritten, _ = check_lms_on_split_devices()
    graph = rewritten.planning.graph
    forward_loops = {a.forward_loop for a in accumulators(graph)}
    # Four forward loops: the bidirectional layer's two directions, the second encoder layer, and the
    # attention decoder (a custom cell).
    assert len(forward_loops) == 4 and any("decoder" in loop for loop in forward_loops)
    assert all(graph[loop].type in WHILE_TYPES for loop in forward_loops)


def test_with_a_sampled_softmax_too_lms_swaps_the_loops_and_the_model_learns():
    """The same checks with the sampled softmax (its sampler is a stateful random op, seeded: the
    swapped step draws the same words as the unswapped one). And the model learns the copy task: its
    full-softmax loss, which training never computes, falls."""
    _, model = check_lms_on_split_devices(steps=6, softmax_samples=20)
    batch = copy_task_batch(3, SOURCE, TARGET, VOCABULARY, seed=7)
    initial, _ = build(COMPUTE, softmax_samples=20)
    full_loss = [float(masked_cross_entropy(batch[1], m.sampled_softmax(m(batch[0])))) for m in (initial, model)]
    assert full_loss[1] < full_loss[0]


def check_lms_on_split_devices(steps: int = 3, source: int = SOURCE, **model):
    """The step built by `build(**model)`, every list swapped on split devices: each forward loop's
    lists swapped (the rest left with their reasons), loss and weights as without LMS for `steps`
    steps, every swap-in gated. (The rewritten step, its trained model.)"""
    batch = copy_task_batch(3, source, TARGET, VOCABULARY, seed=7)
    model_a, step_a = build(COMPUTE, source=source, **model)
    with tf.device(COMPUTE):
        expected = [float(step_a(*batch)) for _ in range(steps)]
    model_b, step_b = build(COMPUTE, source=source, **model)
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in batch]
    rewritten = lms_tf.rewrite(step_b, *specs, config=SWAP_ALL, compute_device=COMPUTE, host_device=HOST)
    graph = rewritten.planning.graph
    forward_loops = {a.forward_loop for a in accumulators(graph)}
    swapped_from = {s.tensor.rpartition(":")[0] for s in rewritten.plan.swaps if s.tensor_list is not None}
    assert swapped_from == forward_loops
    # Every accumulator is swapped or left with its reason.
    reasons = {s.tensor: s.reason for s in rewritten.plan.skipped}
    for accumulator in accumulators(graph):
        assert accumulator.tensor in {s.tensor for s in rewritten.plan.swaps} or (
            "loop accumulator" in reasons[accumulator.tensor])

    losses = [float(rewritten(*batch)) for _ in range(steps)]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    if not model.get("softmax_samples"):  # a sampled loss scores other words each step: it need not fall
        assert losses[-1] < losses[0]
    for a, b in zip(model_a.variables, model_b.variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-6, err_msg=a.path)
    report = verify_gating(rewritten, *batch)
    swap_ins = rewritten.plan.swap_in_count
    assert (report.gated, len(report.gates)) == (swap_ins, swap_ins), report.verification().first_failure()
    return rewritten, model_b


def test_a_run_with_a_sampled_softmax_saves_a_model_that_gives_the_full_logits(tmp_path):
    """Training holds the projection in the loss; model.keras ends at it, with the trained weights."""
    from launcher.config import Recipe
    from launcher.rank.checkpoint import save_trained_model
    from launcher.rank.tasks import build_task

    recipe = Recipe(model=ModelConfig(name="seq2seq", input_shape=[SOURCE, TARGET], vocabulary=VOCABULARY,
                                      embedding=EMBEDDING, units=UNITS, encoder_layers=LAYERS, softmax_samples=20))
    task = build_task(recipe)
    model = task.build_model()
    projection = model.sampled_softmax
    assert any(v is projection.kernel for v in model.trainable_variables)  # trained and broadcast with the rest
    inputs, labels = copy_task_batch(2, SOURCE, TARGET, VOCABULARY, seed=1)
    states = model(inputs)
    assert states.shape == (2, TARGET, UNITS)
    by_hand = states.numpy() @ projection.kernel.numpy().T + projection.bias.numpy()
    saved = keras.saving.load_model(save_trained_model(task.trained_model(model), tmp_path))
    np.testing.assert_allclose(saved(inputs).numpy(), by_hand, rtol=1e-5, atol=1e-5)
    assert saved(inputs).shape == (2, TARGET, VOCABULARY)


def test_the_model_config_takes_the_seq2seq_keys_with_nmt_defaults():
    config = ModelConfig(name="seq2seq", input_shape=[50, 50])
    assert (config.vocabulary, config.embedding, config.units, config.encoder_layers) == (32000, 512, 1024, 4)
    assert config.softmax_samples == 0  # the full softmax unless a sampled one is asked for


def test_at_the_loss_the_simulator_holds_the_vocabulary_sized_buffers_grappler_holds(monkeypatch):
    """Issue 18: at batch 512 of recipes/seq2seq.yaml the simulator said 12.36 GiB and Grappler + the
    loop lists 18.24 GiB. Both count the lists; they differed at the loss. The projection to the
    vocabulary and the loss make four buffers of B x T x V float32 (the Tensordot's reshaped product,
    the BiasAdd, the loss's reshape of the logits, the cross-entropy's backprop); the Reshapes take no
    time, so Grappler holds all four at once. The simulator held two: it also replayed ops no output
    depends on (Keras calls each RNN cell once outside its loop), which ran between them, though
    TensorFlow prunes them from the function and Grappler never schedules them. Here the vocabulary
    makes those buffers the largest by far: 8 x 5 x 4000 x 4 = 640,000 bytes each."""
    from lms_core.costs import PROFILES, step_costs
    from lms_core.link import INFINITE
    from lms_core.loops import unseen_bytes
    from lms_core.plan import Plan
    from lms_core.simulator import simulate
    from lms_core.tf import capture
    from lms_core.tf.estimate import live_at_peak

    batch, vocabulary = 8, 4000
    logits_bytes = batch * TARGET * vocabulary * 4
    four = {"seq2seq_1/projection_1/Tensordot:0", "seq2seq_1/projection_1/BiasAdd:0",
            "SparseSoftmaxCrossEntropyWithLogits/Reshape:0",
            "SparseSoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits:1"}
    specs = (tf.TensorSpec([batch, SOURCE + TARGET], tf.int32), tf.TensorSpec([batch, TARGET], tf.int32))

    def vocabulary_sized_at_peaks():
        _, step = build("/device:CPU:0", vocabulary=vocabulary, layers=1)
        traced = lms_tf.trace_step(step, *specs)
        graph = traced.graph
        simulated = simulate(graph, Plan(settings={}), step_costs(graph, PROFILES["v100"]), INFINITE)
        grappler = live_at_peak(traced.concrete.graph.as_graph_def(), traced.concrete)
        return (simulated, unseen_bytes(graph, set()).baseline_bytes,
                {t for t, n in simulated.resident_at_peak if n >= logits_bytes},
                {t for t, n in grappler.items() if n >= logits_bytes})

    simulated, lists, in_simulation, in_grappler = vocabulary_sized_at_peaks()
    assert in_grappler == in_simulation == four
    assert simulated.peak_device_bytes >= 4 * logits_bytes + lists  # the lists are all live at the loss
    # Negative control: the IR with every op of the function, as before, holds two of the four.
    monkeypatch.setattr(capture, "ops_tensorflow_runs", lambda graph: {op.name for op in graph.get_operations()})
    _, _, in_simulation, in_grappler = vocabulary_sized_at_peaks()
    assert in_grappler == four and len(in_simulation) == 2


def test_tokens_per_second_counts_the_real_target_tokens_not_the_padding():
    from launcher.rank.metrics import IntervalRecord, summarize_rank
    from launcher.rank.tasks.seq2seq import real_tokens

    # By hand: 2 + 1 + 0 real tokens; the padded positions (6 of 9) translate nothing.
    assert int(real_tokens(tf.constant([[3, 4, PAD], [5, PAD, PAD], [PAD, PAD, PAD]]))) == 3
    # Two intervals with different real tokens per sample: 3 steps of 2 s at 100 tokens/s, then 1
    # step of 2 s at 300 tokens/s: 600 + 600 tokens in 8 s = 150 tokens/s (not a mean of rates).
    records = [IntervalRecord(rank=0, host="h", device="CPU:0", step=s, steps=n, step_time_s=2.0, samples_per_sec=4.0,
                              voxels_per_sec=None, peak_memory_bytes=0, host_rss_bytes=0, loss=1.0, learning_rate=0.1,
                              end_time_s=0.0,
                              tokens_per_sec=rate) for s, n, rate in ((3, 3, 100.0), (4, 1, 300.0))]
    assert summarize_rank(0, "h", "CPU:0", records, 1.0, 1.0, "x").tokens_per_sec == 150.0


def test_recurrent_layers_in_chunks_compute_the_same_loss_and_gradients():
    """`steps_per_loop` runs each recurrent layer as consecutive loops over chunks of its steps. The
    reference is the model with one loop per layer, its weights copied across by name: the same loss
    and the same gradients (the chunked Bidirectional's two LSTMs are `encoder_0_forward` and
    `encoder_0_backward` there)."""
    keras.backend.clear_session()  # weight paths without the suffixes earlier models in this process add
    keras.utils.set_random_seed(0)
    whole = seq2seq(SOURCE + 1, TARGET, VOCABULARY, EMBEDDING, UNITS, 3)
    chunked = seq2seq(SOURCE + 1, TARGET, VOCABULARY, EMBEDDING, UNITS, 3, steps_per_loop=2)

    def name(path):
        return path.replace("encoder_0/forward_lstm", "encoder_0_forward").replace("encoder_0/backward_lstm",
                                                                                     "encoder_0_backward")

    reference = {name(v.path): v for v in whole.weights}
    assert sorted(reference) == sorted(name(v.path) for v in chunked.weights)
    for variable in chunked.weights:
        variable.assign(reference[name(variable.path)])
    inputs, labels = copy_task_batch(3, SOURCE + 1, TARGET, VOCABULARY, seed=1)
    with tf.GradientTape(persistent=True) as tape:
        losses = [masked_cross_entropy(labels, model(inputs)) for model in (whole, chunked)]
    expected = dict(zip((name(v.path) for v in whole.trainable_variables),
                        tape.gradient(losses[0], whole.trainable_variables)))
    np.testing.assert_allclose(float(losses[1]), float(losses[0]), rtol=1e-6)
    for variable, gradient in zip(chunked.trainable_variables, tape.gradient(losses[1], chunked.trainable_variables)):
        np.testing.assert_allclose(tf.convert_to_tensor(gradient).numpy(),
                                   tf.convert_to_tensor(expected[name(variable.path)]).numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=variable.path)


def test_each_chunk_is_a_loop_whose_lists_hold_its_own_steps_swapped_gated_and_unchanged():
    """7 source and 5 target steps in chunks of 2: the bidirectional layer runs 4 loops each way, the
    second encoder layer 4 and the decoder 3 (by hand: ceil(7/2) and ceil(5/2)); no list holds more
    than 2 steps. With every list swapped on split devices, training is unchanged and gated."""
    rewritten, _ = check_lms_on_split_devices(source=SOURCE + 1, steps_per_loop=2)
    graph = rewritten.planning.graph
    found = accumulators(graph)
    loops = {a.forward_loop for a in found}
    counts = {kind: sum(kind in loop for loop in loops) for kind in ("encoder_0_forward", "encoder_0_backward",
                                                                    "encoder_1", "decoder")}
    assert counts == {"encoder_0_forward": 4, "encoder_0_backward": 4, "encoder_1": 4, "decoder": 3}
    assert len(loops) == 15 and max(graph.tensor(a.tensor).tensor_list.length for a in found) == 2


def test_the_chunked_step_and_its_twin_sum_gradients_alike_at_any_batch():
    """The gating check runs a plan on the step's smallest twin, which must have the same ops under
    the same names. TensorFlow's tape sums a tensor's gradients early, once 5 are pending, when they
    are large (over 128 MiB), that is, at a large batch; with a 6th reader the paper-sized step then
    has an AddN (and every later AddN renumbered) that the twin lacks. Every decoder loop reads the
    encoder's outputs, so the config allows the decoder 5 loops. At batch 200,000 those outputs
    [B, 7, 8] float32 are 42.7 MiB, 5 of them over 128 MiB. Negative control: with 6 decoder loops,
    the sums differ; the config refuses that."""
    from launcher.config import Recipe, SettingError
    from launcher.rank.tasks import build_task

    def gradient_sums(shape, batch):
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        model = seq2seq(*shape, VOCABULARY, EMBEDDING, UNITS, LAYERS, steps_per_loop=2)

        @tf.function
        def step(inputs, labels):
            with tf.GradientTape() as tape:
                loss = masked_cross_entropy(labels, model(inputs, training=True))
            return tape.gradient(loss, model.trainable_variables)

        specs = (tf.TensorSpec([batch, sum(shape)], tf.int32), tf.TensorSpec([batch, shape[1]], tf.int32))
        graph = lms_tf.trace_step(step, *specs).graph
        return {op.name: sorted(op.inputs) for op in graph.ops.values() if op.type == "AddN"}

    def config(target):
        return ModelConfig(name="seq2seq", input_shape=[SOURCE + 1, target], vocabulary=VOCABULARY,
                           embedding=EMBEDDING, units=UNITS, encoder_layers=LAYERS, steps_per_loop=2)

    twin_shape = build_task(Recipe(model=config(10))).smallest_input_shape()
    assert twin_shape == [7, 9]  # by hand: as many chunks of 2 (4 and 5), the last of 1 step
    assert gradient_sums([7, 10], 200_000) == gradient_sums(twin_shape, 2)
    assert gradient_sums([7, 12], 200_000) != gradient_sums([7, 11], 2)
    with pytest.raises(SettingError, match="steps_per_loop: gives the decoder 6 loops over 12 target steps; at most 5"):
        config(12)
