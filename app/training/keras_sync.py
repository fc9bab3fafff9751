"""A model's own Keras step, made exact across Ray workers: what Keras's fit gets wrong there, and nothing else.

Each worker runs ``model.fit`` itself (its own ``train_step`` and ``test_step``,
compiled losses, metrics, callbacks, History) under the default strategy, on
its part of every global batch. Keras alone would train each worker on its
own; ``synchronise`` adds the three things that make N workers train as one
process over the global batch:

1. **Gradients.** Every optimizer the model holds (``model.optimizer`` and any
   other, e.g. a GAN's two) sums ``rows x gradient`` over the workers before it
   applies them, and divides by the rows: the gradient of the mean loss over
   the whole global batch, also when the workers' parts differ by a row (the
   short last batch). A loss scaled for fp16 overflows on every worker if on
   one (an inf in the sum), so all skip the step together. Keras's own
   reduction under a strategy sums per-replica gradients whose loss it may or
   may not have scaled (loss objects yes, loss functions no): this mean is
   the same for every ``train_step``.
2. **Epoch logs.** Where fit() and evaluate() turn the last step's logs into the
   epoch's (app.internals.replace_epoch_logs), every metric's state (sums,
   counts, confusion buckets: any Keras metric whose state adds up) is summed
   over the workers first and the metric's own ``result()`` read from the
   total: the value one process reports for all the rows (a metric whose state
   does not add up, a running maximum, is refused in the driver before any
   worker starts: ``check_additive``). A log value that is
   no metric's result is averaged over the workers. Nested dicts of logs are
   flattened first, as fit() flattens them (their leaves, by key).
3. **State that is not trained.** Batch-norm moving statistics (float
   non-trainable variables) are averaged over the workers at the same point,
   so every worker evaluates and saves the same model. A synchronized batch
   norm normalises over the global batch (app.training.sync_batch_norm).

With one worker each of these is the identity: the run is ``model.fit``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np

from app import internals
from app.errors import UserError, words_of
from app.internals import replicas as replica_internals
from app.training import sync_batch_norm, user_code, zero, zero_state, zero_weights
from app.training.collective import Collective, Site


def optimizers_of(model) -> list:
    """Every optimizer the model holds: ``model.optimizer`` first, then any attribute that is one (a model that
    compiles with optimizers of its own, as an adversarial model's ``compile(d_optimizer=, g_optimizer=)``)."""
    import keras

    found = [model.optimizer] if isinstance(getattr(model, "optimizer", None), keras.optimizers.Optimizer) else []
    for value in vars(model).values():
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)
    return found


class _Rows(threading.local):
    """The rows of the batch the step being traced holds (a tensor of that trace). Per thread: a strategy of several
    local replicas traces each replica's step in a thread of its own."""

    value: Any = None


def _recording_rows(model) -> _Rows:
    """``model``'s train_step, made to note its batch's rows before it runs."""
    rows = _Rows()
    own_step = model.train_step

    def train_step(data):
        import tensorflow as tf

        rows.value = tf.cast(tf.shape(tf.nest.flatten(data)[0])[0], tf.float32)
        return own_step(data)

    model.train_step = train_step
    return rows


def synchronise(model, collective: Collective, shard_optimizer: int = 0, clock: Any = None) -> list:
    """Make ``model``'s fit() and evaluate() on every worker one exact run over all the workers' rows; with
    ``shard_optimizer``, each optimizer's state cut over the workers (app.training.zero; at stage 3 the weights too:
    app.training.zero_weights), which it returns: what a checkpoint gathers.
    ``clock``: the step clock's InGraph (app.training.step_clock), which times the gradients' all-reduce."""
    if collective.world == 1:
        return []
    rows = _recording_rows(model)
    sync_batch_norm.synchronise(model, collective)
    weights = zero_weights.ShardedWeights.cut(model, collective, rows) if shard_optimizer == 3 else None
    sharded: list = []
    # XLA (Keras's jit_compile, on by default on a GPU outside a strategy) compiles no gather of shapes known only as
    # the step runs: there a sparse gradient is summed dense (app.training.collective.sum_gradients).
    slices = not getattr(model, "jit_compile", False)
    for i, optimizer in enumerate(optimizers_of(model)):
        if shard_optimizer in (1, 2):
            sharded.append(zero.ShardedOptimizer(optimizer, collective, i, rows))
            continue
        if weights is not None:
            sharded.append(zero_state.ShardedState(optimizer, weights, i))
        site = Site.GRADIENTS + i * Site.PACKS
        def summed(values, site=site):
            return collective.sum_gradients(values, site, gather_slices=slices)

        _average_by_rows(optimizer, rows, summed if clock is None else
                         lambda values, summed=summed: clock.timed_sync(values, summed), weights)
    internals.replace_epoch_logs(model, lambda logs: epoch_logs(model, logs, collective))
    return sharded


