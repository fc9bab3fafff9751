"""Keras callbacks on the product's own loop (the parameter servers' coordinator).

``--callbacks file.py:function`` (or ``app.train(callbacks=[...])``) gives a list of
``keras.callbacks.Callback``. The semantics are ``model.fit``'s on one machine:

- ``on_train_begin/end``, ``on_epoch_begin(epoch)`` and ``on_epoch_end(epoch, logs)`` (epochs 0-based, as in
  Keras) with the epoch's exact metrics under Keras's names (``loss``, ``<metric>``, ``val_loss``,
  ``val_<metric>``, ``learning_rate``); ``on_train_batch_end(batch, logs)`` every ``--log-every-steps`` steps,
  with the epoch's running loss and metrics so far.
- ``callback.model`` is the run's model. ``model.stop_training = True`` ends the run after the epoch it was set
  in (that epoch is checkpointed; result.json says who stopped it and why).
- The learning rate a callback sets (``model.optimizer.learning_rate = x``, ``.assign(x)``: ReduceLROnPlateau,
  LearningRateScheduler) becomes a factor the planned schedule is multiplied by from then on
  (``app.training.optim.lr_schedule``): x / (the schedule's LR at that step).
- A callback that raises ends the run with its error (the last checkpoint is kept).

What a callback sees as ``model.optimizer``, during its hooks only, is an ordinary Keras optimizer of the
run's optimizer's class whose ``learning_rate`` variable holds the LR in effect and whose ``iterations`` the
steps taken: the training optimizer's LR is a schedule, which Keras does not let anyone set.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from app import registry
from app.errors import UserCodeError, UserError
from app.training.objective import metric_mode, metric_names_in

if TYPE_CHECKING:
    import keras

    from app.config import TrainConfig
    from app.training.objective import Objective

log = logging.getLogger(__name__)

# Hooks the product never calls (validation and prediction are its own, and only batch ends are called):
# a callback of yours that overrides one is refused, since it would silently not run.
NEVER_CALLED = ("on_train_batch_begin", "on_batch_begin", "on_test_begin", "on_test_end", "on_test_batch_begin",
                "on_test_batch_end", "on_predict_begin", "on_predict_end", "on_predict_batch_begin",
                "on_predict_batch_end")
REFUSED = {
    "History": "the run keeps its history itself (history.csv, result.json)",
    "ProgbarLogger": "the run prints its own progress",
    "BackupAndRestore": "the run checkpoints every epoch itself: --resume continues it, --max-failures restarts it",
    "SwapEMAWeights": "it swaps the weights around an evaluation, which the run does on every worker itself",
}


def load(config: "TrainConfig") -> list["keras.callbacks.Callback"]:
    """The run's callbacks: --callbacks's function called (with ``output_dir`` if it declares it), or the list."""
    import keras

    spec = config.callbacks
    if spec is None:
        return []
    if isinstance(spec, str) and spec.startswith("__main__:["):  # a list given from Python, in a config file
        raise UserError(registry.recorded_callbacks(spec))
    if isinstance(spec, list):
        value, what = spec, "callbacks"
    else:
        what = spec if isinstance(spec, str) else registry.describe(spec)
        value = registry.call_with_declared(registry.resolve(spec, {}), {"output_dir": str(config.output_dir())},
                                            what)
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{what} returned {type(value).__name__} instead of a list of keras.callbacks.Callback")
    for c in value:
        if not isinstance(c, keras.callbacks.Callback):
            raise UserError(f"{what} holds {str(c)[:60]!r} of type {type(c).__name__}, not a "
                            "keras.callbacks.Callback")
    return list(value)


def check(config: "TrainConfig", objective: "Objective") -> list[str]:
    """Load the callbacks in the driver and refuse, one line each, what the run cannot honour; their names."""
    callbacks = load(config)
    names = [n for m in objective.metric_names for n in (m, f"val_{m}")]
    keys = ["loss", "val_loss", *names, "learning_rate"]
    for c in callbacks:
        name = type(c).__name__
        if name in REFUSED and type(c).__module__.startswith("keras."):
            raise UserError(f"callback {name} is not supported: {REFUSED[name]}")
        if getattr(c, "restore_best_weights", False):
            raise UserError(f"callback {name}(restore_best_weights=True) is not supported on the product's own "
                            "loop: the run keeps its best checkpoints instead (--keep-checkpoints)")
        hook = next((h for h in NEVER_CALLED if h in vars(c) or _overrides(type(c), h)), None)
        if hook is not None:
            raise UserError(f"callback {name} defines {hook}, which this product never calls (it calls on_train_begin/"
                            "end, on_epoch_begin/end, and on_train_batch_end every --log-every-steps steps)")
        monitor = getattr(c, "monitor", None)
        if isinstance(monitor, str) and monitor not in keys:
            raise UserError(f"callback {name} monitors {monitor!r}, which the epoch logs do not have (they have "
                            f"{', '.join(keys)})")
        if isinstance(monitor, str) and getattr(c, "mode", None) == "auto" and metric_mode(monitor) is None:
            raise UserError(f"callback {name} monitors {monitor!r}, and its name does not say whether higher or lower "
                            f"is better: give {name}(mode='max') or mode='min'")
    return [type(c).__name__ for c in callbacks]


def _overrides(cls: type, hook: str) -> bool:
    """``cls`` defines ``hook`` in a class of its own (Keras's own callbacks may: they do without it)."""
    import keras

    owner = next(k for k in cls.__mro__ if hook in vars(k))
    return owner is not keras.callbacks.Callback and not owner.__module__.startswith("keras.")


def keras_logs(record: dict[str, Any]) -> dict[str, float]:
    """An epoch record (``train_<name>``, ``val_<name>``) -> Keras's logs: loss, <metric>, val_loss, val_<metric>."""
    names = [n for n in metric_names_in(record) if f"train_{n}" in record] or ["loss"]
    logs = {n: float(record[f"train_{n}"]) for n in names}
    logs.update({f"val_{n}": float(record[f"val_{n}"]) for n in names if f"val_{n}" in record})
    logs["learning_rate"] = float(record["learning_rate"])
    return logs


def lr_factor():
    """The variable the planned LR is multiplied by (1 until a callback sets the LR); create it in the scope."""
    import tensorflow as tf

    return tf.Variable(1.0, trainable=False, dtype=tf.float64, name="callback_lr_factor")


class NoHooks:
    """A run without callbacks: nothing is called, nothing is all-reduced."""

    on_batch = None
    stopped = None

    def train_begin(self) -> None: ...
    def epoch_begin(self, epoch: int) -> None: ...
    def epoch_end(self, epoch: int, record: dict[str, Any]) -> Optional[str]: ...
    def train_end(self) -> None: ...
    def state(self) -> dict[str, Any]:
        return {}


def hooks_for(config: "TrainConfig", model, optimizer, factor, runner, steps: Callable[[], int],
              steps_per_epoch: int, restored: Optional[dict[str, Any]]):
    """The run's hooks: ``runner`` (app.training.loop.StepRunner) reads the LR."""
    if config.callbacks is None:
        return NoHooks()
    return Hooks(load(config), model, optimizer, factor, runner, steps,
                 {"epochs": config.epochs, "steps": steps_per_epoch, "verbose": 0}, restored or {})


class Hooks:
    """The run's callbacks, and the decisions the loop takes from them (stop, the LR factor)."""

    def __init__(self, callbacks: list, model, optimizer, factor, runner, steps, params: dict,
                 restored: dict[str, Any]):
        self.callbacks, self.model, self.factor = callbacks, model, factor
        self.runner, self.steps = runner, steps
        # A restarted or resumed run keeps the LR factor (the callbacks themselves start afresh).
        self.lr_factor = float(restored.get("lr_factor", 1.0))
        factor.assign(self.lr_factor)
        self.stopped: Optional[dict[str, Any]] = restored.get("stopped_early")
        self.stop_reason: Optional[str] = None
        self.failure: Optional[UserCodeError] = None
        self.view = _view_optimizer(optimizer) if callbacks else None
        for c in callbacks:
            c.set_model(model)
            c.set_params(params)
            # mode="auto": Keras reads the direction from the compiled metrics that fit() builds, which this
            # loop does not; the run reads it from the metric's name, as it does for its own metric.
            if isinstance(getattr(c, "monitor", None), str) and getattr(c, "mode", None) == "auto":
                c.mode = metric_mode(c.monitor)

    def train_begin(self) -> None:
        self.model.stop_training = False
        self._call("on_train_begin")
        self._decide()

    def epoch_begin(self, epoch: int) -> None:
        self._call("on_epoch_begin", epoch - 1)
        self._decide()

    @property
    def on_batch(self) -> Callable[[int, dict[str, float]], None]:
        def batch_end(batch: int, scalars: dict[str, float]) -> None:
            # A stop or an error here is acted on at the epoch's end: the epoch's steps all run.
            self._call("on_train_batch_end", batch, {k.removeprefix("train_"): float(v) for k, v in scalars.items()})
            self._decide(final=False)

        return batch_end

    def epoch_end(self, epoch: int, record: dict[str, Any]) -> Optional[str]:
        """Call on_epoch_end; the reason the run stops now, or None."""
        self._call("on_epoch_end", epoch - 1, keras_logs(record))
        if not self._decide():
            return None
        reason = self.stop_reason or "a callback set model.stop_training"
        self.stopped = {"epoch": epoch, "reason": reason}
        log.info("stopped early after epoch %d: %s", epoch, reason)
        return reason

    def train_end(self) -> None:
        self._call("on_train_end")
        if self.failure is not None:
            raise self.failure

    def state(self) -> dict[str, Any]:
        """What the epoch's checkpoint carries for a restart and for result.json."""
        return {"lr_factor": self.lr_factor, **({"stopped_early": self.stopped} if self.stopped else {})}

    def _call(self, hook: str, *args) -> None:
        if not self.callbacks or self.failure is not None:
            return
        with self._optimizer_view():
            for c in self.callbacks:
                try:
                    getattr(c, hook)(*args)
                except Exception as e:
                    self.failure = UserCodeError(f"callback {type(c).__name__} raised {type(e).__name__} in {hook}: "
                                                 f"{e} (the last checkpoint is kept)", e)
                    return
                if getattr(self.model, "stop_training", False) and self.stop_reason is None:
                    from app.training.keras_callbacks import why_stopped

                    self.stop_reason = why_stopped(c, hook)

    @contextlib.contextmanager
    def _optimizer_view(self):
        """``model.optimizer`` as a callback sees it, for the hook; what it set the LR to becomes the factor."""
        now = self.runner.learning_rate(self.steps())
        self.view.learning_rate.assign(now)
        self.view.iterations.assign(self.steps())
        shown = float(self.view.learning_rate.numpy())
        had = "optimizer" in vars(self.model)
        compiled = getattr(self.model, "optimizer", None)
        self.model.optimizer = self.view
        try:
            yield
        finally:
            if had:
                self.model.optimizer = compiled
            else:
                del self.model.optimizer
        wanted = float(self.view.learning_rate.numpy())
        if wanted != shown and now > 0:
            self.lr_factor *= wanted / now

    def _decide(self, final: bool = True) -> bool:
        """The callbacks' decisions taken: the LR factor is set; True when the run stops now."""
        if self.lr_factor != float(self.factor.numpy()):
            self.factor.assign(self.lr_factor)
        if final and self.failure is not None:
            raise self.failure
        return self.stop_reason is not None


def _view_optimizer(optimizer):
    """An unbuilt optimizer of the run's optimizer's class and settings, with a plain (settable) LR variable."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    try:
        config = {**inner.get_config(), "learning_rate": 0.0}
        return type(inner).from_config(config)
    except Exception:  # an optimizer whose config does not round-trip: the LR and the step count are what matter
        return keras.optimizers.SGD(learning_rate=0.0)
