"""app.fit by the model's own step, in this process (backend="local": the per-worker function of the Ray path, one
worker): Keras's initial_epoch and validation_freq, a two-optimizer model resumed from its checkpoint, every refusal
in one line before anything trains, tf.data pipelines run every epoch, labels as the compiled loss reads them, a
PyDataset's own parallel reading said unused, compute_metrics and predict_step overrides. The Ray runs are
tests/test_keras_step.py's."""

from __future__ import annotations

import inspect
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import app
from app.errors import UserError
from app.training.keras_callbacks import RECORD_KEYS

rng = np.random.default_rng(0)
X = rng.normal(size=(60, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int64")


def compiled():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class TwoOptimizers(keras.Model):
    """A GAN's shape: compile(d_optimizer, g_optimizer), its noise from a seed generator (state the checkpoint keeps)."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
        self.discriminator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        self.seed_generator = keras.random.SeedGenerator(3)
        self.tracker = keras.metrics.Mean(name="d_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, real):
        noise = keras.random.normal((tf.shape(real)[0], 2), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_loss = tf.reduce_mean(self.discriminator(self.generator(noise))) - tf.reduce_mean(self.discriminator(real))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.tracker.update_state(d_loss)
        return {"d_loss": self.tracker.result()}


def two_optimizers():
    keras.utils.set_random_seed(1)
    model = TwoOptimizers()
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02))
    return model


def test_initial_epoch_and_validation_freq_as_keras_counts_them(tmp_path):
    args = dict(batch_size=16, epochs=5, initial_epoch=1, validation_data=(X[:20], Y[:20]), validation_freq=2,
                shuffle=False)
    model = compiled()
    expected = model.fit(X, Y, verbose=0, **args)
    got = app.fit(compiled, X, Y, backend="local", output=str(tmp_path / "run"), verbose=0, **args)
    assert got.epoch == expected.epoch == [1, 2, 3, 4]
    assert list(got.history) == list(expected.history)
    for key, values in expected.history.items():  # val_ keys: the epochs validation_freq picks (2 and 4)
        np.testing.assert_allclose(got.history[key], values, atol=1e-6, err_msg=key)
    assert len(got.history["val_loss"]) == 2
    for a, b in zip(model.get_weights(), got.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def executions():
    model = compiled()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  steps_per_execution=3)
    return model


def test_a_steps_per_epoch_that_ends_inside_an_execution_is_said_and_a_whole_one_trains_as_keras(tmp_path):
    """Keras's fit reads a generator through one iterator and runs whole executions: steps_per_epoch=4 with
    steps_per_execution=3 trains 6 steps an epoch there. app.fit trains the 4 it was given and says so; with
    steps_per_epoch=6 the two agree. (Arrays and datasets, one pass an epoch: tests/test_keras_step.py.)"""
    def batches(passes):
        for _ in range(passes):
            for i in range(0, 60, 16):
                yield X[i:i + 16], Y[i:i + 16]

    app.fit(executions, batches(3), steps_per_epoch=4, epochs=2, backend="local", output=str(tmp_path / "split"),
            verbose=0)
    assert ("steps_per_epoch 4 is not a multiple of the model's steps_per_execution 3: Keras's fit would run 6 steps "
            "an epoch") in (tmp_path / "split" / "train.log").read_text()
    model = executions()
    expected = model.fit(batches(3), steps_per_epoch=6, epochs=2, verbose=0)
    got = app.fit(executions, batches(3), steps_per_epoch=6, epochs=2, backend="local", output=str(tmp_path / "whole"),
                  verbose=0)
    assert int(got.model.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 12
    for key, values in expected.history.items():
        np.testing.assert_allclose(got.history[key], values, atol=1e-6, err_msg=key)
    for a, b in zip(model.get_weights(), got.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_two_optimizer_model_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path):
    whole = app.fit(two_optimizers, X, batch_size=20, epochs=3, shuffle=False, backend="local",
                    output=str(tmp_path / "whole"), verbose=0)
    app.fit(two_optimizers, X, batch_size=20, epochs=2, shuffle=False, backend="local",
            output=str(tmp_path / "parts"), verbose=0)
    resumed = app.fit(two_optimizers, X, batch_size=20, epochs=3, shuffle=False, backend="local",
                      output=str(tmp_path / "parts"), resume=True, verbose=0)
    assert resumed.epoch == [0, 1, 2] and resumed.history["d_loss"] == pytest.approx(whole.history["d_loss"], abs=1e-6)
    for a, b in zip(whole.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # Both optimizers' state is in the checkpoint: 3 steps per epoch, 3 epochs each.
    assert [int(o.iterations.numpy()) for o in (resumed.model.d_optimizer, resumed.model.g_optimizer)] == [9, 9]
    assert (tmp_path / "whole" / "checkpoint").is_dir() and (tmp_path / "whole" / "history.csv").is_file()


def _ragged():
    yield X[:10], Y[:10]
    yield X[10:20, :3], Y[10:20]


@pytest.mark.parametrize("kwargs, message", [
    (dict(x=X, y=Y, class_weight=np.array([1.0, 2.0])), "class_weight=dict(enumerate(weights))"),
    (dict(x=(b for b in [(X, Y)]), epochs=2), "give steps_per_epoch"),
    (dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat()), "with no end (repeat())"),
    (dict(x=X, y=Y, validation_data=(X,)), "give both the same x (and y) structure"),
    (dict(x=X, y=Y, validation_freq=0), "validation_freq must be a positive integer"),
    (dict(x=X, y=Y, batch_size=-1), "batch_size must be a positive integer, or None for Keras's default (got -1)"),
    (dict(x=X, y=Y, steps_per_epoch=0), "steps_per_epoch must be a positive integer, or None for Keras's default"),
    (dict(x=_ragged()), "change structure or shape from one batch to the next (batch 2)"),
    (dict(x=X, y=Y, initial_epoch=3, epochs=3), "initial_epoch must be an integer from 0 to epochs - 1 = 2"),
    (dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), validation_split=0.2),
     "validation_split takes the last rows of arrays"),
    (dict(x=tf.data.Dataset.from_tensor_slices(X).batch(8)), "compiled with a loss but x has no labels (y)"),
    (dict(x=X, batch_size=8), "compiled with a loss but x has no labels (y)"),
    (dict(x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8), audit_sample_ids=True),
     "a tf.data.Dataset's elements carry none"),
    (dict(x=X, y=np.array(["no", "yes"])[Y]), "y holds strings (<U3, e.g. 'yes'), and Keras's fit takes numbers"),
    (dict(x=X, y=Y, validation_data=(X, np.array(["no", "yes"], dtype=object)[Y])),
     "validation_data's y holds strings (object, e.g. 'yes')"),
    # Keras's own refusals, which it raises deep in a batch or at the first step on every worker: one line here.
    (dict(x=np.array([object()] * len(Y)), y=Y), "x is an array of Python objects (dtype object, shape "
     f"({len(Y)},), the first a 'object'), and Keras's fit takes numbers from arrays"),
    (dict(x={"features": X}, y=Y), "x: a dict keyed by 'features', and the model's inputs are named"),
    (dict(x=X, y=list(Y)), f"y is a list of {len(Y)} numbers, which Keras reads as {len(Y)} separate arrays (one "
     "per output): give np.asarray(y)"),
    # Text for a model that vectorizes it itself: Keras's array adapter (and its split) takes no strings; a
    # tf.data.Dataset carries them (tests/test_fit.py trains one).
    (dict(x=np.array(["a b", "c"])[Y], y=Y, validation_split=0.25),
     "x holds strings (<U3, e.g. 'c'), and Keras's fit takes numbers from arrays: map them to token ids first (a "
     "keras.layers.TextVectorization adapted to them), or, for a model that takes strings itself, give a "
     "tf.data.Dataset instead: tf.data.Dataset.from_tensor_slices((x, y)).batch(32)"),
])
def test_refused_in_one_line_before_anything_trains(tmp_path, kwargs, message):
    kwargs = {"epochs": 1, **kwargs}
    with pytest.raises(UserError, match=None) as refused:
        app.fit(compiled, backend="local", output=str(tmp_path / "never"), verbose=0, **kwargs)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "never").exists()


def dict_inputs():
    """A functional model built on a dict of inputs: Keras keys x by the dict's keys ("x1"), not the Input's name."""
    a = keras.Input((X.shape[1],), name="a")
    model = keras.Model({"x1": a}, keras.layers.Dense(2)(a))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_a_dict_x_is_keyed_as_the_model_keys_its_inputs(tmp_path):
    """x as a dict trains where Keras's fit takes it (the model's own dict keys), and a dict without them is one line
    before anything trains (Keras says "Missing data for input" at the first step, on every worker)."""
    trained = app.fit(dict_inputs, {"x1": X}, Y, epochs=1, backend="local", output=str(tmp_path / "ok"), verbose=0)
    assert len(trained.history["loss"]) == 1
    with pytest.raises(UserError) as refused:
        app.fit(dict_inputs, {"a": X}, Y, epochs=1, backend="local", output=str(tmp_path / "never"), verbose=0)
    assert str(refused.value) == ("x: a dict keyed by 'a', and the model's inputs are named 'x1' ('x1' missing): key x "
                                  "by the inputs' names, or give one array for a model of one input")
    assert not (tmp_path / "never").exists()


def test_the_audit_with_step_checkpoints_is_one_line_before_ray_starts(tmp_path):
    """(Step checkpoints are Ray Train's: the run would be on Ray.)"""
    with pytest.raises(UserError, match="--audit-sample-ids with --checkpoint-every-steps") as refused:
        app.fit(compiled, X, Y, num_workers=1, audit_sample_ids=True, checkpoint_every_steps=2,
                output=str(tmp_path / "never"), verbose=0)
    assert "\n" not in str(refused.value) and not (tmp_path / "never").exists()


def test_more_workers_than_this_machines_cpus_are_refused_before_ray_starts(tmp_path, monkeypatch):
    """On Ray with no cluster to join: the local Ray it would start cannot hold them, said at once (not after the
    workers' start timeout), as the product's own step says it."""
    import os

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    workers = (os.cpu_count() or 1) + 1
    with pytest.raises(UserError, match=f"{workers} workers x 1 CPUs need {workers} CPUs, but this machine has"):
        app.fit(compiled, X, Y, num_workers=workers, output=str(tmp_path / "never"), verbose=0)
    assert not (tmp_path / "never").exists()


def test_a_keyword_kerass_fit_does_not_take_is_one_line_saying_what_to_give(tmp_path):
    with pytest.raises(UserError, match="strategy: the product's own loop, which trains the model's layers, not its "
                                        "own train_step: leave them out"):
        app.fit(two_optimizers, X, epochs=1, strategy="parameter-server", output=str(tmp_path / "never"))
    # Keywords Keras's fit does not take, for a model of its own step or a compiled one: what to give instead.
    for model, kwargs, words in (
            (two_optimizers, {"per_replica_batch": 8}, "per_replica_batch: app.fit's batch_size is the global batch"),
            (compiled, {"global_batch": 8}, "global_batch: app.fit's batch_size is the global batch"),
            (compiled, {"hidden_units": [8]}, "hidden_units sizes the built-in models"),
            (compiled, {"num_ps": 2}, "num_ps: for a pipeline (backend='local', strategy='pipeline') or parameter"),
            (compiled, {"val_fraction": 0.1}, "with x a ndarray, give validation_split or validation_data")):
        with pytest.raises(UserError, match=re.escape(words)):
            app.fit(model, X, Y, epochs=1, output=str(tmp_path / "never"), **kwargs)
    # Tensor parallel on Keras's fit cuts the state of one optimizer (this one holds its compile()'s default and its
    # own two); with ZeRO, the state would be cut twice.
    with pytest.raises(UserError, match="tensor_parallel=2 splits the state of the model's one optimizer, and "
                                        "two_optimizers holds 3: compile it with one optimizer"):
        app.fit(two_optimizers, X, epochs=1, tensor_parallel=2, output=str(tmp_path / "never"))
    with pytest.raises(UserError, match="tensor_parallel=2 with shard_optimizer: each splits the optimizer's state"):
        app.fit(compiled, X, Y, tensor_parallel=2, shard_optimizer=1, output=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def _pipeline(seed=None):
    """A keras.io-style input pipeline: shuffled every pass, a random augmentation, batched (ids ride along)."""
    ds = tf.data.Dataset.from_tensor_slices((X, np.arange(60))).shuffle(60, seed=seed)
    return ds.map(lambda x, i: (x + tf.random.uniform((4,)), i)).batch(16)


def test_a_tf_data_pipeline_runs_every_epoch_on_every_worker_each_row_once():
    """Each worker rebuilds the pipeline and takes its part of every batch: per pass every row once across the
    workers, reshuffled and augmented anew every pass (as fit() iterates a dataset), a seedless shuffle made the
    same on every worker."""
    from app.data import keras_inputs

    for seed in (7, None):
        data = keras_inputs.read(_pipeline(seed), batch_size=None, rerun=True)
        assert data.pipeline is not None and data.read_once == "" and data.num_batches == 4

        def passes(rank, data=data):
            ds, _ = data.worker_dataset(range(3), 0, rank, 2, training=True)
            return [list(ds.as_numpy_iterator()) for _ in range(3)]

        ranks = [passes(0), passes(1)]
        ids = [[np.concatenate([b[1] for b in one]) for one in r] for r in ranks]
        for e in range(3):
            assert sorted(np.concatenate([ids[0][e], ids[1][e]])) == list(range(60)), (seed, e)  # once across both
        assert not np.array_equal(ids[0][0], ids[0][1])  # reshuffled every pass
        x_of = [{i: x for b in ranks[0][e] for x, i in zip(*b)} for e in range(2)]
        common = set(x_of[0]) & set(x_of[1])
        assert common and all(not np.allclose(x_of[0][i], x_of[1][i]) for i in common)  # augmented anew


@pytest.mark.parametrize("counted", [True, False])
def test_a_reshuffling_tf_data_pipeline_trains_as_keras_fit_weight_for_weight_whole_or_resumed(tmp_path, counted):
    """fit() draws a dataset's passes in its own pattern (app.data.keras_inputs.keras_passes_before), which depends
    on whether it knows the number of batches (a filter hides it); a resumed run goes on with the passes of the
    epochs it has not trained."""
    def pipeline():
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(60, seed=3).map(lambda x, y: (2 * x, y)).batch(16)
        return ds if counted else ds.filter(lambda x, y: True)

    model = compiled()
    expected = model.fit(pipeline(), epochs=4, verbose=0)
    whole = app.fit(compiled, pipeline(), epochs=4, backend="local", output=str(tmp_path / "whole"), verbose=0)
    app.fit(compiled, pipeline(), epochs=2, backend="local", output=str(tmp_path / "parts"), verbose=0)
    resumed = app.fit(compiled, pipeline(), epochs=4, backend="local", output=str(tmp_path / "parts"), resume=True,
                      verbose=0)
    for got in (whole, resumed):
        for key, values in expected.history.items():
            np.testing.assert_allclose(got.history[key], values, atol=1e-6, err_msg=key)
        for a, b in zip(model.get_weights(), got.model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-6)


def _reads_text():
    """keras.io's text classification: the model takes strings and vectorizes them itself."""
    keras.utils.set_random_seed(1)
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=3)
    vectorize.adapt(["good fine film", "bad dull film", "fine", "dull"])
    text = keras.Input((1,), dtype="string")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(vectorize(text)))
    model = keras.Model(text, keras.layers.Dense(1, activation="sigmoid")(pooled))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def test_a_model_that_reads_strings_trains_on_a_tf_data_of_them_as_model_fit(tmp_path):
    """Keras's fit takes strings from a tf.data.Dataset (not from arrays, refused above with this fix)."""
    words = np.array([["bad dull film"], ["good fine film"]])[Y]

    def text():
        return tf.data.Dataset.from_tensor_slices((words, Y.astype("float32"))).batch(16)

    history = app.fit(_reads_text, text(), epochs=3, validation_data=text(), backend="local",
                      output=str(tmp_path / "run"), verbose=0)
    model = _reads_text()
    _as_model_fit(history, model.fit(text(), epochs=3, validation_data=text(), verbose=0), model)
    assert history.history["val_accuracy"][-1] == 1.0


def test_a_nan_in_x_is_not_taken_for_a_metric_whose_state_does_not_add_up():
    """Keras's fit trains a model the user compiled on a NaN feature (its loss NaN, as model.fit's): the driver's
    check of the metrics' states over a batch's halves (run before 2 workers start) takes NaN as equal to NaN."""
    from app.training.keras_sync import check_additive

    x = X.copy()
    x[3, 1] = np.nan
    check_additive(compiled(), (x[:16], Y[:16]), keras_steps=True)


def test_the_plan_says_over_which_rows_each_batch_norm_normalizes():
    from app.training.sync_batch_norm import plan_lines

    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(synchronized=True),
                              keras.layers.Dense(3), keras.layers.BatchNormalization()])
    assert plan_lines(model, 2, 16) == [
        "batch normalization: 1 synchronized layer(s) normalize over the global batch (their sums all-reduced over "
        "the workers at each call); 1 layer(s) normalize over each worker's part of the global batch (16 rows), as "
        "Keras does under a strategy: BatchNormalization(synchronized=True) normalizes over the global batch"]
    assert plan_lines(model, 1, 16) == [] and plan_lines(compiled(), 2, 16) == []


