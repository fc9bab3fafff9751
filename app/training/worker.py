"""THE per-worker function: every backend (Ray Train workers, the local process) runs ``train_worker``.

What differs between backends hides behind a small ``Session``: which
strategy, where the input comes from, where checkpoints go and how an epoch
is reported (``ray.train.report`` with a checkpoint, or a local
``tf.train.CheckpointManager``). Everything else (model, optimizer, LR plan,
steps, metrics, TensorBoard) is here, once, and reads top to bottom.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import numpy as np

from app.data.arrays import DataFacts
from app.data.plan import EpochPlan
from app.training import checkpoint
from app.training.objective import Objective
from app.training.pipeline import StagePlan

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
    progress_bars: bool = False  # the console is a terminal: rank 0 shows a bar inside long epochs
    stages: Optional[StagePlan] = None  # --strategy pipeline: where the model is cut, each stage's device


class Session(Protocol):
    """What a backend provides to ``train_worker``."""

    rank: int
    world: int

    def strategy(self) -> "tf.distribute.Strategy":
        """The strategy; created before any other TensorFlow op of this process."""

    def restore(self, model, optimizer) -> Optional[dict[str, Any]]:
        """Load the last checkpoint into model and optimizer; its state.json, or None on a fresh start."""

    def inputs(self, strategy, plan: EpochPlan, start_epoch: int) -> tuple[Any, Any]:
        """(an endless distributed train iterator from ``start_epoch`` on, the distributed val dataset)."""

    def placement(self, strategy) -> list[str]:
        """Where each rank runs (recorded in result.json), or []."""

    def save_and_report(self, metrics: dict[str, Any], state: dict[str, Any], write: Callable[[str], None]) -> None:
        """Checkpoint the epoch (``state``; ``write(directory)`` writes a whole one) and report its metrics."""

    def progress_bar(self, total: int, desc: str) -> Any:
        """A tqdm-like bar that reaches the person at the console (only rank 0 asks for one)."""


def train_worker(config: "TrainConfig", job: WorkerJob, session: Session) -> None:
    from app.training.loop import EpochBar, EpochDriver
    from app.training.metrics import progress_line
    from app.training.model import build_model
    from app.training.optim import make_optimizer, plan_lr
    from app.training.pipeline import Pipeline
    from app.training.step import make_eval_step, make_replica_state_average, make_train_steps
    from app.training.tensorboard import TensorBoard

    strategy = session.strategy()
    plan = EpochPlan.for_run(
        config, job.facts.num_train_rows, session.world, strategy.num_replicas_in_sync // session.world
    )
    lr_plan = plan_lr(config, plan.global_batch, plan.steps)
    with strategy.scope():
        model = build_model(config, job.facts)
        optimizer = make_optimizer(config, lr_plan)
    # --strategy pipeline: the same model, its layers cut into stages, each stage's variables and computation
    # on its own device; `model` stays one ordinary model (checkpoints, export), `forward` runs the stages.
    pipe = Pipeline.place(model, job.stages, job.facts.feature_shape) if job.stages else None
    model, forward = (pipe.model, pipe) if pipe else (model, model)

    # A restarted worker group (a worker died) or a resumed run starts from the
    # last checkpoint: weights, optimizer (hence the LR schedule position),
    # epoch counter and history.
    progress = checkpoint.Progress(worker_nodes=session.placement(strategy))
    state = session.restore(model, optimizer)
    if state is not None:
        progress = checkpoint.Progress.resumed_from(state, progress)
        if session.rank == 0:
            log.info("resumed from the checkpoint of epoch %d (attempt %d)", progress.epoch, progress.attempt)

    train_iter, val_dataset = session.inputs(strategy, plan, progress.epoch)
    driver = EpochDriver(
        strategy, optimizer,
        make_train_steps(strategy, model, optimizer, job.objective, plan.global_batch, config.grad_accum,
                         config.audit_sample_ids,
                         pipe.train_step(optimizer, job.objective, plan.global_batch, config.pipeline_microbatches)
                         if pipe else None),
        make_eval_step(strategy, forward, job.objective),
        make_replica_state_average(strategy, model),
        metric=job.objective.metric,
        steps_per_execution=config.steps_per_execution,
        # Log points are collectives: every worker must agree on them.
        log_every_steps=config.log_every_steps if config.tensorboard else 0,
        audit_sample_ids=config.audit_sample_ids,
    )
    tensorboard = TensorBoard(job.tensorboard_dir if session.rank == 0 else None)
    make_bar = session.progress_bar if job.progress_bars and session.rank == 0 else None

    for epoch in range(progress.epoch + 1, config.epochs + 1):
        bar = EpochBar(make_bar, plan.steps, f"epoch {epoch}/{config.epochs}")
        try:
            metrics, train = driver.run_epoch(epoch, train_iter, plan.steps, val_dataset, plan.dropped,
                                              tensorboard.step, bar.update)
        finally:
            bar.close()
        metrics["worker_peak_rss_mib"] = largest_peak_rss(strategy, session.rank, session.world)
        progress.record(metrics, train.sample_ids)
        tensorboard.epoch(epoch, metrics)
        if session.rank == 0:
            log.info(progress_line(metrics, config.epochs, progress.history))
        state = progress.state(config=config, lr_plan=lr_plan, plan=plan, task=job.objective.task)
        session.save_and_report(metrics, state, lambda d, s=state: checkpoint.save(d, model, optimizer, s))
    tensorboard.close()


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def largest_peak_rss(strategy, rank: int, world: int) -> float:
    """The largest peak RSS (MiB) of any worker so far: what bounds a worker's memory (one tiny all-reduce)."""
    from app.training.metrics import cross_worker_sum

    mine = np.zeros(world)
    mine[rank] = peak_rss_mib()
    return float(cross_worker_sum(strategy, mine).max())
