"""app.fit: keras.Model.fit's arguments on Ray workers, from a script of the user's own.

The run is a fresh Python process running a file the test writes, with the model function defined in that
script's __main__ (it reaches the Ray workers by value), joined to the session's Ray. The refusals and the
Keras History mapping are checked in this process: they start nothing.
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


def build_model():  # what a Keras script builds; no compile, so the product compiles it with the task's defaults
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    start = np.random.default_rng(1)  # the same starting point in every process
    model.set_weights([start.normal(scale=0.4, size=w.shape).astype("float32") for w in model.get_weights()])
    return model


rng = np.random.default_rng(0)
x = rng.normal(size=(507, 4)).astype("float32")
y = np.argmax(x[:, :3], axis=1)
out = sys.argv[1]

split = app.fit(build_model, x, y, batch_size=64, epochs=2, validation_split=0.2, num_workers=2,
                output=out + "/split", verbose=2)
# Keras's cut: floor(507 * 0.8) = 405 training rows, the last 102 validate.
xv, yv = x[405:], y[405:]
p = split.model.predict(xv, verbose=0)
given = app.fit(build_model, x[:300], y[:300], epochs=2, shuffle=False, validation_data=(x[300:401], y[300:401]),
                num_workers=2, output=out + "/given", verbose=0)
# One model.fit process, the model compiled as the plan says: SGD(0.05, momentum 0.9) at global batch 32 / reference
# 32: nothing to warm up to (the warmup ramps from the unscaled rate to the scaled one, here the same), so 0.05 over
# the first epoch's 10 batches, then a cosine over the second's.
reference = build_model()
rate = keras.optimizers.schedules.CosineDecay(0.05, 10, warmup_target=0.05, warmup_steps=10)
reference.compile(optimizer=keras.optimizers.SGD(rate, momentum=0.9), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
keras_history = reference.fit(x[:300], y[:300], epochs=2, shuffle=False, validation_data=(x[300:401], y[300:401]),
                              verbose=0).history
json.dump({
    "history": split.history, "epoch": split.epoch, "result": split.result,
    "loss_on_last_rows": float(np.mean(keras.losses.sparse_categorical_crossentropy(yv, p))),
    "accuracy_on_last_rows": float(np.mean(np.argmax(p, axis=1) == yv)),
    "given_history": given.history, "keras_history": keras_history,
    "given_weights": [w.tolist() for w in given.model.get_weights()],
    "keras_weights": [w.tolist() for w in reference.get_weights()],
}, open(out + "/fit.json", "w"))
'''



def test_fit_from_a_fresh_script_compiles_a_model_that_compiles_nothing_and_trains_it_as_model_fit(joined, tmp_path):
    """A model function that compiles nothing, as a Keras script writes it: the product compiles it with the task's
    defaults (the plan says which) and Keras's fit trains it on 2 workers, weight for weight as one model.fit
    process of the model so compiled; validation_split validates the last rows, as Keras cuts them."""
    script = tmp_path / "keras_script.py"
    script.write_text(SCRIPT)
    p = run_job(str(script), str(tmp_path), timeout=400, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads((tmp_path / "fit.json").read_text())

    history = got["history"]
    assert list(history) == ["accuracy", "loss", "val_accuracy", "val_loss"], history
    assert all(len(values) == 2 for values in history.values()) and got["epoch"] == [0, 1]
    assert got["result"]["workers"] == 2 and got["result"]["steps_per_epoch"] == 7  # ceil(405 / 64)
    import pandas as pd

    on_disk = pd.read_csv(tmp_path / "split" / "history.csv")  # what the run wrote, beside what app.fit returned
    assert history["val_loss"] == pytest.approx(on_disk["val_loss"].tolist())
    assert history["loss"] == pytest.approx(on_disk["loss"].tolist())
    # The validation rows are the last 102, in order: the trained model scores exactly the reported numbers on them.
    assert history["val_loss"][-1] == pytest.approx(got["loss_on_last_rows"], rel=1e-4)
    assert history["val_accuracy"][-1] == pytest.approx(got["accuracy_on_last_rows"], abs=1e-6)

    # validation_data=(xv, yv), shuffle=False: 2 workers are one model.fit process of the model compiled as said.
    for key, values in got["keras_history"].items():
        np.testing.assert_allclose(got["given_history"][key], values, rtol=0, atol=1e-5, err_msg=key)
    for i, (a, b) in enumerate(zip(got["keras_weights"], got["given_weights"], strict=True)):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=0, atol=1e-5, err_msg=f"weight {i}")
    assert got["keras_history"]["loss"][-1] < got["keras_history"]["loss"][0]
    plan = (tmp_path / "given" / "train.log").read_text()
    assert ("compile: the model compiles nothing, so it is compiled with the classification defaults: loss "
            "sparse_categorical_crossentropy, metric accuracy, optimizer SGD (momentum 0.9) at base_lr 0.05") in plan
    assert "no warmup (the rate is not scaled up), decayed to 0 by a cosine over the run" in plan
    # verbose=2: a line per epoch; verbose=0: nothing on the console, its epochs in train.log.
    console = p.stdout + p.stderr
    assert "epoch 1/2" in console and "epoch 2/2" in console and console.count("epoch 1/2") == 1
    assert "epoch 2/2" in plan


X = np.zeros((100, 4), dtype="float32")
Y = np.zeros(100, dtype="int64")
PS = "parameter-server"


def build_model():
    """Uncompiled: the product compiles it with the task's defaults and Keras's fit trains it (app.run.keras_step)."""
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])


@pytest.mark.parametrize("kwargs, message", [
    ({"callbacks": [object()]}, "callbacks holds '<object object at"),
    ({"x": (i for i in range(3)), "y": None}, "x: When passing a Python generator to a Keras model, the generator "
                                              "must return a tuple"),
    ({"sample_weight": Y[:50]}, "'sample_weight' sizes: 50"),
    ({"y": None}, "the model compiles nothing and x has no labels (y), so no loss can be chosen for it: compile it in "
                  "the model function"),
    ({"y": Y[:50]}, "'y' sizes: 50"),
    ({"validation_split": 1.0}, "validation_split must be in [0, 1)"),
    ({"validation_split": 0.999}, "validation_split=0.999: Training data contains 100 samples, which is not "
                                  "sufficient to split it"),
    ({"validation_data": (X, Y), "val_fraction": 0.1}, "val_fraction holds out a seeded part of a path of files"),
    ({"batch_size": 32, "per_replica_batch": 16}, "per_replica_batch: app.fit's batch_size is the global batch"),
    ({"x": "data/train/", "y": None, "validation_split": 0.2}, "validation_split takes the last rows of arrays"),
    ({"verbose": 3}, "verbose must be 0, 1, 2 or 'auto', as in Keras's fit (got 3)"),
    ({"initial_epoch": 2}, "initial_epoch must be an integer from 0 to epochs - 1 = 0 (got 2)"),
    # With a strategy only the product's own step runs (parameter servers), Keras's arguments it does not take as
    # Keras means them: each named, with what to use.
    ({"x": [X, X], "strategy": PS}, "x is a list of 2, which Keras reads as several model inputs by position"),
    ({"steps_per_epoch": 5, "strategy": PS}, "steps_per_epoch and validation_steps cut epochs short in Keras"),
    ({"validation_batch_size": 8, "strategy": PS}, "validation_batch_size: validation runs at the training batch"),
    ({"validation_freq": 2, "strategy": PS}, "validation_freq=2: every epoch is validated here"),
    ({"max_queue_size": 8}, "unknown key 'max_queue_size'"),
])
def test_fit_refuses_in_one_line_before_anything_starts(tmp_path, kwargs, message):
    from app import fit
    from app.errors import UserError

    kwargs = {"x": X, "y": Y, "output": str(tmp_path / "out"), **kwargs}
    with pytest.raises(UserError) as e:
        fit(build_model, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_fit_refuses_a_built_model_it_needs_the_function(tmp_path):
    import keras

    from app import fit
    from app.errors import UserError

    with pytest.raises(UserError, match="takes the function that builds the model, not a built model"):
        fit(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), X, Y, output=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_model_file_function_that_takes_the_products_arguments_trains_by_the_products_step(tmp_path):
    """app.fit("file.py:build", ...) where build takes (input_shape, num_classes), as --model file.py:build does:
    not called without them to see whether it brings its own step (that call raised a TypeError)."""
    from app.run.keras_step import model_that_brings_its_step

    (tmp_path / "models.py").write_text(
        "import keras\n\n"
        "def build(input_shape, num_classes):\n"
        "    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes)])\n\n"
        "def compiled():\n"
        "    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
        "    m.compile(optimizer='adam', loss='mse')\n"
        "    return m\n")
    assert model_that_brings_its_step(f"{tmp_path / 'models.py'}:build") is None
    assert model_that_brings_its_step(f"{tmp_path / 'models.py'}:compiled").compiled


def test_the_own_loops_epoch_record_is_written_and_read_back_under_keras_history_keys_for_any_metric():
    """history.csv's row of an own-loop epoch names its logs as Keras does, the rest of the record after them, and
    app.fit's History reads them back as Keras's History has them."""
    from app.run.history import keras_history
    from app.training.metrics import epoch_line, history_row, keras_logs

    records = [{"epoch": e, "train_loss": 1.0 / e, "train_accuracy": 0.5, "train_auc": 0.6, "val_loss": 2.0,
                "val_accuracy": 0.7, "val_auc": 0.8, "learning_rate": 0.1, "train_samples": 400,
                "train_seconds": 1.5, "val_samples": 100, "dropped_samples": 5} for e in (1, 2)]
    rows = [history_row(r) for r in records]
    assert list(rows[0]) == ["epoch", "loss", "accuracy", "auc", "val_loss", "val_accuracy", "val_auc",
                             "learning_rate", "train_samples", "train_seconds", "val_samples", "dropped_samples"]
    assert keras_history(rows) == {"loss": [1.0, 0.5], "accuracy": [0.5, 0.5], "auc": [0.6, 0.6],
                                   "val_loss": [2.0, 2.0], "val_accuracy": [0.7, 0.7], "val_auc": [0.8, 0.8]}
    assert epoch_line(2, 3, keras_logs(records[1]), 1.25) == \
        "epoch 2/3  loss 0.5  accuracy 0.5  auc 0.6  val_loss 2  val_accuracy 0.7  val_auc 0.8  (1.2 s)"


def test_validation_split_is_the_last_rows_cut_as_keras_cuts():
    from app.data.arrays import split_last

    x, y = np.arange(507 * 2).reshape(507, 2), np.arange(507)
    (xt, yt), (xv, yv) = split_last(x, y, 0.2)
    assert len(yt) == 405 and list(yv) == list(range(405, 507)) and (xv == x[405:]).all()


BARS = '''
import sys

import keras
import numpy as np

import app
from app.training.loop import EpochBar

EpochBar.DELAY_S = 0.0  # every epoch long enough for a bar: only verbose decides


def build_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


x, y = np.random.default_rng(0).normal(size=(256, 4)).astype("float32"), np.arange(256) % 3
for verbose in (1, 2):
    print(f"== verbose {verbose}", file=sys.stderr, flush=True)
    app.fit(build_model, x, y, batch_size=32, epochs=1, verbose=verbose, backend="local",
            output=f"{sys.argv[1]}/v{verbose}")
'''


def test_at_a_terminal_verbose_1_draws_an_epoch_bar_and_verbose_2_only_the_epoch_lines(tmp_path):
    """As model.fit: verbose=1 a progress bar inside the epoch, verbose=2 one line per epoch (stderr a terminal)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import subprocess
    import sys
    import termios
    import time

    from conftest import REPO, clean_env

    script = tmp_path / "bars.py"
    script.write_text(BARS)
    main, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 0 columns: tqdm draws nothing
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO, env=clean_env(), stdin=subprocess.DEVNULL,
                         stdout=terminal, stderr=terminal)
    os.close(terminal)
    seen, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:  # read as it comes (a full pty would block the script) until EOF (EIO)
        if not select.select([main], [], [], 1)[0]:
            continue
        try:
            chunk = os.read(main, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        seen += chunk
    if p.poll() is None:  # the 300 s passed
        p.kill()
    assert p.wait(timeout=10) == 0, seen.decode(errors="replace")[-3000:]
    os.close(main)
    one, two = seen.decode(errors="replace").split("== verbose 2")
    # Both print their epoch line (from a script that set up no logging, as model.fit prints its own).
    assert "epoch 1/1: " in one and "%|" in one  # tqdm's bar: "epoch 1/1:  50%|#####     | 4/8 ..."
    # (a compiled model trains by its own step: its epoch line names the logs as Keras's History does)
    assert one.count("epoch 1/1  loss ") == 1 and two.count("epoch 1/1  loss ") == 1
    assert "%|" not in two


def test_a_model_function_given_as_a_functools_partial_pickles_for_the_workers():
    """app.fit(functools.partial(build, ...), ...): the module of a partial is functools, which must not be pickled by
    value (cloudpickle then fails: "cannot pickle 'classmethod_descriptor'"); its function's module is the one."""
    import functools

    from ray import cloudpickle

    from app.backends.ray_prep import by_value

    model_fn = functools.partial(_zeros, 3)
    by_value(model_fn)  # this test module by value, as a worker could not import it
    assert cloudpickle.loads(cloudpickle.dumps(model_fn))().shape == (3,)


def _zeros(n):
    return np.zeros(n)
