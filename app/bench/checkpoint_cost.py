"""The checkpoint suite: what checkpointing adds per epoch, the time to write one checkpoint against one epoch.

In this process, no Ray, one device, the preset's workload (by default
jobs/train.py's: the mlp on the embedded digits), trained as a run of one
device trains it: the model function's model, compiled as the run compiles it
(app.training.default_compile, for a model that compiles nothing), and Keras's
``model.fit``. After one untimed epoch (tracing, and the first write, which
also loads ``model.keras`` back once), ``repeats`` epochs, each followed by one
checkpoint write as a run writes it (app.training.keras_checkpoint.save: a
tf.train.Checkpoint of the model and its optimizers, model.keras, state.json)
into a fresh directory. Reports the median write, the median epoch, and their
ratio. Ray's own part of a report (copying the directory into storage,
registering it) comes on top and shows in the epoch timings of a real run.
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
    import keras

    from app.bench.proc import epoch_timer
    from app.data.memory import load_source
    from app.training import default_compile, keras_checkpoint
    from app.training.model import build_model

    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # its per-epoch dataset notices
    repeats = int(preset.params["repeats"])
    config = build_config(None, {**preset.workload, "num_workers": 1, "output": str(out)})
    source = load_source(config)
    keras.utils.set_random_seed(config.seed)
    model = build_model(config, source.facts)
    batch = config.per_replica_batch
    x, y = source.train.x, source.train.y
    if not model.compiled:
        default_compile.decide(model, (x[:batch], y[:batch]), y, config).compile(model)

    epochs, saves, history = [], [], []

    class WriteCheckpoint(keras.callbacks.Callback):
        """After each epoch, one checkpoint as a run's rank 0 writes it (the first one untimed)."""

        def on_epoch_end(self, epoch, logs=None):
            history.append({"epoch": epoch + 1, **(logs or {})})
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                keras_checkpoint.save(model, tmp, {"epoch": epoch + 1, "history": history})
                saves.append(time.perf_counter() - start)

    # The timer's on_epoch_end runs before the write's: an epoch's time holds no checkpoint.
    model.fit(x, y, batch_size=batch, epochs=repeats + 1, shuffle=True, verbose=0,
              callbacks=[epoch_timer(epochs), WriteCheckpoint()])
    epochs, saves = epochs[1:], saves[1:]  # the first: tracing, and the write that loads model.keras back
    epoch_s, save_s = statistics.median(epochs), statistics.median(saves)
    result = {
        "command": command,
        "preset": preset.as_dict(),
        "model": config.model if isinstance(config.model, str) else str(config.model),
        "parameters": int(model.count_params()),
        "steps_per_epoch": -(-len(x) // batch),
        "repeats": repeats,
        "epoch_ms": [s * 1000 for s in epochs],
        "checkpoint_ms": [s * 1000 for s in saves],
        "median_epoch_ms": epoch_s * 1000,
        "median_checkpoint_ms": save_s * 1000,
        "checkpoint_vs_epoch": save_s / epoch_s,
    }
    print(report.checkpoint_summary(result))
    return [report.write_json(out / "checkpoint.json", result)]
