"""Parameter-server training, the coordinator's side: asynchronous steps scheduled on remote workers.

The chief (a Ray actor started by app.backends.ps) builds the model and the
optimizer under ``ParameterServerStrategy.scope()``, which places every
variable (and each shard of an app.layers.ShardedEmbedding) round-robin on
the parameter servers. ``ClusterCoordinator.schedule`` then runs each train
step on whichever worker is free: it reads the variables it needs from the
servers, computes the gradients of one batch and applies them there, without
waiting for any other worker (no all-reduce, no barrier). A slow or lost
worker slows nobody down; the price is staleness: a step's gradients may be
computed from weights that other workers have moved since.

The chief runs the own loop's per-worker function, app.training.worker.train_worker,
with a ``ParameterServerSession``: the epoch loop, the per-replica step
(``replica_train_step``, below), the LR plan, the epoch record, TensorBoard and checkpoints
of model + optimizer + state.json (written by the chief only) are those of
every other path. What the session brings: the strategy and its coordinator,
the workers' datasets, ``LocalCheckpoints`` and the driver's heartbeat. The
epoch driver runs steps through ``ScheduledSteps``: numbered steps scheduled
through the coordinator in chunks, and exact validation over the whole
validation set, evaluated by the chief itself.

What differs, and why:
- one optimizer update is one worker's batch: an epoch is ``rows // batch``
  updates, spread over the workers as they come free, and the LR rule scales
  with that batch;
- Keras 3's ``optimizer.iterations.assign_add`` is a read-then-write that
  concurrent workers race on (16 of 20 increments survived in a test), so the
  epoch driver counts the steps on the chief, each is scheduled with its number,
  and the step sets the LR from it (``driven_lr``); the true count is in
  state.json and result.json;
- each worker reads its own slice of a seeded per-epoch permutation (its
  index comes from the coordinator at run time); a faster worker goes through
  its slice faster, so "every row once per epoch" holds only on average.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from app.data.arrays import Split
from app.data.plan import EpochPlan
from app.training import checkpoint
from app.training.metrics import EpochStats

if TYPE_CHECKING:
    import keras

    from app.config import TrainConfig
    from app.training.measures import Measures

# Steps scheduled between two waits for them all: each wait is a sign of life for the driver's
# stall watch (app.backends.ps) and a progress bar update, for one idle moment per worker per chunk.
STEPS_PER_WORKER_PER_CHUNK = 16


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


class ParameterServerSession:
    """The chief's side of ``train_worker``: ParameterServerStrategy + ClusterCoordinator, LocalCheckpoints.

    ``alive()`` is called whenever training moves on (steps done, evaluated,
    saved): the driver ends a run that stops calling it for --stall-timeout-s.
    Any wait here can hang on a frozen task, not only the steps: even tracing a
    new function registers it with every worker.
    """

    def __init__(self, config: "TrainConfig", cluster_spec: dict[str, list[str]], train: Split, val: Split,
                 checkpoint_dir: str, restore: bool, progress_bar: Callable[..., Any],
                 alive: Callable[[], None] = lambda: None):
        self.config, self.cluster_spec, self.train, self.val = config, cluster_spec, train, val
        self.checkpoint_dir, self.resume, self._progress_bar, self._alive = checkpoint_dir, restore, progress_bar, alive
        self.world = len(cluster_spec["worker"])
        self._strategy = self.coordinator = None  # both made by strategy(), before any other TensorFlow op
        self.checkpoints: Optional[checkpoint.LocalCheckpoints] = None
        self.model, self.optimizer_steps = None, 0

    def strategy(self):
        self._strategy, self.coordinator = connect(self.cluster_spec)
        return self._strategy

    def restore(self, model, optimizer) -> Optional[dict[str, Any]]:
        # Every variable, the optimizer's slots too, exists on the servers before it is restored into (made lazily
        # inside the first step, they would be made on the workers' side of the scheduled function).
        if not optimizer.built:
            with self._strategy.scope():
                optimizer.build(model.trainable_variables)
        self.model = model
        self.checkpoints = checkpoint.LocalCheckpoints(self.checkpoint_dir, model, optimizer,
                                                       keep=self.config.keep_checkpoints)
        state = self.checkpoints.restore() if self.resume else None
        if state is not None:
            self.optimizer_steps = state["optimizer_steps"]
        return state

    def inputs(self, strategy, plan: EpochPlan, start_epoch: int, start_step: int = 0):  # epochs only
        import tensorflow as tf

        from app.data import tf_input

        config, train = self.config, self.train

        def worker_batches(_):
            # Runs inside each remote worker; its index comes from the coordinator at run time.
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            return tf_input.train_batches_from_arrays(
                train, plan, config.seed, config.shuffle, start_epoch, config.epochs, index
            ).repeat()  # endless: a fast worker may run past its slice of the last epoch

        per_worker = self.coordinator.create_per_worker_dataset(strategy.distribute_datasets_from_function(worker_batches))
        # The chief evaluates the whole validation set itself, batch by batch.
        return iter(per_worker), tf_input.eval_batches_from_arrays(self.val, config.per_replica_batch)

    def placement(self, strategy) -> list[str]:
        return []

    def save_and_report(self, metrics: dict[str, Any], state: dict[str, Any], write: Callable[[str], None]) -> None:
        self.optimizer_steps = metrics["optimizer_steps"]
        self.checkpoints.save({**state, "optimizer_steps": self.optimizer_steps})
        self.alive()

    def progress_bar(self, total: int, desc: str):
        return self._progress_bar(total=total, desc=desc)

    def alive(self) -> None:
        self._alive()

    def result(self) -> dict[str, Any]:
        """Where the last checkpoint is, the optimizer steps taken, and where each variable lives."""
        return {"latest": self.checkpoints.latest, "optimizer_steps": self.optimizer_steps,
                "variable_placement": variable_placement(self.model)}


def scheduled_step(strategy, model, optimizer, measures: "Measures", batch: int, schedule):
    """The function each scheduled step runs on a worker: set the LR of step ``n``, take a batch, train on it."""
    import tensorflow as tf

    replica_step = replica_train_step(model, optimizer, measures, global_batch=batch)

    @tf.function
    def step(iterator, n):
        optimizer.learning_rate.assign(tf.cast(schedule(n), optimizer.learning_rate.dtype))
        x, y, _ids, w = next(iterator)
        return strategy.run(replica_step, args=(x, y, w))

    return step


def replica_train_step(model: "keras.Model", optimizer, measures: "Measures", global_batch: int):
    """A worker's step: the gradients of its batch's mean loss (and the model's penalties), applied on the servers.
    Returns the batch's sums [loss, count, metric states] (app.training.measures). Parameter servers refuse fp16 and
    --grad-accum: nothing to scale or accumulate here."""
    import tensorflow as tf

    variables = model.trainable_variables

    def train_step(x, y, sample_weight):
        weight = measures.train_weights(y, sample_weight)
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            per_example_loss = measures.loss(y, out, weight)
            loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        grads = tape.gradient(loss, variables)
        # Before the update: the penalties (model.losses) are read from the weights the loss saw.
        step_sums = measures.sums(y, out, with_penalties(model, per_example_loss), tf.ones_like(per_example_loss),
                                  weight)
        optimizer.apply_gradients(zip(grads, variables))
        return step_sums

    return train_step


def eval_sums(model, measures: "Measures"):
    """(x, y, weight) -> the batch's sums; weight-0 padding rows count for nothing."""

    def eval_step(x, y, w):
        out = model(x, training=False)
        return measures.sums(y, out, with_penalties(model, measures.loss(y, out)), w)

    return eval_step


def with_penalties(model: "keras.Model", per_example_loss):
    """The loss as Keras reports it (``loss``, ``val_loss``): each example's loss plus the model's own penalties
    (``model.losses``: weight regularisers, ``add_loss``), which are per batch, so once per row of a mean."""
    import tensorflow as tf

    if not model.losses:
        return per_example_loss
    return per_example_loss + tf.cast(tf.add_n(model.losses), per_example_loss.dtype)


class ScheduledSteps:
    """The epoch driver's step runner for parameter servers (app.training.loop.StepRunner).

    Steps go out through the coordinator in chunks, each a wait for them all:
    the driver's ``on_steps`` after each (a progress bar update, a sign of
    life). A step lost with a worker that died is re-run on another by the
    coordinator. The sums come back to the chief, which alone holds them: no
    cross-worker sum.
    """

    def __init__(self, coordinator, strategy, model, optimizer, measures: "Measures", plan: EpochPlan, schedule,
                 steps_taken: int):
        import tensorflow as tf

        self.coordinator, self.schedule, self._steps_taken = coordinator, schedule, steps_taken
        self.measures = measures
        self.step = scheduled_step(strategy, model, optimizer, measures, plan.update_batch, schedule)
        self.eval_step = tf.function(eval_sums(model, measures))
        self.chunk = STEPS_PER_WORKER_PER_CHUNK * plan.num_workers

    def steps_taken(self) -> int:
        return self._steps_taken

    def run(self, iterator, first_step: int, remaining: int):
        """Schedule the next chunk of steps, numbered from ``first_step``: each sets the LR of its number."""
        import tensorflow as tf

        n = min(self.chunk, remaining)
        results = [self.coordinator.schedule(self.step, args=(iterator, tf.constant(first_step + i, tf.int64)))
                   for i in range(n)]
        self.coordinator.join()  # raises a step's error, or UnavailableError for a lost parameter server
        return np.sum([np.asarray(r.fetch(), dtype=np.float64) for r in results], axis=0), n

    def evaluate(self, val) -> EpochStats:
        """Every validation row once, on the chief: the same sums as the synchronous paths, so the same metrics."""
        import tensorflow as tf

        start, acc = time.perf_counter(), tf.zeros((self.measures.size,), tf.float64)
        for x, y, w in val:
            acc += self.eval_step(x, y, w)
        return EpochStats.from_sums(acc.numpy(), time.perf_counter() - start, self.measures.results)

    def learning_rate(self, global_step: int) -> float:
        # The LR variable holds whichever step ran last, in no set order: the schedule's LR of the last number.
        return float(self.schedule(max(global_step - 1, 0)))

    def extra_metrics(self) -> dict[str, Any]:
        return {}


def variable_placement(model) -> dict[str, str]:
    """Each model variable (each embedding shard too) -> the device it lives on."""
    return {v.path: v.value.device for v in model.variables}
