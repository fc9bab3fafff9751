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


def build_model():  # what a Keras script builds; no compile, so the product's defaults train it
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


rng = np.random.default_rng(0)
x = rng.normal(size=(507, 4)).astype("float32")
y = np.argmax(x[:, :3], axis=1)
out = sys.argv[1]

split = app.fit(build_model, x, y, batch_size=64, epochs=2, validation_split=0.2, num_workers=2,
                warmup_epochs=0, output=out + "/split", verbose=2)
# Keras's cut: floor(507 * 0.8) = 405 training rows, the last 102 validate.
xv, yv = x[405:], y[405:]
p = split.model.predict(xv, verbose=0)
given = app.fit(build_model, x[:300], y[:300], epochs=1, validation_data=(x[300:401], y[300:401]),
                num_workers=2, output=out + "/given", verbose=0)
json.dump({
    "history": split.history, "epoch": split.epoch, "records": split.records, "result": split.result,
    "loss_on_last_rows": float(np.mean(keras.losses.sparse_categorical_crossentropy(yv, p))),
    "accuracy_on_last_rows": float(np.mean(np.argmax(p, axis=1) == yv)),
    "given_records": given.records, "given_history": given.history,
}, open(out + "/fit.json", "w"))
'''



def test_fit_from_a_fresh_script_keras_history_and_the_last_rows_validate(joined, tmp_path):
    script = tmp_path / "keras_script.py"
    script.write_text(SCRIPT)
    p = run_job(str(script), str(tmp_path), timeout=400, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads((tmp_path / "fit.json").read_text())

    history = got["history"]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history), history
    assert list(history)[0] == "loss" and not any(k.endswith(("samples", "seconds")) for k in history)
    assert all(len(values) == 2 for values in history.values()) and got["epoch"] == [0, 1]
    assert got["result"]["num_replicas"] == 2 and got["result"]["global_batch_size"] == 64
    assert got["result"]["per_replica_batch"] == 32
    last = got["records"][-1]
    import pandas as pd

    on_disk = pd.read_csv(tmp_path / "split" / "history.csv")  # what the run wrote, beside what app.fit returned
    assert history["val_loss"] == pytest.approx(on_disk["val_loss"].tolist())
    assert history["loss"] == pytest.approx(on_disk["train_loss"].tolist())
    assert history["val_loss"][-1] == pytest.approx(got["result"]["metrics"]["val_loss"])
    # The validation rows are the last 102, in order: their count, the training rows left, and the exported
    # model scoring exactly the reported val numbers on them.
    assert last["val_samples"] == 102
    assert last["train_samples"] + last["dropped_samples"] == 405
    assert history["val_loss"][-1] == pytest.approx(got["loss_on_last_rows"], rel=1e-4)
    assert history["val_accuracy"][-1] == pytest.approx(got["accuracy_on_last_rows"], abs=1e-6)

    # validation_data=(xv, yv): exactly those 101 rows validate (odd: padded over 2 workers, padding weighs 0).
    assert got["given_records"][-1]["val_samples"] == 101
    assert got["given_records"][-1]["train_samples"] + got["given_records"][-1]["dropped_samples"] == 300
    assert len(got["given_history"]["val_loss"]) == 1
    # verbose=2: a line per epoch; verbose=0 (the second run, 1 epoch): nothing on the console, its epoch in train.log.
    console = p.stdout + p.stderr
    assert "epoch   1/2" in console and "epoch   2/2" in console and "epoch   1/1" not in console
    assert "epoch   1/1" in (tmp_path / "given" / "train.log").read_text()


X = np.zeros((100, 4), dtype="float32")
Y = np.zeros(100, dtype="int64")


def build_model():
    """Uncompiled: the product's own step (app.run.fit builds the model once to tell whether it brings its step)."""
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 33}, "batch_size 33 is the global batch and does not divide over 2 replicas (2 Ray worker(s), "
                         "one replica each): use 32 or 34"),
    ({"num_workers": 3}, "batch_size 32 (Keras's default) is the global batch and does not divide over 3 replicas"),
    ({"callbacks": [object()]}, "callbacks holds '<object object at"),
    ({"x": (i for i in range(3)), "y": None}, "x of type generator is not supported: give numpy arrays (with y), "
                                              "a data function"),
    ({"x": [X, X]}, "x is a list of 2, which Keras reads as several model inputs by position: give a dict"),
    ({"sample_weight": Y[:50]}, "sample_weight has 50 rows but its x has 100"),
    ({"y": None}, "x arrays need y"),
    ({"y": Y[:50]}, "y has 50 rows but its x has 100"),
    ({"validation_split": 1.0}, "validation_split must be in [0, 1)"),
    ({"validation_split": 0.999}, "validation_split=0.999 leaves an empty train or val set for 100 rows"),
    ({"validation_data": (X, Y, Y)}, "validation_data with sample weights"),
    ({"validation_data": (X, Y), "val_fraction": 0.1}, "val_fraction is the product's own validation set"),
    ({"batch_size": 32, "per_replica_batch": 16}, "batch_size is the global batch and per_replica_batch"),
    ({"x": "data/train/", "y": None, "validation_split": 0.2}, "validation_split takes the last rows of x arrays"),
    # Keras's fit arguments this product does not take as Keras means them: each named, with what to use.
    ({"verbose": 3}, "verbose must be 0, 1, 2 or 'auto', as in Keras's fit (got 3): 0 prints nothing"),
    ({"initial_epoch": 2}, "initial_epoch continues an earlier run in Keras: here, give that run's output and resume=True"),
    ({"steps_per_epoch": 5}, "steps_per_epoch and validation_steps cut epochs short in Keras"),
    ({"validation_steps": 5}, "steps_per_epoch and validation_steps cut epochs short in Keras"),
    ({"validation_batch_size": 8}, "validation_batch_size: validation runs at the training batch here"),
    ({"validation_freq": 2}, "validation_freq=2: every epoch is validated here"),
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


def test_the_epoch_record_maps_to_keras_history_keys_for_any_metric():
    from app.run.fit import keras_history

    records = [{"epoch": e, "train_loss": 1.0 / e, "train_accuracy": 0.5, "train_auc": 0.6, "val_loss": 2.0,
                "val_accuracy": 0.7, "val_auc": 0.8, "learning_rate": 0.1, "train_samples": 400,
                "train_seconds": 1.5, "val_samples": 100, "dropped_samples": 5} for e in (1, 2)]
    assert keras_history(records) == {"loss": [1.0, 0.5], "accuracy": [0.5, 0.5], "auc": [0.6, 0.6],
                                      "val_loss": [2.0, 2.0], "val_accuracy": [0.7, 0.7], "val_auc": [0.8, 0.8]}


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

    from app.backends.ray_train import by_value

    model_fn = functools.partial(_zeros, 3)
    by_value(model_fn)  # this test module by value, as a worker could not import it
    assert cloudpickle.loads(cloudpickle.dumps(model_fn))().shape == (3,)


def _zeros(n):
    return np.zeros(n)
