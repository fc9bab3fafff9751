"""The product's own training in one plain process, no Ray Train: what the checkpoint suite times.

Nothing here is a copy: the driver's model check and objective (app.driver.preflight.check_model), the
worker's model, optimizer and LR plan (app.training.worker.build_training), its step runner
(app.training.worker.replica_steps) and the epoch driver (app.training.loop.EpochDriver). What is left out is
what a run adds between epochs: evaluation, checkpoints, reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.data.plan import EpochPlan

if TYPE_CHECKING:
    from app.config import TrainConfig
    from app.training.worker import Training


@dataclass
class Timed:
    training: "Training"
    driver: Any  # app.training.loop.EpochDriver

    def epoch(self, iterator, plan: EpochPlan, epoch: int = 0):
        """One epoch of ``plan.steps`` steps; its EpochStats (samples, seconds, ...)."""
        return self.driver.train_epoch(iterator, plan.steps, epoch)


def build_training(config: "TrainConfig", strategy, source, plan: EpochPlan) -> Timed:
    """``source``: the in-memory data (app.data.memory.load_source)."""
    from app.driver import preflight
    from app.training.loop import EpochDriver
    from app.training.worker import WorkerJob, build_training, replica_steps

    facts, objective, _ = preflight.check_model(config, source.facts, examples=preflight.examples(source))
    training = build_training(config, WorkerJob(facts, objective, None), strategy, plan)
    steps = replica_steps(config, strategy, training, plan)
    return Timed(training, EpochDriver(steps, training.measures))


def distributed(strategy, batches):
    """An endless iterator of per-replica batches, as a session's ``inputs`` gives the worker."""
    return iter(strategy.distribute_datasets_from_function(lambda _: batches))
