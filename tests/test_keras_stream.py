"""Paths of files and ray.data.Datasets streamed into every worker's Keras fit (app.data.keras_stream).

One user script (tests/scripts/keras_stream_runs.py), joined to the session's Ray, trains on 2 Ray workers: a model
with its own train_step / test_step on x alone from 3 parquet files of 301 rows (neither divides over the workers)
with a 9-row parquet validation set, 14 epochs; the same model from a ray.data.Dataset with no validation argument;
a compiled model from a path with shuffle=False on 1 and 2 workers; a compiled model from a tf.data pipeline of
TFRecord files; and Keras's own model.fit on the same rows. The tests below read its record; the command line and
the refusals are tested on their own.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, clean_env, run_job, script_record, user_module

SCRIPT = REPO / "tests" / "scripts" / "keras_stream_runs.py"


@pytest.fixture(scope="module")
def runs(joined, tmp_path_factory):
    return script_record(SCRIPT, tmp_path_factory, "runs.json", joined)


def test_a_model_with_its_own_step_trains_from_files_every_row_of_an_uneven_split_each_epoch(runs):
    run = runs["own_step_path"]
    history = run["history"]
    # Its own metrics' names, and nothing else: Keras's History of this model.
    assert set(history) == {"reconstruction", "rows", "val_reconstruction", "val_rows"}
    assert len(history["rows"]) == 14  # past the ~9 epochs after which iter_tf_batches deadlocks (ray#62352)
    # The rows its steps saw, summed over both workers: floor(301 / 2) on each, every epoch; validation: all 9.
    assert history["rows"] == [300.0] * 14
    assert history["val_rows"] == [9.0] * 14
    assert run["result"] == {"steps_per_epoch": 19, "rows": 301, "dropped_samples_per_epoch": 1, "workers": 2}
    assert run["params"]["steps"] == 19
    assert history["reconstruction"][-1] < 0.5 * history["reconstruction"][0]


def test_a_model_with_its_own_step_trains_from_a_ray_dataset_with_no_validation_argument(runs):
    """The Dataset a Ray user holds (ray.data.read_parquet), no validation argument: nothing validates, and its
    own metrics count every row of an epoch but the one an uneven split leaves out."""
    run = runs["own_step_ray_dataset"]
    assert list(run["history"]) == ["reconstruction", "rows"]
    assert run["history"]["rows"] == [300.0] * 3
    assert run["result"]["steps_per_epoch"] == 10  # ceil(150 / 16)
    assert run["history"]["reconstruction"][-1] < run["history"]["reconstruction"][0]


def test_streamed_workers_train_as_keras_fit_on_the_same_rows(runs):
    """One worker reads the files' rows in their order (shuffle=False) as model.fit reads the arrays: the same
    batches, the same History, each row's loss weighed by its class as Keras's class_weight weighs it. Two workers
    cut their batches from their own halves: the same rows an epoch but other batches, so close, not equal (the
    docs state the tolerance: 10 % of the loss after 4 epochs here, 5 % seen)."""
    keras_fit, one, two = (runs[k]["history"] for k in ("keras_fit", "compiled_path_1", "compiled_path_2"))
    # A compiled model from a path with no validation argument: no val_*, every row of an epoch trained (one worker;
    # two leave out the row an uneven split cannot give both).
    assert list(one) == list(two) == ["accuracy", "loss"]
    assert [runs[f"compiled_path_{n}"]["result"]["dropped_samples_per_epoch"] for n in (1, 2)] == [0, 1]
    np.testing.assert_allclose(one["loss"], keras_fit["loss"], rtol=1e-5)
    np.testing.assert_allclose(one["accuracy"], keras_fit["accuracy"], rtol=1e-5)
    assert abs(two["loss"][-1] - one["loss"][-1]) < 0.10 * one["loss"][-1]
    assert abs(two["accuracy"][-1] - one["accuracy"][-1]) < 0.05


def test_a_label_column_of_class_names_trains_on_their_sorted_ids_as_keras_fit(runs):
    """Parquet files whose label column holds class names (a pandas category column): the driver reads the names
    (one pass over the column), their sorted order makes the ids, the worker maps its rows' names to them, and the
    validation files' names map to the same ids. One worker, shuffle=False: model.fit's History on those ids; the
    run's config.yaml records the names."""
    got, keras_fit = runs["names"]["history"], runs["names_keras_fit"]["history"]
    assert list(got) == list(keras_fit) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key, values in keras_fit.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
    assert "class_names:\n- apple\n- zebra\n" in runs["names"]["config"]


