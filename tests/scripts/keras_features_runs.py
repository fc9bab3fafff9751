"""A user's script: a model with its own train_step trained by app.fit on 2 Ray workers with the product's features
(those Keras provides itself, app.training.keras_features, and its Dense layers split over each worker's devices,
app.training.tensor_parallel), and by Keras's own model.fit with the same settings.

    python keras_features_runs.py OUT      (joined to a running Ray: RAY_ADDRESS)

Writes OUT/features.json: each run's History (and final weights). tests/test_keras_features.py reads it.
"""

import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from autoencoder import Autoencoder

import app

out = Path(sys.argv[1])
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")


def build(accumulate=None):
    keras.utils.set_random_seed(3)
    model = Autoencoder()
    model.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate))
    return model


runs = {}
# One run with every feature at once, on an elastic range (the session's Ray has room for 2): Keras's gradient
# accumulation under its mixed_bfloat16 policy, the two Dense layers split over 2 devices of each worker (Megatron's
# pair: the encoder by columns, the decoder by rows); the reference is model.fit with the same two Keras settings in
# one process, unsplit.
history = app.fit(build, x, batch_size=32, epochs=3, shuffle=False, num_workers="1:2", grad_accum=2,
                  mixed_precision="bf16", tensor_parallel=2, tensor_layout=["encoder=column", "decoder=row"],
                  output=str(out / "features"), verbose=0)
runs["features"] = {"history": history.history, "workers": history.result["workers"],
                    "tensor_parallel": history.result["tensor_parallel"],
                    "iterations": int(history.model.optimizer.iterations.numpy()),
                    "policy": history.model.encoder.dtype_policy.name,
                    "plan": (out / "features" / "train.log").read_text()}


class CrashOnce(keras.callbacks.Callback):
    """Kills its worker once, after the 5th step of the second epoch (a user's callback runs on rank 0), when Ray
    Train has had time to register the checkpoint taken at step 3."""

    def __init__(self, marker):
        super().__init__()
        self.marker, self.epoch = marker, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 4 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(4)
            os._exit(1)


# A checkpoint every 3 steps on 2 workers, a worker killed inside an epoch: the run goes on from the step, its
# optimizer's state and the epoch's metric so far, and ends as model.fit in one process.
history = app.fit(build, x, batch_size=32, epochs=3, shuffle=False, num_workers=2, checkpoint_every_steps=3,
                  max_failures=1, callbacks=[CrashOnce(str(out / "crashed"))], output=str(out / "steps"), verbose=0)
runs["steps"] = {"history": history.history, "weights": [w.tolist() for w in history.model.get_weights()],
                 "workers_over_time": history.result["workers_over_time"],
                 "log": (out / "steps" / "train.log").read_text()}
reference = build()
runs["steps_keras_fit"] = {"history": reference.fit(x, batch_size=32, epochs=3, shuffle=False, verbose=0).history,
                           "weights": [w.tolist() for w in reference.get_weights()]}



class TwoViews(keras.Model):
    """Images through a synchronized batch norm, called twice in its own train_step (the rows, then mirrored)."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = keras.layers.Conv2D(3, 3), keras.layers.BatchNormalization(synchronized=True)
        self.head = keras.Sequential([keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, images, training=False):
        return self.head(self.norm(self.conv(images), training=training))

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        images, targets = data
        with tf.GradientTape() as tape:
            loss = (tf.reduce_mean(tf.square(self(images, training=True) - targets))
                    + tf.reduce_mean(tf.square(self(tf.reverse(images, [2]), training=True) - targets)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def two_views():
    keras.utils.set_random_seed(4)
    model = TwoViews()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5))
    return model


# 69 images, batches of 16: the last of 5 rows is cut 3 + 2 over the workers.
images = np.random.default_rng(1).normal(size=(69, 6, 6, 1)).astype("float32")
targets = images.mean(axis=(1, 2, 3))[:, None] * 3


class Threads(keras.callbacks.Callback):
    """Rank 0's threads after each step, in its log (a collective that started a thread per op would add several a
    step)."""

    def on_train_batch_end(self, batch, logs=None):
        import psutil

        print(f"THREADS {psutil.Process().num_threads()}", flush=True)


history = app.fit(two_views, images, targets, batch_size=16, epochs=2, shuffle=False, num_workers=2,
                  callbacks=[Threads()], output=str(out / "batch_norm"), verbose=0)
reference = two_views()
runs["batch_norm"] = {"history": history.history, "weights": [w.tolist() for w in history.model.get_weights()],
                      "plan": (out / "batch_norm" / "train.log").read_text(),
                      "threads": [int(line.split("THREADS ")[1]) for line in
                                  (out / "batch_norm" / "train.log").read_text().splitlines() if "THREADS " in line],
                      "keras_history": reference.fit(images, targets, batch_size=16, epochs=2, shuffle=False,
                                                     verbose=0).history,
                      "keras_weights": [w.tolist() for w in reference.get_weights()]}

keras.config.set_dtype_policy("mixed_bfloat16")
reference = build(2).fit(x, batch_size=32, epochs=3, shuffle=False, verbose=0)
runs["keras_fit"] = {"history": reference.history}
(out / "features.json").write_text(json.dumps(runs, indent=1))
