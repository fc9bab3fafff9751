"""Global batch and learning-rate scaling (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

When data-parallel training grows the global batch by k, the LR is scaled by k
(linear rule) or sqrt(k) (sqrt rule, common for Adam), and a linear warmup
from the unscaled LR avoids the early instability of a large LR.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import keras

    from app.config import TrainConfig


@dataclass(frozen=True)
class LrPlan:
    rule: str
    base_lr: Optional[float]  # None: the compiled optimizer's own schedule (decay "as compiled")
    reference_batch: int
    global_batch: int
    peak_lr: Optional[float]  # the LR after warmup: base_lr x factor(global / reference)
    warmup_steps: int
    total_steps: int
    # The schedule is read at optimizer step + step_offset (app.training.lr_position.schedule). Not 0 only
    # after a resume with another number of updates per epoch: the re-planned schedule then goes on from the
    # restored epoch's boundary.
    step_offset: int = 0
    # After the warmup: cosine or constant (--lr-decay), or "as compiled": a compiled optimizer trained at its own
    # LR or schedule, as model.fit trains it (no rule, no warmup: app.training.objective.LR_FLAGS).
    decay: str = "cosine"

    @property
    def as_compiled(self) -> bool:
        return self.decay == AS_COMPILED

    def as_dict(self) -> dict:
        return asdict(self)


def scaled_lr(base_lr: float, rule: str, global_batch: int, reference_batch: int) -> float:
    k = global_batch / reference_batch
    factor = {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[rule]
    return base_lr * factor


AS_COMPILED = "as compiled"


def plan_lr(config: "TrainConfig", global_batch: int, steps_per_epoch: int, objective: Any = None) -> LrPlan:
    """The run's LR plan. ``objective`` (app.training.objective): a compiled optimizer's LR (where the scaling rule
    starts), or its LR as compiled (no rule, warmup or decay: what model.fit does); None: --base-lr and the rule."""
    total = config.epochs * steps_per_epoch
    if objective is not None and objective.lr_as_compiled:
        return LrPlan("none", objective.base_lr, global_batch, global_batch, objective.base_lr, 0, total,
                      decay=AS_COMPILED)
    base = config.base_lr if objective is None or objective.base_lr is None else objective.base_lr
    return LrPlan(
        rule=config.lr_scaling,
        base_lr=base,
        reference_batch=config.reference_batch,
        global_batch=global_batch,
        peak_lr=scaled_lr(base, config.lr_scaling, global_batch, config.reference_batch),
        warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)),
        total_steps=total,
        decay=config.lr_decay,
    )


def lr_schedule(config: "TrainConfig", plan: LrPlan, factor: Any = None
                ) -> "keras.optimizers.schedules.LearningRateSchedule":
    """Keras' CosineDecay does warmup + decay; alpha=1 turns the decay into a constant.

    ``factor``: a variable the schedule's LR is multiplied by (what a Keras callback set the LR to, relative to the
    schedule at that step: app.training.callbacks); the same on every replica.
    """
    import keras

    alpha = 0.0 if plan.decay == "cosine" else 1.0  # constant, and a compiled number kept as it is
    decay_steps = max(plan.total_steps - plan.warmup_steps, 1)
    if plan.warmup_steps == 0:
        schedule = keras.optimizers.schedules.CosineDecay(plan.peak_lr, decay_steps, alpha=alpha)
    else:
        # Goyal et al. ramp up from the unscaled LR (never from above the target).
        start = min(plan.base_lr, plan.peak_lr)
        schedule = keras.optimizers.schedules.CosineDecay(
            start, decay_steps, alpha=alpha, warmup_target=plan.peak_lr, warmup_steps=plan.warmup_steps
        )
    return schedule if factor is None else _scaled_class()(schedule, factor)


@functools.cache
def _scaled_class():  # defined on first use: importing this module does not import Keras
    import keras

    class Scaled(keras.optimizers.schedules.LearningRateSchedule):
        """The planned schedule times a factor variable."""

        def __init__(self, schedule, factor):
            self.schedule, self.factor = schedule, factor

        def __call__(self, step):
            import tensorflow as tf

            lr = self.schedule(step)
            return lr * tf.cast(self.factor, lr.dtype)

        def get_config(self):
            return {"schedule": self.schedule.get_config(), "factor": float(self.factor.numpy())}

    return Scaled


def make_optimizer(config: "TrainConfig", plan: LrPlan, compiled: Any = None) -> "keras.optimizers.Optimizer":
    """The parameter servers' optimizer, its LR a plain variable at ``plan``'s first rate, which each scheduled step
    sets from its own number (asynchronous workers lose increments of ``iterations``, a read-then-write, so a
    schedule cannot follow it; parameter servers refuse a compiled schedule, fp16 and --grad-accum).
    ``compiled``: the optimizer the model was compiled with: a new one of its class and settings (betas, epsilon,
    clipping, weight decay, ...), created here under the strategy's scope, with the planned LR."""
    import keras

    rate = float(lr_schedule(config, plan)(0))
    if compiled is not None:
        inner = getattr(compiled, "inner_optimizer", compiled)  # a LossScaleOptimizer's own
        return type(inner).from_config({**inner.get_config(), "learning_rate": rate})
    if config.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate=rate)
    return keras.optimizers.SGD(learning_rate=rate, momentum=config.momentum)