def test_the_plan_names_the_built_in_options_the_model_does_not_take(tmp_path):
    """--sync-batch-norm with the mlp (which has no batch norm) sizes nothing: the plan says so, and trains on (a
    config file may hold several models' options), on Keras's fit or the parameter servers' loop; options its model
    takes, or left at their defaults, say nothing."""
    from app.config import build_config
    from app.run.api import dry_run

    def plan(**fields):
        return dry_run(build_config(None, {"backend": "local", "epochs": 1, "output": str(tmp_path / "p"), **fields}))

    assert ("options: --sync-batch-norm, --num-heads size nothing here: mlp does not take them (it takes "
            "hidden_units)") in plan(model="mlp", sync_batch_norm=True, num_heads=2, hidden_units=[8])
    assert not [line for line in plan(model="cnn", sync_batch_norm=True, hidden_units=[256, 128])  # mlp's default
                if line.startswith("options:")]
    # The parameter servers' own loop plans it too (a dry run: no Ray starts).
    assert "options: --conv-filters size nothing here: mlp does not take it (it takes hidden_units)" in plan(
        model="mlp", backend="ray", strategy="parameter-server", conv_filters=[4, 8])


def test_a_pipeline_that_cannot_run_on_every_worker_is_read_once_and_says_why(tmp_path):
    from app.data import tf_pipeline

    records = str(tmp_path / "rows.tfrecord")
    with tf.io.TFRecordWriter(records) as w:
        w.write(b"x")
    both = tf.data.Dataset.sample_from_datasets([tf.data.Dataset.range(4), tf.data.Dataset.range(4)]).batch(2)
    cases = {
        "calls Python": tf.data.Dataset.from_generator(lambda: iter(range(3)), output_types=tf.int64),
        "caches to a file": tf.data.Dataset.range(4).batch(2).cache(str(tmp_path / "cache")),
        "picks elements at random": both,
        "random filter": tf.data.Dataset.range(8).filter(lambda i: tf.random.uniform(()) > 0.5).batch(2),
        "repeats without end": tf.data.Dataset.range(3).batch(2).repeat(),
        "not batches": tf.data.Dataset.range(3),
    }
    for words, ds in cases.items():
        pipeline, why = tf_pipeline.serialise(ds)
        assert pipeline is None and words.split()[-1] in why, (words, why)
    assert "caches to a file" in tf_pipeline.serialise(cases["caches to a file"])[1]
    assert tf_pipeline.serialise(_pipeline().cache())[1] == ""  # a cache in memory is the same everywhere
    # A pipeline that reads files runs on every worker, which reads them itself; the plan names them.
    reads, why = tf_pipeline.serialise(tf.data.TFRecordDataset(records).batch(2))
    assert why == "" and reads.files == (records,)
    from app.run import keras_plan

    data = __import__("app.data.keras_inputs", fromlist=["read"]).read(
        tf.data.Dataset.from_generator(lambda: ((X[i:i + 8], Y[i:i + 8]) for i in range(0, 60, 8)),
                                       output_signature=(tf.TensorSpec((None, 4)), tf.TensorSpec((None,), tf.int64))),
        batch_size=None, rerun=True)
    plan = "\n".join(keras_plan.plan_lines(compiled(), data, None, 1, 1, None))
    assert "read once here, as its first pass: it calls Python" in plan


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return X[i * 10:(i + 1) * 10], Y[i * 10:(i + 1) * 10]


