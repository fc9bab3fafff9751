"""The shard-optimizer suite: Adam's state sharded over 2 Ray workers (app.training.zero) against unsharded, in the
same run: samples/s on a model whose step is mostly compute, and each worker's peak memory on a model whose Adam
state is large (``memory_width`` x ``memory_depth`` dense layers: ``memory_width``^2 x depth weights, twice that
in Adam's moments).

Each run is a fresh process with a local Ray of its own (``python -m app.bench.shard_optimizer one '<json>'``), so
its peaks are its own (app.bench.sampler: each Ray Train worker's largest sampled RSS). Steady samples/s are
the epochs after the first (rows trained / the epoch's seconds). -> shard-optimizer.json, with the rate sharded /
unsharded and the per-worker figures: optimizer_state_bytes and optimizer_parts_bytes from result.json, and the peak
RSS difference unsharded - sharded of the worker that writes no checkpoint (the state and the step alone; on paper
at least Adam's state x (N - 1) / N less the flat part of the weights each sharded worker keeps, weights / N, and
the step's summed gradients, held a few buckets at a time), and of rank 0, which also writes the checkpoints.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import child_main, fit_seconds, measure, steady

log = logging.getLogger(__name__)

PARAMS = ("runs", "workers", "rows", "features", "speed_width", "speed_depth", "memory_width", "memory_depth", "memory_rows",
          "batch_size", "epochs")


def build_model(features: int, width: int, depth: int):
    """A compiled MLP (Adam), as a Keras script compiles it."""
    import keras

    model = keras.Sequential([keras.Input((features,)),
                              *[keras.layers.Dense(width, activation="relu") for _ in range(depth)],
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    return model


def one(payload: dict[str, Any]) -> dict[str, Any]:
    """One app.fit in this process: ``{"stage": 0|1|2, "size": "speed"|"memory", "out": DIR, "params": {...}}``."""
    import functools

    import numpy as np
    import ray

    from app.bench.sampler import ProcessPeaks
    from app.run.fit import fit as app_fit

    params, size, stage = payload["params"], payload["size"], int(payload["stage"])
    features, rows = int(params["features"]), int(params["rows" if size == "speed" else "memory_rows"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = (x[:, :10].argmax(axis=1)).astype("int64")
    model = functools.partial(build_model, features, int(params[f"{size}_width"]), int(params[f"{size}_depth"]))
    started = time.time()
    with ProcessPeaks() as peaks:
        ray.init(num_cpus=int(params["workers"]) + 1, include_dashboard=False, logging_level=logging.WARNING)
        try:
            history = app_fit(model, x, y, batch_size=int(params["batch_size"]), epochs=int(params["epochs"]),
                              num_workers=int(params["workers"]), shard_optimizer=stage, output=payload["out"],
                              overwrite=True, verbose=0)
        finally:
            ray.shutdown()
    trained, seconds = fit_seconds(history)
    per_epoch = [trained / s for s in seconds]
    return {
        "samples_per_second": round(steady(per_epoch), 1),
        "best_epoch": round(max(per_epoch[1:] or per_epoch), 1),  # the machine's quietest epoch after the first
        "per_epoch": [round(r, 1) for r in per_epoch],
        "loss": history.history["loss"][-1],
        "seconds": round(time.time() - started, 1),
        "weights_bytes": int(sum(np.asarray(w).nbytes for w in history.model.get_weights())),
        "optimizer_state_bytes": history.result["optimizer_state_bytes"],
        "optimizer_parts_bytes": history.result["optimizer_parts_bytes"],
        # Each worker's, largest first: the first is rank 0's, which also writes the checkpoints (unsharded: Keras's
        # model.keras with the whole state, loaded back to check it; sharded: the state gathered bucket by bucket).
        "train_worker_peaks_mib": sorted((round(p.rss, 1) for p in peaks.processes.values()
                                          if p.name.startswith("ray::RayTrainWorker")), reverse=True),
    }


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params = preset.params
    results: dict[str, Any] = {}
    # Alternating, so that a slower spell of this shared machine falls on both; the speed pair ``runs`` times, each
    # side's best rate counting (this machine's rate drifts by 2x within a run).
    rates: dict[str, list[float]] = {"speed-unsharded": [], "speed-sharded": []}
    best: dict[str, list[float]] = {"speed-unsharded": [], "speed-sharded": []}  # each run's quietest epoch
    for size, times in (("speed", int(params["runs"])), ("memory", 1)):
        for i in range(times):
            for stage in (0, 2):
                label = f"{size}-{'sharded' if stage else 'unsharded'}"
                payload = {"stage": stage, "size": size, "out": str(out / f"run-{label}-{i}"), "params": params}
                measured = measure("app.bench.shard_optimizer", "one", payload, timeout=3600)[0]
                print(f"{label} ({i + 1}/{times}): {json.dumps(measured)}", flush=True)
                if label in rates:
                    rates[label].append(measured["samples_per_second"])
                    best[label].append(measured["best_epoch"])
                if label not in results or measured["samples_per_second"] > results[label]["samples_per_second"]:
                    results[label] = measured
    results["runs_samples_per_second"] = rates
    results["rate_sharded_vs_unsharded"] = round(results["speed-sharded"]["samples_per_second"]
                                                 / results["speed-unsharded"]["samples_per_second"], 3)
    results["best_epoch_sharded_vs_unsharded"] = round(max(best["speed-sharded"]) / max(best["speed-unsharded"]), 3)
    results["rate_sharded_vs_unsharded_memory_model"] = round(
        results["memory-sharded"]["samples_per_second"] / results["memory-unsharded"]["samples_per_second"], 3)
    whole, cut = results["memory-unsharded"], results["memory-sharded"]
    mib = 2 ** 20
    results["memory"] = {
        "weights_mib": round(whole["weights_bytes"] / mib, 1),
        "state_mib_unsharded": round(whole["optimizer_state_bytes"] / mib, 1),
        "state_mib_sharded": round(cut["optimizer_state_bytes"] / mib, 1),
        "parts_mib_sharded": round(cut["optimizer_parts_bytes"] / mib, 1),
        "worker_peaks_mib_unsharded": whole["train_worker_peaks_mib"],
        "worker_peaks_mib_sharded": cut["train_worker_peaks_mib"],
        # the worker that writes no checkpoint: the state and the step alone
        "peak_saved_mib": round(whole["train_worker_peaks_mib"][-1] - cut["train_worker_peaks_mib"][-1], 1),
        "checkpoint_writer_peak_saved_mib": round(whole["train_worker_peaks_mib"][0]
                                                  - cut["train_worker_peaks_mib"][0], 1),
        "on_paper_saved_mib": round((whole["optimizer_state_bytes"] - cut["optimizer_state_bytes"]
                                     - cut["optimizer_parts_bytes"]) / mib, 1),
    }
    summary = out / "shard-optimizer.json"
    report.write_json(summary, {**results, "command": command, "preset": preset.as_dict()})
    print(f"samples/s sharded / unsharded (best of {params['runs']} each): {results['rate_sharded_vs_unsharded']:.3f}; "
          f"their quietest epochs: {results['best_epoch_sharded_vs_unsharded']:.3f}; "
          f"memory model (one each): {results['rate_sharded_vs_unsharded_memory_model']:.3f}")
    print("memory per worker: " + ", ".join(f"{k} {v}" for k, v in results["memory"].items()))
    return [summary]


if __name__ == "__main__":
    child_main({"one": one})