def test_a_tfrecord_pipeline_is_read_by_every_worker_and_trains_as_keras_fit(runs):
    """The driver reads its first batch only; each worker runs the pipeline (its seeded shuffle reshuffling every
    epoch, as Keras's fit runs it) and trains on its part of every batch: the History of model.fit itself."""
    ours, keras_fit = runs["tfrecord_pipeline"]["history"], runs["tfrecord_keras_fit"]["history"]
    assert list(ours) == list(keras_fit) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key in keras_fit:
        np.testing.assert_allclose(ours[key], keras_fit[key], rtol=1e-5, err_msg=key)


OWN_MODEL = """
import keras
import tensorflow as tf


class Autoencoder(keras.Model):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = keras.layers.Dense(3), keras.layers.Dense(6)
        self.tracker = keras.metrics.Mean(name="reconstruction")

    def call(self, x):
        return self.decoder(self.encoder(x))

    def train_step(self, data):
        x = data[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - x))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        self.tracker.update_state(loss)
        return {"reconstruction": self.tracker.result()}

    def test_step(self, data):
        self.tracker.update_state(tf.reduce_mean(tf.square(self(data[0]) - data[0])))
        return {"reconstruction": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def build():
    model = Autoencoder()
    model.compile(optimizer="adam")
    return model
"""


def test_the_command_line_trains_a_model_with_its_own_step_from_a_parquet_file(joined, tmp_path_factory):
    """jobs/train.py --model own.py:build --dataset rows.parquet: Keras's fit on 2 workers, a seeded holdout, and
    the optimizer's state sharded over the workers (--shard-optimizer 2)."""
    from app.training.keras_callbacks import RECORD_KEYS  # an epoch record's keys besides Keras's logs

    module = user_module(tmp_path_factory, "own.py", OWN_MODEL)
    data = module.parent / "rows.parquet"
    x = np.random.default_rng(0).normal(size=(200, 6)).astype("float32")
    pd.DataFrame({f"f{i}": x[:, i] for i in range(6)}).to_parquet(data)
    out = module.parent / "run"
    p = run_job("jobs/train.py", "--model", f"{module}:build", "--dataset", str(data), "--epochs", "2",
                "--val-fraction", "0.25", "--shard-optimizer", "2", "--output", str(out), timeout=600, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    said = p.stderr + p.stdout
    assert "the model's own train_step, test_step" in said and "no 'label' column: the rows are x alone" in said
    assert "seeded 0.25 validation split (val_fraction: this data set has no validation part)" in said
    result = json.loads((out / "result.json").read_text())
    assert [set(r) - set(RECORD_KEYS) for r in result["history"]] == \
        [{"reconstruction", "val_reconstruction"}] * 2
    # The seeded split by row content: about a quarter held out, every row on one side.
    assert 120 < result["rows"] < 180 and result["workers"] == 2
    # Adam's two moments of 6 x 3 + 3 + 3 x 6 + 6 = 45 weights, cut in 2 parts of 23 (the row count in the padding)
    assert "shard_optimizer 2 (ZeRO): each of the 2 workers keeps 1/2 of every optimizer's state" in said
    assert result["optimizer_parts_bytes"] == 23 * 4 and result["optimizer_state_bytes"] == 2 * 23 * 4 + 12


def test_a_built_in_model_on_files_plans_kerass_fit_with_the_class_weights_given(joined, tmp_path):
    """jobs/train.py --dataset <parquet> --class-weight JSON with a built-in model (--dry-run: Ray Data's statistics
    pass sizes the model, nothing trains): Keras's fit on the workers, each row's loss weighed by its class (the
    workers' weighing: test_streamed_workers_train_as_keras_fit_on_the_same_rows), and so with a compiled model
    function of the user's (the weights as given, as app.fit takes class_weight); "balanced", which needs the
    classes' counts before training, is one line."""
    from conftest import run_jobs_at_once

    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4)).astype("float32")
    pd.DataFrame({**{f"f{i}": x[:, i] for i in range(4)}, "label": (x[:, 0] > 0).astype("int64")}).to_parquet(
        tmp_path / "rows.parquet")
    common = ["jobs/train.py", "--dataset", str(tmp_path / "rows.parquet"), "--feature-columns", "f0", "f1", "f2",
              "f3", "--dry-run"]
    (tmp_path / "own.py").write_text(
        "import keras\n\n\ndef build():\n    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
        "    model.compile('adam', keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n    return model\n")
    weighed, balanced, own = run_jobs_at_once(
        [*common, "--class-weight", '{"1": 2.5}', "--output", str(tmp_path / "a")],
        [*common, "--class-weight", "balanced", "--output", str(tmp_path / "b")],
        [*common, "--class-weight", '{"1": 2.5}', "--model", f"{tmp_path / 'own.py'}:build", "--output",
         str(tmp_path / "c")], env=joined, timeout=300)
    assert weighed.returncode == 0, weighed.stderr[-3000:]
    said = weighed.stdout + weighed.stderr
    assert "step: Keras's train_step and test_step" in said and "class_weight: 0: 1, 1: 2.5" in said, said[-3000:]
    assert "each row's loss weighed by its class (class_weight)" in said
    assert balanced.returncode != 0 and "--class-weight balanced needs the labels' counts" in balanced.stderr, \
        balanced.stderr[-3000:]
    assert own.returncode == 0, own.stderr[-3000:]
    said = own.stdout + own.stderr
    assert "step: Keras's train_step and test_step" in said and "class_weight: 1: 2.5 (" in said, said[-3000:]
    assert not any((tmp_path / d).exists() for d in "abc")  # a dry run writes nothing