def test_a_py_datasets_own_parallel_reading_is_said_to_be_unused(tmp_path, caplog):
    """A PyDataset is read once in the calling process: its workers / use_multiprocessing do not apply, and the plan
    says so in one line; it still trains as model.fit trains it."""
    import logging

    with caplog.at_level(logging.INFO):
        history = app.fit(compiled, _Batches(workers=2, use_multiprocessing=True), epochs=1, shuffle=False,
                          backend="local", output=str(tmp_path / "run"), verbose=0)
    keras_history = compiled().fit(_Batches(), epochs=1, shuffle=False, verbose=0)
    assert history.history["loss"] == pytest.approx(keras_history.history["loss"], abs=1e-6)
    assert "x: a PyDataset, read once here in the calling process, one batch after another: its workers=2, " \
           "use_multiprocessing=True are not used" in caplog.text


def _logits(loss, units, metric):
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=[metric])
        return model
    return build


def _as_model_fit(history, keras_history, model) -> None:
    """app.fit's History and trained weights are model.fit's (``keras_history``, ``model``), within 1e-6 (of the
    value: a float32 mean of 1e4 differs in its last bit when summed in another order)."""
    assert list(history.history) == list(keras_history.history) and history.params == keras_history.params
    for key, values in keras_history.history.items():
        assert history.history[key] == pytest.approx(values, rel=1e-6, abs=1e-6), key
    for a, b in zip(history.model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("build, y", [
    (_logits(keras.losses.SparseCategoricalCrossentropy(from_logits=True), 10, "accuracy"),
     (X[:, 0] > 0).astype("float32") * 7),
    (_logits("mse", 1, "mae"), (np.arange(60) % 3).astype("int64")),
    (_logits(keras.losses.CategoricalCrossentropy(from_logits=True), 2, "accuracy"), np.eye(2, dtype="int32")[Y]),
], ids=["float class ids, sparse loss", "int targets, mse", "one-hot ints, categorical loss"])
def test_the_compiled_loss_reads_the_labels_as_they_are(tmp_path, build, y):
    """No task, label encoding or target count guessed from the labels for a compiled model: Keras's loss reads
    them (float class ids with a sparse loss over 10 logits, int targets with MSE, one-hot ints)."""
    history = app.fit(build, X, y, batch_size=16, epochs=2, shuffle=False, backend="local",
                      output=str(tmp_path / "run"), verbose=0)
    model = build()
    keras_history = model.fit(X, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _as_model_fit(history, keras_history, model)


def _uncompiled(units, activation=None):
    def build():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation=activation)])

    return build


