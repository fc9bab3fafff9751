"""The epoch driver: ``steps`` train steps from an endless iterator, then evaluation, as one record.

This is the product's own loop, for what Keras's fit does not train (app.backend's
``own_loop``: parameter servers): how a step runs is a ``StepRunner``'s business
(app.training.parameter_server's ``ScheduledSteps`` schedules numbered steps on the workers).
The driver keeps the host-side step count, the log window, the non-finite check, the epoch record.

The caller passes the same step count on every parameter-server worker;
counting steps on an endless dataset also avoids TF's per-step "does any
worker still have data" check that a finite distributed dataset costs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import numpy as np

from app.errors import NonFiniteLoss
from app.training.metrics import EpochStats, epoch_metrics

if TYPE_CHECKING:
    from app.training.measures import Measures


class StepRunner(Protocol):
    """How train steps run, how an epoch is evaluated, and what the driver cannot see from outside."""

    def steps_taken(self) -> int:
        """Optimizer steps taken before this process's first epoch (a restored run's count)."""

    def run(self, iterator, first_step: int, remaining: int) -> tuple[Any, int]:
        """Run the next steps (at most ``remaining``, numbered from ``first_step``): (the sums [loss, count, metric
        states] over them, how many ran)."""

    def evaluate(self, val) -> EpochStats:
        """Every validation row once, exact sums."""

    def learning_rate(self, global_step: int) -> float:
        """The LR of the last step run, ``global_step`` steps in."""

    def extra_metrics(self) -> dict[str, Any]:
        """What this kind of run adds to each epoch's record."""


class EpochDriver:
    """Runs epochs through a StepRunner; keeps the host-side step count and the log window."""

    def __init__(self, runner: StepRunner, measures: "Measures", *, log_every_steps: int = 0):
        self.runner, self.measures, self.log_every_steps = runner, measures, log_every_steps
        self.global_step: Optional[int] = None  # optimizer steps so far, counted on the host

    def train_epoch(self, iterator, steps: int, epoch: int = 0, on_log: Optional[Callable] = None,
                    on_steps: Optional[Callable[[int], None]] = None, on_batch: Optional[Callable] = None) -> EpochStats:
        """``steps`` steps; every ``log_every_steps`` optimizer steps, ``on_log(step, scalars)`` (the steps since the
        last log point) and ``on_batch(batch, scalars)`` (the epoch so far; ``batch``: the last step's 0-based index
        in the epoch); ``on_steps(k)`` after every k steps run (a progress bar, a sign of life)."""
        import tensorflow as tf

        start = time.perf_counter()
        acc = tf.zeros((self.measures.size,), tf.float64)
        if self.global_step is None:  # first epoch of this process: continue a restored run's count
            self.global_step = self.runner.steps_taken()
        window = _LogWindow(self, on_log, on_batch, start)
        first_step_time, step_sums, done = None, [], 0
        while done < steps:
            local, k = self.runner.run(iterator, self.global_step, steps - done)
            done += k
            if on_steps is not None:
                on_steps(k)
            step_sums.append((done, k, local))  # kept as tensors, checked once at the end
            acc += local
            window.after(acc, k, done)
            if first_step_time is None:
                acc.numpy()  # wait for the step to really finish
                first_step_time = time.time()
        sums = acc.numpy()
        if not np.isfinite(sums[0]):
            bad = next(((s, k) for s, k, local in step_sums if not np.isfinite(np.asarray(local)[0])), None)
            where = (f"a step of {steps}" if bad is None else f"step {bad[0]} of {steps}"
                     if bad[1] == 1 else f"steps {bad[0] - bad[1] + 1}-{bad[0]} of {steps}")
            raise NonFiniteLoss(
                f"non-finite training loss in epoch {epoch}, {where}: check the data for NaN/inf or lower "
                "--base-lr; the last good checkpoint is the one from the epoch before"
            )
        return EpochStats.from_sums(
            sums, time.perf_counter() - start, self.measures.results, first_step_time=first_step_time)

    def run_epoch(self, epoch: int, train_iter, steps: int, val, dropped: int, on_log=None, on_steps=None,
                  on_batch=None):
        """Train ``steps`` steps, evaluate, and return (the epoch's metrics record, the train stats)."""
        train = self.train_epoch(train_iter, steps, epoch=epoch, on_log=on_log, on_steps=on_steps, on_batch=on_batch)
        val_stats = self.runner.evaluate(val)
        lr = self.runner.learning_rate(self.global_step)
        metrics = epoch_metrics(epoch, train, val_stats, lr, dropped)
        metrics["optimizer_steps"] = self.global_step
        metrics.update(self.runner.extra_metrics())
        return metrics, train


class _LogWindow:
    """The steps since the last log point of ``train_epoch`` (a window never spans two epochs).

    The epoch's running sums are read at each log point; the window's are those
    minus their value at the last point: nothing is added per step beyond what
    the epoch already sums.
    """

    def __init__(self, driver: EpochDriver, on_log, on_batch, start: float):
        self.driver, self.on_log, self.on_batch, self.start = driver, on_log, on_batch, start
        self.base = np.zeros(driver.measures.size)  # the epoch's running sums at the last log point

    def after(self, epoch_sums, k: int, done: int) -> None:
        d = self.driver
        before, d.global_step = d.global_step, d.global_step + k
        every = d.log_every_steps
        if not every or d.global_step // every == before // every:
            return
        running = epoch_sums.numpy()
        stats = EpochStats.from_sums(running - self.base, 0.0, d.measures.results)
        now = time.perf_counter()
        lr = d.runner.learning_rate(d.global_step)
        if self.on_log is not None:
            self.on_log(d.global_step, {**_train_scalars(stats), "learning_rate": lr,
                                        "samples_per_second": stats.samples / (now - self.start)})
        if self.on_batch is not None:
            so_far = EpochStats.from_sums(running, 0.0, d.measures.results)
            self.on_batch(done - 1, {**_train_scalars(so_far), "learning_rate": lr})
        self.base, self.start = running, now


def _train_scalars(stats: EpochStats) -> dict[str, float]:
    return {"train_loss": stats.loss, **{f"train_{name}": v for name, v in stats.metrics.items()}}


class EpochBar:
    """One epoch's progress bar, drawn only once the epoch has run ``DELAY_S``: short epochs need none.

    ``make(total=, desc=)`` builds a tqdm-like bar (tqdm locally; ray.experimental.tqdm_ray
    in a Ray worker, which the driver draws); ``make=None`` draws nothing.
    """

    DELAY_S = 3.0

    def __init__(self, make: Optional[Callable], total: int, desc: str):
        self.make, self.total, self.desc = make, total, desc
        self.start, self.done, self.bar = time.monotonic(), 0, None

    def update(self, k: int) -> None:
        self.done += k
        if self.bar is not None:
            self.bar.update(k)
        elif self.make is not None and time.monotonic() - self.start >= self.DELAY_S:
            self.bar = self.make(total=self.total, desc=self.desc)
            self.bar.update(self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
