"""Each built-in model learns its built-in dataset with its own defaults: no optimizer, learning-rate or size flag,
exactly as the README's commands write them (only --epochs is set, to keep the run short). The mlp on the digits
is the shared 2-worker run (tests/test_train_ray.py::test_two_workers_learn_the_digits)."""

from __future__ import annotations

import json

from conftest import clean_env, run_job, run_jobs_at_once


def test_the_transformer_the_cnn_and_the_mlp_on_raw_scale_columns_learn_with_their_defaults(tmp_path):
    """The transformer on synthetic-text (its own default: Adam at 1e-3; under the global SGD at 0.05 it stayed at
    chance, val accuracy 0.11), the cnn on the digits, writing only model.keras (--export keras), and the mlp on the
    shipped wine.csv, 13 measurements on scales from 0.1 to 1,680 (side by side). What is asked of the models alone
    runs on the local backend (one replica, no Ray): a transformer on 2 Ray workers is
    tests/test_data.py::test_transformer_learns_a_text_column."""
    text, cnn, wine = run_jobs_at_once(
        ["jobs/train.py", "--model", "transformer", "--dataset", "synthetic-text", "--backend", "local", "--epochs",
         "3", "--output", str(tmp_path / "text")],
        ["jobs/train.py", "--model", "cnn", "--backend", "local", "--epochs", "5", "--export", "keras",
         "--output", str(tmp_path / "cnn")],
        ["jobs/train.py", "--dataset", "examples/wine.csv", "--label-column", "class", "--backend", "local",
         "--epochs", "10", "--output", str(tmp_path / "wine")],
        envs=[clean_env(), clean_env(), clean_env()], timeout=600)
    # The mlp standardises the columns with their training rows' mean and variance (SGD at 0.1 on them as they are:
    # loss 3e7 in the first epoch, then val accuracy 0.41, the share of the largest class).
    assert wine.returncode == 0, wine.stderr[-3000:]
    assert "inputs standardised by the training rows' mean and variance" in wine.stdout + wine.stderr
    wine_result = json.loads((tmp_path / "wine" / "result.json").read_text())
    assert wine_result["metrics"]["val_accuracy"] >= 0.9, wine_result["metrics"]
    assert text.returncode == 0, text.stderr[-3000:]
    assert cnn.returncode == 0, cnn.stderr[-3000:]
    text_result = json.loads((tmp_path / "text" / "result.json").read_text())
    assert (text_result["config"]["optimizer"], text_result["base_lr"]) == ("adam", 0.001)
    # The transformer's model.keras holds the product's PositionEmbedding: keras.models.load_model opens it in a
    # fresh process once app.layers is imported (Keras knows a custom layer only from a module imported), and says
    # which class it lacks without (docs/guides/configuration.md says both).
    load = "import keras, sys; {}keras.models.load_model(sys.argv[1]); print('opened')"
    model_file = str(tmp_path / "text" / "model.keras")
    opened, lacking = (run_job("-c", load.format(first), model_file, timeout=120) for first in ("import app.layers; ", ""))
    assert opened.returncode == 0 and opened.stdout.strip().endswith("opened"), opened.stderr[-2000:]
    assert lacking.returncode != 0 and "PositionEmbedding" in lacking.stderr, lacking.stderr[-2000:]
    assert text_result["num_replicas"] == 1
    assert text_result["metrics"]["val_accuracy"] >= 0.9, text_result["metrics"]
    cnn_result = json.loads((tmp_path / "cnn" / "result.json").read_text())
    assert (cnn_result["config"]["optimizer"], cnn_result["base_lr"]) == ("sgd", 0.05)
    assert cnn_result["metrics"]["val_accuracy"] >= 0.9, cnn_result["metrics"]
    # The digits' flat rows reach the cnn as they come (it reshapes them to 8x8x1 inside the model).
    assert "examples of shape (64,)" in cnn.stdout + cnn.stderr and "model: cnn" in cnn.stdout + cnn.stderr
    # --export keras: model.keras and no SavedModel
    assert cnn_result["model_file"] == "model.keras" and cnn_result["saved_model"] is None
    assert (tmp_path / "cnn" / "model.keras").is_file() and not (tmp_path / "cnn" / "saved_model").exists()
