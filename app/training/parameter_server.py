"""Parameter-server training, the coordinator's side: asynchronous steps scheduled on remote workers.

The chief (a Ray actor started by app.run.ps) builds the model and the
optimizer under ``ParameterServerStrategy.scope()``, which places every
variable (and each shard of an app.layers.ShardedEmbedding) round-robin on
the parameter servers. ``ClusterCoordinator.schedule`` then runs each train
step on whichever worker is free: it reads the variables it needs from the
servers, computes the gradients of one batch and applies them there, without
waiting for any other worker (no all-reduce, no barrier). A slow or lost
worker slows nobody down; the price is staleness: a step's gradients may be
computed from weights that other workers have moved since.

What stays as on every other path: the per-replica step (app.training.step),
the LR plan, exact validation over the whole validation set (the chief
evaluates it itself after every epoch), the epoch record, checkpoints of
model + optimizer + state.json (written by the chief only).

What differs, and why:
- one optimizer update is one worker's batch: an epoch is ``rows // batch``
  updates, spread over the workers as they come free, and the LR rule scales
  with that batch;
- Keras 3's ``optimizer.iterations.assign_add`` is a read-then-write that
  concurrent workers race on (16 of 20 increments survived in a test), so the
  coordinator counts the steps it schedules, passes each step its number, and
  the step sets the LR from it; the true count is in state.json and result.json;
- each worker reads its own slice of a seeded per-epoch permutation (its
  index comes from the coordinator at run time); a faster worker goes through
  its slice faster, so "every row once per epoch" holds only on average.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from app.data.arrays import Split
from app.data.plan import EpochPlan
from app.training import checkpoint
from app.training.metrics import EpochStats

if TYPE_CHECKING:
    from app.config import TrainConfig
    from app.training.worker import WorkerJob

log = logging.getLogger(__name__)

# Steps scheduled between two waits for them all: each wait is a sign of life for the driver's
# stall watch (app.run.ps) and a progress bar update, for one idle moment per worker per chunk.
STEPS_PER_WORKER_PER_CHUNK = 16


@dataclass(frozen=True)
class ChiefResult:
    latest_checkpoint: str
    optimizer_steps: int
    variable_placement: dict[str, str]


def connect(cluster_spec: dict[str, list[str]]):
    """ParameterServerStrategy and its coordinator, this process being the chief of ``cluster_spec``."""
    import tensorflow as tf

    # The chief coordinates and evaluates; one compute thread leaves the CPUs to the workers.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster_spec), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    return strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def train_chief(config: "TrainConfig", job: "WorkerJob", cluster_spec: dict[str, list[str]], train: Split,
                val: Split, checkpoint_dir: str, restore: bool, progress_bar: Optional[Callable[..., Any]] = None,
                alive: Callable[[], None] = lambda: None) -> ChiefResult:
    """Train ``config.epochs`` epochs on the cluster; return where the last checkpoint is and what ran where.

    ``alive()`` is called whenever training moves on (steps done, evaluated,
    saved): the driver ends a run that stops calling it for --stall-timeout-s.
    Any wait here can hang on a frozen task, not only the steps: even tracing a
    new function registers it with every worker.
    """
    import tensorflow as tf

    from app.data import tf_input
    from app.training.loop import EpochBar
    from app.training.metrics import epoch_metrics, progress_line
    from app.training.model import build_model
    from app.training.optim import lr_schedule, make_optimizer, plan_lr
    from app.training.step import eval_sums
    from app.training.tensorboard import TensorBoard

    strategy, coordinator = connect(cluster_spec)
    workers = len(cluster_spec["worker"])
    plan = EpochPlan.for_run(config, job.facts.num_train_rows, workers)  # each worker's slice of an epoch
    updates = plan.steps * workers  # optimizer updates per epoch, one worker's batch each
    lr_plan = plan_lr(config, plan.step_batch, updates)
    with strategy.scope():
        model = build_model(config, job.facts)
        optimizer = make_optimizer(config, lr_plan, driven_lr=True)
        optimizer.build(model.trainable_variables)

    checkpoints = checkpoint.LocalCheckpoints(checkpoint_dir, model, optimizer, keep=config.keep_checkpoints)
    progress, steps_done = checkpoint.Progress(), 0
    state = checkpoints.restore() if restore else None
    if state is not None:
        progress, steps_done = checkpoint.Progress.resumed_from(state), state["optimizer_steps"]
        log.info("resumed from the checkpoint of epoch %d (attempt %d)", progress.epoch, progress.attempt)

    def worker_batches(_):
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        return tf_input.train_batches_from_arrays(
            train, plan, config.seed, config.shuffle, progress.epoch, config.epochs, index, workers
        ).repeat()  # endless: a fast worker may run past its slice of the last epoch

    train_iter = iter(coordinator.create_per_worker_dataset(strategy.distribute_datasets_from_function(worker_batches)))
    step = scheduled_step(strategy, model, optimizer, job.objective, plan.step_batch, lr_schedule(config, lr_plan))
    evaluate = tf.function(eval_sums(model, job.objective))
    val_batches = tf_input.eval_batches_from_arrays(val, config.per_replica_batch)
    tensorboard = TensorBoard(job.tensorboard_dir)

    for epoch in range(progress.epoch + 1, config.epochs + 1):
        bar = EpochBar(progress_bar, updates, f"epoch {epoch}/{config.epochs}")
        try:
            stats = run_updates(coordinator, step, train_iter, steps_done, updates, workers,
                                lambda k: (bar.update(k), alive()))
        finally:
            bar.close()
        steps_done += updates
        if not np.isfinite(stats.loss):
            from app.training.loop import NonFiniteLoss

            raise NonFiniteLoss(f"non-finite training loss in epoch {epoch}: check the data for NaN/inf or lower "
                                "--base-lr; the last good checkpoint is the one from the epoch before")
        val_stats = evaluate_all(evaluate, val_batches)
        alive()
        lr = float(lr_schedule(config, lr_plan)(steps_done - 1))
        metrics = epoch_metrics(epoch, stats, val_stats, lr, plan.dropped, job.objective.metric)
        metrics["optimizer_steps"] = steps_done
        progress.record(metrics)
        tensorboard.epoch(epoch, metrics)
        log.info(progress_line(metrics, config.epochs, progress.history))
        state = progress.state(config=config, lr_plan=lr_plan, plan=plan, task=job.objective.task)
        checkpoints.save({**state, "optimizer_steps": steps_done})
        alive()
    tensorboard.close()
    return ChiefResult(checkpoints.latest, steps_done, variable_placement(model))


def scheduled_step(strategy, model, optimizer, objective, batch: int, schedule):
    """The function each scheduled step runs on a worker: set the LR of step ``n``, take a batch, train on it."""
    import tensorflow as tf

    from app.training.step import replica_train_step

    replica_step = replica_train_step(model, optimizer, objective, global_batch=batch, grad_accum=1)

    @tf.function
    def step(iterator, n):
        optimizer.learning_rate.assign(tf.cast(schedule(n), optimizer.learning_rate.dtype))
        x, y, _ids = next(iterator)
        return strategy.run(replica_step, args=(x, y))

    return step


def run_updates(coordinator, step, iterator, first_step: int, count: int, workers: int,
                on_steps: Callable[[int], None]) -> EpochStats:
    """Schedule ``count`` steps numbered from ``first_step``; their summed [loss, metric, count] as EpochStats.

    Steps go out in chunks, ``on_steps(k)`` after each. A step lost with a
    worker that died is re-run on another by the coordinator.
    """
    import tensorflow as tf

    start, results, chunk, first_done = time.perf_counter(), [], STEPS_PER_WORKER_PER_CHUNK * workers, None
    for begin in range(0, count, chunk):
        n = min(chunk, count - begin)
        results += [coordinator.schedule(step, args=(iterator, tf.constant(first_step + begin + i, tf.int64)))
                    for i in range(n)]
        coordinator.join()  # raises a step's error, or UnavailableError for a lost parameter server
        first_done = first_done or time.time()
        on_steps(n)
    sums = np.sum([np.asarray(r.fetch(), dtype=np.float64) for r in results], axis=0)
    return EpochStats.from_sums(sums, time.perf_counter() - start, first_step_time=first_done)


def evaluate_all(evaluate, batches) -> EpochStats:
    """Every validation row once, on the chief: the same sums as the synchronous paths, so the same metrics."""
    import tensorflow as tf

    start, acc = time.perf_counter(), tf.zeros((3,), tf.float64)
    for x, y, w in batches:
        acc += evaluate(x, y, w)
    return EpochStats.from_sums(acc.numpy(), time.perf_counter() - start)


def variable_placement(model) -> dict[str, str]:
    """Each model variable (each embedding shard too) -> the device it lives on."""
    return {v.path: v.value.device for v in model.variables}
