"""The weights sharded over the workers too (shard_optimizer=3, app.training.zero_weights): 2 workers at stage 3 train
the weights of 2 unsharded workers and of Keras's model.fit in one process; checkpoints hold the whole model, so a
run resumes at another stage and worker count; the plan states each worker's bytes at every stage, and a run whose
stage does not fit the memory budget is refused with the stage that fits. One user script
(tests/scripts/zero3_runs.py) makes the Ray runs; the gathered layers' gradients, the cut and the arithmetic are
checked in this process."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO, close_weights, run_job, script_record, user_module

SCRIPT = REPO / "tests" / "scripts" / "zero3_runs.py"


@pytest.fixture(scope="module")
def runs(joined, tmp_path_factory):
    return script_record(SCRIPT, tmp_path_factory, "zero3.json", joined)


def _plan(run: dict) -> list[str]:
    return [line.split("app.plan: ", 1)[1] for line in run["plan"].splitlines() if "app.plan: " in line]


def test_two_workers_at_stage_3_train_the_weights_of_two_unsharded_workers_and_of_model_fit(runs):
    """Embedding, MultiHeadAttention, LayerNormalization, Conv1D and a softmax Dense (whose logits Keras's
    cross-entropy reads), Adam, 3 epochs of 120 token rows (a short last batch): every weight within 1e-5 of the
    unsharded run's and of model.fit's in one process; every layer cut (none whole), each worker holding half of the
    weights and of Adam's moments."""
    run = runs["attention"]
    close_weights(run["sharded"]["weights"], run["unsharded"]["weights"], atol=1e-5)
    close_weights(run["sharded"]["weights"], run["keras_fit"]["weights"], atol=1e-5)
    np.testing.assert_allclose(run["sharded"]["history"]["accuracy"], run["keras_fit"]["history"]["accuracy"],
                               atol=1e-6)
    plan = _plan(run["sharded"])
    assert any(line.startswith("shard_optimizer 3 (ZeRO): each of the 2 workers keeps 1/2 of every weight, gradient "
                               "and optimizer slot of 8 layer(s)") for line in plan), plan
    assert not any("whole on every worker" in line for line in plan)
    weights = sum(np.asarray(w).size for w in run["unsharded"]["weights"])
    parts = run["sharded"]["result"]["optimizer_parts_bytes"] // 4
    assert weights / 2 <= parts < weights / 2 + 15 * 2  # 15 weights, each part padded by at most one element
    counters = run["unsharded"]["result"]["optimizer_state_bytes"] - 2 * weights * 4
    assert run["sharded"]["result"]["optimizer_state_bytes"] == counters + 2 * parts * 4


def test_sgd_momentum_global_clipnorm_and_bf16_at_stage_3_are_the_unsharded_run(runs):
    """A model with its own train_step computing in bfloat16, SGD with momentum and global_clipnorm (the norm over
    every worker's parts), a batch norm between its Dense layers: the batch norm stays whole (named in the plan with
    why), the Dense layers are cut, and the weights are the unsharded run's within 1e-5 after 3 epochs."""
    run = runs["sgd_bf16"]
    close_weights(run["sharded"]["weights"], run["unsharded"]["weights"], atol=1e-5)
    np.testing.assert_allclose(run["sharded"]["history"]["loss"], run["unsharded"]["history"]["loss"], rtol=1e-5)
    plan = _plan(run["sharded"])
    assert "shard_optimizer 3: whole on every worker: batch_normalization (0.1 KiB: it updates state as it runs " \
           "(its non-trainable variables))" in plan
    assert run["sharded"]["result"]["optimizer_parts_bytes"] == 4 * (32 + 4 + 11 + 2)  # 9x7, 7, 7x3, 3 halved
    memory = next(line for line in plan if line.startswith("memory: each worker's weights"))
    assert all(f"stage {stage} " in memory for stage in range(4))


