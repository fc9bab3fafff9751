"""A data function that returns a tf.data pipeline, as TensorFlow users write them, on 2 Ray workers."""

from __future__ import annotations

import json

import pytest

from conftest import refusals_at_once, run_job, user_module

USER_FILE = '''
import tensorflow as tf

import app


def pipeline():
    """The digits through a tf.data pipeline: shuffled, mapped to 8x8x1 images."""
    ds = tf.data.Dataset.from_tensor_slices(app.digits())
    return ds.shuffle(2000, seed=0).map(lambda x, y: (tf.reshape(x, (8, 8, 1)), y))


def batched():
    return pipeline().batch(50).prefetch(2)


def endless():
    return pipeline().repeat()


def tiny():
    """Two elements: too few to hold out a validation set (a batch above the rows would train: one short step)."""
    return pipeline().take(2)


def named_wrong():
    return pipeline().map(lambda x, y: ({"pixels": x}, y))


def image_model():
    import keras

    image = keras.Input((8, 8, 1), name="image")
    out = keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(image))
    return keras.Model({"image": image}, out)
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    return user_module(tmp_path_factory, "my_pipeline.py", USER_FILE)


def test_a_tf_data_pipeline_trains_on_two_workers_every_element_once(user_file, joined, tmp_path):
    """From the command line, a batched pipeline (batches of 50): re-batched to the per-replica batch, every element
    once per epoch across the 2 workers, and it learns the digits."""
    out = tmp_path / "run"
    p = run_job("jobs/train.py", "--model", "cnn", "--dataset", f"{user_file}:batched", "--num-workers", "2",
                "--per-replica-batch", "16", "--epochs", "4", "--audit-sample-ids", "--sync-batch-norm", "--output",
                str(out), timeout=400, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["num_replicas"] == 2 and result["global_batch_size"] == 32
    assert result["steps_per_epoch"] == -(-1438 // 32)  # the pipeline's batches of 50 do not count: its elements do
    assert result["metrics"]["val_accuracy"] >= 0.9
    # The cnn's batch norms, synchronized (tests/test_keras_features.py: as model.fit over the global batch)
    assert "batch normalization: 6 synchronized layer(s) normalize over the global batch" in \
        (out / "train.log").read_text()
    audit = json.loads((out / "audit_sample_ids.json").read_text())
    assert len(audit) == len(result["audit"]) == result["epochs_completed"] == 4
    for ids, counts in zip(audit, result["audit"]):  # every training element once an epoch, over both workers
        assert len(ids) == len(set(ids)) == counts["seen"] == counts["unique"] == 1438
    assert audit[0] != audit[1] and sorted(audit[0]) == sorted(audit[1])  # the same rows, in a new order


BAD_PIPELINES = [
    ("cnn", "endless", "returned an infinite tf.data.Dataset (repeat()): this product makes the epochs"),
    ("cnn", "tiny", "leaves an empty train or val set for 2 rows"),
    ("image_model", "named_wrong", "the data's inputs are named pixels, but "),
]


@pytest.fixture(scope="module")
def bad_pipeline_runs(user_file, tmp_path_factory):
    def argv(i, out):
        model, function, _ = BAD_PIPELINES[i]
        return ["jobs/train.py", "--model", model if model == "cnn" else f"{user_file}:{model}", "--dataset",
                f"{user_file}:{function}", "--backend", "local", "--output", str(out)]

    return refusals_at_once(tmp_path_factory, "bad-pipelines", argv, len(BAD_PIPELINES))


@pytest.mark.parametrize("case", range(len(BAD_PIPELINES)), ids=[f"{m}-{f}" for m, f, _ in BAD_PIPELINES])
def test_a_pipeline_that_cannot_train_is_one_line_before_anything(bad_pipeline_runs, case):
    out, p = bad_pipeline_runs[case]
    errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and BAD_PIPELINES[case][2] in errors[0], p.stdout + p.stderr
    assert "Traceback" not in p.stderr and not out.exists()
