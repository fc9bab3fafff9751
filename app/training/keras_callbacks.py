"""The callbacks a worker adds to the model's own fit(): rank 0's decisions taken by every worker, and one
checkpoint and report per epoch (app.training.keras_worker). Only workers import this module (it imports Keras)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import keras
import numpy as np

from app.errors import NonFiniteLoss
from app.training import metrics
from app.training.collective import Collective

log = logging.getLogger(__name__)

_BATCH_HOOKS = ("on_train_batch_end", "on_batch_end", "on_train_batch_begin", "on_batch_begin")


def acts_per_batch(callbacks: list) -> bool:
    """Whether a callback may decide inside an epoch (stop, set the LR): it overrides a batch hook."""
    return any(getattr(type(c), n, None) is not getattr(keras.callbacks.Callback, n)
               for c in callbacks for n in _BATCH_HOOKS)


def learning_rates(model) -> list:
    """The optimizers' learning-rate variables a callback may set (a schedule is not one)."""
    from app.training.keras_sync import optimizers_of

    return [lr for o in optimizers_of(model) if hasattr(lr := getattr(o, "_learning_rate", None), "assign")]


def raised_by_callback(error: BaseException, callbacks: list) -> Optional[Exception]:
    """The one line for an error one of the user's ``callbacks`` raised (its class and the hook fit() called), or
    None when none of them raised it: the outermost frame of a callback's own is the hook."""
    import traceback

    from app.errors import UserCodeError

    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if any(owner is c for c in callbacks):
            return UserCodeError(f"callback {type(owner).__name__} raised {type(error).__name__} in "
                                 f"{frame.f_code.co_name}: {error}", error)
    return None


def on_every_worker(callbacks: list) -> list:
    """The user's callbacks that run on every worker, not rank 0 alone: ``SwapEMAWeights`` swaps the weights every
    worker validates (and trains) with, each worker's EMA being the same; it writes nothing."""
    return [c for c in callbacks if isinstance(c, keras.callbacks.SwapEMAWeights)]


class Decisions(keras.callbacks.Callback):
    """The user's callbacks run on rank 0 only (only rank 0 writes files); what they decide, ``stop_training`` and
    the learning rates, every worker takes at the same point (epoch begin and end, and each batch's end when a
    callback acts there), or their steps (and all-reduces) would part."""

    def __init__(self, collective: Collective, model, rank: int, per_batch: bool):
        super().__init__()
        self.collective, self.rank, self.per_batch = collective, rank, per_batch
        self.rates = learning_rates(model)
        # Its batch hook does nothing then: Keras may run the batch hooks off the training thread (a hook that
        # acts makes fit() read every step's logs on it).
        self.async_safe = not per_batch

    def _agree(self) -> None:
        if self.collective.world == 1:
            return
        mine = np.zeros(1 + len(self.rates))
        if self.rank == 0:
            mine[0] = float(bool(self.model.stop_training))
            mine[1:] = [float(r.numpy()) for r in self.rates]
        total = self.collective.host(mine)
        self.model.stop_training = bool(total[0] > 0)
        for r, value in zip(self.rates, total[1:]):
            r.assign(value)

    def on_epoch_begin(self, epoch, logs=None):
        self._agree()

    def on_train_batch_end(self, batch, logs=None):
        if self.per_batch:
            self._agree()

    def on_epoch_end(self, epoch, logs=None):
        self._agree()


class StepWatch(keras.callbacks.Callback):
    """Each training step inside the stall watch's bound (app.training.stall_watch): its all-reduces run in the
    traced step, where no host code sees them wait."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def on_train_batch_begin(self, batch, logs=None):
        self.watch.begin(step=True)

    def on_train_batch_end(self, batch, logs=None):
        self.watch.end(step=True)

    # An input of unknown size ends inside a step (its last call finds no batch), whose batch end never comes: it
    # ends before the validation or the epoch's end, which must not wait under it.
    def on_test_begin(self, logs=None):
        self.watch.end_open_step()

    def on_epoch_end(self, epoch, logs=None):
        self.watch.end_open_step()


class Bar(keras.callbacks.Callback):
    """verbose=1 for a person at a terminal: rank 0's bar inside each epoch (app.training.loop.EpochBar: drawn
    only once an epoch has run a few seconds), closed before the epoch's line."""

    def __init__(self, make: Callable[..., Any], steps: int, epochs: int):
        super().__init__()
        self.make, self.steps, self.epochs, self.bar = make, steps, epochs, None

    def on_epoch_begin(self, epoch, logs=None):
        from app.training.loop import EpochBar

        self.bar = EpochBar(self.make, self.steps, f"epoch {epoch + 1}/{self.epochs}")

    def on_train_batch_end(self, batch, logs=None):
        self.bar.update(1)

    def on_epoch_end(self, epoch, logs=None):
        self.bar.close()


