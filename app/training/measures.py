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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from app import internals
from app.data.arrays import first
from app.errors import UserError
from app.training import default_compile
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
        return fn(y, out) if objective.loss_weight is None else fn(y, out) * objective.loss_weight

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


@dataclass
class _Head:
    """One output of the model: its loss (per example) and its metrics."""

    name: Optional[str]  # the output's name; None for a model with one output
    loss: Callable
    loss_weight: float
    metrics: list[tuple["keras.metrics.Metric", bool]]  # (metric, weighted)


def _resolved(kind: str, identifier: Any, y_example: np.ndarray, out_example: np.ndarray) -> Any:
    """A compile() loss or metric as fit() resolves it; one that Keras does not know, as one line naming it."""
    resolve = internals.resolve_loss if kind == "loss" else internals.resolve_metric
    try:
        return resolve(identifier, y_example, out_example)
    except ValueError as e:
        raise default_compile.unknown_name(kind, identifier, e) from None


class Measures:
    """The loss and the metrics of ``objective``, as ``model`` (this process's) was compiled."""

    def __init__(self, objective: Objective, model: "keras.Model"):
        import tensorflow as tf

        self.objective = objective
        args = internals.compile_arguments(model) or {}
        outputs = objective.outputs or ((None, objective.label_shape, objective.output_shape, objective.label_dtype,
                                         objective.task),)
        names = [o[0] for o in outputs]
        self.heads: list[_Head] = []
        for i, (name, label_shape, output_shape, dtype, _task) in enumerate(outputs):
            y_ex, out_ex = np.zeros((2, *label_shape), dtype), np.zeros((2, *output_shape), np.float32)
            if objective.compiled_loss:
                loss = _resolved("loss", per_output(args["loss"], i, names, "loss"), y_ex, out_ex).call
            else:
                loss = default_loss(objective)
            weight = per_output(args.get("loss_weights"), i, names, "loss_weights") if objective.compiled_loss else None
            if objective.compiled_metrics:
                metrics = [(_resolved("metric", m, y_ex, out_ex), weighted)
                           for key, weighted in (("metrics", False), ("weighted_metrics", True))
                           for m in _flat(per_output(args.get(key), i, names, key, listed=True))]
            else:
                metrics = [(default_metric(objective.task, objective.from_logits, bool(label_shape)), False)]
            self.heads.append(_Head(name, loss, 1.0 if weight is None else float(weight), metrics))
        self.metrics = [m for head in self.heads for m in head.metrics]
        self.names = [f"{head.name}_{n}" if head.name else n
                      for head in self.heads for n in unique_names(head.metrics)]
        self._shapes = [[(tuple(v.shape), v.dtype) for v in m.variables] for m, _ in self.metrics]
        self.size = 2 + sum(int(np.prod(shape)) for shapes in self._shapes for shape, _ in shapes)
        self._class_weights = (tf.constant(objective.class_weights, tf.float32)
                               if objective.class_weights is not None else None)

    # --- inside a step (tf.function, replica context) --------------------------------------------------------

    def _pairs(self, y, out):
        """(head, its labels, its outputs): a dict of labels by output name; outputs as a dict, list or one."""
        if len(self.heads) == 1:
            return [(self.heads[0], y, out)]
        return [(head, y[head.name], out[head.name] if isinstance(out, dict) else out[i])
                for i, head in enumerate(self.heads)]

    def train_weights(self, y, sample_weight=None) -> Optional["tf.Tensor"]:
        """Each training example's weight: the data's sample weight times its class's --class-weight (Keras's
        class_weight and sample_weight), or None for neither."""
        import tensorflow as tf

        w = sample_weight
        if self._class_weights is not None:
            ids = tf.argmax(y, axis=-1) if self.objective.label_shape else tf.reshape(tf.cast(y, tf.int64), (-1,))
            by_class = tf.gather(self._class_weights, ids)
            w = by_class if w is None else w * by_class
        return w

    def loss(self, y, out, weight=None) -> "tf.Tensor":
        """Per-example loss, shape (n,) (each output's, times its loss weight, added), times ``weight``: what
        the caller divides by the global batch. Validation passes no weight, as Keras's fit."""
        import tensorflow as tf

        total = None
        for head, y_k, out_k in self._pairs(y, out):
            per_example = head.loss(y_k, tf.cast(out_k, tf.float32))
            if per_example.shape.rank and per_example.shape.rank > 1:  # per time step, per pixel: the example's mean
                per_example = tf.reduce_mean(tf.reshape(per_example, (tf.shape(per_example)[0], -1)), axis=-1)
            per_example = per_example * head.loss_weight if head.loss_weight != 1.0 else per_example
            total = per_example if total is None else total + per_example
        return total if weight is None else total * weight

    def sums(self, y, out, per_example_loss, mask, weight=None) -> "tf.Tensor":
        """[loss sum, count, every metric's state change] of one batch; rows of ``mask`` 0 (padding) count for
        nothing. Unweighted metrics see only the mask; weighted ones ``weight`` too."""
        import tensorflow as tf

        mask = tf.cast(mask, tf.float32)
        parts = [tf.reshape(tf.reduce_sum(per_example_loss * mask), (1,)), tf.reshape(tf.reduce_sum(mask), (1,))]
        for head, y_k, out_k in self._pairs(y, out):
            for m, weighted in head.metrics:
                zero = [tf.zeros(v.shape, v.dtype) for v in m.variables]
                new = m.stateless_update_state(zero, y_k, tf.cast(out_k, tf.float32),
                                               sample_weight=mask * weight if weighted and weight is not None else mask)
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

        a_pairs, b_pairs = self._pairs(y_a, out_a), self._pairs(y_b, out_b)
        names = iter(self.names)
        for (head, ya, oa), (_, yb, ob) in zip(a_pairs, b_pairs):
            for m, _ in head.metrics:
                name = next(names)
                zero = [tf.zeros(v.shape, v.dtype) for v in m.variables]
                try:
                    a = m.stateless_update_state(zero, ya, oa)
                    both = m.stateless_update_state(a, yb, ob)
                    b = m.stateless_update_state(zero, yb, ob)
                except Exception as e:
                    raise UserError(f"metric {name} ({type(m).__name__}) fails on this model's outputs and labels: "
                                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
                if not all(np.allclose(np.asarray(s), np.asarray(x) + np.asarray(y), rtol=1e-5, atol=1e-6)
                           for s, x, y in zip(both, a, b)):
                    raise UserError(
                        f"metric {name} ({type(m).__name__}) keeps a state that does not add up over batches, so it "
                        "cannot be combined exactly over workers: drop it from compile(metrics=...), or use a metric "
                        "whose state is sums or counts (keras.metrics.Mean, AUC, Precision, ...)")


def per_output(given: Any, i: int, names: list[Optional[str]], what: str, listed: bool = False) -> Any:
    """What compile() gave for output ``i``: a dict by output name, a list with one entry per output, or (one
    output; a loss for every output) the value itself."""
    if len(names) == 1 or given is None:
        if isinstance(given, dict) and len(names) == 1:
            raise UserError(f"compile({what}=...) is a dict, but the model has one output: give it as a "
                            f"{'list' if listed else 'single value'}")
        return given
    if isinstance(given, dict):
        unknown = set(given) - set(names)
        if unknown:
            raise UserError(f"compile({what}=...) names output(s) {', '.join(sorted(unknown))}, but the model's "
                            f"outputs are {', '.join(names)}")
        return given.get(names[i])
    if isinstance(given, (list, tuple)) and (not listed or any(isinstance(g, (list, tuple)) for g in given)):
        if len(given) != len(names):
            raise UserError(f"compile({what}=...) has {len(given)} entries, but the model has {len(names)} outputs "
                            f"({', '.join(names)}): give one per output, or a dict by output name")
        return given[i]
    if listed:  # one flat list of metrics: Keras takes it only for a single output
        raise UserError(f"compile({what}=...) is one list, but the model has {len(names)} outputs: give a dict by "
                        f"output name ({', '.join(names)}), e.g. {{'{names[0]}': ['accuracy']}}")
    return given  # one loss for every output


def _flat(metrics: Any) -> list[Any]:
    if metrics is None:
        return []
    return list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]