def test_a_stage_3_run_resumes_on_one_worker_unsharded_and_back_at_stage_3_as_if_never_stopped(runs):
    """Adam with clipnorm: 2 epochs at stage 3 on 2 workers, the third on 1 worker (its checkpoint held the whole
    model and state), the fourth at stage 3 on 2 workers again (each cut its part of the one worker's checkpoint):
    model.fit's weights after 2, 3 and 4 epochs."""
    run = runs["clipnorm"]
    for name, epochs in (("sharded_2", 2), ("resumed_1_worker", 3), ("resumed_sharded", 4)):
        close_weights(run[name]["weights"], run[f"keras_fit_{epochs}"]["weights"], atol=1e-5)
        assert len(run[name]["history"]["loss"]) == epochs
    assert run["resumed_1_worker"]["result"]["optimizer_parts_bytes"] == 0
    assert run["resumed_sharded"]["result"] == run["sharded_2"]["result"]


def _gradients(model, inputs):
    import tensorflow as tf

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            outputs = model(x)
            # a softmax's output carries its logits, which Keras's cross-entropy reads: through the gather too
            assert getattr(outputs, "_keras_logits", None) is not None
            loss = tf.add_n([tf.reduce_sum(tf.square(o)) for o in [outputs, outputs._keras_logits]])
        return loss, tape.gradient(loss, model.trainable_variables)

    return step(inputs)


def test_a_gathered_layer_computes_its_outputs_and_gradients_as_the_whole_layer():
    """Cut for one worker (the collectives are the identity), each kind of layer computes through its gathered
    weights, forward and again backward: the loss and every weight's gradient are those of the uncut model, the
    softmax's logits included. A layer called twice in one step (a shared Dense) gathers once for each call; the
    batch norm stays whole."""
    import keras
    import tensorflow as tf

    from app.training import zero_weights
    from app.training.collective import Collective

    def build():
        keras.utils.set_random_seed(3)
        ids = keras.Input((6,), dtype="int32")
        image = keras.Input((8, 8, 2))
        h = keras.layers.Embedding(20, 4)(ids)
        h = keras.layers.MultiHeadAttention(2, 3)(h, h)
        h = keras.layers.LayerNormalization()(h)
        shared = keras.layers.Dense(5, activation="tanh")
        a = shared(keras.layers.Flatten()(h))
        c = keras.layers.Conv2D(3, 3)(image)
        c = keras.layers.BatchNormalization()(c)
        b = shared(keras.layers.Flatten()(c)[:, :24])
        return keras.Model([ids, image], keras.layers.Dense(2, activation="softmax")(a + b))

    rng = np.random.default_rng(0)
    inputs = [tf.constant(rng.integers(0, 20, (5, 6)), tf.int32), tf.constant(rng.normal(size=(5, 8, 8, 2)), tf.float32)]
    whole, cut = build(), build()
    rows = type("Rows", (), {"value": tf.constant(1.0)})()
    weights = zero_weights.ShardedWeights.cut(cut, Collective(1), rows)
    assert {type(s.layer).__name__ for s in weights.shards} == {"Embedding", "EinsumDense", "LayerNormalization",
                                                                "Dense", "Conv2D"}
    assert all(zero_weights.is_shard(v) for v in cut.trainable_variables if "batch_normalization" not in v.path)
    loss_whole, grads_whole = _gradients(whole, inputs)
    loss_cut, grads_cut = _gradients(cut, inputs)
    assert float(loss_cut) == pytest.approx(float(loss_whole), rel=1e-6)
    for v, g, h in zip(whole.trainable_variables, grads_whole, grads_cut):
        np.testing.assert_allclose(np.ravel(tf.convert_to_tensor(h))[:v.numpy().size],
                                   np.ravel(tf.convert_to_tensor(g)), atol=1e-5, err_msg=v.path)


