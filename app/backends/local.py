"""The local backend of the product's own step: the model cut into pipeline stages, in this process, no Ray.

app.run.config_run sends every other local run to Keras's fit (app.backends.keras_fit), and refuses to resume a
run of the own step under another strategy. The input is tf.data from the same arrays with the same rules as the
Ray path. Ray is never imported here.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from app.backend import backend_of
from app.config import TrainConfig
from app.driver import outputs
from app.errors import NonFiniteLoss, RunFailed, UserError
from app.training import checkpoint
from app.training import strategy as strategy_lib
from app.training.worker import WorkerJob, train_worker
from app.ui import console

log = logging.getLogger(__name__)

CHECKPOINT_DIR = checkpoint.LOCAL_DIR


class LocalSession:
    """One process, every local device: a tf.distribute strategy and tf.train.CheckpointManager checkpoints."""

    world = 1
    coordinator = None  # synchronous replicas of one process: its strategy all-reduces them

    def __init__(self, config: TrainConfig, strategy, source, start_from: Optional[str] = None):
        # start_from: a Ray Train checkpoint a resumed run goes on from (newer than any of its own)
        self.config, self._strategy, self.source, self.start_from = config, strategy, source, start_from
        self.checkpoints: Optional[checkpoint.LocalCheckpoints] = None

    def strategy(self):
        return self._strategy

    def progress_bar(self, total: int, desc: str):
        return tqdm_bar(total, desc)

    def restore(self, model, optimizer) -> Optional[dict[str, Any]]:
        config = self.config
        self.checkpoints = checkpoint.LocalCheckpoints(
            config.output_dir() / CHECKPOINT_DIR, model, optimizer, keep=config.keep_checkpoints
        )
        if self.start_from:
            state = checkpoint.restore_from(self.start_from, model, optimizer)
        else:
            state = self.checkpoints.restore() if config.resume else None
        if state is not None:
            log.info("resumed from %s (epoch %d)", self.start_from or self.checkpoints.latest, state["epoch"])
        return state

    def inputs(self, strategy, plan, start_epoch: int, start_step: int = 0):
        from app.data import tf_input

        config, source = self.config, self.source
        # start_step: a Ray Train checkpoint inside an epoch (--checkpoint-every-steps) that this run resumes.
        train = strategy.distribute_datasets_from_function(
            lambda _: tf_input.train_batches_from_arrays(
                source.train, plan, config.seed, config.shuffle, start_epoch, config.epochs, start_step=start_step
            )
        )
        val_batches = tf_input.eval_batches_from_arrays(
            source.val, config.per_replica_batch, strategy.num_replicas_in_sync
        )
        return iter(train), strategy.distribute_datasets_from_function(lambda _: val_batches)

    def placement(self, strategy) -> list[str]:
        return []

    def save_and_report(self, metrics, state, write: Callable[[str], None]) -> None:
        self.checkpoints.save(state)

    def alive(self) -> None:
        """Nobody watches a local run for stalls."""


def tqdm_bar(total: int, desc: str):
    """An epoch's bar in this process's terminal (gone once the epoch's line is printed)."""
    import tqdm

    return tqdm.tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def run(config: TrainConfig, started_at: float | None = None) -> dict[str, Any]:
    """Train with a local strategy and write the same outputs as the Ray path."""
    from app.training.tensorboard import logdir_for

    started_at = started_at or time.time()
    strategy, name, reason, checked, lines = plan(config)
    for line in lines:
        log.info(line)
    out = outputs.prepare_output_dir(config)
    log.info("output: %s (TensorFlow's own lines: %s)", out, out / console.LOG_FILE)
    pipeline = checked.model.get("pipeline")  # --strategy pipeline: the StagePlan
    job = WorkerJob(checked.facts, checked.objective, logdir_for(config, out.name), progress_bars=console.bars(),
                    stages=pipeline)
    start = checked.resumed
    session = LocalSession(config, strategy, checked.source, start.path if start and start.ray_train else None)
    try:
        with console.routed(out / console.LOG_FILE, config.show_logs, plan=lines):
            train_worker(config, job, session)
    except NonFiniteLoss as e:
        raise RunFailed(str(e)) from None
    latest = session.checkpoints.latest if session.checkpoints else None
    if latest is None:
        raise UserError(f"no checkpoint in {out / CHECKPOINT_DIR} to export")
    summary = outputs.write_outputs(
        config, session.checkpoints.restore_state(), latest + checkpoint.MODEL_SUFFIX,
        strategy=name, started_at=started_at,
        extra={"strategy_reason": reason, **({"stages": list(pipeline.stages)} if pipeline else {})},
    )
    return summary


def dry_run_lines(config: TrainConfig) -> list[str]:
    """--dry-run's plan (app.run.api.driver)."""
    return plan(config)[-1]


def plan(config: TrainConfig):
    """(strategy, its name, why, the checks, the plan lines): what a run logs first and --dry-run prints."""
    from app.driver import preflight

    strategy, reason = make_strategy(config)
    replicas = strategy.num_replicas_in_sync
    devices = strategy_lib.stage_devices() if backend_of(config).pipeline else []
    checked = preflight.check(config, 1, replicas, stage_devices=devices)
    name = "pipeline" if devices else strategy_lib.name_of(strategy)
    return strategy, name, reason, checked, preflight.plan_lines(config, checked, 1, replicas, f"{name} ({reason})")


def make_strategy(config: TrainConfig):
    """The local strategy and why (devices are configured before TensorFlow initialises them: first)."""
    try:
        strategy, reason = strategy_lib.local_strategy(config.strategy, config.devices, config.cpus_per_worker)
    except strategy_lib.StrategyUnavailable as e:
        raise UserError(str(e)) from None
    return strategy, reason
