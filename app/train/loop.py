"""The strategy-agnostic training loop.

Nothing here knows whether it runs under MultiWorkerMirroredStrategy in a Ray
worker, MirroredStrategy over local devices, TPUStrategy or one device: it
takes a strategy, a model and optimizer built under ``strategy.scope()``, and
distributed datasets of per-replica batches.

Metrics are exact sums (loss, correct predictions, sample count) reduced
across all replicas of all workers once per epoch, so a val accuracy is the
accuracy over the whole validation set, not an average of per-worker averages.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    import keras
    import tensorflow as tf


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    samples: int
    seconds: float
    first_step_time: Optional[float] = None  # wall clock when the first step finished
    sample_ids: Optional[np.ndarray] = field(default=None, repr=False)  # all replicas' ids, if audited


class NonFiniteLoss(Exception):
    """The training loss became NaN or infinite."""


class Loop:
    """Compiled train/eval steps for one (strategy, model, optimizer)."""

    def __init__(
        self,
        strategy: "tf.distribute.Strategy",
        model: "keras.Model",
        optimizer: "keras.optimizers.Optimizer",
        global_batch_size: int,
        audit_sample_ids: bool = False,
        steps_per_execution: int = 1,
        log_every_steps: int = 0,
        grad_accum: int = 1,
    ):
        import keras
        import tensorflow as tf

        self.strategy = strategy
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.audit_sample_ids = audit_sample_ids
        self.steps_per_execution = steps_per_execution
        self.log_every_steps = log_every_steps
        self.global_step: Optional[int] = None  # optimizer steps so far, counted on the host
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        if optimizer is not None and not optimizer.built:
            # Create the slot variables now, under the scope: created lazily inside the
            # first tf.function call they break MirroredStrategy ("must feed a value
            # for placeholder tensor ... fn_with_cond").
            with strategy.scope():
                optimizer.build(model.trainable_variables)

        def sums(y, logits, per_example_loss, weight):
            correct = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int64), y), tf.float32)
            # float64 so that sums over a large epoch stay exact (counts) or close (loss).
            return tf.cast(
                tf.stack(
                    [tf.reduce_sum(per_example_loss * weight), tf.reduce_sum(correct * weight), tf.reduce_sum(weight)]
                ),
                tf.float64,
            )

        variables = model.trainable_variables
        scales_loss = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

        def micro_batch_gradients(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                per_example_loss = loss_fn(y, logits)
                # Divide by the *global* batch (all replicas, all micro-batches): the
                # all-reduce then sums replica gradients into the gradient of the mean
                # over the global batch.
                loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=global_batch_size)
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses)) / grad_accum
                if scales_loss:
                    loss = optimizer.scale_loss(loss)
            return tape.gradient(loss, variables), sums(y, logits, per_example_loss, tf.ones_like(per_example_loss))

        def train_step(x, y):
            if grad_accum == 1:
                grads, step_sums = micro_batch_gradients(x, y)
            else:
                # K micro-batches, one at a time (activation memory of one), gradients
                # summed locally; the optimizer's all-reduce then runs once per K.
                micro = tf.shape(x)[0] // grad_accum

                def accumulate(i, grads, step_sums):
                    part = slice(i * micro, (i + 1) * micro)
                    g, s = micro_batch_gradients(x[part], y[part])
                    return i + 1, [a + b for a, b in zip(grads, g)], step_sums + s

                zeros = [tf.zeros(v.shape, dtype=v.dtype) for v in variables]
                _, grads, step_sums = tf.while_loop(
                    lambda i, *_: i < grad_accum, accumulate, (tf.constant(0), zeros, tf.zeros((3,), tf.float64))
                )
            if scales_loss:
                grads = agree_on_overflow(grads)
            optimizer.apply_gradients(zip(grads, variables))
            return step_sums

        def agree_on_overflow(grads):
            """Make an fp16 overflow on any replica an overflow on all of them.

            LossScaleOptimizer checks the *local* gradients before its all-reduce:
            under MWMS a worker that overflowed would skip the step (and the
            all-reduce) while the others wait in it forever; under Mirrored the
            first replica decides and another's inf would be summed into the
            weights. One scalar all-reduce per step makes the decision global.
            """
            bad = tf.cast(
                tf.logical_not(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])), tf.float32
            )
            any_bad = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, bad) > 0
            poison = tf.where(any_bad, float("nan"), 0.0)
            return [g + tf.cast(poison, g.dtype) for g in grads]

        def eval_step(x, y, w):
            logits = model(x, training=False)
            return sums(y, logits, loss_fn(y, logits), w)

        @tf.function
        def distributed_train_step(batch):
            x, y, ids = batch
            per_replica = strategy.run(train_step, args=(x, y))
            gathered = strategy.gather(ids, axis=0) if audit_sample_ids else tf.zeros((0,), tf.int64)
            return per_replica, gathered

        @tf.function
        def distributed_train_steps(iterator, k):
            # Several steps per call (TPUs need it: one host round trip per k steps).
            acc = tf.zeros((3,), tf.float64)
            for _ in tf.range(k):
                x, y, _ids = next(iterator)
                per_replica = strategy.run(train_step, args=(x, y))
                acc += tf.add_n(list(strategy.experimental_local_results(per_replica)))
            return acc

        @tf.function
        def distributed_eval_step(batch):
            return strategy.run(eval_step, args=batch)

        # Non-trainable state (batch-norm moving mean/variance) is updated by each
        # replica from its own batch: Keras 3 creates these variables with
        # aggregation "none", so the replicas' copies drift apart, each evaluates
        # with its own, and rank 0 saves only its own. Averaging them over every
        # replica once per epoch keeps one consistent value (what tf.keras 2 did
        # with ON_READ/MEAN variables, without a collective on every step).
        replica_state = [v for v in model.non_trainable_variables if "float" in str(v.dtype)]

        @tf.function
        def average_replica_state():
            def average():
                ctx = tf.distribute.get_replica_context()
                for v in replica_state:
                    # all_reduce of the variable itself fails under MWMS ("destinations can not be
                    # empty"): reduce a tensor copy of this replica's value.
                    v.assign(ctx.all_reduce(tf.distribute.ReduceOp.MEAN, tf.identity(v.value)))

            strategy.run(average)

        self._traced = False
        self._train_step = distributed_train_step
        self._train_steps = distributed_train_steps
        self._eval_step = distributed_eval_step
        self._average_replica_state = average_replica_state if replica_state else None

    @classmethod
    def for_run(cls, strategy, model, optimizer, global_batch_size: int, config) -> "Loop":
        """The loop as a TrainConfig asks for it (both backends build it this way)."""
        return cls(
            strategy,
            model,
            optimizer,
            global_batch_size,
            audit_sample_ids=config.audit_sample_ids,
            steps_per_execution=config.steps_per_execution,
            # Log points are collectives: every worker must agree on them.
            log_every_steps=config.log_every_steps if config.tensorboard else 0,
            grad_accum=config.grad_accum,
        )

    # --- helpers ---------------------------------------------------------------
    def _first_batch(self, iterator):
        """The next batch; the first time, trace the train step while that batch is on its way.

        The first batch of a run waits for the input to start (on Ray, a new Ray
        Data execution with processes of its own) and the first step waits for
        tracing; both are seconds on the path to the first step, and they overlap.
        """
        if self._traced:
            return next(iterator)
        self._traced = True
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            batch = pool.submit(next, iterator)
            self._train_step.get_concrete_function(iterator.element_spec)
            return batch.result()

    def _local_sum(self, per_replica) -> "tf.Tensor":
        import tensorflow as tf

        return tf.add_n(list(self.strategy.experimental_local_results(per_replica)))

    def cross_worker_sum(self, local: np.ndarray) -> np.ndarray:
        """Sum a host-side vector over every worker (a no-op with one process)."""
        import tensorflow as tf

        local = np.asarray(local, dtype=np.float64)
        calls = iter(range(1 << 30))

        def value_fn(ctx):
            # Only this process's first replica contributes, so that a worker
            # with several local replicas is not counted several times.
            return tf.constant(local if next(calls) == 0 else np.zeros_like(local))

        values = self.strategy.experimental_distribute_values_from_function(value_fn)
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy()

    # --- epochs ----------------------------------------------------------------
    def train_epoch(self, iterator, steps: int, epoch: int = 0, on_log=None) -> EpochStats:
        """``steps`` steps from an endless distributed iterator.

        The caller passes the same ``steps`` on every worker (an all-reduce with
        a missing peer waits forever). Using an endless dataset and counting
        steps also avoids TF's per-step "does any worker still have data"
        all-reduce that a finite multi-worker dataset costs.

        Every ``log_every_steps`` optimizer steps, every worker sums the steps
        since the last point (a collective: all workers reach it at the same
        step) and ``on_log(step, scalars)`` gets them.
        """
        import tensorflow as tf

        start = time.perf_counter()
        acc = tf.zeros((3,), tf.float64)
        window = _LogWindow(self, on_log, start)
        first_step_time = None
        id_chunks = []
        step_sums = []  # per call, this worker's sums: kept as tensors, checked once at the end
        done = 0
        while done < steps:
            if self.steps_per_execution == 1:
                per_replica, ids = self._train_step(self._first_batch(iterator) if done == 0 else next(iterator))
                local = self._local_sum(per_replica)
                step_sums.append((done + 1, local))
                acc += local
                window.after(acc, 1)
                if self.audit_sample_ids:
                    id_chunks.append(ids.numpy())
                done += 1
            else:
                k = min(self.steps_per_execution, steps - done)
                local = self._train_steps(iterator, tf.constant(k))
                step_sums.append((done + k, local))
                acc += local
                window.after(acc, k)
                done += k
            if first_step_time is None:
                acc.numpy()  # wait for the step to really finish
                first_step_time = time.time()
        loss_sum, correct, count = self.cross_worker_sum(acc.numpy())
        seconds = time.perf_counter() - start
        if not np.isfinite(loss_sum):
            bad = next((s for s, sums in step_sums if not np.isfinite(sums.numpy()[0])), None)
            where = f"step {bad} of {steps}" if bad is not None else f"a step of {steps} on another worker"
            raise NonFiniteLoss(
                f"non-finite training loss in epoch {epoch}, {where}: check the data for NaN/inf or lower "
                "--base-lr; the last good checkpoint is the one from the epoch before"
            )
        return EpochStats(
            loss=loss_sum / max(count, 1),
            accuracy=correct / max(count, 1),
            samples=int(count),
            seconds=seconds,
            first_step_time=first_step_time,
            sample_ids=np.concatenate(id_chunks) if id_chunks else None,
        )

    def run_epoch(
        self, epoch: int, train_iter, steps: int, val_dataset, dropped: int, on_log=None
    ) -> tuple[dict, EpochStats]:
        """Train ``steps`` steps, evaluate, and return the epoch's metrics record."""
        train = self.train_epoch(train_iter, steps, epoch=epoch, on_log=on_log)
        if self._average_replica_state is not None:
            self._average_replica_state()
        val = self.evaluate(val_dataset)
        return epoch_metrics(epoch, train, val, self.optimizer.learning_rate.numpy(), dropped), train

    def evaluate(self, dist_dataset) -> EpochStats:
        """Weighted loss/accuracy over every replica's batches; padding rows weigh 0."""
        import tensorflow as tf

        start = time.perf_counter()
        acc = tf.zeros((3,), tf.float64)
        for batch in dist_dataset:
            acc += self._local_sum(self._eval_step(batch))
        loss_sum, correct, count = self.cross_worker_sum(acc.numpy())
        return EpochStats(
            loss=loss_sum / max(count, 1),
            accuracy=correct / max(count, 1),
            samples=int(count),
            seconds=time.perf_counter() - start,
        )