def _np_dtype(dtype: Any) -> Any:
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype) if not isinstance(dtype, str) else dtype)


def settle(objective: Objective, model: "keras.Model", facts, examples: Any = None, rows: int = 64) -> Objective:
    """The driver's check of the loss and the metrics on this model and these labels; the objective with the
    metrics' names. Everything that would fail in a worker's first step fails here, in one line.

    ``examples``: (x, y) training rows, where the driver holds them (in-memory data); else zeros of the
    inputs' shapes (valid token ids too) and random labels of the data's kind."""
    import dataclasses

    import keras

    from app.training.objective import RESERVED

    measures = Measures(objective, model)
    taken = [n for n in measures.names if n in RESERVED]
    if taken:
        raise UserError(f"a metric is named {taken[0]!r}, which the run's records use for their own values: "
                        "give it another name (name=...)")
    rng = np.random.default_rng(0)
    if examples is not None and len(np.asarray(first(examples[1]))) >= 2:
        x, y = examples
        rows = len(np.asarray(first(y))) // 2
    else:
        x, y = facts.zeros(2 * rows), example_labels(objective, facts, 2 * rows, rng)
    out = _numpy(model(x, training=False), keras)
    _check_loss_fits_labels(objective, measures, y, out)
    half = lambda a, part: a[:rows] if part == 0 else a[rows:]  # noqa: E731
    split = [(_nest(lambda a, p=p: half(a, p), y), _nest(lambda a, p=p: half(a, p), out)) for p in (0, 1)]
    measures.check_additive(*split[0], *split[1])
    return dataclasses.replace(objective, metric_names=tuple(measures.names))