def _binary_accuracy(threshold):
    return lambda: keras.metrics.BinaryAccuracy(name="accuracy", threshold=threshold)


@pytest.mark.parametrize("build, y, loss, metric", [
    (_uncompiled(3), (np.arange(60) % 3).astype("int64"), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
     lambda: "accuracy"),
    (_uncompiled(3, "softmax"), (np.arange(60) % 3).astype("float32"), keras.losses.SparseCategoricalCrossentropy(),
     lambda: "accuracy"),
    (_uncompiled(1, "sigmoid"), Y, keras.losses.BinaryCrossentropy(), _binary_accuracy(0.5)),
    (_uncompiled(1), Y.astype(bool), keras.losses.BinaryCrossentropy(from_logits=True), _binary_accuracy(0.0)),
    (_uncompiled(2, "softmax"), np.eye(2, dtype="float32")[Y], keras.losses.CategoricalCrossentropy(),
     lambda: "accuracy"),
    (_uncompiled(1), X[:, 0] * 2.0, keras.losses.MeanSquaredError(), lambda: "mae"),
    (_uncompiled(1), X[:, 0] * 0.5, keras.losses.MeanSquaredError(), lambda: "mae"),
], ids=["class ids, logits", "float class ids, softmax", "0/1, sigmoid", "booleans, one logit", "one-hot, softmax",
        "float targets", "float targets near 0"])
