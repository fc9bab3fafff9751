"""The local backend: the same loop in one process, no Ray.

MirroredStrategy over GPUs (or logical CPUs), TPUStrategy, one device, or
CentralStorageStrategy; the input is tf.data from the same sources, with the
same rules as the Ray path (seeded reshuffle, equal whole batches, every
sample at most once per epoch). Ray is never imported here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from app import checkpoint, data, report
from app.config import TrainConfig
from app.errors import RunFailed, UserError

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"


def run(config: TrainConfig, started_at: float | None = None) -> dict[str, Any]:
    """Train with a local strategy and write the same outputs as the Ray path."""
    from app import models, monitor, scaling
    from app import strategy as strategy_lib
    from app.loop import Loop, NonFiniteLoss, progress_line

    started_at = started_at or time.time()
    source = data.load_source(config)
    # Devices are configured before TensorFlow initialises them: strategy first.
    try:
        strategy, reason = strategy_lib.local_strategy(config.strategy, config.devices, config.cpus_per_worker)
    except strategy_lib.StrategyUnavailable as e:
        raise UserError(str(e)) from None
    log.info("strategy: %s (%s)", type(strategy).__name__, reason)

    plan = data.EpochPlan(
        len(source.train), 1, config.per_replica_batch, strategy.num_replicas_in_sync, config.grad_accum
    )
    plan.check()
    out = report.prepare_output_dir(config)
    lr_plan = scaling.plan_lr(config, plan.global_batch, plan.steps)

    with strategy.scope():
        model = models.build_model(config, source.feature_shape, source.num_classes)
        optimizer = scaling.make_optimizer(config, lr_plan)

    ckpt_root = out / CHECKPOINT_DIR
    progress = checkpoint.Progress()
    latest = checkpoint.latest_versioned(ckpt_root) if config.resume else None
    if latest is not None:
        progress = checkpoint.Progress.resumed_from(checkpoint.restore(latest, model, optimizer))
        log.info("resumed from %s (epoch %d)", latest, progress.epoch)

    train_iter = iter(
        strategy.distribute_datasets_from_function(
            lambda _: data.train_batches_from_arrays(
                source.train, plan, config.seed, config.shuffle, progress.epoch, config.epochs
            )
        )
    )
    val_batches = data.eval_batches_from_arrays(source.val, config.per_replica_batch, strategy.num_replicas_in_sync)
    val_dataset = strategy.distribute_datasets_from_function(lambda _: val_batches)
    loop = Loop.for_run(strategy, model, optimizer, plan.global_batch, config)
    tensorboard = monitor.TensorBoard(monitor.logdir_for(config, out.name))

    for epoch in range(progress.epoch + 1, config.epochs + 1):
        try:
            metrics, train = loop.run_epoch(epoch, train_iter, plan.steps, val_dataset, plan.dropped, tensorboard.step)
        except NonFiniteLoss as e:
            raise RunFailed(str(e)) from None
        metrics["worker_peak_rss_mib"] = report.peak_rss_mib()
        progress.record(metrics, train.sample_ids)
        tensorboard.epoch(epoch, metrics)
        log.info(progress_line(metrics, config.epochs, progress.history))
        state = progress.state(config=config, lr_plan=lr_plan, plan=plan)
        checkpoint.save_versioned(ckpt_root, model, optimizer, state, keep=config.keep_checkpoints)

    tensorboard.close()
    latest = checkpoint.latest_versioned(ckpt_root)
    if latest is None:
        raise UserError(f"no checkpoint in {ckpt_root} to export")
    summary = report.write_outputs(
        config, latest, strategy=type(strategy).__name__, started_at=started_at,
        extra={"strategy_reason": reason},
    )
    log.info("outputs in %s", out)
    return summary
