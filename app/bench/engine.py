"""The engine suite: app.fit (each worker running the model's own Keras fit) against what the machine gives the same
work without it, in the same run, as three ratios.

One compiled CNN, synthetic images, a global batch of ``batch_size``; every
process has 1 CPU's worth of TensorFlow threads unless said. Each row of the table is a fresh process (or two started
at once) with a local Ray of its own where it needs one:

- ``fit 2 threads``: ``model.fit`` in one plain process on both cores (the reference a user has today);
- ``fit pair``: two plain ``model.fit`` processes at once, 1 thread each, each on half the rows with half the batch:
  what two free single-thread processes reach (their rates summed);
- ``local``: ``app.fit(..., backend="local")``, one device, TensorFlow's own threads (both cores), as model.fit;
- ``local pair``: two such runs at once, each on half the rows with half the batch (their rates summed);
- ``ray 1``: ``app.fit(..., num_workers=1)`` on one Ray worker of 2 CPUs (both cores, as the local run's
  TensorFlow takes them); ``ray 2``: ``num_workers=2``, workers of 1 CPU each;
- ``fit pair 128``, ``ray 2 128``: the pair and the 2 workers again at 128 rows a worker a step (4x the rows per
  all-reduce).

Steady samples/s are the epochs after the first; a whole run's are every epoch's rows over every epoch's seconds
(the first epoch, which traces the step, included; not the start-up). ``runs`` repeats the whole set, one row after
another (interleaved: a slow minute of the machine hits a ratio's two rows alike); each ratio (TARGETS) is taken
within each run and reported as the median over the runs, beside each run's CPU steal (/proc/stat). A Ray row also
records where its steps' time went (result.json's ``time``: app.driver.time_report) -> engine.json.
"""

from __future__ import annotations

import functools
import logging
import statistics
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import child_main, cpu_times, epoch_timer, fit_seconds, measure, steady, steal_fraction

log = logging.getLogger(__name__)

PARAMS = ("runs", "model", "rows", "image_size", "batch_size", "epochs")

# (row, kind, processes, payload): the set, in the order it runs.
ROWS = (("fit 2 threads", "fit", 1, {"threads": 2, "part": 1}),
        ("fit pair", "fit", 2, {"threads": 1, "part": 2}),
        ("local", "app", 1, {"backend": "local", "workers": 1, "part": 1}),
        ("local pair", "app", 2, {"backend": "local", "workers": 1, "part": 2}),
        # one worker holds both cores, as the local run's TensorFlow does (its threads are the process's default)
        ("ray 1", "app", 1, {"backend": "ray", "workers": 1, "part": 1, "cpus": 2}),
        ("ray 2", "app", 1, {"backend": "ray", "workers": 2, "part": 1, "cpus": 1}),
        ("fit pair 128", "fit", 2, {"threads": 1, "part": 2, "batch": 256}),
        ("ray 2 128", "app", 1, {"backend": "ray", "workers": 2, "part": 1, "cpus": 1, "batch": 256}))
TARGETS = (("ray 1 steady / local steady", "ray 1", "local", "steady", 0.97),
           ("ray 1 whole / local whole", "ray 1", "local", "whole", 0.97),
           ("ray 2 steady / fit pair steady, 128 rows a worker", "ray 2 128", "fit pair 128", "steady", 0.95),
           ("ray 2 steady / fit pair steady, batch_size rows", "ray 2", "fit pair", "steady", 0.85),
           ("ray 2 whole / local pair whole", "ray 2", "local pair", "whole", 0.90))


def images(params: dict[str, Any], part: int):
    """The rows of one process: seeded images whose class is where their brightest quadrant is, 1/``part`` of them."""
    import numpy as np

    rows, side = int(params["rows"]) // part, int(params["image_size"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, side, side, 1)).astype("float32")
    half = side // 2
    quadrants = np.stack([x[:, :half, :half].mean((1, 2, 3)), x[:, :half, half:].mean((1, 2, 3)),
                          x[:, half:, :half].mean((1, 2, 3)), x[:, half:, half:].mean((1, 2, 3))], axis=1)
    return x, quadrants.argmax(axis=1).astype("int64")


