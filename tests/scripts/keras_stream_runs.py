"""A user's script: Keras models trained by app.fit on files, on a ray.data.Dataset and on a tf.data pipeline of
TFRecord files, on 2 Ray workers (a model with its own train_step from a path and from a Dataset; a compiled one
from a path, from a path whose label column holds class names, and from TFRecord files).

    python keras_stream_runs.py OUT      (joined to a running Ray: RAY_ADDRESS)

Writes OUT/runs.json: each run's History, params and result.json figures, and Keras's own model.fit on the same
rows (read here with pandas and tf.data: the test's reference, not the product's input).
tests/test_keras_stream.py reads it.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

import app

out = Path(sys.argv[1])
rng = np.random.default_rng(0)


def write_parts(directory: Path, frame: pd.DataFrame, parts: int) -> Path:
    directory.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(frame)), parts)):
        frame.iloc[part].to_parquet(directory / f"part-{i}.parquet")
    return directory


# 301 rows in 3 files: neither divides over 2 workers.
X = rng.normal(size=(301, 8)).astype("float32")
features = pd.DataFrame({f"f{i}": X[:, i] for i in range(8)})
unlabelled = write_parts(out / "unlabelled", features, 3)
val_rows = write_parts(out / "val", features.iloc[:9], 1)
labels = (X[:, 0] + 0.5 * X[:, 1] > 0).astype("int64")
labelled = write_parts(out / "labelled", features.assign(label=labels), 3)


class Autoencoder(keras.Model):
    """A model with its own train_step and test_step on x alone; ``rows`` counts the rows its steps saw."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = keras.layers.Dense(4), keras.layers.Dense(8)
        self.loss_tracker = keras.metrics.Mean(name="reconstruction")
        self.rows = keras.metrics.Sum(name="rows")

    def call(self, x):
        return self.decoder(self.encoder(x))

    def _track(self, x, loss):
        self.loss_tracker.update_state(loss)
        self.rows.update_state(tf.cast(tf.shape(x)[0], tf.float32))
        return {m.name: m.result() for m in self.metrics}

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - x))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self._track(x, loss)

    def test_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return self._track(x, tf.reduce_mean(tf.square(self(x) - x)))

    @property
    def metrics(self):
        return [self.loss_tracker, self.rows]


def autoencoder():
    model = Autoencoder()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def classifier():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def record(history) -> dict:
    return {"history": history.history, "params": history.params,
            "result": {k: history.result[k] for k in ("steps_per_epoch", "rows", "dropped_samples_per_epoch", "workers")}}


runs = {}
# 14 epochs: Ray Data's iter_tf_batches deadlocks after ~9 (ray-project/ray#62352); the product's reader must not.
runs["own_step_path"] = record(app.fit(autoencoder, str(unlabelled), batch_size=16, epochs=14,
                                       validation_data=str(val_rows), num_workers=2, output=str(out / "r1"), verbose=0))
import ray.data  # noqa: E402  (the Ray the script joined: app.fit connected it)

runs["own_step_ray_dataset"] = record(app.fit(autoencoder, ray.data.read_parquet(str(unlabelled)), batch_size=32,
                                              epochs=3, num_workers=2, output=str(out / "r2"), verbose=0))
# Class 1 weighs twice class 0, as Keras's class_weight weighs each row's loss (the workers weigh their rows).
CLASS_WEIGHT = {0: 1.0, 1: 2.0}
for workers in (1, 2):
    runs[f"compiled_path_{workers}"] = record(app.fit(classifier, str(labelled), batch_size=30, epochs=4,
                                                      shuffle=False, num_workers=workers, class_weight=CLASS_WEIGHT,
                                                      output=str(out / f"r3_{workers}"), verbose=0))
keras_fit = classifier().fit(X, labels, batch_size=30, epochs=4, shuffle=False, class_weight=CLASS_WEIGHT, verbose=0)
runs["keras_fit"] = {"history": keras_fit.history}

# A label column of class names (a pandas category column: parquet stores it as a dictionary of strings). Sorted,
# "apple" is class 0 and "zebra" class 1: the ids are 1 - labels, as model.fit is given them below.
named = features.assign(label=pd.Categorical(np.where(labels == 1, "apple", "zebra")))
history = app.fit(classifier, str(write_parts(out / "named", named, 3)), batch_size=30, epochs=3, shuffle=False,
                  validation_data=str(write_parts(out / "named_val", named.iloc[:30], 1)), num_workers=1,
                  output=str(out / "r5"), verbose=0)
runs["names"] = {"history": history.history, "config": (out / "r5" / "config.yaml").read_text()}
keras_fit = classifier().fit(X, 1 - labels, batch_size=30, epochs=3, shuffle=False,
                             validation_data=(X[:30], 1 - labels[:30]), verbose=0)
runs["names_keras_fit"] = {"history": keras_fit.history}

# A tf.data pipeline that reads TFRecord files (3 files, 301 rows): every worker reads them, every epoch.
records = out / "records"
records.mkdir()
files = [str(records / f"part-{i}.tfrecord") for i in range(3)]
for i, path in enumerate(files):
    with tf.io.TFRecordWriter(path) as writer:
        for j in range(i, len(X), 3):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=X[j])),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[labels[j]]))})).SerializeToString())
FEATURES = {"x": tf.io.FixedLenFeature([8], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}


def parse(record):
    example = tf.io.parse_single_example(record, FEATURES)
    return example["x"], example["y"]


def pipeline(names, shuffled):
    ds = tf.data.TFRecordDataset(names).map(parse)
    return (ds.shuffle(64, seed=5) if shuffled else ds).batch(43)  # 7 batches of 301 rows: none left out


history = app.fit(classifier, pipeline(files, True), epochs=3, validation_data=pipeline(files[:1], False),
                  num_workers=2, output=str(out / "r4"), verbose=0)
runs["tfrecord_pipeline"] = {"history": history.history, "params": history.params}
keras_fit = classifier().fit(pipeline(files, True), epochs=3, validation_data=pipeline(files[:1], False), verbose=0)
runs["tfrecord_keras_fit"] = {"history": keras_fit.history}
(out / "runs.json").write_text(json.dumps(runs, indent=1))