def _average_by_rows(optimizer, rows: _Rows, summed: Any, weights: Optional["zero_weights.ShardedWeights"] = None
                     ) -> None:
    """``optimizer`` applies the mean gradient over every part's rows (a worker's, a replica's): each part's
    gradient of its mean loss weighed by its rows, summed with the rows by ``summed(values)`` (a value may be None)
    in the same all-reduce, then divided by them. ``weights``: the model's weights cut over the workers, whose
    parts' gradients come summed (reduce-scattered in the backward pass) and are only divided here."""
    own_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        import tensorflow as tf

        if weights is not None and trainable_variables is None:
            raise UserError("shard_optimizer 3: the model's step calls optimizer.apply(grads) without its variables: "
                            "pass them, optimizer.apply(grads, variables), as Keras's own train_step does")
        n = rows.value
        parted = [weights is not None and trainable_variables is not None and zero_weights.is_shard(v)
                  for v in (trainable_variables if trainable_variables is not None else grads)]
        # A sparse gradient (tf.IndexedSlices) stays sparse: its slices are gathered, not summed (``summed``)
        weighed = [None if p else _scaled(g, lambda d, n=n: tf.cast(n, d)) for g, p in zip(grads, parted)]
        summed_up = summed(weighed + [tf.reshape(n, [1])])
        total = summed_up[-1][0]
        mean = [_scaled(g if p else s, lambda d: 1 / tf.cast(total, d)) for g, s, p in zip(grads, summed_up, parted)]
        if weights is not None:
            mean = weights.before_apply(optimizer, mean, list(trainable_variables))
        return own_apply(mean, trainable_variables)

    optimizer.apply = apply


def _scaled(gradient, factor: Callable[[Any], Any]) -> Any:
    """``gradient`` times ``factor(its dtype)``: a dense one, a tf.IndexedSlices' values (kept sparse), or None."""
    import tensorflow as tf

    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor(gradient.values.dtype), gradient.indices,
                                gradient.dense_shape)
    gradient = tf.convert_to_tensor(gradient)
    return gradient * factor(gradient.dtype)


def synchronise_replicas(model) -> None:
    """Make ``model``'s fit() under a strategy of several local replicas (Mirrored over GPUs or logical CPUs, a TPU's
    cores), built in its scope, one exact step over the global batch, as ``synchronise`` makes N workers: each
    optimizer sums ``rows x gradient`` over the replicas (the replica context's all-reduce) and divides by the rows
    before it applies them, so clipping and the fp16 overflow check see the global batch's gradient, the same on
    every replica. Keras's own parts are off (app.internals.replicas): its fit runs inside
    ``replica_internals.unscaled_losses()``. The metrics' states are summed over the replicas when read (central
    storage's one copy of each takes every replica's change: ``replica_internals.updates_exact_on_one_copy``, once
    the model is built). State that is not trained (batch-norm moving statistics: Keras updates each
    replica's copy with its own part of the batch) is averaged over the replicas where the epoch's logs are made,
    before validation, as ``synchronise`` averages it over the workers. Each optimizer applies once, in the
    cross-replica context (``_apply_once_over_replicas``): so gradient accumulation and fp16 run here as on a worker."""
    rows = _recording_rows(model)
    replica_internals.before_epoch_logs(model, lambda: _average_over_local_replicas(model))
    replica_internals.merge_call_in_cross_replica_context()
    for optimizer in optimizers_of(model):
        for each in {id(o): o for o in (optimizer, getattr(optimizer, "inner_optimizer", optimizer))}.values():
            replica_internals.gradients_summed_before_apply(each)  # a LossScaleOptimizer's inner one sums too
        _apply_once_over_replicas(optimizer)
        _average_by_rows(optimizer, rows, _sum_over_replicas)


