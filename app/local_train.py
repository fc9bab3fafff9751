"""The local backend: the same loop in one process, no Ray.

MirroredStrategy over GPUs (or logical CPUs), TPUStrategy, one device, or
CentralStorageStrategy; the input is tf.data from the same sources, with the
same rules as the Ray path (seeded reshuffle, equal whole batches, every
sample at most once per epoch). Ray is never imported here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from app import checkpoint, data, report
from app.config import TrainConfig
from app.errors import UserError

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"


def run(config: TrainConfig, started_at: float | None = None) -> dict[str, Any]:
    """Train with a local strategy and write the same outputs as the Ray path."""
    from app import models, scaling
    from app import strategy as strategy_lib
    from app.loop import Loop, epoch_metrics, progress_line

    started_at = started_at or time.time()
    source = data.load_source(config)
    # Devices are configured before TensorFlow initialises them: strategy first.
    try:
        strategy, reason = strategy_lib.local_strategy(config.strategy, config.devices, config.cpus_per_worker)
    except strategy_lib.StrategyUnavailable as e:
        raise UserError(str(e)) from None
    log.info("strategy: %s (%s)", type(strategy).__name__, reason)

    plan = data.EpochPlan(len(source.train), 1, config.per_replica_batch, strategy.num_replicas_in_sync)
    plan.check()
    out = report.prepare_output_dir(config)
    lr_plan = scaling.plan_lr(config, plan.global_batch, plan.steps)

    with strategy.scope():
        model = models.build_model(config, source.feature_shape, source.num_classes)
        optimizer = scaling.make_optimizer(config, lr_plan)

    train_iter = iter(
        strategy.distribute_datasets_from_function(
            lambda _: data.train_batches_from_arrays(source.train, plan, config.seed, config.shuffle)
        )
    )
    val_batches = data.eval_batches_from_arrays(source.val, config.per_replica_batch)
    val_dataset = strategy.distribute_datasets_from_function(lambda _: val_batches)
    loop = Loop(
        strategy,
        model,
        optimizer,
        plan.global_batch,
        audit_sample_ids=config.audit_sample_ids,
        steps_per_execution=config.steps_per_execution,
    )

    history: list[dict[str, Any]] = []
    audit_ids: list[list[int]] = []
    ckpt_dir = out / CHECKPOINT_DIR
    for epoch in range(config.epochs):
        train = loop.train_epoch(train_iter, plan.steps)
        val = loop.evaluate(val_dataset)
        metrics = epoch_metrics(epoch + 1, train, val, optimizer.learning_rate.numpy(), plan.dropped)
        if train.sample_ids is not None:
            audit_ids.append(train.sample_ids.tolist())
        history.append(metrics)
        log.info(progress_line(metrics, config.epochs, history))
        state = {"epoch": epoch + 1, "history": history, "lr_plan": lr_plan.as_dict(), "plan": plan.as_dict()}
        if audit_ids:
            state["audit_sample_ids"] = audit_ids
        ckpt_dir.mkdir(exist_ok=True)
        checkpoint.save(ckpt_dir, model, state)

    summary = report.write_outputs(
        config, Path(ckpt_dir), strategy=type(strategy).__name__, started_at=started_at,
        extra={"strategy_reason": reason},
    )
    log.info("outputs in %s", out)
    return summary
