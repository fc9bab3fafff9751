"""The product's features on Keras's own fit, for a model with its own train_step on 2 Ray workers
(app.training.keras_features): each is what Keras provides, checked against Keras's own model.fit where Keras has
it. One user script (tests/scripts/keras_features_runs.py) makes the runs; the tests read its record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REPO, run_job

SCRIPT = REPO / "tests" / "scripts" / "keras_features_runs.py"


@pytest.fixture(scope="module")
def runs(joined, tmp_path_factory):
    out = tmp_path_factory.mktemp("keras_features")
    p = run_job(str(SCRIPT), str(out), timeout=900, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "features.json").read_text())


def test_grad_accum_is_kerass_gradient_accumulation_on_two_workers(runs):
    """grad_accum=2 on 2 workers = model.fit with gradient_accumulation_steps=2 in one process (the gradients of
    each step averaged over both workers' rows, then accumulated as Keras accumulates them)."""
    ours, keras_fit = runs["grad_accum"]["history"], runs["keras_grad_accum"]["history"]
    assert list(ours) == ["reconstruction"]
    np.testing.assert_allclose(ours["reconstruction"], keras_fit["reconstruction"], rtol=1e-4)
    # Keras counts optimizer steps, one per two batches: 8 batches of 32 an epoch, 3 epochs.
    assert runs["grad_accum"]["iterations"] == 8 * 3 // 2


def test_bf16_builds_the_model_under_kerass_mixed_policy_on_two_workers(runs):
    run = runs["bf16"]
    assert run["policy"] == "mixed_bfloat16"
    assert list(run["history"]) == ["reconstruction"]
    values = run["history"]["reconstruction"]
    assert all(np.isfinite(values)) and values[-1] < values[0]