def _apply_once_over_replicas(optimizer) -> None:
    """``optimizer`` applies the replicas' summed gradient (the same on each) once, in the cross-replica context:
    its gradient accumulation's and its loss scale's conditions then hold no merge_call, which TensorFlow refuses
    inside a condition."""
    own_apply, cross_replica_apply = optimizer.apply, replica_internals.cross_replica_apply(optimizer)

    def apply(grads, trainable_variables=None):
        import tensorflow as tf

        replica = tf.distribute.get_replica_context()
        if replica is None or not replica_internals.strategy_merges():
            return own_apply(grads, trainable_variables)  # nothing merges: Keras's conditions hold no merge_call
        given = [i for i, g in enumerate(grads) if g is not None]

        def once(strategy, *summed):
            whole = [None] * len(grads)
            for i, g in zip(given, summed):
                whole[i] = strategy.experimental_local_results(g)[0]
            return cross_replica_apply(whole, trainable_variables)

        return replica.merge_call(once, args=tuple(grads[i] for i in given))

    optimizer.apply = apply


def _average_over_local_replicas(model) -> None:
    strategy = model.distribute_strategy
    for variable in model.non_trainable_variables:
        if "float" not in str(variable.dtype):
            continue
        copies = strategy.experimental_local_results(getattr(variable, "value", variable))
        if len(copies) > 1:
            mean = sum(c.read_value() for c in copies) / len(copies)
            for c in copies:
                c.assign(mean)


def _sum_over_replicas(values: list) -> list:
    """``values`` summed over the local replicas by the replica context's all-reduce (None stays None)."""
    import tensorflow as tf

    replica = tf.distribute.get_replica_context()
    if replica is None:  # traced in the strategy's scope, outside a step: nothing to sum
        return values
    summed = iter(replica.all_reduce(tf.distribute.ReduceOp.SUM, [v for v in values if v is not None]))
    return [None if v is None else next(summed) for v in values]


def _metric_variables(model) -> list:
    seen, out = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def epoch_logs(model, logs: Any, collective: Collective) -> dict[str, Any]:
    """The epoch's (or evaluation's) logs over every worker: Keras's own choice between the metrics' results and
    the last step's logs, from the metric states summed over the workers. A worker that ran no step (its part of
    a streamed validation set is empty) has no logs: its metrics' results stand for them (zero states, keyed as
    the others' logs of a step that returns its metrics' results)."""
    if not logs:
        logs = dict(model.get_metrics_result())
    if isinstance(logs, dict) and any(isinstance(v, dict) for v in logs.values()):
        logs = internals.flat_logs(logs)  # what fit() makes of them after this point: their leaves, by key
    if not isinstance(logs, dict) or any(isinstance(v, dict) or np.ndim(v) for v in logs.values()):
        raise TypeError(f"the model's train_step or test_step returned {_kind(logs)}: return a dict of scalars "
                        "(the metrics' results, {m.name: m.result() for m in self.metrics}, nested dicts of them "
                        "too), as fit() logs them")
    _average_state(model, collective)
    variables = _metric_variables(model)
    local = [np.asarray(v.numpy()) for v in variables]
    extra = sorted(logs)
    flat = np.concatenate([a.ravel().astype(np.float64) for a in local]
                          + [np.asarray([float(np.asarray(logs[k])) for k in extra], np.float64)])
    total = collective.host(flat)
    at = 0
    for v, a in zip(variables, local):
        v.assign(total[at:at + a.size].reshape(a.shape).astype(a.dtype))
        at += a.size
    results = dict(model.get_metrics_result())
    # Back to this worker's own state: fit() goes on accumulating it (a callback's log point, the next steps).
    for v, a in zip(variables, local):
        v.assign(a)
    if set(logs) == set(results):
        return results
    averaged = dict(zip(extra, total[at:] / collective.world))
    return {k: results.get(k, averaged[k]) for k in logs}


def step_state(model, collective: Collective) -> list[list]:
    """At a checkpoint inside an epoch: the batch-norm statistics averaged over the workers (their updates are
    linear in them, so the epoch's end is unchanged; every worker then saves rank 0's), and each metric variable
    summed over the workers, as lists (state.json holds them)."""
    _average_state(model, collective)
    variables = _metric_variables(model)
    local = [np.asarray(v.numpy()) for v in variables]
    if not local:
        return []
    total = collective.host(np.concatenate([a.ravel().astype(np.float64) for a in local]))
    out, at = [], 0
    for a in local:
        out.append(total[at:at + a.size].reshape(a.shape).tolist())
        at += a.size
    return out


