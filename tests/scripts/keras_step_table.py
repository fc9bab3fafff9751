"""The conformance table of app.fit against keras.Model.fit (tests/test_keras_step.py runs it, once).

Each model kind is written as keras.io writes it; each input kind is one of fit()'s. For every pair: Keras's own
fit in this process, then app.fit on one worker (the local backend: the same per-worker function, world 1) or on
2 Ray workers (the session's Ray: RAY_ADDRESS). Every run starts from the same weights (the model function seeds
Keras) and reads the rows in order (shuffle=False). Arguments: the output directory, then JSON [[model, input]
pairs, "one" or "two"]. Writes table.json: per pair, each run's History, weights and optimizer steps, or its error.
"""

import json
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import app

ROWS, FEATURES, BATCH = 96, 4, 21  # 4 batches of 21 and a short one of 12: 11 + 10 and 6 + 6 rows on 2 workers
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, FEATURES)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int64")
W = rng.uniform(0.5, 1.5, size=ROWS).astype("float32")
XV = rng.normal(size=(40, FEATURES)).astype("float32")
YV = (XV[:, 0] + XV[:, 1] > 0).astype("int64")
# Token ids, 3 a row from 8: every batch looks up some rows of the embedding several times
T = rng.integers(0, 8, size=(ROWS, 3))


def functional():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def executions():
    """The functional model compiled with steps_per_execution=3: an epoch's 5 steps run as 3 and 2, as fit() runs
    them on arrays (one pass per epoch), not as 3 and 3 into the next epoch's batches."""
    model = functional()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], weighted_metrics=["accuracy"], steps_per_execution=3)
    return model