class Checkpoints(keras.callbacks.Callback):
    """Every epoch: its record (Keras's epoch logs, exact over every worker), a checkpoint and a report."""

    def __init__(self, session, write: Callable[[str], None], state: dict[str, Any], epochs: int,
                 gather: Optional[Callable[[], None]] = None, own: Optional[list] = None, rows: Optional[int] = None,
                 finite: bool = False, settle: Optional[Collective] = None, clock: Any = None,
                 collective: Optional[Collective] = None, sync_timed: bool = False):
        """``state``: what ``write`` saves beside the weights: the epoch reached, the history and why the run stopped
        early, kept here; ``gather``: what every worker does before rank 0 writes (a sharded optimizer's parts put
        together); ``own``: the user's callbacks this worker runs (which may stop the run); ``rows``: the rows an
        epoch trains over every worker (its speed's numerator), None where the workers count them as they read;
        ``finite``: a non-finite epoch loss ends the run before its checkpoint (a model the product compiled: one
        the user compiled trains on, as Keras's fit does); ``settle``: the user gave callbacks, which may set the
        weights as training ends (EarlyStopping's ``restore_best_weights``) on rank 0, where they run: every worker
        then takes rank 0's weights over this collective and the run's last checkpoint holds them; ``clock``: the
        worker's StepClock (app.training.step_clock), whose epoch split every worker gathers to the checkpoint's
        state over ``collective`` (``sync_timed``: its steps time their all-reduce)."""
        super().__init__()
        self.clock, self.collective, self.sync_timed = clock, collective, sync_timed
        self.session, self.write, self.state, self.epochs, self.gather = session, write, state, epochs, gather
        self.own, self.rows, self.finite, self.settle = own or [], rows, finite, settle
        self.written: Optional[int] = None  # rank 0's weights as its last checkpoint holds them (a fingerprint)
        self.started = time.perf_counter()
        self.told_first_step = False  # in this process's first epoch record (a restart's, a resumed run's too)

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if self.finite and loss is not None and not np.isfinite(float(loss)):  # the same logs on every worker
            raise NonFiniteLoss(f"non-finite training loss in epoch {epoch + 1}: check the data for NaN/inf or lower "
                                "--base-lr; the last good checkpoint is the one from the epoch before")
        seconds = time.perf_counter() - self.started
        record = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0},
                  "seconds": round(seconds, 3), "workers": self.session.world, "attempt": self.state.get("attempt", 0),
                  **({"samples_per_second": round(self.rows / seconds, 1)} if self.rows and seconds else {})}
        if not self.told_first_step:
            # wall clock (the driver's start is one): this process's first step, as the step clock marked it
            first = self.clock.marks.at.get("first step") if self.clock is not None else None
            record["first_step_time"], self.told_first_step = first, True
        self.state["history"].append(record)
        self.state["epoch"] = epoch + 1
        self.state.pop("settled", None)
        for key in StepCheckpoints.STATE_KEYS:  # the epoch is whole: no step inside it to go on from
            self.state.pop(key, None)
        if self.model.stop_training and epoch + 1 < self.epochs:  # agreed by every worker (Decisions runs first)
            self.state["stopped_early"] = {"epoch": epoch + 1, "reason": next(
                (why_stopped(c, "on_epoch_end") for c in self.own if getattr(c, "stopped_epoch", 0)),
                "a callback set model.stop_training")}
        if self.session.rank == 0:
            log.info(epoch_line(record, self.epochs))
        if self.clock is not None:
            self._time(epoch)
        if self.gather is not None:
            self.gather()
        saving = time.perf_counter()
        self.session.save_and_report(record, self.write)
        if self.clock is not None:
            self.clock.checkpoint = time.perf_counter() - saving
        if self.settle is not None and self.session.rank == 0:
            self.written = _fingerprint(self.model)

    def _time(self, epoch: int) -> None:
        """Every worker's split of the epoch (and its start-up marks), gathered into the checkpoint's state: where
        the run's time went (app.driver.time_report reads it)."""
        from app.training.step_clock import MARKS

        marks = [self.clock.marks.at.get(name, 0.0) for name in MARKS]
        row = np.concatenate([self.clock.row(), marks])
        rows = self.collective.gather(row) if self.collective is not None else row[None]
        took = self.state.setdefault("time", {"epochs": [], "sync_timed": self.sync_timed})
        split = rows[:, :-len(MARKS)]
        took["epochs"].append({"epoch": epoch + 1, "at": time.time(), "workers": np.round(split, 4).tolist()})
        took["marks"] = [dict(zip(MARKS, r)) for r in rows[:, -len(MARKS):].tolist()]

    def on_train_end(self, logs=None):
        if self.settle is None or not self.state["history"]:
            return
        changed = self.session.rank == 0 and _fingerprint(self.model) != self.written
        if self.settle.host(np.array([float(changed)]))[0] == 0:
            return
        log.info("a callback set the weights as training ended: the run's checkpoint holds them")
        self.settle.broadcast_variables(_floats(self.model))
        if self.gather is not None:
            self.gather()
        self.state["settled"] = 1  # a resumed run goes on from this checkpoint, not the epoch's (app.backends.keras_fit)
        self.session.save_and_report(self.state["history"][-1], self.write)
        if self.session.rank == 0:
            self.written = _fingerprint(self.model)


