"""Where a worker's time goes: its start-up links, and each epoch's steps split into input, compute, sync and hooks.

Keras's fit runs every step as one call of its ``train_function`` (``next(iterator)`` then the model's
``train_step``, traced into one function), with the callbacks' batch hooks between two calls. The clock times:

- on the host, each ``train_function`` call (``StepClock`` wraps it as fit starts): the whole step, its input
  included; the epoch's training loop from its begin to its validation (or its end); the validation pass;
- inside the traced step (``InGraph``, a worker of one replica: a Ray worker, or a local run on one device), with
  ``tf.timestamp`` ops that wait for the tensors they follow and that the next ops wait for: the moment each step's
  batch is in hand (summed; the host sums the moments it called the function: both are the wall clock), and the
  gradients' all-reduce from its last gradient to its last sum (the sync the backward pass did not hide, the wait
  for the slowest worker included).

So per epoch: **input** = batches in hand - calls begun (the wait for the batch, and the call's dispatch); the
body = calls - input; **sync** = the all-reduces; **compute** = body - sync; **hooks** = loop - step calls
(callbacks, Keras's loop). A step's end is its call's return: an update that reads nothing the step returns still
ends inside it. Each fit's first step traces the function: it is a start-up link of its own ("first step"), not in
the split. On a GPU a call may return before its kernels end: the wait then shows in the hooks that read the
step's logs.

``Profile`` is --profile-steps A:B: TensorFlow's profiler over those steps of the run, on every worker, into a
TensorBoard run of each worker's own (TensorBoard's profile tab opens them).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import keras
import numpy as np

log = logging.getLogger(__name__)

# One epoch of one worker, in this order (app.driver.time_report reads it): the steps timed (each fit's first step
# is not), their calls, their bodies and syncs (0 where not timed in the step), the hooks between steps, the epoch's
# start (its begin hooks and its input's iterator, to its first step), the validation, the previous epoch's
# checkpoint and report, and the first step's seconds (0 in an epoch that did not start a fit).
EPOCH_FIELDS = ("steps", "calls", "body", "sync", "hooks", "epoch_start", "validation", "checkpoint", "first_step")
# A worker's start-up marks, in the order they end (wall clock; 0: not reached in this process).
MARKS = ("worker process", "worker configured", "worker entered", "tensorflow", "inputs", "model", "traced", "first step")


def process_started() -> float:
    """When this process started, on the wall clock, to the kernel's 10 ms: its age (/proc/uptime less its start
    tick in /proc/self/stat) back from now. psutil's create_time adds the start tick to the boot time, which /proc
    gives in whole seconds: up to 1 s off the wall clock the marks are read on. Elsewhere than Linux, psutil's."""
    import os
    from pathlib import Path

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


def worker_started() -> float:
    """When this worker's process started (wall clock): Ray may start it before the run asks for it."""
    return process_started()


class Marks:
    """The start-up links of one worker: the wall clock when each ended, in order."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def mark(self, name: str, at: Optional[float] = None) -> None:
        self.at.setdefault(name, time.time() if at is None else at)

    @classmethod
    def of_worker(cls, entered: float, configured: Optional[float] = None) -> "Marks":
        """A worker's marks once its TensorFlow and collectives are set up (``entered``: when its function began;
        ``configured``: when Ray Train gave it its TF_CONFIG, None where no Ray Train did)."""
        marks = cls()
        marks.mark("worker process", worker_started())
        if configured is not None:
            marks.mark("worker configured", configured)
        marks.mark("worker entered", entered)
        marks.mark("tensorflow")
        return marks


class InGraph:
    """Inside the traced step (a worker of one replica): the sum of the moments each step's batch was in hand (from
    an offset the host sets each epoch), the steps run, and the gradients' sync."""

    def __init__(self) -> None:
        import tensorflow as tf

        self.offset = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="clock_offset")
        self.starts = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="clock_starts")
        self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="clock_steps")
        self.sync = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="clock_sync")

    def wrap_step(self, model) -> None:
        """``model.train_step`` notes when its batch is in hand, before any of its ops runs."""
        own_step = model.train_step

        def train_step(data):
            start, data = _first(data)
            self.starts.assign_add(start - self.offset)
            self.count.assign_add(1)
            return own_step(data)

        model.train_step = train_step

    def timed_sync(self, values: list, summed: Callable[[list], list]) -> list:
        """``summed(values)`` (the gradients' all-reduce), its exposed time added to the sync."""
        import tensorflow as tf

        start, values = _first(values)
        out = summed(values)
        with tf.control_dependencies([v for v in tf.nest.flatten(out, expand_composites=True) if v is not None]):
            self.sync.assign_add(tf.timestamp() - start)
        return out

    def read(self) -> np.ndarray:
        """(the batches' moments in hand, summed; the steps run; the sync's seconds) so far."""
        return np.array([self.starts.numpy(), float(self.count.numpy()), self.sync.numpy()])


