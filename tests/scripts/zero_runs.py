"""A user's script: models trained by app.fit on 2 Ray workers with their optimizers' state sharded
(shard_optimizer, app.training.zero), unsharded, and by Keras's own model.fit in one process.

    python zero_runs.py OUT      (joined to a running Ray: RAY_ADDRESS)

Writes OUT/zero.json: each run's final weights, History and result.json figures. tests/test_zero.py reads it.
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
x = rng.normal(size=(200, 9)).astype("float32")  # 200 rows, batch 32: a short last batch of 8 every epoch
y = (x[:, :3] @ rng.normal(size=(3, 3))).astype("float32")


class Regressor(keras.Model):
    """Its own train_step; layer sizes whose flat lengths are odd, so the parts cut across variables."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def train_step(self, data):
        inputs, targets = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(inputs) - targets))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]


class TwoOptimizers(keras.Model):
    """A GAN's shape: compile(d_optimizer, g_optimizer), each applied in its own train_step (the generator's input
    a fixed function of the row, so that 2 workers see what one process sees)."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(9)])
        self.discriminator = keras.Sequential([keras.Input((9,)), keras.layers.Dense(5, activation="tanh"),
                                               keras.layers.Dense(1)])
        self.tracker = keras.metrics.Mean(name="d_loss")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        real, _ = data
        noise = tf.tanh(real[:, :3] * 0.5)
        with tf.GradientTape() as tape:
            d_loss = tf.reduce_mean(self.discriminator(self.generator(noise))) - tf.reduce_mean(self.discriminator(real))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.tracker.update_state(d_loss)
        return {"d_loss": self.tracker.result()}


def two_optimizers():
    keras.utils.set_random_seed(6)
    model = TwoOptimizers()
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.02, momentum=0.5))
    return model


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5),
    "adamw_global_clipnorm": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01, global_clipnorm=0.3),
}


def builder(optimizer: str, own_step: bool):
    def build():
        keras.utils.set_random_seed(5)
        if own_step:
            model = Regressor()
        else:  # compiled, with a constraint Keras applies after each update
            model = keras.Sequential([keras.Input((9,)), keras.layers.Dense(7, activation="tanh",
                                      kernel_constraint=keras.constraints.MaxNorm(0.8)), keras.layers.Dense(3)])
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss=None if own_step else "mse")
        return model

    return build


def weights(model) -> list:
    return [np.asarray(w).tolist() for w in model.get_weights()]


runs = {}
fit = dict(batch_size=32, shuffle=False, verbose=0)


def sharded_run(name: str, build, epochs: int, stage: int, output: str):
    """app.fit sharded on 2 workers for ``epochs``, and model.fit's run of as many epochs in this process."""
    sharded = app.fit(build, x, y, epochs=epochs, num_workers=2, shard_optimizer=stage, output=str(out / output),
                      **fit)
    reference = build()
    reference_history = reference.fit(x, y, epochs=epochs, **fit)
    runs[name] = {"sharded": weights(sharded.model), "keras_fit": weights(reference),
                  "history": sharded.history, "keras_history": reference_history.history,
                  "result": {k: sharded.result[k] for k in ("optimizer_state_bytes", "optimizer_parts_bytes")},
                  "plan": (out / output / "train.log").read_text()}
    return sharded


for name, own_step in (("sgd_momentum_clipnorm", False), ("adamw_global_clipnorm", True)):
    sharded_run(name, builder(name, own_step), 3, 1, f"{name}-sharded")

# Two optimizers, each sharded (their parts and checkpoints apart).
gan = app.fit(two_optimizers, x, y, epochs=2, num_workers=2, shard_optimizer=2, output=str(out / "gan"), **fit)
reference = two_optimizers()
reference_history = reference.fit(x, y, epochs=2, **fit)
runs["two_optimizers"] = {"sharded": weights(gan.model), "keras_fit": weights(reference), "history": gan.history,
                          "keras_history": reference_history.history,
                          "iterations": [int(o.iterations.numpy()) for o in (gan.model.d_optimizer,
                                                                             gan.model.g_optimizer)]}

# Adam (stage 2) sharded on 2 workers for 2 epochs, then resumed on 1 worker (unsharded) to the third: the
# checkpoint holds the whole state, put together from both workers' parts.
build = builder("adam", True)
first = sharded_run("adam", build, 2, 2, "resumed")
resumed = app.fit(build, x, y, epochs=3, num_workers=1, resume=True, output=str(out / "resumed"), **fit)
reference = build()
reference.fit(x, y, epochs=3, **fit)
runs["adam"]["keras_fit_3_epochs"] = weights(reference)
runs["adam"]["resumed"] = weights(resumed.model)
runs["adam"]["resumed_history"] = resumed.history
# The other way: 2 epochs unsharded on 2 workers (the state every worker holds whole; the same weights as the
# sharded 2 epochs above), the third resumed sharded: each worker keeps its part of the whole state the unsharded
# checkpoint holds.
whole = app.fit(build, x, y, epochs=2, num_workers=2, output=str(out / "resharded"), **fit)
runs["adam"]["sharded_2_epochs"] = weights(first.model)
runs["adam"]["unsharded"] = weights(whole.model)
runs["adam"]["unsharded_result"] = {k: whole.result[k] for k in ("optimizer_state_bytes", "optimizer_parts_bytes")}
resharded = app.fit(build, x, y, epochs=3, num_workers=2, shard_optimizer=2, resume=True,
                    output=str(out / "resharded"), **fit)
runs["adam"]["resharded"] = weights(resharded.model)


# fp16: a loss scale far too large for float16's range, so the first steps overflow (an inf in some gradient) and
# are skipped while the scale halves. Sharded, every worker skips the same steps as unsharded and as model.fit.
def fp16():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((9,)), keras.layers.Dense(7, activation="tanh", dtype="mixed_float16"),
                              keras.layers.Dense(3, dtype="mixed_float16")])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**19),
                  loss="mse")
    return model


def scale_of(model) -> dict:
    return {"scale": float(model.optimizer.dynamic_scale.numpy()), "iterations": int(model.optimizer.iterations),
            "adam_iterations": int(model.optimizer.inner_optimizer.iterations)}


runs["fp16"] = {}
for name, stage in (("sharded", 2), ("unsharded", 0)):
    trained = app.fit(fp16, x, y, epochs=1, num_workers=2, shard_optimizer=stage, output=str(out / f"fp16-{name}"),
                      **fit)
    runs["fp16"][name] = {"weights": weights(trained.model), "history": trained.history, **scale_of(trained.model)}
reference = fp16()
reference_history = reference.fit(x, y, epochs=1, **fit)
runs["fp16"]["keras_fit"] = {"weights": weights(reference), "history": reference_history.history,
                             **scale_of(reference)}
(out / "zero.json").write_text(json.dumps(runs, indent=1))