def _floats(model) -> list:
    """The model's float weights (what training and a callback set; a counter of another dtype is not)."""
    return [v for v in model.weights if "float" in str(v.dtype)]


def _fingerprint(model) -> int:
    """A hash of the float weights' bytes: what changes when a callback sets the weights."""
    import hashlib

    digest = hashlib.blake2b(digest_size=8)
    for v in _floats(model):
        digest.update(np.ascontiguousarray(v.numpy()).tobytes())
    return int.from_bytes(digest.digest(), "little")


class StepCheckpoints(keras.callbacks.Callback):
    """--checkpoint-every-steps: a checkpoint every N steps inside an epoch (its end has Checkpoints' own), so that
    a restart or a resize re-does at most N steps. It holds where the epoch is (``step``: the steps done in it) and
    the epoch's metric states so far summed over the workers (app.training.keras_sync.step_state), from which a run
    that goes on there ends the epoch with the logs of an unbroken one. Before Checkpoints, after Decisions."""

    STATE_KEYS = ("step", "metric_states")

    def __init__(self, every: int, steps: Callable[[int], int], save: Callable[[], None], state: dict[str, Any],
                 collective: Collective, skip: int = 0):
        """``steps(epoch)``: the epoch's steps on this worker count; ``save()``: checkpoint and report ``state``
        (every worker: a report is a barrier); ``skip``: the steps of the first epoch done before this fit."""
        super().__init__()
        self.every, self.steps, self.save, self.state, self.collective = every, steps, save, state, collective
        self.skip, self.epoch_steps = skip, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_steps = self.steps(epoch)  # once an epoch: it cuts the epoch's seeded order of every row

    def on_train_batch_end(self, batch, logs=None):
        from app.training.keras_sync import step_state

        done = self.skip + batch + 1  # ``batch``: the last step an execution ran (steps_per_execution runs several)
        before = self.state.get("step", self.skip)
        if done // self.every > before // self.every and done < self.epoch_steps:
            self.state["step"], self.state["metric_states"] = done, step_state(self.model, self.collective)
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.skip = 0