def _first(tree):
    """A timestamp taken once every tensor of ``tree`` exists, and ``tree`` made to wait for it: what reads the
    returned tensors runs after the timestamp (else the executor may run it first, and the clock would start late)."""
    import tensorflow as tf

    with tf.control_dependencies([t for t in tf.nest.flatten(tree, expand_composites=True) if t is not None]):
        start = tf.timestamp()
    with tf.control_dependencies([start]):
        return start, tf.nest.map_structure(lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, tree,
                                            expand_composites=True)


class StepClock(keras.callbacks.Callback):
    """The epoch's split on this worker (first in fit's callbacks: its epoch begin is the epoch's, its epoch end
    runs before the checkpoint's). Its hooks are epoch and test begins and ends: Keras may still run the batch hooks
    off the training thread."""

    async_safe = True

    def __init__(self, in_graph: Optional[InGraph], marks: Marks):
        super().__init__()
        self.in_graph, self.marks = in_graph, marks
        self.checkpoint = 0.0  # the last epoch's checkpoint and report (Checkpoints adds it)
        self._reset()
        self._graph_at = np.zeros(3)
        self._fit_calls = 0
        self.offset = 0.0  # the in-graph clock's offset this epoch (wall clock)

    def _reset(self) -> None:
        self.calls = self.first = self.begins = 0.0  # begins: the timed calls' starts, summed from the offset
        self.steps = 0
        self.loop_start: Optional[float] = None
        self.loop = self.validation = 0.0
        self.epoch_start: Optional[float] = None
        self._test_start: Optional[float] = None

    def on_train_begin(self, logs=None):
        self._fit_calls = 0
        fn = self.model.train_function
        if getattr(fn, "_clocked", None) is self:  # a later fit of this worker: the function is wrapped already
            return
        clock = self

        def timed(iterator):
            begun, started = time.time(), time.perf_counter()
            if clock.loop_start is not None and clock.epoch_start is None:
                clock.epoch_start = started - clock.loop_start
            out = fn(iterator)
            seconds = time.perf_counter() - started
            if clock._fit_calls == 0:  # a fit's first call traces the function: a start-up link
                clock.first += seconds
                if clock.in_graph is not None:
                    clock._graph_at = clock.in_graph.read()
                clock.marks.mark("first step")
            else:
                clock.calls += seconds
                clock.begins += begun - clock.offset
                clock.steps += 1
            clock._fit_calls += 1
            return out

        timed._clocked = self
        self.model.train_function = timed

    def on_epoch_begin(self, epoch, logs=None):
        self._reset()
        self.loop_start = time.perf_counter()
        if self.in_graph is not None:
            self.offset = time.time()
            self.in_graph.offset.assign(self.offset)
            self._graph_at = self.in_graph.read()

    def _end_loop(self) -> None:
        if self.loop_start is not None:
            self.loop, self.loop_start = time.perf_counter() - self.loop_start, None

    def on_test_begin(self, logs=None):
        self._end_loop()
        self._test_start = time.perf_counter()

    def on_test_end(self, logs=None):
        if self._test_start is not None:
            self.validation += time.perf_counter() - self._test_start
            self._test_start = None

    def on_epoch_end(self, epoch, logs=None):
        self._end_loop()

    def row(self) -> np.ndarray:
        """This epoch's split (EPOCH_FIELDS), after its on_epoch_end."""
        body = sync = 0.0
        if self.in_graph is not None and self.steps:
            now = self.in_graph.read()
            starts, count, sync = now - self._graph_at
            self._graph_at = now
            # A call of several steps (steps_per_execution) holds more batches than calls: its input is not split.
            waited = max(0.0, starts - self.begins) if round(count) == self.steps else 0.0
            body = max(self.calls - waited, 1e-9)
        start = self.epoch_start or 0.0
        hooks = max(0.0, self.loop - self.calls - self.first - start)
        return np.array([self.steps, self.calls, body, sync, hooks, start, self.validation, self.checkpoint,
                         self.first])