def test_what_stays_whole_names_why():
    """Layers whose weights a gather cannot stand in for: state updated as it runs, a constraint or a regularizer,
    a weight kept in a list (the product's ShardedEmbedding); the plain ones gather."""
    import keras

    from app.layers import ShardedEmbedding
    from app.training.zero_memory import why_whole

    def built(layer, shape):
        layer.build(shape)
        return layer

    assert why_whole(built(keras.layers.BatchNormalization(), (None, 4))).startswith("it updates state")
    assert why_whole(built(keras.layers.Dense(3, kernel_constraint="max_norm"), (None, 4))).startswith("a constraint")
    assert why_whole(built(keras.layers.Dense(3, kernel_regularizer="l2"), (None, 4))).startswith("a constraint")
    assert why_whole(built(ShardedEmbedding(10, 4, num_shards=2), (None, 3))) == \
        "it reads a weight that is not one of its attributes"
    for layer, shape in ((keras.layers.Dense(3), (None, 4)), (keras.layers.Conv1D(2, 3), (None, 5, 4)),
                         (keras.layers.Embedding(9, 2), (None, 3)), (keras.layers.LayerNormalization(), (None, 4))):
        assert why_whole(built(layer, shape)) is None


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), world=st.integers(1, 6), by_rows=st.booleans())
def test_every_element_of_a_weight_is_in_exactly_one_workers_part(shape, world, by_rows):
    """Flat parts, or an embedding's whole rows: the workers' parts put together in rank order are the weight, then
    zeros (less than one element, or one row, a worker)."""
    from app.training.zero_memory import part_of as _part
    from app.training.zero_weights import Shard

    part, part_shape = _part(shape, world, by_rows)
    shard = Shard(None, "", 0, tuple(shape), "w", "w", "float32", part, part_shape, 0)
    whole = np.arange(int(np.prod(shape)), dtype="float32").reshape(shape) + 1
    parts = [shard.mine(whole, rank) for rank in range(world)]
    assert all(p.shape == part_shape for p in parts)
    flat = np.concatenate([p.ravel() for p in parts])
    np.testing.assert_array_equal(flat[:whole.size], whole.ravel())
    row = int(np.prod(part_shape[1:]))  # 1 for flat parts
    assert not flat[whole.size:].any() and flat.size - whole.size < world * row  # less than a row a worker
    if by_rows and len(shape) > 1:
        assert part_shape[1:] == tuple(shape[1:])


def test_the_bytes_a_worker_holds_at_each_stage_are_the_arithmetic():
    """Dense 9->7->3 (94 weights) with Adam (two slots, 12 bytes of counters) on 2 workers: stage 0 holds the weights,
    their gradients and both moments; 1 and 2 half the moments; 3 half of everything, plus the largest layer (70
    weights) gathered with its gradient."""
    import keras

    from app.training.zero_memory import training_bytes

    model = keras.Sequential([keras.Input((9,)), keras.layers.Dense(7), keras.layers.Dense(3)])
    needs = training_bytes(model, keras.optimizers.Adam(), 2)
    parts = 32 + 4 + 11 + 2
    assert needs == {0: 4 * 94 * 4 + 12, 1: 2 * 94 * 4 + 2 * 47 * 4 + 12, 2: 2 * 94 * 4 + 2 * 47 * 4 + 12,
                     3: 4 * parts * 4 + 2 * 70 * 4 + 12}


MODEL = '''
import keras


def create_model():
    """Four Dense layers of 512: 0.8 M weights, Adam."""
    inputs = keras.Input((64,))
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(512, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model
'''


