"""The shard-optimizer suite: ZeRO's stages over 2 Ray workers against unsharded, in the same run: Adam's state
sharded (stage 2, app.training.zero) and the weights with it (stage 3, app.training.zero_weights). Samples/s on a
model whose step is mostly compute, in ``runs`` interleaved rounds (stage 0, 2, 3 each round; the ratios to the
round's stage 0, their median, each round's CPU steal), and each worker's peak memory on a model whose weights and
Adam state are large (``memory_width`` x ``memory_depth`` dense layers: ``memory_width``^2 x depth weights, twice
that in Adam's moments), against each stage's arithmetic (app.training.zero_memory), which the suite also gives for
8 and 64 workers.

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
          "batch_size", "epochs", "memory_epochs", "memory_stages")


def build_model(features: int, width: int, depth: int):
    """A compiled MLP (Adam), as a Keras script compiles it."""
    import keras

    model = keras.Sequential([keras.Input((features,)),
                              *[keras.layers.Dense(width, activation="relu") for _ in range(depth)],
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    return model


def one(payload: dict[str, Any]) -> dict[str, Any]:
    """One app.fit in this process: ``{"stage": 0-3, "size": "speed"|"memory", "out": DIR, "params": {...}}``."""
    import functools

    import numpy as np
    import ray

    from app.bench.sampler import ProcessPeaks
    from app.run.fit import fit as app_fit

    params, size, stage = payload["params"], payload["size"], int(payload["stage"])
    features, rows = int(params["features"]), int(params["rows" if size == "speed" else "memory_rows"])
    epochs = int(params["epochs" if size == "speed" else "memory_epochs"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = (x[:, :10].argmax(axis=1)).astype("int64")
    model = functools.partial(build_model, features, int(params[f"{size}_width"]), int(params[f"{size}_depth"]))
    started = time.time()
    with ProcessPeaks() as peaks:
        ray.init(num_cpus=int(params["workers"]) + 1, include_dashboard=False, logging_level=logging.WARNING)
        try:
            history = app_fit(model, x, y, batch_size=int(params["batch_size"]), epochs=epochs,
                              num_workers=int(params["workers"]), shard_optimizer=stage, output=payload["out"],
                              overwrite=True, verbose=0, **({"export": ["keras"]} if size == "memory" else {}))
        finally:
            ray.shutdown()
    if size == "memory":  # its checkpoints (3 GiB an epoch for the full preset's model): only the figures count
        import shutil

        shutil.rmtree(payload["out"], ignore_errors=True)
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


STAGES = (0, 2, 3)


def _one_round(label: str, params: dict, out: Path, i: int, stages: tuple[int, ...] = STAGES) -> dict[str, Any]:
    """Each stage once, in order: {stage: its measures}, and the round's CPU steal."""
    from app.bench.proc import cpu_times, steal_fraction

    before, measured = cpu_times(), {}
    for stage in stages:
        payload = {"stage": stage, "size": label, "out": str(out / f"run-{label}-{stage}-{i}"), "params": params}
        measured[stage] = measure("app.bench.shard_optimizer", "one", payload, timeout=3600)[0]
        print(f"{label} stage {stage} ({i + 1}): {json.dumps(measured[stage])}", flush=True)
    return {"stages": measured, "steal": steal_fraction(before, cpu_times())}


def arithmetic(params: dict, workers: tuple[int, ...] = (2, 8, 64)) -> dict[str, Any]:
    """Each worker's bytes at every stage (weights, gradients, Adam's state; activations not counted) and a step's
    bytes on the wire a worker, for the memory model on ``workers`` workers: the paper figures of the measured ones."""
    import math

    width, depth, features = int(params["memory_width"]), int(params["memory_depth"]), int(params["features"])
    layers = [features * width + width] + [width * width + width] * (depth - 1) + [width * 10 + 10]
    weights = 4 * sum(layers)
    out: dict[str, Any] = {"weights_mib": round(weights / 2**20, 1)}
    for n in workers:
        part = 4 * sum(math.ceil(w / n) for w in layers)
        largest = 4 * max(layers)
        stage = {0: 4 * weights, 2: 2 * weights + 2 * part, 3: 4 * part + 2 * largest}
        # an all-reduce's ring: 2 (N-1)/N of the gradients; stage 3 gathers the weights twice and reduce-scatters once
        wire = {0: 2 * (n - 1) / n * weights, 2: 2 * (n - 1) / n * weights, 3: 3 * (n - 1) / n * weights}
        out[f"{n}_workers"] = {"mib_a_worker": {k: round(v / 2**20, 1) for k, v in stage.items()},
                               "wire_mib_a_step": {k: round(v / 2**20, 1) for k, v in wire.items()}}
    return out


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    import statistics

    params = preset.params
    rounds = [_one_round("speed", params, out, i) for i in range(int(params["runs"]))]
    ratios = {stage: [r["stages"][stage]["samples_per_second"] / r["stages"][0]["samples_per_second"] for r in rounds]
              for stage in STAGES[1:]}
    memory = _one_round("memory", params, out, 0, tuple(params["memory_stages"]))["stages"]
    mib = 2 ** 20
    results: dict[str, Any] = {
        "rounds": [{"samples_per_second": {s: r["stages"][s]["samples_per_second"] for s in STAGES},
                    "steal": r["steal"]} for r in rounds],
        "rate_vs_unsharded_median": {f"stage_{s}": round(statistics.median(v), 3) for s, v in ratios.items()},
        "rate_vs_unsharded_rounds": {f"stage_{s}": [round(x, 3) for x in v] for s, v in ratios.items()},
        "memory": {f"stage_{s}": {"weights_mib": round(m["weights_bytes"] / mib, 1),
                                  "state_mib": round(m["optimizer_state_bytes"] / mib, 1),
                                  "parts_mib": round(m["optimizer_parts_bytes"] / mib, 1),
                                  "worker_peaks_mib": m["train_worker_peaks_mib"], "loss": m["loss"]}
                   for s, m in memory.items()},
        "arithmetic": arithmetic(params),
    }
    summary = out / "shard-optimizer.json"
    report.write_json(summary, {**results, "command": command, "preset": preset.as_dict()})
    print(f"samples/s against unsharded, median of {len(rounds)} rounds: {results['rate_vs_unsharded_median']} "
          f"(rounds {results['rate_vs_unsharded_rounds']}; steal {[r['steal'] for r in rounds]})")
    print("memory per worker: " + json.dumps(results["memory"]))
    print("arithmetic: " + json.dumps(results["arithmetic"]))
    return [summary]


if __name__ == "__main__":
    child_main({"one": one})