class _LogWindow:
    """The steps since the last log point of ``Loop.train_epoch`` (a window never spans two epochs).

    The window's sums are the epoch's running sums minus their value at the
    last point: nothing is added per step beyond what the epoch already sums.
    """

    def __init__(self, loop: Loop, on_log, start: float):
        self.loop, self.on_log, self.start = loop, on_log, start
        self.base = np.zeros(3)  # the epoch's running sums at the last log point
        if loop.global_step is None:  # first epoch of this process: continue a restored optimizer's count
            loop.global_step = int(loop.optimizer.iterations.numpy()) if loop.optimizer is not None else 0

    def after(self, epoch_sums, k: int) -> None:
        loop = self.loop
        before, loop.global_step = loop.global_step, loop.global_step + k
        every = loop.log_every_steps
        if not every or loop.global_step // every == before // every:
            return
        # Every worker gets here at the same step (same config, same step count): a collective is safe.
        now_sums = epoch_sums.numpy()
        loss_sum, correct, count = loop.cross_worker_sum(now_sums - self.base)
        now = time.perf_counter()
        if self.on_log is not None:
            self.on_log(
                loop.global_step,
                {
                    "train_loss": loss_sum / max(count, 1),
                    "train_accuracy": correct / max(count, 1),
                    "learning_rate": float(loop.optimizer.learning_rate.numpy()),
                    "samples_per_second": count / (now - self.start),
                },
            )
        self.base, self.start = now_sums, now