def test_a_model_over_the_memory_budget_is_refused_unsharded_and_trains_at_stage_3(tmp_path_factory, joined):
    """From the command line, each worker's budget 11 MiB (--memory-per-worker): unsharded the model's training
    needs 12.6 MiB a worker: refused in one line naming stage 3's figure, before any worker starts, nothing written
    (and a budget of 5 MiB, which even stage 3 does not fit: one line with its figure).
    At --shard-optimizer 3 (8.3 MiB) it trains, with the budget reserved from Ray; its model.keras is Keras's."""
    module = user_module(tmp_path_factory, "wide.py", MODEL)
    out = tmp_path_factory.mktemp("budget")
    argv = ["jobs/train.py", "--model", f"{module}:create_model", "--dataset", "synthetic", "--synthetic-shape", "64",
            "--synthetic-rows", "256", "--epochs", "1", "--memory-per-worker", str(11 / 1024)]
    refused = run_job(*argv, "--output", str(out / "refused"), timeout=200)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the model's training needs 12.6 MiB a worker at --shard-optimizer 0, more than the "
                           "11.0 MiB budget (--memory-per-worker); at --shard-optimizer 3 it needs 8.3 MiB"), line
    assert not (out / "refused").exists()
    argv[-1] = str(5 / 1024)  # a budget even stage 3 does not fit
    short = run_job(*argv, "--shard-optimizer", "3", "--output", str(out / "short"), timeout=200)
    assert short.returncode == 2 and short.stderr.strip().splitlines()[-1] == (
        "error: the model's training needs 8.3 MiB a worker at --shard-optimizer 3, more than the 5.0 MiB budget "
        "(--memory-per-worker): more workers, more memory a worker (--memory-per-worker), or a smaller model"), \
        short.stderr[-2000:]
    assert not (out / "short").exists()
    argv[-1] = str(11 / 1024)
    trained = run_job(*argv, "--shard-optimizer", "3", "--output", str(out / "trained"), timeout=400, env=joined)
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = json.loads((out / "trained" / "result.json").read_text())
    assert result["config"]["memory_per_worker"] == pytest.approx(11 / 1024)
    assert result["optimizer_parts_bytes"] == 4 * sum(-(-n // 2) for n in (64 * 512, 512, *[512 * 512, 512] * 3,
                                                                           5120, 10))
    import keras

    assert keras.models.load_model(out / "trained" / "model.keras").count_params() == 64 * 512 + 512 + 3 * (512 * 512
                                                                                                         + 512) + 5130


def test_stage_3_where_there_is_nothing_to_cut_or_it_cannot_combine(tmp_path):
    """One worker: nothing to shard, said once in the plan, and it trains unsharded. The parameter servers (they hold
    the variables apart) and tensor parallel (its split layers, named, compute through their devices' shards): one
    line each, before anything starts, nothing written, no Ray started."""
    import keras
    import ray

    import app
    from app.config import TrainConfig
    from app.errors import UserError

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="ff_in"),
                                  keras.layers.Dense(4, name="ff_out"), keras.layers.Dense(2, name="logits")])
        model.compile(optimizer="adam", loss="mse")
        return model

    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 2), "float32")
    one = app.fit(build, x, y, epochs=1, shard_optimizer=3, backend="local", output=str(tmp_path / "one"), verbose=0)
    assert "shard_optimizer 3: one worker, nothing to shard: it trains unsharded" in \
        (tmp_path / "one" / "train.log").read_text()
    assert one.result["optimizer_parts_bytes"] == 0
    with pytest.raises(ValueError, match="parameter servers already hold it apart"):
        TrainConfig(strategy="parameter-server", shard_optimizer=3)
    ray_before = ray.is_initialized()  # another test of this process may have joined the session's Ray
    with pytest.raises(UserError) as refused:
        app.fit(build, x, y, epochs=1, num_workers=2, shard_optimizer=3, tensor_parallel=2,
                tensor_layout=["ff_in=column", "ff_out=row"], output=str(tmp_path / "never"), verbose=0)
    assert str(refused.value).startswith("tensor_parallel=2 with shard_optimizer=3: ff_in, ff_out compute through")
    assert not (tmp_path / "never").exists() and ray.is_initialized() == ray_before