def pooled_cnn(input_shape, num_classes):
    """A CNN whose weights are few for its compute (pooling, global average): what crosses the workers is small."""
    import keras

    model = keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(num_classes, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def model_fn(params: dict[str, Any], input_shape):
    """``model``: "dense-head" (app.bench.keras_fit.compiled_cnn: a Dense on the whole feature map, 1.6M weights at
    32x32) or "pooled" (``pooled_cnn``: 66k weights)."""
    from app.bench.keras_fit import compiled_cnn

    return functools.partial({"dense-head": compiled_cnn, "pooled": pooled_cnn}[params["model"]], input_shape, 4)


def rates(rows: int, seconds: list[float]) -> dict[str, Any]:
    per_epoch = [rows / s for s in seconds]
    return {"steady": round(steady(per_epoch), 1), "whole": round(rows * len(seconds) / sum(seconds), 1),
            "per_epoch": [round(r, 1) for r in per_epoch]}


def plain_fit(payload: dict[str, Any]) -> dict[str, Any]:
    """``model.fit`` in this plain process, ``threads`` TensorFlow threads (no Ray, no strategy)."""
    import tensorflow as tf

    threads = int(payload["threads"])
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    import keras

    params, part = payload["params"], int(payload["part"])
    x, y = images(params, part)
    keras.utils.set_random_seed(0)
    model = model_fn(params, x.shape[1:])()
    seconds: list[float] = []
    model.fit(x, y, batch_size=_batch(payload) // part, epochs=int(params["epochs"]), verbose=0,
              callbacks=[epoch_timer(seconds)])
    return rates(len(x), seconds)


def app_fit(payload: dict[str, Any]) -> dict[str, Any]:
    """``app.fit`` in this process, on ``backend`` with ``workers`` workers of ``cpus`` CPUs; on Ray, the local Ray app.fit
    starts itself, as in a user's script that starts none."""
    from app.run.fit import fit

    params, part = payload["params"], int(payload["part"])
    x, y = images(params, part)
    history = fit(model_fn(params, x.shape[1:]), x, y,
                  batch_size=_batch(payload) // part, epochs=int(params["epochs"]),
                  num_workers=int(payload["workers"]), backend=payload["backend"],
                  cpus_per_worker=int(payload.get("cpus", 1)),
                  output=payload["out"], overwrite=True, verbose=0)
    took = history.result.get("time") or {}
    return {**rates(*fit_seconds(history)), "time": {k: took.get(k) for k in ("shares", "step_ms", "bound")}}


def _batch(payload: dict[str, Any]) -> int:
    """The global batch of a row: its own, or the preset's."""
    return int(payload.get("batch") or payload["params"]["batch_size"])


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params = preset.params
    runs: list[dict[str, Any]] = []
    for i in range(int(params["runs"])):
        before, rows = cpu_times(), {}
        for name, kind, processes, given in ROWS:
            payloads = [{**given, "params": params, "out": str(out / f"{name.replace(' ', '-')}-{i}-{p}")}
                        for p in range(processes)]
            results = measure("app.bench.engine", kind, payloads, timeout=3600)
            rows[name] = {k: round(sum(r[k] for r in results), 1) for k in ("steady", "whole")}  # a pair's summed
            rows[name]["processes"] = results
            print(f"run {i + 1}, {name}: steady {rows[name]['steady']:,.0f}, whole {rows[name]['whole']:,.0f} "
                  "samples/s", flush=True)
        runs.append({"rows": rows, "steal": steal_fraction(before, cpu_times()),
                     "ratios": {label: round(rows[a][kind] / rows[b][kind], 3) for label, a, b, kind, _ in TARGETS}})
    ratios = {label: {"median": round(statistics.median(r["ratios"][label] for r in runs), 3), "target": target,
                      "runs": [r["ratios"][label] for r in runs]} for label, _, _, _, target in TARGETS}
    for ratio in ratios.values():
        ratio["reached"] = ratio["median"] >= ratio["target"]
    summary = out / "engine.json"
    report.write_json(summary, {"command": command, "preset": preset.as_dict(), "runs": runs, "ratios": ratios,
                                "steal": [r["steal"] for r in runs]})
    for label, ratio in ratios.items():
        print(f"{label}: median {ratio['median']:.2f} of {ratio['runs']} (target {ratio['target']:.2f})")
    print(f"CPU steal per run: {[r['steal'] for r in runs]}")
    return [summary]


if __name__ == "__main__":
    child_main({"fit": plain_fit, "app": app_fit})