def test_a_model_that_compiles_nothing_is_compiled_with_the_tasks_defaults_and_trains_as_model_fit(
        tmp_path, build, y, loss, metric):
    """The product's compile() for a model that compiles nothing, per label kind (app.training.default_compile):
    Keras's fit with that compile, weight for weight; optimizer and base_lr as asked, the rate as it is. Float
    targets of a mean square above 1 weigh the loss by 1 / it; those near 0 leave it unweighted."""
    square = float(np.mean(np.square(y.astype("float64")))) if y.dtype.kind == "f" and y.ndim == 1 else 0.0
    weight = 1 / square if isinstance(loss, keras.losses.MeanSquaredError) and square > 1 else None
    history = app.fit(build, X, y, batch_size=16, epochs=2, shuffle=False, backend="local", optimizer="adam",
                      base_lr=0.01, lr_scaling="none", warmup_epochs=0, lr_decay="constant",
                      output=str(tmp_path / "run"), verbose=0)
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, loss_weights=weight, metrics=[metric()])
    keras_history = model.fit(X, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    _as_model_fit(history, keras_history, model)


def test_a_built_in_model_on_arrays_is_sized_by_them_and_trains_as_model_fit(tmp_path):
    """app.fit("mlp", x, y): the built-in sized by the arrays (x's shape, one output per class id), compiled with
    the defaults, trained by Keras's fit as model.fit trains that model so compiled; its options as keywords."""
    from app.models import build_mlp

    y = (np.arange(60) % 3).astype("int64")
    history = app.fit("mlp", X, y, hidden_units=[8], batch_size=16, epochs=2, shuffle=False, backend="local",
                      optimizer="adam", base_lr=0.01, lr_scaling="none", warmup_epochs=0, lr_decay="constant",
                      output=str(tmp_path / "run"), verbose=2)  # History.params has it, as Keras's
    keras.utils.set_random_seed(0)  # the run's seed, set before each worker builds the model
    # The run gives the built-in its training rows' moments (validation_split=0: every row is a training row).
    model = build_mlp((4,), 3, hidden_units=[8], feature_mean=X.mean(0), feature_variance=X.var(0))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    keras_history = model.fit(X, y, batch_size=16, epochs=2, shuffle=False, verbose=2)
    _as_model_fit(history, keras_history, model)
    # Float targets far from 0: the mlp predicts in their units (its output scaled by their standard deviation,
    # shifted by their mean), compiled with its mean squared error weighted by 1 / their variance. All three are the
    # rows validation_split leaves for training, as Keras cuts them (the first 45 of 60).
    t = (5e4 + 1e4 * X @ np.array([1.0, -2.0, 0.5, 0.0])).astype("float32")
    history = app.fit("mlp", X, t, hidden_units=[8], batch_size=16, epochs=2, shuffle=False, backend="local",
                      validation_split=0.25, lr_scaling="none", warmup_epochs=0, lr_decay="constant",
                      output=str(tmp_path / "targets"), verbose=2)
    keras.utils.set_random_seed(0)
    model = build_mlp((4,), 1, hidden_units=[8], feature_mean=X[:45].mean(0), feature_variance=X[:45].var(0),
                      target_mean=float(t[:45].astype("float64").mean()),
                      target_variance=float(t[:45].astype("float64").var()))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mean_squared_error",
                  loss_weights=1 / float(t[:45].astype("float64").var()), metrics=["mae"])
    keras_history = model.fit(X, t, batch_size=16, epochs=2, shuffle=False, validation_split=0.25, verbose=2)
    _as_model_fit(history, keras_history, model)
    assert history.history["val_loss"][-1] < 0.5 and history.history["val_mae"][-1] < 0.5 * t.std()
    with pytest.raises(UserError, match="the built-in cnn does not take hidden_units"):
        app.fit("cnn", X, y, hidden_units=[8], backend="local", output=str(tmp_path / "cnn"), verbose=0)
    # Prices stored as integers are no class ids: 50,001 classes for 60 rows is one line, with the fix.
    with pytest.raises(UserError, match=r"y: integer labels up to 50,000 make 50,001 classes for the mlp, more than "
                                        r"the 60 rows: give y as floats \(y.astype\('float32'\)\)"):
        app.fit("mlp", X, np.where(X[:, 0] > 0, 50_000, 20_000), backend="local", output=str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()


ROWS = np.random.default_rng(1).normal(size=(400, 4)).astype("float32")
TARGETS = np.stack([ROWS @ np.array([1.0, 2.0, 0.0, 1.0]), 1e3 + 300 * ROWS[:, 2]], axis=1).astype("float32")


def _two_targets():
    """A data function of two float targets on scales far apart (near 0 and near 1,000), its validation rows its
    own."""
    return {"train": (ROWS[:320], TARGETS[:320]), "val": (ROWS[320:], TARGETS[320:])}


def test_the_built_in_mlp_predicts_several_targets_each_in_its_units(tmp_path):
    """The command line's route with a data function of two targets (app.train, as jobs/train.py --dataset
    data.py:fn): an output per target, each scaled by its own training rows' mean and standard deviation, the
    default loss weighted by 1 / the mean of their variances."""
    result = app.train(model="mlp", data=_two_targets, backend="local", epochs=5, hidden_units=[16],
                       output=str(tmp_path / "run"))
    model = keras.saving.load_model(tmp_path / "run" / "model.keras", compile=False)
    assert model.output_shape == (None, 2) and result["task"] == "regression"
    layer = model.get_layer("in_target_units")
    y = TARGETS[:320].astype("float64")
    np.testing.assert_allclose(layer.offset, y.mean(0), rtol=1e-6)
    np.testing.assert_allclose(np.square(layer.scale), y.var(0), rtol=1e-5)
    assert result["metrics"]["val_loss"] < 0.2  # a loss of 1 is predicting the targets' means


def test_a_model_that_compiles_nothing_and_that_no_default_fits_is_one_line(tmp_path):
    a = keras.Input((4,))

    def two_outputs():
        return keras.Model(a, {"p": keras.layers.Dense(2)(a), "q": keras.layers.Dense(1)(a)})

    for build, y, message in [(_uncompiled(3), None, "the model compiles nothing and x has no labels (y)"),
                              (two_outputs, {"p": Y, "q": X[:, 0]}, "the product's defaults are for one output; "
                               "compile it in the model function"),
                              (_uncompiled(3), X[:, 0], "its labels are float32 of shape () per example and its "
                               "output (3,): no default loss takes both")]:
        with pytest.raises(UserError) as e:
            app.fit(build, X, y, backend="local", output=str(tmp_path / "run"), verbose=0)
        assert message in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "run").exists()


