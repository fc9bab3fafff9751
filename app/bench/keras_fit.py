"""The keras suite: a compiled Keras model (Adam, two metrics) trained by this product against its own fit().

Same model function, data, batch, epochs and thread count, each in a process of its own:

- fit: ``model.fit(x, y, batch_size=B, epochs=E)`` in a plain process (no Ray, no strategy): Keras's own loop;
- local: ``jobs/train.py --backend local --strategy one-device``: this product's run (Keras's fit in it);
- ray: ``jobs/train.py --num-workers 1``: the same in one Ray Train worker.

Steady samples/s (the first epoch, with its tracing, left out) as ratios of fit's -> keras.json.

    python -m app.bench.keras_fit fit '<TrainConfig JSON>'   # the baseline alone
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from app.bench.preset import Preset
from app.bench.proc import child_main, epoch_timer, measure, run_script, steady, workload_flags
from app.config import TrainConfig

PARAMS = ("runs",)
MODEL = "app.bench.keras_fit:compiled_cnn"


def compiled_cnn(input_shape, num_classes):
    """The benchmark's model, compiled as a Keras script compiles it: Adam, cross-entropy, two metrics."""
    import keras

    model = keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(num_classes, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3)])
    return model


def keras_fit(payload: dict[str, Any]) -> dict[str, Any]:
    """The baseline: the model function's compiled model and Keras's model.fit, on the run's training rows."""
    from app.data.memory import load_source
    from app.training.model import build_model
    from app.training.strategy import set_thread_counts

    config = TrainConfig(**payload)
    threads = set_thread_counts(config.cpus_per_worker)
    import keras

    source = load_source(config)
    model = build_model(config, source.facts)
    if not model.compiled:  # a built-in model (the throughput suite's): compiled as a Keras script would be
        from app.training.model import ends_in_probabilities

        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=not ends_in_probabilities(model)) \
            if source.facts.task == "classification" else "mse"
        model.compile(optimizer="adam", loss=loss, metrics=["accuracy"] if source.facts.task == "classification"
                      else None)

    seconds: list[float] = []
    rows = len(source.train) // config.per_replica_batch * config.per_replica_batch  # whole batches, as the product
    model.fit(source.train.x[:rows], source.train.y[:rows], batch_size=config.per_replica_batch, epochs=config.epochs,
              shuffle=True, verbose=0, callbacks=[epoch_timer(seconds)])
    per_epoch = [rows / s for s in seconds]
    return {"samples_per_second": steady(per_epoch), "per_epoch": per_epoch, "threads": threads}


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    workload = {**preset.workload, "model": MODEL}
    flags = workload_flags(workload)
    rates: dict[str, list[float]] = {"fit": [], "local": [], "ray": []}
    for i in range(int(preset.params["runs"])):
        payload = {**workload, "output": str(out / f"fit-{i}")}
        rates["fit"].append(measure("app.bench.keras_fit", "fit", payload)[0]["samples_per_second"])
        for name, backend in (("local", ["--backend", "local", "--strategy", "one-device"]),
                              ("ray", ["--num-workers", "1"])):
            run_dir = out / f"{name}-{i}"
            run_script([sys.executable, "jobs/train.py", *flags, *backend, "--output", str(run_dir)], timeout=1800)
            rates[name].append(_steady_from(run_dir / "history.csv"))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} samples/s" for k, v in rates.items()), flush=True)
    best = {k: max(v) for k, v in rates.items()}  # the best of each: the machine drifts (BENCHMARKS.md)
    result = {
        "command": command,
        "workload": workload,
        "samples_per_second": rates,
        "best": best,
        "local_vs_fit": best["local"] / best["fit"],
        "ray_1_worker_vs_fit": best["ray"] / best["fit"],
        "goals": {"local >= 1.0x fit": best["local"] / best["fit"] >= 1.0,
                  "ray 1 worker >= 0.97x fit": best["ray"] / best["fit"] >= 0.97},
    }
    path = out / "keras.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"local / fit {result['local_vs_fit']:.2f}, ray 1 worker / fit {result['ray_1_worker_vs_fit']:.2f}")
    return [path]


def _steady_from(history_csv: Path) -> float:
    """The run's steady samples/s: its epochs after the first, from history.csv."""
    import csv

    with history_csv.open() as f:
        per_epoch = [float(row["samples_per_second"]) for row in csv.DictReader(f)]
    return steady(per_epoch)


if __name__ == "__main__":
    child_main({"fit": keras_fit})