def _nest(fn, value):
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [fn(v) for v in value]
    return fn(value)


def _numpy(value, keras):
    return _nest(lambda t: keras.ops.convert_to_numpy(t).astype(np.float32), value)


def example_labels(objective: Objective, facts, n: int, rng) -> Any:
    """Random labels of the data's kind: class ids, one-hot rows, or float targets (a dict of them by output)."""
    if objective.outputs:
        return {name: _labels(task, shape, (out_shape or (2,))[-1], n, rng)
                for name, shape, out_shape, _, task in objective.outputs}
    return _labels(objective.task, objective.label_shape, facts.num_classes, n, rng)


def _labels(task: str, shape, num_classes, n: int, rng) -> np.ndarray:
    if task == "regression":
        return rng.normal(size=(n, *shape)).astype(np.float32)
    k = shape[-1] if shape else (num_classes or 2)
    ids = rng.integers(0, k, n)
    return np.eye(k, dtype=np.float32)[ids] if shape else ids.astype(np.int64)


def _check_loss_fits_labels(objective: Objective, measures: Measures, y, out) -> None:
    kind = objective.loss_name.lower().replace("categoricalcrossentropy", "categorical_crossentropy")
    one_hot = bool(objective.label_shape) and objective.task != "regression"
    if not objective.outputs and "sparse" in kind and one_hot:
        raise UserError(f"loss {objective.loss_name} takes class ids, but the labels are one-hot "
                        f"({objective.label_shape[-1]} columns): compile with loss='categorical_crossentropy', "
                        "or give the labels as class ids")
    if not objective.outputs and "categorical" in kind and "sparse" not in kind and not objective.label_shape \
            and objective.task != "regression":
        raise UserError(f"loss {objective.loss_name} takes one-hot labels, but the labels are class ids: compile "
                        "with loss='sparse_categorical_crossentropy', or one-hot the labels")
    n = len(next(iter(y.values())) if isinstance(y, dict) else y)
    try:
        per_example = measures.loss(y, out)
    except Exception as e:
        raise UserError(f"loss {objective.loss_name} does not fit the labels and the model's outputs: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if tuple(per_example.shape) != (n,):
        raise UserError(f"loss {objective.loss_name} gives shape {tuple(per_example.shape)} for {n} examples; "
                        "expected one value per example")
