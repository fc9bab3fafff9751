"""The product's own loop's per-worker function, ``train_worker``: the run Keras's fit does not train (parameter
servers: Keras 3's fit has no ParameterServerStrategy) runs it on the chief.

The chief's ``Session`` (app.training.parameter_server) says which strategy, where the input comes from, where
checkpoints go (a local ``tf.train.CheckpointManager``) and how an epoch is reported; its coordinator schedules
the steps on the remote workers, which the epoch driver reaches through a step runner. Everything else (model,
optimizer, LR plan, the epoch loop, metrics, TensorBoard) is here, once, and reads top to bottom.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from app.data.arrays import DataFacts
from app.data.plan import EpochPlan
from app.training import callbacks, checkpoint
from app.training.measures import Measures
from app.training.objective import Objective

if TYPE_CHECKING:
    import tensorflow as tf

    from app.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerJob:
    """What the driver decided once and every worker is handed with the config."""

    facts: DataFacts
    objective: Objective
    tensorboard_dir: Optional[str]
    progress_bars: bool = False  # the console is a terminal: a bar inside long epochs


class Session(Protocol):
    """What a backend provides to ``train_worker``."""

    world: int  # workers that each take a slice of every epoch's rows (parameter servers' workers; else 1)
    # ParameterServerStrategy's ClusterCoordinator: steps are scheduled on remote workers, asynchronously.
    # None: synchronous replicas (strategy.run, gradients all-reduced).
    coordinator: Optional[Any]

    def strategy(self) -> "tf.distribute.Strategy":
        """The strategy; created before any other TensorFlow op of this process."""

    def restore(self, model, optimizer) -> Optional[dict[str, Any]]:
        """Load the last checkpoint into model and optimizer; its state.json, or None on a fresh start."""

    def inputs(self, strategy, plan: EpochPlan, start_epoch: int, start_step: int = 0) -> tuple[Any, Any]:
        """(an endless distributed train iterator from step ``start_step`` of the epoch after ``start_epoch`` on,
        the distributed val dataset)."""

    def placement(self, strategy) -> list[str]:
        """Where each worker runs (recorded in result.json), or []."""

    def save_and_report(self, metrics: dict[str, Any], state: dict[str, Any], write: Callable[[str], None]) -> None:
        """Checkpoint the epoch (``state``; ``write(directory)`` writes a whole one) and report its metrics."""

    def progress_bar(self, total: int, desc: str) -> Any:
        """A tqdm-like bar that reaches the person at the console."""

    def alive(self) -> None:
        """Training moved on (steps ran, an evaluation ended): a sign of life for a driver that watches for stalls."""


@dataclass
class Training:
    """What one worker trains, built by ``build_training``."""

    model: Any
    optimizer: Any
    measures: Measures
    lr_plan: Any  # app.training.optim.LrPlan
    lr_factor: Any  # --callbacks: the factor a callback's LR change scales the planned schedule by


def build_training(config: "TrainConfig", job: WorkerJob, strategy, plan: EpochPlan) -> Training:
    """Model, optimizer and LR plan under ``strategy``, as the driver's objective (``job.objective``) says."""
    from app.training.model import build_model
    from app.training.optim import make_optimizer, plan_lr

    lr_plan = plan_lr(config, plan.update_batch, plan.updates, job.objective)
    with strategy.scope():
        # A compiled model brings its optimizer: a new one of its class and settings, the planned LR.
        model = build_model(config, job.facts)
        # --callbacks: an LR a callback sets scales the planned schedule by a factor (app.training.callbacks).
        lr_factor = callbacks.lr_factor() if config.callbacks else None
        optimizer = make_optimizer(config, lr_plan, compiled=model.optimizer if job.objective.compiled_optimizer
                                   else None)
    # Its loss and metrics, as this worker's own call of the model function compiled them.
    measures = Measures(job.objective, model)
    return Training(model, optimizer, measures, lr_plan, lr_factor)


