"""The checkpoint suite: what checkpointing adds per epoch, the time to write one checkpoint against one epoch.

In this process, no Ray, one device, the preset's workload (by default
jobs/train.py's: the mlp on the embedded digits): after one untimed epoch
(tracing), ``repeats`` epochs, each followed by one checkpoint write as a run
writes it (app.training.checkpoint.save: tf.train.Checkpoint of model and
optimizer, model.keras, state.json) into a fresh directory. Reports the median
write, the median epoch, and their ratio. Ray's own part of a report (copying
the directory into storage, registering it) comes on top and shows in the
epoch timings of a real run.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

from app.bench import report
from app.bench.preset import Preset
from app.config import build_config

PARAMS = ("repeats",)


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    import tensorflow as tf

    from app.bench.training import build_training, distributed
    from app.data.memory import load_source
    from app.data.plan import EpochPlan
    from app.data.tf_input import train_batches_from_arrays
    from app.training import checkpoint

    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # its per-epoch dataset notices
    repeats = int(preset.params["repeats"])
    config = build_config(None, {**preset.workload, "num_workers": 1, "output": str(out)})
    source = load_source(config)
    strategy = tf.distribute.get_strategy()
    plan = EpochPlan.for_run(config, len(source.train), 1)
    timed = build_training(config, strategy, source, plan)
    iterator = distributed(strategy, train_batches_from_arrays(source.train, plan, config.seed, True, 0, repeats + 1))
    timed.epoch(iterator, plan)  # trace once
    epochs, saves = [], []
    progress = checkpoint.Progress()
    for epoch in range(1, repeats + 1):
        start = time.perf_counter()
        timed.epoch(iterator, plan, epoch)
        epochs.append(time.perf_counter() - start)
        progress.epoch = epoch
        state = progress.state(config=config, lr_plan=timed.training.lr_plan, plan=plan, task=source.facts.task)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            checkpoint.save(tmp, timed.training.model, timed.training.optimizer, state)
            saves.append(time.perf_counter() - start)
    epoch_s, save_s = statistics.median(epochs), statistics.median(saves)
    result = {
        "command": command,
        "preset": preset.as_dict(),
        "model": config.model if isinstance(config.model, str) else str(config.model),
        "parameters": int(timed.training.model.count_params()),
        "steps_per_epoch": plan.steps,
        "repeats": repeats,
        "epoch_ms": [s * 1000 for s in epochs],
        "checkpoint_ms": [s * 1000 for s in saves],
        "median_epoch_ms": epoch_s * 1000,
        "median_checkpoint_ms": save_s * 1000,
        "checkpoint_vs_epoch": save_s / epoch_s,
    }
    print(report.checkpoint_summary(result))
    return [report.write_json(out / "checkpoint.json", result)]
