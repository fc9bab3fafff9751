"""The compiled steps: train (one or several per call) and eval.

Each factory takes the strategy, a model and optimizer built under its scope,
and the run's measures (app.training.measures: its loss and metrics), and
returns a ``tf.function``. Nothing here knows which strategy it runs under
(a pipeline's or the parameter servers': the runs of the product's own loop,
app.training.loop; every other run trains by Keras's fit).

Every step returns this replica's sums [loss, count, every metric's state] as
float64 (app.training.measures): the caller adds them over replicas once per
epoch. These runs are one process: what crosses replicas is the strategy's own
all-reduce (parameter servers: its variables, on the servers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import keras

    from app.training.measures import Measures


def build_optimizer_slots(strategy, model, optimizer) -> None:
    """Create the optimizer's slot variables now, under the scope.

    Created lazily inside the first tf.function call they break
    MirroredStrategy ("must feed a value for placeholder tensor ... fn_with_cond").
    """
    if optimizer is not None and not optimizer.built:
        with strategy.scope():
            optimizer.build(model.trainable_variables)


def sum_over_replicas(value):
    """Sum over every replica (the strategy's replica context)."""
    import tensorflow as tf

    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)


def agree_on_overflow(grads):
    """Make an fp16 overflow on any replica an overflow on all of them.

    LossScaleOptimizer checks the *local* gradients before its all-reduce:
    under Mirrored the first replica decides and another's inf would be summed
    into the weights. One scalar all-reduce per step makes the decision global.
    """
    import tensorflow as tf

    bad = tf.cast(tf.logical_not(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])), tf.float32)
    any_bad = sum_over_replicas(bad) > 0
    poison = tf.where(any_bad, float("nan"), 0.0)
    return [g + tf.cast(poison, g.dtype) for g in grads]


def with_penalties(model: "keras.Model", per_example_loss):
    """The loss as Keras reports it (``loss``, ``val_loss``): each example's loss plus the model's own penalties
    (``model.losses``: weight regularisers, ``add_loss``), which are per batch, so once per row of a mean."""
    import tensorflow as tf

    if not model.losses:
        return per_example_loss
    return per_example_loss + tf.cast(tf.add_n(model.losses), per_example_loss.dtype)


def replica_train_step(model: "keras.Model", optimizer, measures: "Measures", global_batch: int,
                       short_last: bool = False):
    """The per-replica step: gradients of the loss averaged over the *global* batch, then applied.

    ``short_last``: the plan ends each epoch with a short step (app.data.plan), so the global batch is counted in
    every step (one scalar all-reduce) instead of taken from the plan. Accumulating several micro-batches per update
    is Keras's (gradient_accumulation_steps, app.training.keras_features): the runs here take one batch a step
    (parameter servers refuse --grad-accum; a pipeline's step is its own, its micro-batches its accumulation).
    """
    import keras
    import tensorflow as tf

    variables = model.trainable_variables
    scales_loss = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def rows_in_step(sample_weight):
        if not short_last:
            return global_batch
        rows = tf.cast(tf.shape(sample_weight)[0], tf.float32)
        return tf.cast(sum_over_replicas(rows), tf.int32)

    def train_step(x, y, sample_weight):
        weight = measures.train_weights(y, sample_weight)
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            per_example_loss = measures.loss(y, out, weight)
            # Divide by the *global* batch (all replicas): the all-reduce then sums replica gradients into the
            # gradient of the mean over the global batch.
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=rows_in_step(sample_weight))
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            if scales_loss:
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, variables)
        # Before the update: the penalties (model.losses) are read from the weights the loss saw.
        step_sums = measures.sums(y, out, with_penalties(model, per_example_loss), tf.ones_like(per_example_loss),
                                  weight)
        if scales_loss:
            grads = agree_on_overflow(grads)
        # The strategy's optimizer all-reduces its replicas' gradients (each of the loss over the global batch).
        optimizer.apply_gradients(zip(grads, variables))
        return step_sums

    return train_step


@dataclass
class TrainSteps:
    one: Callable[..., Any]  # (x, y, ids, sample weights) batch -> (per-replica sums, gathered sample ids)
    many: Callable[..., Any]  # (iterator, k) -> this worker's sums over k steps


def make_train_steps(strategy, model, optimizer, measures, global_batch: int, audit_sample_ids: bool = False,
                     replica_step: Optional[Callable] = None, short_last: bool = False) -> TrainSteps:
    """``replica_step``: a per-replica (x, y, w) -> sums step of its own (app.training.pipeline's), else the usual.
    ``short_last``: as for ``replica_train_step``. ``one`` returns the step's sample ids (every replica's)."""
    import tensorflow as tf

    build_optimizer_slots(strategy, model, optimizer)
    step = replica_step or replica_train_step(model, optimizer, measures, global_batch, short_last)

    @tf.function
    def one(batch):
        x, y, ids, w = batch
        per_replica = strategy.run(step, args=(x, y, w))
        gathered = strategy.gather(ids, axis=0) if audit_sample_ids else tf.zeros((0,), tf.int64)
        return per_replica, gathered

    @tf.function
    def many(iterator, k):
        # Several steps per call (TPUs need it: one host round trip per k steps).
        acc = tf.zeros((measures.size,), tf.float64)
        for _ in tf.range(k):
            x, y, _ids, w = next(iterator)
            acc += tf.add_n(list(strategy.experimental_local_results(strategy.run(step, args=(x, y, w)))))
        return acc

    return TrainSteps(one, many)


def eval_sums(model, measures: "Measures"):
    """(x, y, weight) -> this replica's sums; weight-0 padding rows count for nothing."""

    def eval_step(x, y, w):
        out = model(x, training=False)
        return measures.sums(y, out, with_penalties(model, measures.loss(y, out)), w)

    return eval_step


def make_eval_step(strategy, model, measures: "Measures"):
    """(x, y, weight) batch -> per-replica sums."""
    import tensorflow as tf

    eval_step = eval_sums(model, measures)

    @tf.function
    def distributed(batch):
        return strategy.run(eval_step, args=batch)

    return distributed