def test_app_train_on_files_compiles_a_model_that_compiles_nothing_as_app_fit_does(tmp_path):
    """The command line's route (app.train, as jobs/train.py --model own.py:build --dataset rows.parquet): the same
    compile and Keras's fit; Keras's keys in the record."""
    import pandas as pd

    pd.DataFrame({**{f"f{i}": X[:, i] for i in range(4)}, "label": Y}).to_parquet(tmp_path / "rows.parquet")
    result = app.train(model=_uncompiled(2), data=str(tmp_path / "rows.parquet"), backend="local", epochs=2,
                       output=str(tmp_path / "run"))
    assert set(result["final"]) - set(RECORD_KEYS) == {"accuracy", "loss"}
    assert "compiled with the classification defaults: loss sparse_categorical_crossentropy (from logits)" in \
        (tmp_path / "run" / "train.log").read_text()


def test_app_fit_with_a_data_function_trains_by_kerass_fit_and_returns_kerass_history(tmp_path):
    """A data function as x, a model function of no arguments: the run a config makes (app.run.config_run: the
    seeded val_fraction held out of the function's arrays), returned as Keras's History."""
    def rows():
        return X, Y

    history = app.fit(_uncompiled(2), rows, epochs=2, backend="local", output=str(tmp_path / "run"), verbose=0)
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"] and history.epoch == [0, 1]
    assert history.result["metrics"]["val_accuracy"] == history.history["val_accuracy"][-1]
    assert history.model.count_params() == _uncompiled(2)().count_params()


