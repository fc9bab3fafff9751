"""Keras's synchronized batch normalization made true across Ray workers.

``BatchNormalization(synchronized=True)`` normalises a training batch by the mean
and variance of the whole global batch: Keras sums x, x² and the count with the
replica context's all-reduce. Each worker of this product runs Keras's step under
the default strategy (app.training.collective), where that all-reduce sums
nothing, so such a layer would normalise over the worker's own part only.
``synchronise`` gives every such layer the global batch's moments: the three sums
over the workers in one all-reduce per call, and Keras's own formula on them, as
one process computes them over the whole batch.

The backward pass sums the gradient of those sums the same way, each worker's
weighed by its count and divided by this worker's: the product's optimizer step
weighs each worker's gradient by its rows (app.training.keras_sync), so the
weights cancel and the step is one process's over the global batch, also when the
workers' parts differ by a row. A layer that is not synchronized normalises over
each worker's part, as Keras does under any strategy; the plan says which.
"""

from __future__ import annotations

import threading
from typing import Any

from app.errors import UserError
from app.internals import batch_norm
from app.training.collective import Collective, Site

CALLS = 32  # calls of one layer in one step (a discriminator on real, then generated rows), each its own keys


def layers_of(model) -> tuple[list, list]:
    """The model's batch-norm layers, nested ones too: (synchronized, not synchronized)."""
    import keras

    from app import internals

    found = [layer for layer in internals.sublayers(model) if isinstance(layer, keras.layers.BatchNormalization)]
    return [b for b in found if b.synchronized], [b for b in found if not b.synchronized]


def plan_lines(model, world: int, per_worker: Any) -> list[str]:
    """The plan's line for the model's batch norm on ``world`` workers (none for no batch norm, or one worker)."""
    synchronized, each = layers_of(model)
    if world == 1 or not (synchronized or each):
        return []
    parts = []
    if synchronized:
        parts.append(f"{len(synchronized)} synchronized layer(s) normalize over the global batch (their sums "
                     "all-reduced over the workers at each call)")
    if each:
        rows = f" ({per_worker} rows)" if per_worker else ""
        parts.append(f"{len(each)} layer(s) normalize over each worker's part of the global batch{rows}, as Keras "
                     "does under a strategy: BatchNormalization(synchronized=True) normalizes over the global batch")
    return ["batch normalization: " + "; ".join(parts)]


class _Calls(threading.local):
    """How many times each layer was called in the step being traced (per thread, as app.training.keras_sync's
    rows): a layer called twice in one step takes other keys the second time."""

    def __init__(self):
        self.made: dict[int, int] = {}

    def next(self, index: int) -> int:
        call = self.made.get(index, 0)
        self.made[index] = call + 1
        return call


def synchronise(model, collective: Collective) -> int:
    """Every synchronized batch-norm layer of ``model`` normalises over the global batch; returns how many."""
    synchronized, _ = layers_of(model)
    if collective.world == 1 or not synchronized:
        return len(synchronized)
    calls = _Calls()
    own_step = model.train_step

    def train_step(data):
        calls.made = {}  # a new trace of the step: the layers' calls count from the first again
        return own_step(data)

    model.train_step = train_step
    for index, layer in enumerate(synchronized):
        batch_norm.replace_moments(layer, _over_workers(layer, index, collective, calls))
    return len(synchronized)


def _over_workers(layer, index: int, collective: Collective, calls: _Calls):
    def moments(own, inputs, mask):
        if mask is not None:  # Keras's masked moments are each replica's own, synchronized or not
            return own(inputs, mask)
        call = calls.next(index)
        if call >= CALLS:
            raise UserError(f"batch-norm layer {layer.name!r} is called more than {CALLS} times in one training step: "
                            "the product synchronizes at most that many calls (make it synchronized=False)")
        return _global_moments(inputs, batch_norm.reduction_axes(layer), collective,
                               Site.BATCH_NORM + 2 * (index * CALLS + call))

    return moments


def _global_moments(x, axes: list[int], collective: Collective, site: int):
    """Keras's synchronized moments (``ops.moments(synchronized=True)``) with the workers' sums."""
    import tensorflow as tf

    local = tf.stack([tf.reduce_sum(x, axis=axes, keepdims=True),
                      tf.reduce_sum(tf.square(x), axis=axes, keepdims=True),
                      tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True)])

    @tf.custom_gradient
    def summed(parts):
        def grad(upstream):
            count = parts[2]  # the rows behind this worker's sums (times the positions each row has)
            return tf.math.divide_no_nan(collective.in_graph(upstream * count, site + 1), count)

        return collective.in_graph(parts, site), grad

    total, squares, count = tf.unstack(summed(local))
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
    return tf.squeeze(mean, axes), tf.squeeze(variance, axes)
