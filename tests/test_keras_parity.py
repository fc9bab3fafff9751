"""app.fit is model.fit: a compiled model trains with its own optimizer, learning rate (or schedule) and batch, as
Keras's own loop trains it, weight for weight; and on 2 Ray workers as on 1 (each step's global batch holds the
same rows whatever the number of workers).

A compiled model brings its step: app.fit runs Keras's own fit on every worker (app.run.keras_step). One fresh
script (the user's, joined to the session's Ray) trains each case with ``keras.Model.fit`` in its own
process and with ``app.fit`` on 1 (and 2) workers, from the same initial weights (set by the model function from a
seeded numpy generator) and the same order (``shuffle=False``), and writes the weights and histories. Each case puts
several of Keras's features in one model (one run checks them all): SGD with momentum, L2 regularisation, dropout
(off at evaluation) and class weights; Adam with a LearningRateSchedule, two named inputs and sample weights; both
on 499 rows in batches of 64, so every epoch ends with a short batch.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_job

SCRIPT = '''
import json
import sys

import keras
import numpy as np

import app

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (np.argmax(x[:, :3], axis=1) + (x[:, 3] > 1.2)).clip(0, 2)
xv = rng.normal(size=(128, 8)).astype("float32")
yv = np.argmax(xv[:, :3], axis=1)
weights = rng.uniform(0.5, 1.5, size=512).astype("float32")


def initial(model):
    """The same starting point in every process: weights from a seeded generator, not from Keras's initialisers."""
    start = np.random.default_rng(1)
    model.set_weights([start.normal(scale=0.4, size=w.shape).astype("float32") for w in model.get_weights()])
    return model


def sgd_l2_dropout():
    model = initial(keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dropout(0.3, seed=7),
        keras.layers.Dense(3, activation="softmax"),
    ]))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def adam_schedule_two_inputs():
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(16, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = initial(keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(h)))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=4, decay_rate=0.7)
    model.compile(optimizer=keras.optimizers.Adam(schedule),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def named(rows):
    return {"a": x[:rows, :5], "b": x[:rows, 5:]}


# name: (model function, its inputs of the first `rows` rows, validation inputs, extra fit arguments, worker counts).
# 499 rows in batches of 64: 7 whole batches, then a short one of 51 rows (25 + 26 on 2 workers).
CASES = {
    # Dropout draws its masks per replica: 2 workers draw other masks than 1 (each over its half of the batch).
    "sgd_momentum_l2_dropout_class_weights": (sgd_l2_dropout, lambda rows: x[:rows], xv,
                                              {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}, (1,)),
    "adam_schedule_two_inputs_sample_weights": (adam_schedule_two_inputs, named, {"a": xv[:, :5], "b": xv[:, 5:]},
                                                {"sample_weight": weights[:499]}, (1, 2)),
}
rows = 499
out = sys.argv[1]
found = {}
for name, (build, inputs, val_inputs, extra, workers) in CASES.items():
    common = dict(batch_size=64, epochs=2, shuffle=False, validation_data=(val_inputs, yv), **extra)
    model = build()
    history = model.fit(inputs(rows), y[:rows], verbose=0, **common)
    found[name] = {"keras": {"weights": [w.tolist() for w in model.get_weights()], "history": history.history,
                             "evaluate": model.evaluate(val_inputs, yv, batch_size=64, verbose=0, return_dict=True)}}
    for n in workers:
        run = app.fit(build, inputs(rows), y[:rows], num_workers=n, output=f"{out}/{name}-{n}", **common)
        found[name][n] = {"weights": [w.tolist() for w in run.model.get_weights()], "history": run.history,
                          "learning_rate": float(keras.ops.convert_to_numpy(run.model.optimizer.learning_rate)),
                          "keras_learning_rate": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
                          "steps": run.result["steps_per_epoch"], "dropped": run.result["dropped_samples_per_epoch"]}
json.dump(found, open(out + "/parity.json", "w"))
'''


@pytest.fixture(scope="module")
def parity(joined, tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    script = out / "keras_script.py"
    script.write_text(SCRIPT)
    p = run_job(str(script), str(out), timeout=900, env=joined)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((out / "parity.json").read_text()), p, out


def same_weights(a, b, what):
    assert len(a) == len(b) > 0, what
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(np.array(v), np.array(u), rtol=0, atol=1e-5, err_msg=f"{what}: weight {i}")


def same_history(keras_history, ours, what):
    for key, values in keras_history.items():
        assert key in ours, (what, key, sorted(ours))
        np.testing.assert_allclose(ours[key], values, rtol=0, atol=1e-5, err_msg=f"{what}: {key}")


CASES = ["sgd_momentum_l2_dropout_class_weights", "adam_schedule_two_inputs_sample_weights"]


@pytest.mark.parametrize("case", CASES)
def test_one_worker_trains_as_keras_fit_weight_for_weight(parity, case):
    found, *_ = parity
    keras_run, one = found[case]["keras"], found[case]["1"]
    same_weights(keras_run["weights"], one["weights"], f"{case}: keras fit vs app.fit on 1 worker")
    same_history(keras_run["history"], one["history"], f"{case}: history")
    # The compiled LR as it is (a number, or the schedule at the same step): no scaling, warmup or decay of the product's.
    assert one["learning_rate"] == pytest.approx(one["keras_learning_rate"], abs=1e-9)
    # Every row trained, every epoch: 8 steps, the last one short (499 - 7 x 64 = 51 rows).
    assert one["steps"] == 8 and one["dropped"] == 0
    # Trained weights moved (the comparison would be empty otherwise), and dropout is off at evaluation: the
    # validation loss is what keras's evaluate() says of the trained model.
    assert keras_run["history"]["loss"][-1] < keras_run["history"]["loss"][0]
    assert keras_run["history"]["val_loss"][-1] == pytest.approx(keras_run["evaluate"]["loss"], abs=1e-5)


@pytest.mark.parametrize("case", ["adam_schedule_two_inputs_sample_weights"])
def test_two_workers_train_as_one_with_the_same_global_batch(parity, case):
    found, *_ = parity
    one, two = found[case]["1"], found[case]["2"]
    same_weights(one["weights"], two["weights"], f"{case}: 1 vs 2 workers")
    same_history(one["history"], two["history"], f"{case}: 1 vs 2 workers")
    assert two["steps"] == 8 and two["dropped"] == 0


def test_the_plan_says_how_it_trains(parity):
    """app.fit prints only its epochs (as model.fit does); the run's plan heads each run's train.log."""
    _, p, out = parity
    adam = (out / "adam_schedule_two_inputs_sample_weights-2" / "train.log").read_text()
    assert ("step: Keras's train_step and test_step for the compiled loss and metrics, run by model.fit on each of 2 "
            "worker(s), gradients averaged over every global batch") in adam
    assert "data: 499 rows, examples of shape" in adam
    assert "8 steps per epoch, each global batch split over 2 workers, every row once per epoch" in adam
    assert "learning rate:" not in p.stdout + p.stderr
