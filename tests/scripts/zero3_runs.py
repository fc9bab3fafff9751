"""A user's script: models trained by app.fit on 2 Ray workers with their weights sharded (shard_optimizer=3,
app.training.zero_weights), unsharded, on 1 worker and by Keras's own model.fit in one process.

    python zero3_runs.py OUT      (joined to a running Ray: RAY_ADDRESS)

Writes OUT/zero3.json: each run's final weights, History, plan and result.json figures. tests/test_zero_weights.py
reads it.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import app

out = Path(sys.argv[1])
rng = np.random.default_rng(0)
tokens = rng.integers(0, 50, size=(120, 10)).astype("int32")  # 120 rows, batch 32: a short last batch of 24
classes = (tokens[:, :3].sum(axis=1) % 3).astype("int32")
x = rng.normal(size=(200, 9)).astype("float32")  # 200 rows, batch 32: a short last batch of 8
y = (x[:, :3] @ rng.normal(size=(3, 3))).astype("float32")
fit = dict(batch_size=32, shuffle=False, verbose=0)


def attention():
    """Embedding, MultiHeadAttention (its four EinsumDense), LayerNormalization, Conv1D and Dense: each gathers
    itself; odd sizes, so the parts end in padding. Adam, compiled, a softmax output."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((10,), dtype="int32")
    h = keras.layers.Embedding(50, 12)(inputs)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 5)(h, h))
    h = keras.layers.Conv1D(7, 3, activation="relu")(h)
    # A softmax output: Keras's cross-entropy reads the logits it carries, sharded as unsharded.
    outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class Regressor(keras.Model):
    """Its own train_step; a batch norm between its Dense layers, which stays whole (it updates its statistics)."""

    def __init__(self, dtype=None):
        super().__init__(dtype=dtype)
        self.hidden = keras.layers.Dense(7, activation="tanh", dtype=dtype)
        self.norm = keras.layers.BatchNormalization(dtype=dtype)
        self.out = keras.layers.Dense(3, dtype=dtype)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, inputs, training=False):
        return self.out(self.norm(self.hidden(inputs), training=training))

    def train_step(self, data):
        inputs, targets = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(self(inputs, training=True), "float32") - targets))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]


def regressor(dtype=None):
    def build():
        keras.utils.set_random_seed(5)
        model = Regressor(dtype)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=0.3))
        return model

    return build


def clipped():
    """Compiled, Adam with clipnorm: each weight's gradient norm is its whole gradient's, summed over the parts."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((9,)), keras.layers.Dense(11, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.02, clipnorm=0.2), loss="mse")
    return model


def weights(model) -> list:
    return [np.asarray(w, dtype="float32").tolist() for w in model.get_weights()]


def on_ray(name: str, build, data, epochs: int, stage: int, workers: int = 2, **more) -> dict:
    trained = app.fit(build, *data, epochs=epochs, num_workers=workers, shard_optimizer=stage,
                      output=str(out / name), **fit, **more)
    return {"weights": weights(trained.model), "history": trained.history,
            "result": {k: trained.result.get(k) for k in ("optimizer_state_bytes", "optimizer_parts_bytes")},
            "plan": (out / name / "train.log").read_text()}


def in_one_process(build, data, epochs: int) -> dict:
    model = build()
    history = model.fit(*data, epochs=epochs, **fit)
    return {"weights": weights(model), "history": history.history}


runs = {
    "attention": {"sharded": on_ray("attention-3", attention, (tokens, classes), 3, 3),
                  "unsharded": on_ray("attention-0", attention, (tokens, classes), 3, 0),
                  "keras_fit": in_one_process(attention, (tokens, classes), 3)},
    # SGD with momentum and global_clipnorm, computing in bfloat16 (its variables float32), its own train_step.
    "sgd_bf16": {"sharded": on_ray("sgd-bf16-3", regressor("mixed_bfloat16"), (x, y), 3, 3),
                 "unsharded": on_ray("sgd-bf16-0", regressor("mixed_bfloat16"), (x, y), 3, 0)},
}
# Adam with clipnorm: 2 epochs at stage 3 on 2 workers, the third resumed on 1 worker (unsharded: the checkpoint
# held the whole model and state), the fourth at stage 3 on 2 workers again (each cut its part of the unsharded
# checkpoint the one worker wrote).
runs["clipnorm"] = {"sharded_2": on_ray("resumed", clipped, (x, y), 2, 3),
                    "resumed_1_worker": on_ray("resumed", clipped, (x, y), 3, 0, workers=1, resume=True),
                    "resumed_sharded": on_ray("resumed", clipped, (x, y), 4, 3, resume=True),
                    **{f"keras_fit_{n}": in_one_process(clipped, (x, y), n) for n in (2, 3, 4)}}
(out / "zero3.json").write_text(json.dumps(runs, indent=1))
