"""One process's loss and metrics, bound to its own model: the per-example loss, each batch's metric-state
change, and the values those changes add up to.

Exact over every replica and worker, for any Keras metric whose state adds up
(counts, sums, confusion-matrix buckets): a step does not update the metric; it
returns the change its batch makes to the metric's state, computed from a zero
state with Keras's own ``stateless_update_state``. The changes are added over
steps on the host, all-reduced once per epoch, and the metric's own
``stateless_result`` turns the total into the value one process would report
for all the rows. Nothing per step crosses the network beyond the gradients.

A step's sums are one float64 vector: [loss sum, example count, every metric's
state, flattened]. float64: counts stay exact over a large epoch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from app import internals
from app.errors import UserError
from app.training.objective import Objective

if TYPE_CHECKING:
    import keras
    import tensorflow as tf


def default_metric(task: str, from_logits: bool, one_hot: bool) -> "keras.metrics.Metric":
    """The task's metric for a model compiled without metrics (or not compiled)."""
    import keras

    if task == "regression":
        return keras.metrics.MeanAbsoluteError(name="mae")
    if task == "binary":
        return keras.metrics.BinaryAccuracy(name="accuracy", threshold=0.0 if from_logits else 0.5)
    return (keras.metrics.CategoricalAccuracy if one_hot else keras.metrics.SparseCategoricalAccuracy)(name="accuracy")


def default_loss(objective: Objective) -> Callable:
    """The --loss (or the task's default) as a per-example function of (y, outputs)."""
    import functools
    import inspect

    import keras
    import tensorflow as tf

    fn = keras.losses.get(objective.loss_name)
    if isinstance(fn, keras.losses.Loss):
        return fn.call  # a Loss's call() is per example (its reduction is applied by __call__ only)
    if "from_logits" in inspect.signature(fn).parameters:
        fn = functools.partial(fn, from_logits=objective.from_logits)
    task, one_hot = objective.task, bool(objective.label_shape)

    def per_example(y, out):
        if task != "classification" and not objective.label_shape:
            # binary and regression with one target: compare shapes (n, 1) with (n, 1).
            y = tf.reshape(tf.cast(y, tf.float32), (-1, 1))
            out = tf.reshape(out, (tf.shape(out)[0], -1))
        elif one_hot or task == "regression":
            y = tf.cast(y, tf.float32)
        return fn(y, out)

    return per_example


def unique_names(metrics: list[tuple["keras.metrics.Metric", bool]]) -> list[str]:
    """The names Keras's fit() would report: a repeated name gets _1, _2; a weighted one repeating an
    unweighted one gets the prefix weighted_."""
    names: list[str] = []
    for m, weighted in metrics:
        # An unnamed metric object's name depends on how many of its class this process made before
        # (AUC() is "auc" in the driver, "auc_1" in a worker that built the model twice): its class's name.
        auto = internals.auto_name_of(m)
        name = auto if re.fullmatch(rf"{re.escape(auto)}(_\d+)?", m.name) else m.name
        if name in names and weighted:
            name = f"weighted_{name}"
        base, k = name, 1
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