class Profile(keras.callbacks.Callback):
    """--profile-steps A:B: TensorFlow's profiler from step A's begin to step B's end (steps of the run, counted
    from 1 over its epochs), written under ``logdir`` (a TensorBoard run of this worker's own)."""

    def __init__(self, first: int, last: int, logdir: str, steps_before: int):
        super().__init__()
        self.first, self.last, self.logdir = first, last, logdir
        self.done = steps_before  # the run's steps before this fit (a resumed run's)
        self.on = False
        self._epoch_start = steps_before

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self.done

    def on_train_batch_begin(self, batch, logs=None):
        step = self._epoch_start + batch + 1
        if self.on and step > self.last:
            self._stop()
        elif not self.on and self.first <= step <= self.last:
            import tensorflow as tf

            tf.profiler.experimental.start(self.logdir)
            self.on = True
        self.done = step

    def _stop(self) -> None:
        import tensorflow as tf

        tf.profiler.experimental.stop()
        self.on = False
        log.info("profile of steps %d-%d written to %s", self.first, self.last, self.logdir)

    def on_epoch_end(self, epoch, logs=None):
        if self.on and self.done >= self.last:
            self._stop()

    def on_train_end(self, logs=None):
        if self.on:
            self._stop()


SHARES = ("input", "compute", "sync", "hooks")  # a step's parts, in the order the run-end line names them


def split(rows: list) -> dict[str, float]:
    """Seconds of each part of the timed steps (SHARES), the validation, checkpoint and first-step seconds and the
    steps timed, over epoch rows (EPOCH_FIELDS) of one worker or several (then each worker's mean)."""
    a = np.asarray(rows, dtype=np.float64).reshape(-1, len(EPOCH_FIELDS))
    f = dict(zip(EPOCH_FIELDS, a.T))
    body = f["body"]
    timed = body > 0  # rows whose steps were timed inside (else the whole call counts as compute)
    parts = {
        "input": np.where(timed, np.maximum(f["calls"] - body, 0.0), 0.0),
        "compute": np.where(timed, np.maximum(body - f["sync"], 0.0), f["calls"]),
        "sync": np.where(timed, f["sync"], 0.0),
        "hooks": f["hooks"],
    }
    return {**{k: float(v.sum()) for k, v in parts.items()}, "epoch_start": float(f["epoch_start"].sum()),
            "validation": float(f["validation"].sum()),
            "checkpoint": float(f["checkpoint"].sum()), "first_step": float(f["first_step"].sum()),
            "steps": float(f["steps"].sum())}


def shares(seconds: dict[str, float]) -> dict[str, float]:
    """Each part's fraction of the timed steps' time (SHARES; empty when nothing was timed)."""
    total = sum(seconds[k] for k in SHARES)
    return {k: seconds[k] / total for k in SHARES} if total > 0 else {}
