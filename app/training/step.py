"""The parameter servers' per-replica steps (the product's own loop, app.training.loop; every other run trains by
Keras's fit): train and eval, each taking a model and optimizer built under the strategy's scope and the run's
measures (app.training.measures: its loss and metrics).

Every step returns this replica's sums [loss, count, every metric's state] as float64
(app.training.measures): the coordinator adds them over the steps it scheduled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    fp16 and --grad-accum).
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


def eval_sums(model, measures: "Measures"):
    """(x, y, weight) -> this replica's sums; weight-0 padding rows count for nothing."""

    def eval_step(x, y, w):
        out = model(x, training=False)
        return measures.sums(y, out, with_penalties(model, measures.loss(y, out)), w)

    return eval_step