def two_inputs():
    """Two inputs, fit on a list of two arrays (Keras's convention for a model of several inputs): features, and
    token ids into an Embedding trained by Adam. The Embedding's gradient is sparse (tf.IndexedSlices, a slice per
    lookup), and Adam squares each slice before a row's are added, so the workers' slices must reach the optimizer as
    one process's would. Adam keeps an EMA of the weights, which SwapEMAWeights (the input's callback) swaps in to
    validate, on every worker."""
    keras.utils.set_random_seed(1)
    a, b = keras.Input((2,), name="a"), keras.Input((3,), dtype="int64", name="b")
    tokens = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(8, 4)(b))
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, tokens]))
    model = keras.Model([a, b], keras.layers.Dense(2)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class OwnStep(keras.Model):
    """keras.io's VAE shape: its own train_step and test_step, three Mean trackers, fit on x alone."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(3, activation="tanh")])
        self.decoder = keras.Sequential([keras.Input((3,)), keras.layers.Dense(FEATURES)])
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def losses_of(self, data):
        z = self.encoder(data)
        reconstruction = self.decoder(z)
        reconstruction_loss = tf.reduce_mean(tf.reduce_sum(tf.square(data - reconstruction), axis=1))
        kl_loss = tf.reduce_mean(tf.reduce_sum(tf.square(z), axis=1)) * 0.1
        return reconstruction_loss + kl_loss, reconstruction_loss, kl_loss

    def train_step(self, data):
        with tf.GradientTape() as tape:
            total, reconstruction, kl = self.losses_of(data)
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return self._track(total, reconstruction, kl)

    def test_step(self, data):
        return self._track(*self.losses_of(data))

    def _track(self, total, reconstruction, kl):
        self.total_loss_tracker.update_state(total)
        self.reconstruction_loss_tracker.update_state(reconstruction)
        self.kl_loss_tracker.update_state(kl)
        return {m.name: m.result() for m in self.metrics}


def own_step():
    keras.utils.set_random_seed(1)
    model = OwnStep()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


class GAN(keras.Model):
    """keras.io's GAN shape: compile(d_optimizer, g_optimizer), two Mean trackers, seeded noise, x alone."""

    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(FEATURES)])
        self.discriminator = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        self.seed_generator = keras.random.SeedGenerator(3)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real):
        n = tf.shape(real)[0]
        noise = keras.random.normal((n, 2), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            logits = self.discriminator(tf.concat([fake, real], 0))
            labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0)
            d_loss = self.loss_fn(labels, logits)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((n, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        # Nested, as a step may return them: fit() logs the leaves (d_loss, g_loss).
        return {"losses": {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}}


def gan():
    keras.utils.set_random_seed(1)
    model = GAN()
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    return model


class Distiller(keras.Model):
    """keras.io's distillation shape: a frozen teacher passed to the constructor, compile() of its own,
    compute_loss overridden."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher
        self.teacher.trainable = False

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.5):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn, self.alpha = student_loss_fn, distillation_loss_fn, alpha

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(tf.nn.softmax(teacher_pred), tf.nn.softmax(y_pred))
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def distiller():
    keras.utils.set_random_seed(1)
    teacher = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    student = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    model = Distiller(student, teacher)
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distillation_loss_fn=keras.losses.KLDivergence())
    return model


class ActivityPenalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.01 * tf.reduce_mean(tf.square(x)))
        return x


def add_loss():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    h = ActivityPenalty()(keras.layers.Dense(8, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def two_outputs():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(8, activation="relu")(inputs)
    priority = keras.layers.Dense(1, name="priority")(h)
    department = keras.layers.Dense(2, activation="softmax", name="department")(h)
    model = keras.Model(inputs, {"priority": priority, "department": department})
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"priority": "mse", "department": "sparse_categorical_crossentropy"},
                  loss_weights={"priority": 1.0, "department": 0.2},
                  metrics={"department": ["accuracy"]})
    return model


class Rows(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def generator(epochs):
    for _ in range(epochs):
        for i in range(0, ROWS, BATCH):
            yield X[i:i + BATCH], Y[i:i + BATCH]


def batched(*arrays):
    return tf.data.Dataset.from_tensor_slices(arrays).batch(BATCH)


# input kind -> fit() keyword arguments (a function: a generator is used once)
INPUTS = {
    "arrays": lambda: {"x": X, "y": Y, "batch_size": BATCH, "validation_data": (XV, YV)},
    "dict": lambda: {"x": {"features": X}, "y": Y, "batch_size": BATCH},
    # 24 rows a batch, as "arrays x" below: the own-step model's Mean trackers are fed one value per batch.
    "tf.data x": lambda: {"x": tf.data.Dataset.from_tensor_slices(X).batch(24)},
    # Reshuffled every pass, as keras.io's pipelines are: each epoch trains on the pass model.fit would read.
    "tf.data x,y": lambda: {"x": tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(ROWS, seed=2).batch(BATCH),
                            "validation_data": batched(XV, YV)},
    "tf.data x,y,w": lambda: {"x": batched(X, Y, W)},
    "PyDataset": lambda: {"x": Rows(X, Y), "validation_data": Rows(XV, YV)},
    "generator": lambda: {"x": generator(EPOCHS), "steps_per_epoch": -(-ROWS // BATCH)},
    # 24 rows a batch: 12 per worker. A Mean tracker fed one loss per batch (not per row) averages the workers'
    # batch means, which is the global batch's mean when its parts are equal.
    "arrays x": lambda: {"x": X, "batch_size": 24, "validation_data": (XV,)},
    # Keras's per-output loss trackers are such Mean trackers too: 24 rows a batch (72 train, 24 validate).
    "two targets": lambda: {"x": X, "y": {"priority": X[:, :1] * 2, "department": Y}, "batch_size": 24,
                            "validation_split": 0.25},
    "regression": lambda: {"x": X, "y": X[:, :1] - X[:, 2:3], "batch_size": BATCH},
    "list": lambda: {"x": [X[:, :2], T], "y": (X[:, 0] + T[:, 0] / 4 > 1).astype("int64"), "batch_size": 24,
                     "validation_split": 0.25, "callbacks": [keras.callbacks.SwapEMAWeights()]},
}
# A path of parquet files as x (and validation_data): the same rows as an in-memory kind, written as columns f0..f3
# (and label); Keras's fit gets that kind's arrays. On one worker (the local backend) app.fit reads the path into
# those arrays; on Ray workers a path streams through Ray Data (tests/test_keras_stream.py).
PATHS = {"parquet x,y": "arrays", "parquet x": "arrays x"}


def as_path(input_name, out):
    kwargs = INPUTS[PATHS[input_name]]()

    def write(x, y, name):
        import pandas as pd

        frame = pd.DataFrame({f"f{i}": x[:, i] for i in range(x.shape[1])})
        if y is not None:
            frame["label"] = y
        frame.to_parquet(f"{out}-{name}.parquet")
        return f"{out}-{name}.parquet"

    kwargs["x"] = write(kwargs.pop("x"), kwargs.pop("y", None), "train")
    if "validation_data" in kwargs:
        val = kwargs.pop("validation_data")
        kwargs["validation_data"] = write(val[0], val[1] if len(val) > 1 else None, "val")
    return kwargs


MODELS = {"functional": functional, "executions": executions, "two_inputs": two_inputs, "own_step": own_step,
          "gan": gan, "distiller": distiller, "add_loss": add_loss, "two_outputs": two_outputs}
EPOCHS = 2


def outcome(fit, *args, **kwargs):
    try:
        history, model = fit(*args, **kwargs)
    except Exception as e:  # the table records refusals: Keras's and the product's
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "weights": [w.tolist() for w in model.get_weights()],
            "optimizer_steps": [int(o.iterations.numpy()) for o in optimizers(model)]}


def optimizers(model):
    return [o for o in [model.optimizer, getattr(model, "d_optimizer", None), getattr(model, "g_optimizer", None)]
            if o is not None]


def keras_fit(model_name, input_name):
    model = MODELS[model_name]()
    return model.fit(**INPUTS[PATHS.get(input_name, input_name)](), epochs=EPOCHS, shuffle=False, verbose=0), model


def app_fit(model_name, input_name, out, **where):
    given = as_path(input_name, out) if input_name in PATHS else INPUTS[input_name]()
    history = app.fit(MODELS[model_name], **given, epochs=EPOCHS, shuffle=False, verbose=0, output=out, **where)
    return history, history.model


WHERE = {"one": {"backend": "local"}, "two": {"num_workers": 2}}


def main(out_dir, pairs, workers):
    table = {}
    for m, i in pairs:
        key, started = f"{m} | {i}", time.monotonic()
        table[key] = {"keras": outcome(keras_fit, m, i),
                      workers: outcome(app_fit, m, i, f"{out_dir}/{m}-{i}-{workers}", **WHERE[workers])}
        print(key, {k: v.get("error", "ok") for k, v in table[key].items()}, f"{time.monotonic() - started:.1f} s",
              flush=True)
    with open(f"{out_dir}/table.json", "w") as f:
        json.dump(table, f)


if __name__ == "__main__":
    main(sys.argv[1], *json.loads(sys.argv[2]))
