"""The project's own training loop in one plain process, no Ray Train: what the breakdown and checkpoint suites time.

Model, optimizer, LR plan and compiled train step are built as
app.training.worker.train_worker builds them, and epochs run through the same
EpochDriver; there is no evaluation, checkpointing or reporting in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.data.arrays import DataFacts
from app.data.plan import EpochPlan

if TYPE_CHECKING:
    from app.config import TrainConfig


@dataclass
class Training:
    model: Any
    optimizer: Any
    lr_plan: Any
    driver: Any  # app.training.loop.EpochDriver

    def epoch(self, iterator, plan: EpochPlan, epoch: int = 0):
        """One epoch of ``plan.steps`` steps; its EpochStats (samples, seconds, ...)."""
        return self.driver.train_epoch(iterator, plan.steps, epoch)


def build_training(config: "TrainConfig", strategy, facts: DataFacts, plan: EpochPlan) -> Training:
    from app.training.loop import EpochDriver, ReplicaSteps
    from app.training.measures import Measures
    from app.training.model import build_model, check_output
    from app.training.objective import objective_for
    from app.training.optim import make_optimizer, plan_lr
    from app.training.step import make_train_steps

    with strategy.scope():
        model = build_model(config, facts)
    objective = objective_for(config, facts, model, check_output(model, facts, "model"))
    lr_plan = plan_lr(config, plan.global_batch, plan.steps, objective)
    with strategy.scope():
        optimizer = make_optimizer(config, lr_plan, compiled=model.optimizer if objective.compiled_optimizer else None)
    measures = Measures(objective, model)
    steps = make_train_steps(strategy, model, optimizer, measures, plan.global_batch, config.grad_accum)
    driver = EpochDriver(ReplicaSteps(strategy, optimizer, measures, steps,
                                      steps_per_execution=config.steps_per_execution), measures)
    return Training(model, optimizer, lr_plan, driver)


def distributed(strategy, batches):
    """An endless iterator of per-replica batches, as a session's ``inputs`` gives the worker."""
    return iter(strategy.distribute_datasets_from_function(lambda _: batches))