LOCAL_SCRIPT = """
import json, sys
import keras, numpy as np, pandas as pd
import app

out = sys.argv[1]
rng = np.random.default_rng(3)
x = rng.normal(size=(97, 5)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
frame = pd.DataFrame({f"f{i}": x[:, i] for i in range(5)}).assign(label=y)
frame.iloc[:50].to_parquet(out + "/a.parquet"); frame.iloc[50:].to_parquet(out + "/b.parquet")


def build():
    keras.utils.set_random_seed(2)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    m.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m


h = app.fit(build, out, batch_size=16, epochs=3, shuffle=False, backend="local", class_weight={0: 0.5, 1: 1.5},
            output=out + "/run", verbose=0)
k = build()
kh = k.fit(x, y, batch_size=16, epochs=3, shuffle=False, class_weight={0: 0.5, 1: 1.5}, verbose=0)
json.dump({"app": h.history, "keras": kh.history,
           "weights": float(max(np.abs(a - b).max() for a, b in zip(h.model.get_weights(), k.get_weights())))},
          open(out + "/local.json", "w"))
"""


def test_the_local_backend_reads_a_path_and_trains_as_keras_fit_weight_for_weight(tmp_path):
    script = tmp_path / "local_path.py"
    script.write_text(LOCAL_SCRIPT)
    p = run_job(str(script), str(tmp_path), timeout=300, env=clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    record = json.loads((tmp_path / "local.json").read_text())
    assert list(record["app"]) == list(record["keras"])
    for key in record["keras"]:
        np.testing.assert_allclose(record["app"][key], record["keras"][key], rtol=1e-5)
    assert record["weights"] < 1e-5


REFUSALS = """
import sys
import keras, numpy as np, pandas as pd
import app
from app.errors import UserError

out = sys.argv[1]
pd.DataFrame({"f0": np.zeros(8, "float32"), "f1": np.ones(8, "float32"), "label": np.zeros(8, "int64")}).to_parquet(
    out + "/d.parquet")


def build():
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile(optimizer="adam", loss="mse")
    return m


cases = {
    "missing": dict(x=out + "/nowhere.parquet"),
    "batch": dict(x=out + "/d.parquet", batch_size=31, num_workers=2),
    "labels twice": dict(x=out + "/d.parquet", y=np.zeros(8)),
    "split": dict(x=out + "/d.parquet", validation_split=0.2, backend="local"),
    "column": dict(x=out + "/d.parquet", feature_columns=["f0", "nope"], backend="local"),
    "shape": dict(x=out + "/d.parquet", backend="local"),
    "unlabelled weighed": dict(x=out + "/d.parquet", label_column="target", class_weight={0: 2.0}, backend="local"),
}
for name, kwargs in cases.items():
    try:
        app.fit(build, output=out + "/never", **kwargs)
        print(name, "| trained")
    except UserError as e:
        print(name, "|", e)
"""


def test_streamed_inputs_that_cannot_train_are_one_line_before_anything_starts(tmp_path):
    import os

    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    p = run_job(str(script), str(tmp_path), timeout=300, env=clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(line.split(" | ", 1) for line in p.stdout.splitlines() if " | " in line)
    assert "does not exist" in lines["missing"] and "nowhere.parquet" in lines["missing"]
    assert "must divide over the 2 workers (use 30 or 32)" in lines["batch"]
    assert lines["labels twice"].startswith("y with a path or a ray.data.Dataset")
    assert "give validation_data" in lines["split"]
    assert "'nope'" in lines["column"]
    assert "x (columns f0, f1): its examples have shape (2,), but the model's input takes (3,)" in lines["shape"]
    assert lines["unlabelled weighed"].startswith("class_weight weighs the rows by their label, but x has no 'target'")
    assert not os.path.exists(tmp_path / "never")  # nothing written
    assert "Started a local Ray" not in p.stderr  # refused before Ray


LARGE = """
import resource, shutil, sys
import keras, numpy as np, tensorflow as tf
import app

out = sys.argv[1]
width, per_file, files = 1 << 20, 260, 4  # 4 MiB records: 1,040 of them, 4.06 GiB through the pipeline
row = np.random.default_rng(0).normal(size=width).astype("float32").tobytes()
# One 1.02 GiB file, listed 4 times: the pipeline reads 4.06 GiB from disk as 4 files would (writing 4 GiB is
# the slow part, and what is read is what this checks).
name = f"{out}/part.tfrecord"
with tf.io.TFRecordWriter(name) as writer:
    for j in range(per_file):
        writer.write(tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[row])),
            "y": tf.train.Feature(float_list=tf.train.FloatList(value=[j % 2]))})).SerializeToString())
names = [name] * files
FEATURES = {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.float32)}


def parse(records):
    parsed = tf.io.parse_example(records, FEATURES)
    return tf.reshape(tf.io.decode_raw(parsed["x"], tf.float32), (-1, width)), parsed["y"]


def build():
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
    return model


pipeline = tf.data.TFRecordDataset(names).batch(8).map(parse)
history = app.fit(build, pipeline, epochs=1, backend="local", output=out + "/run", verbose=0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
__import__("os").remove(name)
print("RESULT", peak, len(history.history["loss"]), history.result["rows"])
"""


def test_a_tfrecord_input_larger_than_4_gib_trains_with_the_process_under_2_gib(tmp_path):
    """4.06 GiB of TFRecords (more than the 4 GiB a driver would hold of an input it reads) through a tf.data
    pipeline: the files are read as the run goes (the driver read one batch), and the process's peak RSS stays
    under 2 GiB. One process (the local backend): the driver and the worker are one, so one peak bounds both."""
    import shutil

    if shutil.disk_usage(tmp_path).free < 3 << 30:
        pytest.skip("needs 3 GiB of free disk for 1 GiB of TFRecord files")
    script = tmp_path / "large.py"
    script.write_text(LARGE)
    p = run_job(str(script), str(tmp_path), timeout=900, env=clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    peak, epochs, rows = p.stdout.split("RESULT", 1)[1].split()
    assert epochs == "1" and rows == "None"  # one epoch; its rows counted by the run, not read beforehand
    assert float(peak) < 2048, f"peak RSS {float(peak):,.0f} MiB"

