"""The conformance table: app.fit against keras.Model.fit, for model kinds x input kinds (issue: "any Keras model,
trained by its own step").

tests/scripts/keras_step_table.py is a user's script: each model written as keras.io writes it (a compiled
functional model; a VAE-shaped model with its own train_step, test_step and three Mean trackers, fit on x alone; a
GAN with compile(d_optimizer, g_optimizer); a distiller with a frozen teacher in its constructor, compile() of its own
and compute_loss overridden; add_loss; two named outputs with dict losses and loss_weights), each input as fit()
takes it (arrays, a dict of arrays, tf.data of x, (x, y) and (x, y, w), a PyDataset, a generator with
steps_per_epoch; validation as tf.data, PyDataset, (x,) arrays, validation_split). It runs once, joined to the
session's Ray, and every test below reads its table.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, run_job

SCRIPT = REPO / "tests" / "scripts" / "keras_step_table.py"


# (model kind, input kind) pairs; the model and input kinds are the script's MODELS and INPUTS.
PAIRS = [("functional", "arrays"), ("functional", "dict"), ("functional", "tf.data x,y"),
         ("functional", "tf.data x,y,w"), ("functional", "PyDataset"), ("functional", "generator"),
         ("functional", "tf.data x"), ("own_step", "arrays x"), ("own_step", "tf.data x"), ("gan", "tf.data x"),
         ("distiller", "arrays"), ("distiller", "tf.data x,y"), ("add_loss", "regression"),
         ("two_outputs", "two targets")]
TWO_WORKERS = [("functional", "tf.data x,y"), ("own_step", "arrays x"), ("gan", "tf.data x"),
               ("two_outputs", "two targets")]


@pytest.fixture(scope="module")
def table(joined, tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_step")
    p = run_job(str(SCRIPT), str(out), json.dumps([PAIRS, TWO_WORKERS]), timeout=900, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "table.json").read_text())


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert list(a["history"]) == list(b["history"]), "History keys differ"
    for key in a["history"]:
        np.testing.assert_allclose(a["history"][key], b["history"][key], rtol=tol, atol=tol, err_msg=key)
    for wa, wb in zip(a["weights"], b["weights"]):
        np.testing.assert_allclose(wa, wb, rtol=tol, atol=tol)
    assert a["optimizer_steps"] == b["optimizer_steps"]


@pytest.mark.parametrize("pair", [f"{m} | {i}" for m, i in PAIRS])
def test_one_worker_is_keras_fit_weight_for_weight_or_refused_as_keras_refuses(table, pair):
    keras, one = table[pair]["keras"], table[pair]["one"]
    if "error" in keras:  # a pair Keras refuses (a compiled loss given no labels) is refused too
        assert "error" in one, f"Keras refused it ({keras['error']}) but app.fit trained it"
        return
    assert "error" not in one, one.get("error")
    _close(keras, one)


@pytest.mark.parametrize("pair", [f"{m} | {i}" for m, i in TWO_WORKERS])
def test_two_workers_train_as_one_worker(table, pair):
    one, two = table[pair]["one"], table[pair]["two"]
    assert "error" not in two, two.get("error")
    if pair.startswith("gan"):
        # Its noise is drawn per replica (as under any Keras strategy), so its numbers differ from one worker's;
        # its two optimizers still step once per global batch, and its History has Keras's keys.
        assert list(two["history"]) == list(one["history"]) == ["d_loss", "g_loss"]
        assert two["optimizer_steps"] == one["optimizer_steps"]
        assert all(np.isfinite(v).all() for v in two["history"].values())
        return
    _close(one, two)


def test_the_history_has_the_keys_keras_reports_and_no_others(table):
    two = table["two_outputs | two targets"]
    keys = list(two["keras"]["history"])
    assert "priority_loss" in keys and "department_loss" in keys and "val_department_loss" in keys
    assert list(two["two"]["history"]) == keys
    assert "val_loss" not in table["own_step | tf.data x"]["one"]["history"]  # no validation: none reported
