"""What is minimised and what is reported, per task: the per-example loss and the metric.

Both are per-example, so that every backend sums them exactly over every
replica and worker (app.training.metrics) instead of averaging averages:

| task           | default loss                         | metric                  |
|----------------|--------------------------------------|-------------------------|
| classification | sparse categorical cross-entropy     | accuracy (argmax == y)  |
| binary         | binary cross-entropy                 | accuracy (p > 0.5)      |
| regression     | mean squared error                   | mae (mean abs. error)   |

``--loss`` takes any Keras loss name instead. Whether the model outputs logits
is read from its last activation (softmax / sigmoid: probabilities), or given
with ``--from-logits``.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from app.errors import UserError

if TYPE_CHECKING:
    import tensorflow as tf

DEFAULT_LOSS = {
    "classification": "sparse_categorical_crossentropy",
    "binary": "binary_crossentropy",
    "regression": "mean_squared_error",
}


# Each metric the product reports, and which way is better: decided here only.
MODES = {"accuracy": "max", "mae": "min"}


def metric_name(task: str) -> str:
    """The metric's key in reports: train_<name>, val_<name>."""
    return "mae" if task == "regression" else "accuracy"


def metric_mode(metric: str) -> str:
    """"max" or "min": which way ``metric`` (a name in MODES, or val_/train_<name>) is better."""
    return MODES[metric.split("_", 1)[1] if metric.startswith(("val_", "train_")) else metric]


def metric_in(record: dict) -> str:
    """Which metric an epoch record or result's metrics carry (their keys are val_<name>)."""
    return next(name for name in MODES if f"val_{name}" in record)


@dataclass(frozen=True)
class Objective:
    task: str
    loss_name: str
    from_logits: bool

    @property
    def metric(self) -> str:
        return metric_name(self.task)

    @property
    def mode(self) -> str:
        return metric_mode(self.metric)

    def loss_fn(self) -> Callable[["tf.Tensor", "tf.Tensor"], "tf.Tensor"]:
        """(y, outputs) -> per-example loss (no reduction: the caller divides by the global batch)."""
        import keras
        import tensorflow as tf

        fn = keras.losses.get(self.loss_name)
        if isinstance(fn, keras.losses.Loss):  # a class instance: take its function
            fn = fn.fn if hasattr(fn, "fn") else fn
        if "from_logits" in inspect.signature(fn).parameters:
            fn = functools.partial(fn, from_logits=self.from_logits)

        def per_example(y, out):
            out = tf.cast(out, tf.float32)
            if self.task != "classification":
                # binary and regression: one output per example; compare shapes (n, 1) with (n, 1).
                y = tf.reshape(tf.cast(y, tf.float32), (-1, 1))
                out = tf.reshape(out, (tf.shape(out)[0], -1))
            loss = fn(y, out)
            return tf.reshape(loss, (tf.shape(out)[0], -1)) if loss.shape.rank and loss.shape.rank > 1 else loss

        return per_example

    def metric_fn(self) -> Callable[["tf.Tensor", "tf.Tensor"], "tf.Tensor"]:
        """(y, outputs) -> per-example metric value (1/0 for a correct prediction, or |error|)."""
        import tensorflow as tf

        def per_example(y, out):
            out = tf.cast(out, tf.float32)
            if self.task == "classification":
                return tf.cast(tf.equal(tf.argmax(out, axis=-1, output_type=tf.int64), tf.cast(y, tf.int64)), tf.float32)
            out = tf.reshape(out, (tf.shape(out)[0],))
            if self.task == "binary":
                threshold = 0.0 if self.from_logits else 0.5
                return tf.cast(tf.equal(tf.cast(out > threshold, tf.int64), tf.cast(y, tf.int64)), tf.float32)
            return tf.abs(out - tf.cast(y, tf.float32))

        return per_example


def objective_for(config, task: str, model) -> Objective:
    """The run's objective: its task, the loss (--loss or the task's default), logits or probabilities."""
    import keras

    from app.training.model import ends_in_probabilities

    loss = config.loss or DEFAULT_LOSS[task]
    try:
        keras.losses.get(loss)
    except (ValueError, TypeError):
        raise UserError(f"unknown loss {loss!r}: give a Keras loss name such as {', '.join(DEFAULT_LOSS.values())}, "
                        "huber or mean_absolute_error") from None
    from_logits = config.from_logits if config.from_logits is not None else not ends_in_probabilities(model)
    return Objective(task, loss, from_logits if task != "regression" else False)
