"""The streaming suite: one compiled model trained by Keras's fit on 2 Ray workers from three inputs, and the memory
of the streamed ones at 1x and ``scale`` x the rows.

The inputs, the same rows (``rows`` of ``shape`` float32 and a class id, learnable: a class pattern under noise):

- arrays: ``app.fit(build, x, y)``, the rows in the driver's memory (the baseline);
- parquet: ``app.fit(build, "dir/")``, read by Ray Data's tasks and streamed to the workers
  (app.data.keras_stream; ``data_cache`` as the preset says: ``stream`` reads the files every epoch);
- parquet-cached: the same, kept in the object store after its first read (``data_cache: memory``; 1x only);
- tfrecord: ``app.fit(build, tf.data.TFRecordDataset(files).map(parse).batch(B))``: every worker reads the files
  itself (app.data.tf_pipeline), the driver its first batch only;
- arrays-dense, parquet-dense: arrays and parquet again, to a model of one Dense layer (a step that costs next to
  nothing): what the input alone delivers on this machine, the ceiling of the CNN's rate from it.

Each run is a fresh process with a local Ray of its own (``python -m app.bench.streaming one '<json>'``), so its
peaks are its own (app.bench.sampler): the driver's ``ru_maxrss``, the largest sampled RSS and own memory (RssAnon)
of the Ray Train workers and of Ray Data's tasks, and the object store's pages. Steady samples/s are the epochs
after the first (rows trained / the epoch's seconds, from the run's History records). ``runs`` rounds of the 1x set,
every input once a round: each input's rate over the same round's arrays, and the median of those ratios over the
rounds (this machine's speed drifts by half from minute to minute: only a ratio within a round compares two inputs),
each round's CPU steal (/proc/stat) beside it -> streaming.json, with the memory ratios scale x / 1x (goal: flat).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.memory import COMPLETE, _is_task, write_dataset
from app.bench.preset import Preset
from app.bench.proc import child_main, cpu_times, measure, steady, steal_fraction

log = logging.getLogger(__name__)

PARAMS = ("runs", "rows", "scale", "rows_per_file", "shape", "workers", "batch_size", "epochs", "data_cache")
INPUTS = ("arrays", "parquet", "tfrecord", "parquet-cached")  # the last: kept in the object store (1x only)
# The input alone: the same rows to a model of one Dense layer, whose step costs next to nothing, so the rate is what
# the input delivers on this machine (1x, each run): the ceiling of the CNN's rate from it.
INPUT_BOUND = ("arrays-dense", "parquet-dense")
TARGETS = {"parquet": 0.8, "parquet-cached": 0.9}  # each input's rate over the arrays' (the median of the rounds)


def build_model(shape: tuple[int, ...], dense: bool = False):
    """A compiled CNN over the flat pixels, as a Keras script compiles it (``dense``: one Dense layer instead)."""
    import keras

    if dense:
        model = keras.Sequential([keras.Input((int(__import__("math").prod(shape)),)),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model
    model = keras.Sequential([
        keras.Input((int(__import__("math").prod(shape)),)),
        keras.layers.Reshape(shape),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def write_tfrecords(parquet_dir: Path, directory: Path) -> None:
    """The parquet rows as TFRecord files, one per parquet file (x: a float list, y: an int64)."""
    import pyarrow.parquet as pq
    import tensorflow as tf

    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(parquet_dir.glob("*.parquet")):
        table = pq.read_table(path)
        x = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
        y = table.column("label").to_numpy()
        with tf.io.TFRecordWriter(str(directory / (path.stem + ".tfrecord"))) as writer:
            for row, label in zip(x, y):
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=row)),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))})).SerializeToString())


def one(payload: dict[str, Any]) -> dict[str, Any]:
    """One app.fit in this process: ``{"input": KIND, "data": DIR, "out": DIR, "params": {...}}``."""
    import functools

    import numpy as np
    import ray

    from app.bench.sampler import ProcessPeaks
    from app.run.fit import fit as app_fit
    from app.training.metrics import peak_rss_mib

    params, kind, data = payload["params"], payload["input"], Path(payload["data"])
    shape = tuple(params["shape"])
    width = int(np.prod(shape))
    dense, kind = kind.endswith("-dense"), kind.removesuffix("-dense")
    fit = functools.partial(app_fit, functools.partial(build_model, shape, dense), batch_size=int(params["batch_size"]),
                            epochs=int(params["epochs"]), num_workers=int(params["workers"]),
                            output=payload["out"], overwrite=True, verbose=0)
    started = time.time()
    with ProcessPeaks() as peaks:
        ray.init(num_cpus=int(params["workers"]) + 1, include_dashboard=False, logging_level=logging.WARNING)
        try:
            if kind == "arrays":
                import pyarrow.parquet as pq

                table = pq.read_table(data / "parquet")
                x = table.column("pixels").combine_chunks().flatten().to_numpy().reshape(table.num_rows, width)
                history = fit(x, table.column("label").to_numpy())
            elif kind.startswith("parquet"):
                cache = "memory" if kind == "parquet-cached" else params["data_cache"]
                history = fit(str(data / "parquet"), label_column="label", data_cache=cache)
            else:
                import tensorflow as tf

                features = {"x": tf.io.FixedLenFeature([width], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}

                def parse(records):
                    parsed = tf.io.parse_example(records, features)
                    return parsed["x"], parsed["y"]

                files = sorted(str(f) for f in (data / "tfrecord").glob("*.tfrecord"))
                pipeline = (tf.data.TFRecordDataset(files, num_parallel_reads=2).batch(int(params["batch_size"]))
                            .map(parse, num_parallel_calls=tf.data.AUTOTUNE))
                history = fit(pipeline)
        finally:
            ray.shutdown()
    rows = history.result.get("rows") or payload["rows"]
    trained = rows - (history.result.get("dropped_samples_per_epoch") or 0)
    per_epoch = [trained / r["seconds"] for r in history.records]
    train_worker = lambda name: name.startswith("ray::RayTrainWorker")  # noqa: E731
    return {
        "samples_per_second": round(steady(per_epoch), 1),
        "per_epoch": [round(r, 1) for r in per_epoch],
        "accuracy": history.history["accuracy"][-1],
        "seconds": round(time.time() - started, 1),
        "driver_peak_mib": round(peak_rss_mib(), 1),
        "train_worker_peak_mib": peaks.largest(train_worker),
        "train_worker_anon_peak_mib": peaks.largest(train_worker, "own"),
        "ray_data_process_anon_peak_mib": peaks.largest(_is_task, "own"),
        "object_store_pages_peak_mib": round(peaks.shmem_peak, 1),
    }


def dataset(root: Path, rows: int, params: dict[str, Any]) -> Path:
    """Parquet and TFRecord files of the same ``rows`` rows under ``root`` (written unless complete already)."""
    data = root / f"data-{rows}"
    if not (data / COMPLETE).exists():
        log.info("writing %d rows to %s ...", rows, data)
        write_dataset(data / "parquet", rows, int(params["rows_per_file"]), tuple(params["shape"]))
        write_tfrecords(data / "parquet", data / "tfrecord")
        (data / COMPLETE).write_text("done")
    return data


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params = preset.params
    scale, runs = int(params["scale"]), int(params["runs"])
    rounds: list[dict[str, Any]] = []
    kept: dict[str, list[dict[str, Any]]] = {}  # per input, every round's figures (the median run's are reported)
    data = dataset(out, int(params["rows"]), params)
    for i in range(runs):  # every input at 1x once a round; each streamed rate over the same round's arrays
        before, results = cpu_times(), {}
        for kind in INPUTS + INPUT_BOUND:
            payload = {"input": kind, "data": str(data), "out": str(out / f"run-1x-{kind}-{i}"),
                       "rows": int(params["rows"]), "params": params}
            results[kind] = measure("app.bench.streaming", "one", payload, timeout=4 * 3600)[0]
            print(f"round {i + 1} {kind}: {json.dumps(results[kind])}", flush=True)
        base = results["arrays"]["samples_per_second"]
        rounds.append({"steal": steal_fraction(before, cpu_times()),
                       "samples_per_second": {k: r["samples_per_second"] for k, r in results.items()},
                       "ratios": {k: round(results[k]["samples_per_second"] / base, 3) for k in INPUTS[1:]},
                       # what parquet delivers to a step that costs next to nothing, over the CNN's rate from arrays
                       "parquet_input_alone": round(results["parquet-dense"]["samples_per_second"] / base, 3)})
        for kind, result in results.items():
            kept.setdefault(kind, []).append(result)
    ratios = {k: {"median": round(statistics.median(r["ratios"][k] for r in rounds), 3), "target": TARGETS.get(k),
                  "runs": [r["ratios"][k] for r in rounds]} for k in INPUTS[1:]}
    median_run = {k: sorted(v, key=lambda r: r["samples_per_second"])[len(v) // 2] for k, v in kept.items()}
    results = {"1x": median_run, f"{scale}x": {}}
    bigger = dataset(out, int(params["rows"]) * scale, params)
    for kind in ("parquet", "tfrecord"):  # the streamed inputs' memory at scale x rows, once
        payload = {"input": kind, "data": str(bigger), "out": str(out / f"run-{scale}x-{kind}"),
                   "rows": int(params["rows"]) * scale, "params": params}
        results[f"{scale}x"][kind] = measure("app.bench.streaming", "one", payload, timeout=4 * 3600)[0]
        print(f"{scale}x {kind}: {json.dumps(results[f'{scale}x'][kind])}", flush=True)
    figures = ("driver_peak_mib", "train_worker_anon_peak_mib", "object_store_pages_peak_mib")
    memory = {k: {f: round(results[f"{scale}x"][k][f] / max(results["1x"][k][f], 1e-9), 3) for f in figures}
              for k in ("parquet", "tfrecord")}
    summary = out / "streaming.json"
    report.write_json(summary, {"rounds": rounds, "ratios": ratios, "steal": [r["steal"] for r in rounds],
                                "parquet_input_alone_median": statistics.median(r["parquet_input_alone"] for r in rounds),
                                "runs": results, "memory_ratio": memory, "command": command,
                                "preset": preset.as_dict()})
    for kind, ratio in ratios.items():
        print(f"{kind} / arrays: median {ratio['median']:.2f} of {ratio['runs']}"
              + (f" (target {ratio['target']:.2f})" if ratio["target"] else ""))
    print(f"CPU steal per round: {[r['steal'] for r in rounds]}")
    for kind, ratios_of in memory.items():
        print(f"{kind} memory {scale}x / 1x: " + ", ".join(f"{f} {v:.2f}" for f, v in ratios_of.items()))
    return [summary]


if __name__ == "__main__":
    child_main({"one": one})