class Measures:
    """The loss and the metrics of ``objective``, as ``model`` (this process's) was compiled."""

    def __init__(self, objective: Objective, model: "keras.Model"):
        self.objective = objective
        args = internals.compile_arguments(model) or {}
        y_ex = np.zeros((2, *objective.label_shape), objective.label_dtype)
        out_ex = np.zeros((2, *objective.output_shape), np.float32)
        if objective.compiled_loss:
            self._loss = internals.resolve_loss(args["loss"], y_ex, out_ex).call
        else:
            self._loss = default_loss(objective)
        if objective.compiled_metrics:
            self.metrics = [(internals.resolve_metric(m, y_ex, out_ex), weighted)
                            for key, weighted in (("metrics", False), ("weighted_metrics", True))
                            for m in _flat(args.get(key))]
        else:
            self.metrics = [(default_metric(objective.task, objective.from_logits, bool(objective.label_shape)), False)]
        self.names = unique_names(self.metrics)
        self._shapes = [[(tuple(v.shape), v.dtype) for v in m.variables] for m, _ in self.metrics]
        self._sizes = [sum(int(np.prod(shape)) for shape, _ in shapes) for shapes in self._shapes]
        self.size = 2 + sum(self._sizes)
        import tensorflow as tf

        self._class_weights = (tf.constant(objective.class_weights, tf.float32)
                               if objective.class_weights is not None else None)

    # --- inside a step (tf.function, replica context) --------------------------------------------------------

    def example_weights(self, y) -> Optional["tf.Tensor"]:
        """--class-weight: each example's weight from its class (Keras's class_weight), else None."""
        import tensorflow as tf

        if self._class_weights is None:
            return None
        ids = tf.argmax(y, axis=-1) if self.objective.label_shape else tf.reshape(tf.cast(y, tf.int64), (-1,))
        return tf.gather(self._class_weights, ids)

    def loss(self, y, out, training: bool = True) -> "tf.Tensor":
        """Per-example loss, shape (n,): what the caller divides by the global batch. Class weights apply to
        training only, as in Keras's fit (its validation loss is unweighted)."""
        import tensorflow as tf

        out = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), out)
        per_example = self._loss(y, out)
        if per_example.shape.rank and per_example.shape.rank > 1:  # per time step, per pixel: the example's mean
            per_example = tf.reduce_mean(tf.reshape(per_example, (tf.shape(per_example)[0], -1)), axis=-1)
        w = self.example_weights(y) if training else None
        return per_example if w is None else per_example * w

    def sums(self, y, out, per_example_loss, mask, training: bool = True) -> "tf.Tensor":
        """[loss sum, count, every metric's state change] of one batch; rows of ``mask`` 0 (padding) count for
        nothing. Unweighted metrics see only the mask; weighted ones the class weights too (in training)."""
        import tensorflow as tf

        out = tf.cast(out, tf.float32)
        mask = tf.cast(mask, tf.float32)
        w = self.example_weights(y) if training else None
        parts = [tf.reshape(tf.reduce_sum(per_example_loss * mask), (1,)), tf.reshape(tf.reduce_sum(mask), (1,))]
        for m, weighted in self.metrics:
            zero = [tf.zeros(v.shape, v.dtype) for v in m.variables]
            new = m.stateless_update_state(zero, y, out, sample_weight=mask * w if weighted and w is not None
                                           else mask)
            parts += [tf.reshape(tf.cast(v, tf.float64), (-1,)) for v in new]
        return tf.concat([tf.cast(p, tf.float64) for p in parts], axis=0)

    # --- on the host ---------------------------------------------------------------------------------------

    def results(self, state: np.ndarray) -> dict[str, float]:
        """Summed metric states (the vector's tail) -> each metric's value."""
        out, at = {}, 0
        for (m, _), shapes, name in zip(self.metrics, self._shapes, self.names):
            values = []
            for shape, dtype in shapes:
                n = int(np.prod(shape))
                values.append(np.asarray(state[at:at + n]).reshape(shape).astype(_np_dtype(dtype)))
                at += n
            out[name] = float(np.asarray(m.stateless_result(values)))
        return out

    def check_additive(self, y_a, out_a, y_b, out_b) -> None:
        """Refuse (one line) a metric whose state after two batches is not the sum of each batch's change."""
        import tensorflow as tf

        for (m, _), name in zip(self.metrics, self.names):
            zero = [tf.zeros(v.shape, v.dtype) for v in m.variables]
            try:
                a = m.stateless_update_state(zero, y_a, out_a)
                both = m.stateless_update_state(a, y_b, out_b)
                b = m.stateless_update_state(zero, y_b, out_b)
            except Exception as e:
                raise UserError(f"metric {name} ({type(m).__name__}) fails on this model's outputs and labels: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
            if not all(np.allclose(np.asarray(s), np.asarray(x) + np.asarray(y), rtol=1e-5, atol=1e-6)
                       for s, x, y in zip(both, a, b)):
                raise UserError(
                    f"metric {name} ({type(m).__name__}) keeps a state that does not add up over batches, so it "
                    "cannot be combined exactly over workers: drop it from compile(metrics=...), or use a metric whose "
                    "state is sums or counts (keras.metrics.Mean, AUC, Precision, ...)")


def _flat(metrics: Any) -> list[Any]:
    if metrics is None:
        return []
    if isinstance(metrics, dict):
        raise UserError("compile(metrics=...) is a dict per output; this product trains models with one output: "
                        "give a list of metrics")
    if not isinstance(metrics, (list, tuple)):
        return [metrics]
    if any(isinstance(m, (list, tuple, dict)) for m in metrics):
        raise UserError("compile(metrics=...) holds a list per output; this product trains models with one output: "
                        "give one flat list of metrics")
    return list(metrics)


def _np_dtype(dtype: Any) -> Any:
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype) if not isinstance(dtype, str) else dtype)


