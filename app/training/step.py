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
from typing import TYPE_CHECKING, Any, Callable

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


def with_penalties(model: "keras.Model", per_example_loss):
    """The loss as Keras reports it (``loss``, ``val_loss``): each example's loss plus the model's own penalties
    (``model.losses``: weight regularisers, ``add_loss``), which are per batch, so once per row of a mean."""
    import tensorflow as tf

    if not model.losses:
        return per_example_loss
    return per_example_loss + tf.cast(tf.add_n(model.losses), per_example_loss.dtype)


def replica_train_step(model: "keras.Model", optimizer, measures: "Measures", global_batch: int):
    """The per-replica step: gradients of the loss averaged over the *global* batch, then applied.

    The parameter servers' workers take it (asynchronous: each applies its own batch): one batch a step of the
    plan's size, never a short last one, no fp16 overflow to agree on across replicas (parameter servers refuse
    fp16 and --grad-accum). A pipeline's step is its own (app.training.pipeline); every other run trains by Keras's
    fit.
    """
    import keras
    import tensorflow as tf

    variables = model.trainable_variables
    scales_loss = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def train_step(x, y, sample_weight):
        weight = measures.train_weights(y, sample_weight)
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            per_example_loss = measures.loss(y, out, weight)
            # Divide by the *global* batch (all replicas): the all-reduce then sums replica gradients into the
            # gradient of the mean over the global batch.
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            if scales_loss:
                loss = optimizer.scale_loss(loss)
        grads = tape.gradient(loss, variables)
        # Before the update: the penalties (model.losses) are read from the weights the loss saw.
        step_sums = measures.sums(y, out, with_penalties(model, per_example_loss), tf.ones_like(per_example_loss),
                                  weight)
        # The strategy's optimizer all-reduces its replicas' gradients (each of the loss over the global batch).
        optimizer.apply_gradients(zip(grads, variables))
        return step_sums

    return train_step


@dataclass
class TrainSteps:
    one: Callable[..., Any]  # (x, y, ids, sample weights) batch -> (per-replica sums, gathered sample ids)
    many: Callable[..., Any]  # (iterator, k) -> this worker's sums over k steps


def make_train_steps(strategy, model, optimizer, measures, replica_step: Callable,
                     audit_sample_ids: bool = False) -> TrainSteps:
    """``replica_step``: a per-replica (x, y, w) -> sums step (app.training.pipeline's). ``one`` returns the step's
    sample ids (every replica's)."""
    import tensorflow as tf

    build_optimizer_slots(strategy, model, optimizer)

    @tf.function
    def one(batch):
        x, y, ids, w = batch
        per_replica = strategy.run(replica_step, args=(x, y, w))
        gathered = strategy.gather(ids, axis=0) if audit_sample_ids else tf.zeros((0,), tf.int64)
        return per_replica, gathered

    @tf.function
    def many(iterator, k):
        # Several steps per call (TPUs need it: one host round trip per k steps).
        acc = tf.zeros((measures.size,), tf.float64)
        for _ in tf.range(k):
            x, y, _ids, w = next(iterator)
            acc += tf.add_n(list(strategy.experimental_local_results(strategy.run(replica_step, args=(x, y, w)))))
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
