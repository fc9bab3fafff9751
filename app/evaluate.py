"""Evaluate an exported model in a plain process: no Ray, no distribution."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app import data
from app.config import TrainConfig, build_config
from app.errors import UserError
from app.report import CONFIG_FILE, MODEL_FILE

log = logging.getLogger(__name__)


def evaluate_model(model_path: str | Path, config: TrainConfig) -> dict[str, Any]:
    """Val loss/accuracy of a .keras model on the config's validation split."""
    import keras
    import tensorflow as tf

    from app.loop import Loop

    model_path = Path(model_path)
    if not model_path.is_file():
        raise UserError(f"model file {str(model_path)!r} does not exist")
    model = keras.models.load_model(model_path, compile=False)
    source = data.load_source(config)
    strategy = tf.distribute.get_strategy()  # the default, single-device strategy
    loop = Loop(strategy, model, optimizer=None, global_batch_size=config.per_replica_batch)
    batches = data.eval_batches_from_arrays(source.val, config.per_replica_batch)
    stats = loop.evaluate(strategy.distribute_datasets_from_function(lambda _: batches))
    return {"val_loss": stats.loss, "val_accuracy": stats.accuracy, "val_samples": stats.samples}


def evaluate_run(run_dir: str | Path) -> dict[str, Any]:
    """Evaluate ``<run>/model.keras`` on the data described by ``<run>/config.yaml``; writes ``<run>/eval.json``."""
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILE).is_file():
        raise UserError(f"{str(run_dir)!r} is not a run directory (no {CONFIG_FILE})")
    config = build_config(run_dir / CONFIG_FILE)
    metrics = evaluate_model(run_dir / MODEL_FILE, config)
    (run_dir / "eval.json").write_text(json.dumps(metrics, indent=2))
    return metrics