def train_worker(config: "TrainConfig", job: WorkerJob, session: Session) -> None:
    from app.training.loop import EpochBar, EpochDriver
    from app.training.metrics import epoch_line, keras_logs
    from app.training.tensorboard import TensorBoard

    strategy = session.strategy()
    config = config.at_size(strategy.num_replicas_in_sync)  # --global-batch: this size's equal part of it
    # Each worker is one replica that applies its own batches, so an epoch is workers x steps updates of one
    # worker's batch, and the LR follows the coordinator's count of them (app.training.optim.make_optimizer).
    plan = EpochPlan.for_run(config, job.facts.num_train_rows, session.world, 1, asynchronous=True)
    training = build_training(config, job, strategy, plan)
    model, optimizer = training.model, training.optimizer

    # A restarted chief or a resumed run starts from the last checkpoint.
    progress, state, lr_plan = restore(config, session, strategy, training, plan)

    # A checkpoint inside an epoch (--checkpoint-every-steps) goes on from its exact step of that epoch's order.
    train_iter, val = session.inputs(strategy, plan, progress.epoch, progress.step)
    driver = EpochDriver(
        step_runner(config, session, strategy, training, plan, lr_plan, progress.history),
        training.measures,
        log_every_steps=config.log_every_steps if config.tensorboard or config.callbacks else 0,
    )
    tensorboard = TensorBoard(job.tensorboard_dir)
    make_bar = session.progress_bar if job.progress_bars else None
    hooks = callbacks.hooks_for(config, model, optimizer, training.lr_factor, driver.runner,
                                lambda: driver.global_step or driver.runner.steps_taken(), plan.updates, state)
    last_epoch = progress.epoch if hooks.stopped else config.epochs  # a run a callback stopped stays stopped

    def save(metrics: dict[str, Any]) -> None:
        state = progress.state(config=config, lr_plan=lr_plan, plan=plan, task=job.objective.task)
        state["objective"] = job.objective.summary(config)
        state.update(hooks.state())
        session.save_and_report(metrics, state, lambda d, s=state: checkpoint.save(d, model, optimizer, s))

    def after_steps(k: int, bar) -> None:
        bar.update(k)
        session.alive()
        progress.step += k  # a resumed Ray Train checkpoint inside an epoch goes on from its step

    try:
        hooks.train_begin()
        for epoch in range(progress.epoch + 1, last_epoch + 1):
            hooks.epoch_begin(epoch)
            bar = EpochBar(make_bar, plan.updates, f"epoch {epoch}/{config.epochs}")
            try:
                metrics, _ = driver.run_epoch(epoch, train_iter, plan.updates - progress.step, val, plan.dropped,
                                              tensorboard.step, lambda k, bar=bar: after_steps(k, bar),
                                              hooks.on_batch)
            finally:
                bar.close()
            session.alive()
            metrics["workers"] = session.world
            progress.record(metrics)
            tensorboard.epoch(epoch, metrics)
            log.info(epoch_line(epoch, config.epochs, keras_logs(metrics), metrics["epoch_seconds"]))
            stop = hooks.epoch_end(epoch, metrics)
            save(metrics)
            if stop:
                break
        hooks.train_end()
    finally:
        tensorboard.close()


def restore(config: "TrainConfig", session: Session, strategy, training: Training, plan: EpochPlan
            ) -> tuple[checkpoint.Progress, Optional[dict[str, Any]], Any]:
    """The last checkpoint, if any, restored into the training: weights, optimizer (hence the LR schedule's
    position), epoch counter and history. Returns the progress, the checkpoint's state and the LR plan."""
    from app.training import lr_position

    progress = checkpoint.Progress(worker_nodes=session.placement(strategy))
    lr_plan = training.lr_plan
    state = session.restore(training.model, training.optimizer)
    if state is None:
        progress.sized(session.world)
        return progress, None, lr_plan
    progress = checkpoint.Progress.resumed_from(state, progress)
    resized = progress.sized(session.world, state.get("worker_nodes"))
    # Another worker count since the checkpoint: the schedule re-planned for this one goes on from the
    # restored epoch's boundary (app.training.lr_position); the optimizer's own state is as restored. The steps
    # are the coordinator's count (Keras's own races under asynchronous workers).
    steps_done = progress.history[-1]["optimizer_steps"] if progress.history else 0
    lr_plan = lr_position.continued(lr_plan, state, progress.epoch, steps_done, plan.updates)
    # One line: the resize (if any) and where training goes on.
    log.info("%sresumed at %s from its checkpoint (attempt %d, %d optimizer steps taken%s)",
             f"{resized}; " if resized else "", progress.position(), progress.attempt, steps_done,
             f"; LR schedule read {lr_plan.step_offset:+d} steps from there" if lr_plan.step_offset else "")
    return progress, state, lr_plan


def step_runner(config: "TrainConfig", session: Session, strategy, training: Training, plan: EpochPlan, lr_plan,
                history: list[dict[str, Any]]):
    """How the epoch driver runs steps: scheduled by the parameter servers' coordinator. ``lr_plan``: the
    training's, or where a resumed run's schedule goes on from (app.training.lr_position)."""
    from app.training import lr_position
    from app.training.parameter_server import ScheduledSteps

    # Keras's own step count is racy under asynchronous workers: the count goes on from the checkpoint's.
    done = history[-1]["optimizer_steps"] if history else 0
    return ScheduledSteps(session.coordinator, strategy, training.model, training.optimizer, training.measures,
                          plan, lr_position.schedule(config, lr_plan, training.lr_factor), steps_taken=done)
