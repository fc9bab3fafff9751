"""The conformance table: app.fit against keras.Model.fit, for model kinds x input kinds (issue: "any Keras model,
trained by its own step").

tests/scripts/keras_step_table.py is a user's script: each model written as keras.io writes it (a compiled
functional model, and the same compiled with steps_per_execution; one of two inputs; a VAE-shaped model with its
own train_step, test_step and three Mean trackers, fit on x alone; a GAN with compile(d_optimizer, g_optimizer); a
distiller with a frozen teacher in its constructor, compile() of its own and compute_loss overridden; add_loss; two
named outputs with dict losses and loss_weights; two inputs, one of token ids into an Embedding trained by Adam,
whose gradient is sparse, validated with its EMA weights),
each input as fit() takes it (arrays, a dict of arrays, a list of arrays, tf.data of x, (x, y) and (x, y, w), a
PyDataset, a generator with steps_per_epoch; validation as tf.data, PyDataset, (x,) arrays, validation_split; and a
path of parquet files, with and without a label column, read on one worker into the same rows). It
runs twice: every pair on one worker (the local backend, in the local test lane), and on 2 workers (joined to the
session's Ray) every model kind and every path by which rows reach the workers; the tests below read the two tables.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, clean_env, run_job

SCRIPT = REPO / "tests" / "scripts" / "keras_step_table.py"


# (model kind, input kind) pairs; the model and input kinds are the script's MODELS and INPUTS.
PAIRS = [("functional", "arrays"), ("functional", "dict"), ("functional", "tf.data x,y"),
         ("functional", "tf.data x,y,w"), ("functional", "PyDataset"), ("functional", "generator"),
         ("functional", "tf.data x"), ("executions", "arrays"), ("executions", "tf.data x,y"),
         ("own_step", "arrays x"), ("own_step", "tf.data x"), ("gan", "tf.data x"),
         ("distiller", "arrays"), ("distiller", "tf.data x,y"), ("add_loss", "regression"),
         ("two_outputs", "two targets"), ("two_inputs", "list"),
         ("functional", "parquet x,y"), ("own_step", "parquet x"), ("distiller", "parquet x,y")]
NAMES = [f"{m} | {i}" for m, i in PAIRS]
# On 2 workers (a Ray run each, ~18 s): every model kind, and every path by which rows reach the workers (not
# every pairing of the two). A dict of arrays, a PyDataset and a generator are read by the driver into rows as
# arrays are (app.data.keras_inputs.read), and the workers cut those rows as they cut the arrays'
# (KerasData.worker_dataset): on 2 workers they run what "functional | arrays" runs (a nested structure is cut in
# "two_inputs | list" and "two_outputs | two targets"); the distiller's arrays take that path too, its tf.data the
# pipeline's, as the steps_per_execution model's tf.data does, and the own step's arrays of x alone. A tf.data of
# (x, y) is the pipeline "tf.data x,y,w" runs, with its weights. The one-worker table checks every pair against
# Keras's fit.
TWO_WORKER_PAIRS = [pair for pair in PAIRS if pair not in {
    ("functional", "dict"), ("functional", "PyDataset"), ("functional", "generator"), ("distiller", "arrays"),
    ("executions", "tf.data x,y"), ("functional", "tf.data x,y"), ("own_step", "arrays x"),
    # a path on Ray workers streams each worker its own share (not Keras's batches): tests/test_keras_stream.py
    ("functional", "parquet x,y"), ("own_step", "parquet x"), ("distiller", "parquet x,y")}]
TWO_WORKER_NAMES = [f"{m} | {i}" for m, i in TWO_WORKER_PAIRS]


def _table(tmp_path_factory, workers: str, env: dict[str, str], pairs: list) -> dict:
    out = tmp_path_factory.mktemp(f"keras_step_{workers}")
    p = run_job(str(SCRIPT), str(out), json.dumps([pairs, workers]), timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "table.json").read_text())


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """Every pair with model.fit and with app.fit on one worker (the local backend: no Ray; the local test lane)."""
    return _table(tmp_path_factory, "one", clean_env(), PAIRS)


@pytest.fixture(scope="module")
def two_workers(joined, tmp_path_factory):
    """TWO_WORKER_PAIRS with model.fit and with app.fit on 2 Ray workers (the session's Ray)."""
    return _table(tmp_path_factory, "two", joined, TWO_WORKER_PAIRS)


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert list(a["history"]) == list(b["history"]), "History keys differ"
    for key in a["history"]:
        np.testing.assert_allclose(a["history"][key], b["history"][key], rtol=tol, atol=tol, err_msg=key)
    for wa, wb in zip(a["weights"], b["weights"]):
        np.testing.assert_allclose(wa, wb, rtol=tol, atol=tol)
    assert a["optimizer_steps"] == b["optimizer_steps"]


def _as_keras_fit(row: dict, workers: str) -> None:
    keras, ours = row["keras"], row[workers]
    if "error" in keras:  # a pair Keras refuses (a compiled loss given no labels) is refused too
        assert "error" in ours, f"Keras refused it ({keras['error']}) but app.fit trained it"
        return
    assert "error" not in ours, ours.get("error")
    _close(keras, ours)


@pytest.mark.parametrize("pair", NAMES)
def test_one_worker_is_keras_fit_weight_for_weight_or_refused_as_keras_refuses(one_worker, pair):
    _as_keras_fit(one_worker[pair], "one")


@pytest.mark.parametrize("pair", TWO_WORKER_NAMES)
def test_two_workers_are_keras_fit_weight_for_weight_or_refused_as_keras_refuses(two_workers, pair):
    """2 workers, each training on its part of every global batch, against Keras's fit of the whole batch in one
    process: so 2 workers = 1 worker too (the test above), within 1e-5 each."""
    if pair.startswith("gan"):
        # Its noise is drawn per replica (as under any Keras strategy), so its numbers differ from one process's;
        # its two optimizers still step once per global batch, and its History has Keras's keys.
        keras, two = two_workers[pair]["keras"], two_workers[pair]["two"]
        assert "error" not in two, two.get("error")
        assert list(two["history"]) == list(keras["history"]) == ["d_loss", "g_loss"]
        assert two["optimizer_steps"] == keras["optimizer_steps"]
        assert all(np.isfinite(v).all() for v in two["history"].values())
        return
    _as_keras_fit(two_workers[pair], "two")


def test_the_history_has_the_keys_keras_reports_and_no_others(two_workers):
    two = two_workers["two_outputs | two targets"]
    keys = list(two["keras"]["history"])
    assert "priority_loss" in keys and "department_loss" in keys and "val_department_loss" in keys
    assert list(two["two"]["history"]) == keys
    assert "val_loss" not in two_workers["own_step | tf.data x"]["two"]["history"]  # no validation: none reported