def restore_step_state(model, states: list, rank: int) -> None:
    """The metric states a checkpoint inside an epoch holds (``step_state``'s sums): on rank 0, zero on the others,
    so that the sum over the workers at the epoch's end counts every step once."""
    for v, saved in zip(_metric_variables(model), states):
        value = np.asarray(saved, dtype=np.float64) if rank == 0 else np.zeros(np.shape(saved))
        v.assign(value.astype(v.dtype))


def _kind(logs: Any) -> str:
    if not isinstance(logs, dict):
        return f"a {type(logs).__name__}"
    bad = next(k for k, v in logs.items() if isinstance(v, dict) or np.ndim(v))
    return f"a dict whose {bad!r} is not a scalar"


def _average_state(model, collective: Collective) -> None:
    collective.average_variables([v for v in model.non_trainable_variables if "float" in str(v.dtype)])


def check_additive(model, batch: Any, keras_steps: bool) -> None:
    """Refuse, in one line, a metric whose state does not add up over batches (a running maximum): ``epoch_logs``
    sums every metric's state over the workers, which gives one process's value only for states of sums and
    counts. Checked in the driver on the two halves of one batch through the model's own ``test_step`` (its
    compiled metrics and any it tracks itself), before any worker starts; a subclassed model is built by it here, as
    its first call builds it (so the plan can size its optimizer's state). A ``test_step`` of the model's own that
    cannot run here (its evaluation may need what only its workers set up) is not checked: its workers say why it
    fails. Keras's own (``keras_steps``: nothing of the step overridden) fails on every worker as it fails here, as
    Keras's fit would fail, unless the user's own code raised: that is one line now, with the shapes its compiled
    loss and metrics were given."""
    import tensorflow as tf

    def state(parts: list) -> list[list[np.ndarray]]:
        model.reset_metrics()
        for part in parts:
            model.test_step(part)
        return [[np.asarray(v.numpy(), np.float64) for v in m.variables] for m in _leaf_metrics(model.metrics)]

    try:  # a batch that does not halve (a ragged or a scalar element) is not checked either
        leaves = tf.nest.flatten(batch)
        n = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0
        if n < 2:
            return
        halves = [tf.nest.map_structure(lambda a, s=s: a[s], batch) for s in (slice(0, n // 2), slice(n // 2, n))]
    except Exception:
        return
    try:
        a, b, both = state(halves[:1]), state(halves[1:]), state(halves)
    except Exception as e:
        # The user's own code (a layer's call) may branch on what only this eager call sees (a batch's size): in
        # the workers' traced step it may run, as in Keras's fit. Keras's own compiled loss and metrics do not.
        if keras_steps and isinstance(batch, (tuple, list)) and len(batch) > 1 and \
                user_code.raised_by_model(e, model) is None:
            said = f"{type(e).__name__}: {words_of(e)}"
            outputs = _shapes(lambda: model(batch[0]))
            if outputs is None:  # its call fails, before any loss or metric
                raise UserError(f"the model fails on a batch of x as Keras's fit would: {said}") from e
            raise UserError(f"the model's compiled loss and metrics fail on a batch as Keras's fit would: {said} "
                            f"(labels of shape {_shapes(lambda: batch[1])}, outputs of shape {outputs}): compile "
                            "with a loss and metrics that take these labels") from e
        return
    finally:
        model.reset_metrics()
    for metric, sa, sb, s in zip(_leaf_metrics(model.metrics), a, b, both):
        if not all(np.allclose(x, y + z, rtol=1e-5, atol=1e-6, equal_nan=True) for x, y, z in zip(s, sa, sb)):
            raise UserError(
                f"metric {metric.name} ({type(metric).__name__}) keeps a state that does not add up over batches, "
                "so it cannot be combined exactly over workers: drop it from compile(metrics=...) (or from the model), "
                "use a metric whose state is sums or counts (keras.metrics.Mean, AUC, Precision, ...), or train on "
                "one worker (num_workers=1), where it is model.fit's own")


def _shapes(tree: Callable[[], Any]) -> Optional[str]:
    """The shapes of what ``tree()`` returns, or None if it raises."""
    import tensorflow as tf

    try:
        return ", ".join(str(tuple(np.shape(leaf))) for leaf in tf.nest.flatten(tree()))
    except Exception:
        return None


def _leaf_metrics(metrics: list) -> list:
    """The metrics themselves, inside the containers that hold them (compile()'s ``CompileMetrics``)."""
    return [leaf for m in metrics
            for leaf in (_leaf_metrics(m.metrics) if isinstance(getattr(m, "metrics", None), list) and m.metrics else [m])]