def epoch_metrics(epoch: int, train: EpochStats, val: EpochStats, learning_rate: float, dropped: int) -> dict:
    """The per-epoch record shared by every backend (history.csv, Ray reports)."""
    metrics = {
        "epoch": epoch,
        "train_loss": float(train.loss),
        "train_accuracy": float(train.accuracy),
        "val_loss": float(val.loss),
        "val_accuracy": float(val.accuracy),
        "learning_rate": float(learning_rate),
        "samples_per_second": train.samples / train.seconds,
        "train_seconds": train.seconds,
        "epoch_seconds": train.seconds + val.seconds,
        "train_samples": train.samples,
        "dropped_samples": dropped,
        "val_samples": val.samples,
    }
    if train.first_step_time is not None:
        metrics["first_step_time"] = train.first_step_time
    if train.sample_ids is not None:
        metrics["audit_ids_seen"] = int(train.sample_ids.size)
        metrics["audit_ids_unique"] = int(np.unique(train.sample_ids).size)
    return metrics


def progress_line(m: dict, epochs: int, history: list[dict]) -> str:
    mean_epoch = sum(h["epoch_seconds"] for h in history) / len(history)
    eta = mean_epoch * (epochs - m["epoch"])
    return (
        f"epoch {m['epoch']:>3}/{epochs}  train_loss {m['train_loss']:.4f}  val_loss {m['val_loss']:.4f}  "
        f"val_acc {m['val_accuracy']:.4f}  lr {m['learning_rate']:.4g}  "
        f"{m['samples_per_second']:,.0f} samples/s  {m['epoch_seconds']:.1f} s  ETA {eta:.0f} s"
    )
