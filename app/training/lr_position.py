"""Where a resumed run's learning-rate schedule goes on from.

The schedule is a function of the optimizer's step count (``optimizer.iterations``), planned for
``epochs x updates per epoch`` steps. A run resumed on the same number of updates per epoch (the same
workers, or more ``--epochs``) reads the schedule at the restored count, as if it had never stopped (the
schedule itself is re-planned for the new ``--epochs``, as Keras's ``initial_epoch`` would).

A run resumed with another number of updates per epoch (another worker count, hence another global batch
and LR) keeps its optimizer state, step count included (Adam's moments and bias correction go on), and gets
the schedule planned for the new count, read from the restored epoch's boundary: epoch e ends at step
``e x updates`` of the new plan, so the schedule is read at ``iterations + step_offset`` with
``step_offset = e x updates - iterations``. The offset is recorded in the checkpoint's LR plan, so a worker
group restarted later in that run (a lost worker) reads the schedule where it was.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from app.training.optim import LrPlan, lr_schedule

if TYPE_CHECKING:
    from app.config import TrainConfig


def continued(plan: LrPlan, restored: dict[str, Any], epoch: int, steps_done: int, updates: int) -> LrPlan:
    """``plan`` (this attempt's) positioned after a restore: ``restored`` is the checkpoint's state.json,
    ``epoch`` its epoch, ``steps_done`` the optimizer steps it took, ``updates`` the updates per epoch now."""
    if plan.base_lr is None:  # a compiled schedule reads the optimizer's own step count, restored: as in Keras
        return plan
    before = restored.get("lr_plan") or {}
    epochs_before = (restored.get("config") or {}).get("epochs") or 0
    updates_before = before.get("total_steps", 0) // epochs_before if epochs_before else None
    if updates_before == updates:  # the same steps per epoch: where the schedule was
        return replace(plan, step_offset=int(before.get("step_offset", 0)))
    return replace(plan, step_offset=epoch * updates - steps_done)


def schedule(config: "TrainConfig", plan: LrPlan, factor=None):
    """``plan``'s schedule (app.training.optim.lr_schedule, times a callback's ``factor``), read
    ``plan.step_offset`` steps ahead of the optimizer's step count."""
    planned = lr_schedule(config, plan, factor)
    return _shifted_class()(planned, plan.step_offset) if plan.step_offset else planned


@functools.cache
def _shifted_class():
    # Keras is imported here, not with the module: a Ray worker imports TensorFlow on a thread of its own
    # while train_worker's imports run, and a second import of it meanwhile sees half a module.
    import keras

    @keras.saving.register_keras_serializable(package="app")
    class Shifted(keras.optimizers.schedules.LearningRateSchedule):
        def __init__(self, schedule, offset: int):
            self.schedule, self.offset = schedule, int(offset)

        def __call__(self, step):
            return self.schedule(step + self.offset)

        def get_config(self) -> dict[str, Any]:
            return {"schedule": keras.saving.serialize_keras_object(self.schedule), "offset": self.offset}

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            return cls(keras.saving.deserialize_keras_object(config["schedule"]), config["offset"])

    return Shifted