def compiled_by_name():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("build, flags, optimizer", [
    # its compiled SGD(0.1), at the rate and momentum given
    (compiled, {"base_lr": 0.02, "momentum": 0.5}, lambda: keras.optimizers.SGD(0.02, momentum=0.5)),
    # an optimizer compile() was given by name, at the rate given
    (compiled_by_name, {"base_lr": 0.003}, lambda: keras.optimizers.Adam(0.003)),
    # the product's optimizer in its place, the LR rule (on by default for it) set to leave the rate as it is
    (compiled, {"optimizer": "adam", "base_lr": 0.01, "lr_scaling": "none", "warmup_epochs": 0,
                "lr_decay": "constant"}, lambda: keras.optimizers.Adam(0.01)),
])
def test_flags_change_a_compiled_models_optimizer_and_it_trains_as_model_fit_compiled_so(tmp_path, build, flags,
                                                                                          optimizer):
    """--optimizer, --base-lr, --momentum over a model the user compiled: Keras's fit of that model, its compile()
    kept but for what the flags change (app.training.default_compile.Recompile), weight for weight."""
    def rows():
        return {"train": (X, Y), "val": (X[:20], Y[:20])}

    out = tmp_path / "run"
    result = app.train(model=build, data=rows, backend="local", epochs=2, per_replica_batch=16, shuffle=False,
                       output=str(out), **flags)
    model = build()
    model.compile(optimizer=optimizer(), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    expected = model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, validation_data=(X[:20], Y[:20]), verbose=0)
    for key, values in expected.history.items():
        np.testing.assert_allclose([r[key] for r in result["history"]], values, rtol=1e-5, atol=1e-6, err_msg=key)
    for got, want in zip(keras.models.load_model(out / "model.keras").get_weights(), model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_flags_a_compiled_model_has_nothing_to_change_in_are_one_line(tmp_path):
    """Before anything trains (on Ray: before any Ray starts)."""
    def rows():
        return X, Y

    def nothing():
        return None

    for flags, message in [({"task": "regression"}, "--task chooses the compile of a model that compiles nothing"),
                           ({"from_logits": True}, "--from-logits goes with --loss"),
                           ({"num_classes": 3}, "--num-classes sizes the built-in models"),
                           ({"model": two_optimizers, "optimizer": "adam"}, "--optimizer: the product's compile, and"),
                           ({"model": nothing, "backend": "ray"}, "builds no Keras model")]:
        with pytest.raises(UserError, match=re.escape(message)):
            app.train(**{"model": compiled, "backend": "local", **flags}, data=rows, output=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


class OwnMetricsAndPredict(keras.Model):
    """keras.io's "customizing fit" shapes: compute_metrics adds a metric of its own, predict_step returns classes."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.logit_mae = keras.metrics.MeanAbsoluteError(name="logit_mae")

    def call(self, x):
        return self.dense(x)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        self.logit_mae.update_state(tf.one_hot(y, 2), y_pred)
        return super().compute_metrics(x, y, y_pred, sample_weight)

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return tf.argmax(self(x), axis=-1)


def _own_metrics_and_predict():
    keras.utils.set_random_seed(1)
    model = OwnMetricsAndPredict()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def test_compute_metrics_and_predict_step_run_as_keras_runs_them(tmp_path):
    history = app.fit(_own_metrics_and_predict, X, Y, batch_size=16, epochs=2, shuffle=False, backend="local",
                      validation_data=(X[:20], Y[:20]), output=str(tmp_path / "run"), verbose=0)
    model = _own_metrics_and_predict()
    keras_history = model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, validation_data=(X[:20], Y[:20]),
                              verbose=0)
    assert "logit_mae" in keras_history.history and list(history.history) == list(keras_history.history)
    for key, values in keras_history.history.items():
        assert history.history[key] == pytest.approx(values, abs=1e-6), key
    # history.model is the trained model, its own predict_step included (classes, not logits).
    np.testing.assert_array_equal(history.model.predict(X, verbose=0), model.predict(X, verbose=0))
    assert history.model.predict(X[:3], verbose=0).shape == (3,)


def test_labels_shapes_and_a_missing_compile_are_one_line_before_any_worker_starts(tmp_path):
    """What Keras's fit would pass into the graph (a NaN label, a class id past the model's outputs), validation
    examples of another shape, and a model with its own train_step that was never compiled: one line each."""
    import app
    from app.errors import UserError

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")

    def classifier():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    def regression():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model

    class Uncompiled(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

        def train_step(self, data):
            return {}

    ids, nan = np.zeros(64, "int64"), np.zeros(64, "float32")
    ids[[3, 9]], nan[5] = 3, np.nan
    cases = [((classifier, x, ids), {}, "class ids must be 0..2 for the model's 3 outputs; row(s) 3, 9 hold 3, 3"),
             ((regression, x, nan), {}, "labels are NaN in 1 row(s) (row 5)"),
             ((regression, x, np.ones(64, "float32")), {"validation_data": (x[:10, :3], np.ones(10))},
              "validation_data's x has examples of shape (3,) but the training data's (4,)"),
             ((Uncompiled, x), {}, "call compile(optimizer=...) in Uncompiled before it returns the Uncompiled")]

    # The user's own code raising (a PyDataset, a generator, the model function): its name, the error, where.
    class Corrupt(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 2:
                raise ValueError("batch 2 is corrupt")
            return x[:16], nan[:16]

    def batches():
        yield x[:16], nan[:16]
        raise KeyError("shard-7")

    def unbuildable():
        raise OSError("no weights file")

    line = inspect.getsourcelines(Corrupt)[1] + 6
    cases += [((regression, Corrupt()), {},
               f"x: Corrupt.__getitem__ raised ValueError: batch 2 is corrupt (test_keras_step_local.py line {line})"),
              ((regression, batches()), {"epochs": 1}, "x: the generator batches raised KeyError: 'shard-7' ("),
              ((unbuildable, x, nan), {}, "the model function test_labels_shapes_and_a_missing_compile_are_one_line_"
                                          "before_any_worker_starts.<locals>.unbuildable raised OSError: no weights")]
    for args, kwargs, said in cases:
        with pytest.raises(UserError, match=re.escape(said)):
            app.fit(*args, backend="local", output=str(tmp_path / "never"), verbose=0, **kwargs)
    assert not (tmp_path / "never").exists()


def test_app_evaluate_and_predict_take_the_arrays_of_an_app_fit_run(tmp_path):
    """A run of app.fit on arrays: app.evaluate scores every row of the arrays it is given, as Keras's evaluate does,
    app.predict predicts the arrays given; given none, one line says to (config.yaml cannot hold arrays)."""
    out = tmp_path / "run"
    app.fit(compiled, X, Y, batch_size=16, epochs=1, backend="local", output=str(out), verbose=0)
    scored = app.evaluate(str(out / "model.keras"), data=(X, Y))
    by_keras = keras.models.load_model(out / "model.keras").evaluate(X, Y, verbose=0, return_dict=True)
    assert scored["val_samples"] == len(X) and scored["dataset"] == "arrays given to app.evaluate"
    assert {k for k in scored if k.startswith("val_")} == {"val_loss", "val_accuracy", "val_samples"}
    for key, value in by_keras.items():
        assert scored[f"val_{key}"] == pytest.approx(value, rel=1e-5), key
    assert app.predict(str(out), data=X, output=str(tmp_path / "predicted"), backend="local")["rows"] == len(X)
    with pytest.raises(UserError, match=re.escape("was trained on data passed from Python (app:fit(x)), which its "
                                                  "config cannot read again: give the data")):
        app.evaluate(str(out / "model.keras"))


class OwnStepBugs(keras.Model):
    """A model of its own step, with the bugs a user writes in one: an unpacking that fails when Keras's fit traces
    the step, a matrix product whose shapes fail when it runs, and a test_step that fails as validation traces it."""

    def __init__(self, bug):
        super().__init__()
        self.bug, self.dense = bug, keras.layers.Dense(1)

    def call(self, inputs):
        return self.dense(inputs)

    def train_step(self, data):
        if self.bug == "unpack":
            x, y, w = data
        x, y = data
        with tf.GradientTape() as tape:
            out = self(x, training=True)
            loss = tf.reduce_mean(tf.matmul(out, y[:, None]) if self.bug == "matmul" else tf.square(out))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}

    def test_step(self, data):
        raise KeyError(f"no metric {self.bug}")


def test_an_error_in_the_models_own_step_is_one_line_naming_it_where_the_error_says(tmp_path):
    """Keras's fit traces and runs the model's own steps as graphs, whose errors name no code of the user's
    (autograph's "in user code:", TensorFlow's "Graph execution error"): one line names the model's method, the
    error and its file and line where the error says them; the whole traceback is in the run's log."""
    from app.errors import UserCodeError

    def own(bug):
        def build():
            model = OwnStepBugs(bug)
            model.compile(optimizer="sgd")
            return model
        return build

    first = inspect.getsourcelines(OwnStepBugs)[1]
    y = Y.astype("float32")
    cases = [("unpack", {}, f"OwnStepBugs.train_step raised ValueError: not enough values to unpack (expected 3, got 2) "
                            f"(test_keras_step_local.py line {first + 13})"),
             ("matmul", {}, "OwnStepBugs.train_step (or its test_step, call) raised InvalidArgumentError: Matrix "
                            "size-incompatible: In[0]: [16,1], In[1]: [16,1]"),
             ("validation", {"validation_data": (X, y)},
              f"OwnStepBugs.test_step raised KeyError: 'no metric validation' (test_keras_step_local.py line {first + 22})")]
    for bug, kwargs, said in cases:
        with pytest.raises(UserCodeError) as raised:
            app.fit(own(bug), X, y, batch_size=16, epochs=1, backend="local", output=str(tmp_path / bug), verbose=0,
                    **kwargs)
        log = tmp_path / bug / "train.log"
        assert str(raised.value) == f"{said} (full traceback in {log})"
        assert "Traceback (most recent call last)" in log.read_text()


def test_a_loss_that_goes_nan_or_below_zero_trains_on_as_model_fit_and_its_curves_still_draw(tmp_path):
    """Keras's fit trains on through a NaN loss (its History holds the NaN) and takes a loss below zero (a cosine
    similarity): the run does the same, and curves.png draws both, the loss on a linear scale."""
    def diverging():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e20), loss="mse")
        return model

    def cosine():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.CosineSimilarity())
        return model

    losses = {}
    for name, build, y in (("nan", diverging, X[:, 0]), ("cosine", cosine, np.eye(2, dtype="float32")[Y])):
        expected = build().fit(X, y, batch_size=20, epochs=2, shuffle=False, verbose=0).history["loss"]
        # tensorboard: the run's own records, on Keras's fit (its rows and its validation, none, as given)
        got = app.fit(build, X, y, batch_size=20, epochs=2, shuffle=False, backend="local",
                      output=str(tmp_path / name), verbose=0, tensorboard=name == "cosine")
        assert sorted(got.history) == ["loss"] and (tmp_path / name / "tensorboard").is_dir() == (name == "cosine")
        losses[name] = got.history["loss"]
        assert (got.result["backend"], got.result["strategy"], got.result["per_replica_batch"]) == \
            ("local", "default strategy (one replica)", 20)
        np.testing.assert_allclose(losses[name], expected, rtol=1e-5)  # NaN where Keras's is NaN
        assert (tmp_path / name / "curves.png").stat().st_size > 10_000, name
    assert np.isnan(losses["nan"][-1]) and max(losses["cosine"]) < 0