class StepScalars(keras.callbacks.Callback):
    """TensorBoard's ``step/<name>`` every N steps (--log-every-steps): the epoch's loss and metrics so far, summed
    over every worker (app.training.keras_sync.epoch_logs: one small all-reduce a point, which every worker joins at
    the same step), and the learning rate; rank 0 writes them (``board``, None on the others). The step counts
    batches on from the first optimizer's step count when the fit starts (a resumed run's included)."""

    def __init__(self, every: int, collective: Collective, board: Optional["Board"]):
        super().__init__()
        self.every, self.collective, self.board = every, collective, board
        self.start = self.done = 0

    def on_train_begin(self, logs=None):
        from app.training.keras_sync import optimizers_of

        optimizers = optimizers_of(self.model)
        self.done = int(optimizers[0].iterations.numpy()) if optimizers else self.done

    def on_epoch_begin(self, epoch, logs=None):
        self.start = self.done

    def on_train_batch_end(self, batch, logs=None):
        from app.training.keras_sync import epoch_logs

        before, self.done = self.done, self.start + batch + 1  # ``batch``: an execution's last step
        if self.done // self.every == before // self.every:
            return
        summed = epoch_logs(self.model, dict(logs or {}), self.collective)
        scalars = as_metrics({k: float(v) for k, v in summed.items() if np.ndim(v) == 0})
        if self.board is not None:
            self.board.board.step(self.done, with_learning_rate(self.model, scalars))


def why_stopped(callback, hook: str) -> str:
    """Why a callback stopped the run, in a line: EarlyStopping says what did not improve."""
    name = type(callback).__name__
    if isinstance(callback, keras.callbacks.EarlyStopping):
        wait = callback.wait
        return f"{name}: {callback.monitor} did not improve for {wait} epoch{'s' if wait != 1 else ''} " \
               f"(patience {callback.patience})"
    return f"{name} set model.stop_training in {hook}"


# What an epoch record holds besides Keras's epoch logs.
RECORD_KEYS = ("epoch", "seconds", "workers", "attempt", "samples_per_second", "first_step_time")


def as_metrics(record: dict[str, Any]) -> dict[str, float]:
    """An epoch record's logs under the names every run's result.json and TensorBoard give them: ``loss`` ->
    ``train_loss``, ``val_loss`` as it is (the learning rate a callback logged stays ``learning_rate``)."""
    return {k if k.startswith("val_") or k == "learning_rate" else f"train_{k}": v for k, v in record.items()
            if k not in RECORD_KEYS}


class Board(keras.callbacks.Callback):
    """Rank 0's TensorBoard scalars, once per epoch (app.training.tensorboard: ``epoch/<name>``, the numbers of
    history.csv, exact over every worker), the learning rate and the speed with them. After Checkpoints, whose
    record it writes."""

    def __init__(self, logdir: str, state: dict[str, Any]):
        super().__init__()
        from app.training.tensorboard import TensorBoard

        self.board, self.state = TensorBoard(logdir), state

    def on_epoch_end(self, epoch, logs=None):
        record = self.state["history"][-1]
        scalars = with_learning_rate(self.model, {**as_metrics(record), "workers": record["workers"]})
        if "samples_per_second" in record:
            scalars["samples_per_second"] = record["samples_per_second"]
        scalars.update(step_times(self.state))
        self.board.epoch(record["epoch"], scalars)

    def close(self) -> None:
        """After the run's fits (a run that goes on inside an epoch fits that epoch's rest first)."""
        self.board.close()


def step_times(state: dict[str, Any]) -> dict[str, float]:
    """The epoch's milliseconds a step in each part (input, compute, sync, hooks: app.training.step_clock), every
    worker's mean, as TensorBoard's ``epoch/time_<part>_ms``; none before the epoch's split is gathered."""
    from app.training.step_clock import SHARES, split

    epochs = state.get("time", {}).get("epochs")
    seconds = split(epochs[-1]["workers"]) if epochs else {}
    if not seconds.get("steps"):
        return {}
    return {f"time_{k}_ms": 1000 * seconds[k] / seconds["steps"] for k in SHARES}


def with_learning_rate(model, scalars: dict[str, float]) -> dict[str, float]:
    """``scalars`` with the model's optimizer's rate at this step, unless a callback logged one."""
    optimizer = getattr(model, "optimizer", None)
    if "learning_rate" not in scalars and optimizer is not None:
        scalars["learning_rate"] = float(np.asarray(optimizer.learning_rate))
    return scalars


def epoch_line(record: dict[str, Any], epochs: int) -> str:
    """One console line per epoch: its logs as Keras names them (app.training.metrics.epoch_line)."""
    return metrics.epoch_line(record["epoch"], epochs, {k: v for k, v in record.items() if k not in RECORD_KEYS},
                              record["seconds"])
