"""Keras's private API for its fit under a local tf.distribute strategy of several replicas (app.training.keras_sync
``synchronise_replicas``), behind the same door as app.internals: the only place app/ touches these names,
checked against the installed Keras by tests/test_internals.py. A leaf: libraries imported inside the functions.
"""

from __future__ import annotations

from typing import Any, Callable

# Under a strategy of N replicas, Keras divides a loss by N where a Loss object or an added loss makes it
# (keras/src/losses/loss.py ``scale_loss_for_distribution``; ``unscale_loss_for_distribution`` multiplies the
# trackers' copy back), and the TensorFlow optimizer sums the replicas' gradients in ``_all_reduce_sum_gradients``
# (keras/src/backend/tensorflow/optimizer.py), after apply() clipped each replica's own. A train_step whose loss
# is a plain function is not divided, and a short last batch cut unevenly is not a mean over the global batch:
# the product averages over the rows itself, before apply(), and so turns both of Keras's parts off. No public API
# sets either. Keras builds a model's variables and its optimizer's slots under the strategy's scope before the
# first step in ``Trainer._symbolic_build``; a resumed run restores into them before fit(), so it builds them so.
# fit() and evaluate() would then build again in ``_maybe_symbolic_build`` (keras/src/backend/tensorflow/
# trainer.py), from their first batch's parts averaged over the replicas: parts that differ by a row (359 rows
# over 2 replicas) fail there ("Inputs to operation AddN ... must have the same size"); built, nothing is left
# for it to do.


def unscaled_losses() -> Any:
    """A context inside which Keras neither divides losses by the replicas nor multiplies the trackers' back."""
    import contextlib

    from keras.src.losses import loss as loss_module

    @contextlib.contextmanager
    def context():
        saved = loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution
        loss_module.scale_loss_for_distribution = loss_module.unscale_loss_for_distribution = _same
        try:
            yield
        finally:
            loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution = saved

    return context()


def _same(value: Any) -> Any:
    return value


def gradients_summed_before_apply(optimizer: Any) -> None:
    """Make ``optimizer`` apply the gradients it is given as they are: the caller summed the replicas' already."""
    optimizer._all_reduce_sum_gradients = _same


# Keras's TensorFlow optimizer updates through ``tf.__internal__.distribute.interim.maybe_merge_call``, a merge_call
# under a strategy of several local replicas on CPUs: refused inside the ``ops.cond`` of gradient accumulation or of
# a LossScaleOptimizer's finite check. The product applies the replicas' one summed gradient once, in the
# cross-replica context (keras_sync), where the update function is simply called, as merge_call would call it.


def strategy_merges() -> bool:
    """Whether Keras's optimizer would merge_call under the current strategy (as it asks: most strategies do; a
    Mirrored one over GPUs inside XLA does not)."""
    import tensorflow as tf

    return not tf.__internal__.distribute.strategy_supports_no_merge_call()


def merge_call_in_cross_replica_context() -> None:
    """Make Keras's ``maybe_merge_call`` call its function directly in the cross-replica context (once per process;
    the replica context's calls go on as before)."""
    import tensorflow as tf

    interim = tf.__internal__.distribute.interim
    own = interim.maybe_merge_call
    if getattr(own, "cross_replica_aware", False):
        return

    def maybe_merge_call(fn: Callable, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        if tf.distribute.in_cross_replica_context():
            return fn(strategy, *args, **kwargs)
        return own(fn, strategy, *args, **kwargs)

    maybe_merge_call.cross_replica_aware = True
    interim.maybe_merge_call = maybe_merge_call


def cross_replica_apply(optimizer: Any) -> Callable:
    """``optimizer``'s apply for the cross-replica context. A LossScaleOptimizer's own apply refuses that context:
    under a strategy that merges it makes one merge_call around its finite check and its update, which in the
    cross-replica context is its common apply (the check, then the inner optimizer's apply or a smaller scale)."""
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    if not isinstance(optimizer, LossScaleOptimizer):
        return optimizer.apply

    def apply(grads: list, trainable_variables: Any = None) -> None:
        if not optimizer.built:
            optimizer.build(trainable_variables)
            optimizer.built = True
        optimizer._common_apply(grads, trainable_variables=trainable_variables)

    return apply


def updates_exact_on_one_copy(model: Any) -> None:
    """Make ``model``'s (built) updates in a replica context exact where the strategy keeps one copy of a variable
    (central storage's ``AggregatingVariable``), which such an update reaches merged over the replicas by the
    variable's aggregation. A metric's state: Keras assigns the new state (``assign_add`` is ``assign(self +
    value)``), which a sum would count once per replica; its change is assigned instead, summed, as Mirrored's
    per-replica copies are summed when read. Untrained state that Keras gives no aggregation (batch-norm moving
    statistics, a seed generator's state): the replicas' new values averaged (the first replica's for integers),
    as Mirrored's copies averaged before validation give (the moving averages are linear in them)."""
    import tensorflow as tf
    from tensorflow.python.distribute.ps_values import AggregatingVariable

    metric_variables = {id(v): v for metric in model.metrics for v in metric.variables}
    for variable in {**{id(v): v for v in model.variables}, **metric_variables}.values():
        raw = getattr(variable, "_value", None)
        if not isinstance(raw, AggregatingVariable):
            continue
        if id(variable) in metric_variables:
            def direct_assign(value: Any, raw: Any = raw) -> None:
                value = tf.cast(value, raw.dtype)
                if tf.distribute.in_cross_replica_context():
                    raw.assign(value)  # a reset, or a restored state: once
                else:
                    raw.assign_add(value - raw.read_value())

            variable._direct_assign = direct_assign
        elif not variable.trainable and raw.aggregation == tf.VariableAggregation.NONE:
            raw._aggregation = (tf.VariableAggregation.MEAN if raw.dtype.is_floating
                                else tf.VariableAggregation.ONLY_FIRST_REPLICA)


def symbolic_build(model: Any, batch: Any) -> None:
    """Build ``model``'s variables, its compiled metrics and its optimizer's slots for ``batch`` as fit() does before
    its first step (under the model's strategy)."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=batch)
    model._maybe_symbolic_build = _nothing_to_build


def _nothing_to_build(iterator: Any = None, data_batch: Any = None) -> None:
    """fit()'s and evaluate()'s build of a model ``symbolic_build`` built."""


# fit() and evaluate() make an epoch's logs in ``_get_metrics_result_or_logs`` after its last step (before
# validation): where replicas' copies of untrained state (batch-norm statistics) are made one.


def before_epoch_logs(model: Any, act: Callable[[], None]) -> None:
    """Make ``model`` run ``act()`` where fit() and evaluate() make an epoch's logs, before Keras's own making."""
    own = model._get_metrics_result_or_logs

    def logs_after(logs: Any) -> Any:
        act()
        return own(logs)

    model._get_metrics_result_or_logs = logs_after