def settle(objective: Objective, model: "keras.Model", facts, rows: int = 64) -> Objective:
    """The driver's check of the loss and the metrics on this model and these labels; the objective with the
    metrics' names. Everything that would fail in a worker's first step fails here, in one line."""
    import dataclasses

    import keras

    from app.training.objective import RESERVED

    measures = Measures(objective, model)
    taken = [n for n in measures.names if n in RESERVED]
    if taken:
        raise UserError(f"a metric is named {taken[0]!r}, which the run's records use for their own values: "
                        "give it another name (name=...)")
    rng = np.random.default_rng(0)
    # In [0, 1): valid inputs for token models too (ids 0), varied for the rest.
    x = rng.uniform(size=(2 * rows, *facts.feature_shape)).astype(np.float32)
    out = keras.ops.convert_to_numpy(model(x, training=False)).astype(np.float32)
    y = example_labels(objective, facts, 2 * rows, rng)
    _check_loss_fits_labels(objective, measures, y, out)
    measures.check_additive(y[:rows], out[:rows], y[rows:], out[rows:])
    return dataclasses.replace(objective, metric_names=tuple(measures.names))


def example_labels(objective: Objective, facts, n: int, rng) -> np.ndarray:
    """Random labels of the data's kind: class ids, one-hot rows, or float targets."""
    if objective.task == "regression":
        return rng.normal(size=(n, *objective.label_shape)).astype(np.float32)
    ids = rng.integers(0, facts.num_classes or 2, n)
    if objective.label_shape:
        return np.eye(objective.label_shape[-1], dtype=np.float32)[ids]
    return ids.astype(np.int64)


def _check_loss_fits_labels(objective: Objective, measures: Measures, y, out) -> None:
    kind = objective.loss_name.lower().replace("categoricalcrossentropy", "categorical_crossentropy")
    one_hot = bool(objective.label_shape) and objective.task != "regression"
    if "sparse" in kind and one_hot:
        raise UserError(f"loss {objective.loss_name} takes class ids, but the labels are one-hot "
                        f"({objective.label_shape[-1]} columns): compile with loss='categorical_crossentropy', "
                        "or give the labels as class ids")
    if "categorical" in kind and "sparse" not in kind and not objective.label_shape and objective.task != "regression":
        raise UserError(f"loss {objective.loss_name} takes one-hot labels, but the labels are class ids: compile "
                        "with loss='sparse_categorical_crossentropy', or one-hot the labels")
    try:
        per_example = measures.loss(y, out)
    except Exception as e:
        raise UserError(f"loss {objective.loss_name} does not fit labels of shape {y.shape[1:]} and outputs of "
                        f"shape {out.shape[1:]}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if tuple(per_example.shape) != (len(y),):
        raise UserError(f"loss {objective.loss_name} gives shape {tuple(per_example.shape)} for {len(y)} examples; "
                        "expected one value per example")