def test_a_built_in_model_plans_kerass_fit_on_ray_compiled_with_the_defaults_and_its_class_weights(tmp_path):
    """`jobs/train.py --class-weight balanced --dry-run` in this process (a dry run starts no Ray): the built-in model,
    built for the data, trains by Keras's fit on Ray, compiled with the task's defaults, its class weights said."""
    from app.config import build_config
    from app.run.api import dry_run

    plan = dry_run(build_config(None, {"class_weight": "balanced", "epochs": 1, "output": str(tmp_path / "out")}))
    assert plan[0].startswith("run: backend ray, collective all-reduce") and plan[1].startswith(
        "step: Keras's train_step and test_step for the compiled loss and metrics, run by model.fit on each of 2")
    # 64x256+256 + 256x128+128 + 128x10+10; the digits' pixels as they are (one scale: not standardised)
    assert "model: mlp, 50,826 parameters" in plan
    assert any(line.startswith("compile: the product builds the model, and compiles it with the classification "
                               "defaults") and line.endswith("(--optimizer, --base-lr, --momentum, --task, --loss, "
                                                             "--from-logits choose them)")
               for line in plan), plan
    weights = next(line for line in plan if line.startswith("class_weight: "))
    assert weights.count(": ") == 11 and "9: 0.978" in weights, weights  # balanced: rows / (classes x class's rows)
    assert not (tmp_path / "out").exists()


def _predicts_in_target_units():
    """Compiles nothing: the product compiles it with the regression defaults."""
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])


def test_a_model_that_compiles_nothing_trains_on_targets_of_any_scale_and_the_plan_says_how_to_reach_far_ones(
        tmp_path):
    """Unweighted, the default mean squared error of targets of mean 10 overflows at the default rate (NaN in the
    first or second epoch); weighted by 1 / their mean square it trains. Targets of mean 200,000 train finite too;
    the plan says how to reach targets far from 0 (a Rescaling at the model's end), and nothing for those near it."""
    rng = np.random.RandomState(0)
    x = rng.randn(256, 6).astype("float32")
    direction = x @ rng.randn(6, 1).astype("float32")
    for mean, std, epochs in ((10.0, 4.0, 4), (3.0, 1.0, 1), (2e5, 5e4, 1)):
        y = (direction / direction.std() * std + mean).astype("float32")
        out = tmp_path / f"mean{mean:g}"
        history = app.fit(_predicts_in_target_units, x, y, batch_size=64, epochs=epochs, validation_split=0.25,
                          backend="local", output=str(out), verbose=0).history
        assert np.isfinite(history["loss"]).all() and np.isfinite(history["val_loss"]).all(), history
        square = float(np.mean(np.square(y[:192].astype(np.float64))))  # the training rows (the last quarter validates)
        plan = (out / "train.log").read_text()
        assert f"loss mean_squared_error weighted by 1 / the targets' mean square ({square:.4g})" in plan, plan
        assert ("end the model in keras.layers.Rescaling(" in plan) == (square > 100), plan  # default_compile.FAR_TARGETS
    assert history["loss"][-1] <= 1.01  # predicting 0 is a loss of 1
