"""The predict suite: batch prediction's rows/s against model.predict, and its memory as the data grows.

1. Writes a parquet dataset of ``rows`` rows (app.bench.memory.write_dataset: ``shape`` float32 as a list column
   and a label, in files of ``rows_per_file``) and the same at ``scale`` times the rows, and trains the workload on
   the 1x set (jobs/train.py --backend local): the run predicted with.
2. rows/s, each in a process of its own:
   - ``model.predict`` in one plain process on the 1x rows, the model loaded and the features in memory (the call
     alone is timed, after a warm-up call), TensorFlow on 1 thread and on every core;
   - the Ray path (app.tools.predict, what jobs/predict.py calls), actors x 1 CPU, each run with a local Ray of its
     own: 2 actors on the 1x rows, 1 and 2 actors on the scale x rows (the start-up amortised). rows /
     ``predict_seconds`` (from the pool's start to the last file written: the actors' start, their TensorFlow
     import and model load, reading, predicting, writing) and rows / the whole call (Ray's start and the checks on
     the first rows too). Not sampled: reading every process's memory costs CPU.
3. Memory, 2 actors, at 1x and at ``scale`` x (two more runs): each predictor actor's peak own memory (RssAnon) and
   RSS, Ray Data's read/repartition/write tasks', the driver's (ru_maxrss), the object store's pages, sampled every
   2 s by app.bench.sampler.

-> predict.json. Datasets and the run are kept in the output directory and reused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.memory import dataset
from app.bench.preset import Preset
from app.bench.proc import child_main, measure, run_script, workload_flags

log = logging.getLogger(__name__)

PARAMS = ("rows", "scale", "rows_per_file", "shape", "batch_size")
FEATURES = "pixels"  # app.bench.memory.write_dataset's feature column


def plain(payload: dict[str, Any]) -> dict[str, Any]:
    """model.predict in this process: ``{"run": DIR, "data": DIR, "threads": N or 0 (all), "batch_size": B}``."""
    import math

    import numpy as np
    import pyarrow.dataset as pads

    if payload["threads"]:
        from app.training.strategy import set_thread_counts

        set_thread_counts(payload["threads"])
    import keras

    model = keras.models.load_model(Path(payload["run"]) / "model.keras", compile=False)
    column = pads.dataset(payload["data"], format="parquet").to_table(columns=[FEATURES]).column(FEATURES)
    shape = tuple(model.inputs[0].shape[1:])
    x = column.combine_chunks().flatten().to_numpy().astype(np.float32).reshape(len(column), math.prod(shape))
    x = x.reshape(len(x), *shape)
    batch = int(payload["batch_size"])
    model.predict(x[: 4 * batch], batch_size=batch, verbose=0)  # traced once, as the actors' first batch is
    started = time.perf_counter()
    model.predict(x, batch_size=batch, verbose=0)
    seconds = time.perf_counter() - started
    return {"rows": len(x), "seconds": round(seconds, 3), "rows_per_second": round(len(x) / seconds, 1)}


def on_ray(payload: dict[str, Any]) -> dict[str, Any]:
    """app.tools.predict on a local Ray this process starts: ``{"run", "data", "out", "workers", "batch_size",
    "sample"}``. ``sample``: the processes' memory every 2 s (reading every process's smaps costs CPU: seen taking
    most of a core at 0.5 s on this 2-core machine, so runs timed for rows/s are not sampled)."""
    import ray

    from app.bench.sampler import ProcessPeaks
    from app.tools import predict, trained
    from app.training.metrics import peak_rss_mib

    found = trained.located(run=payload["run"], overrides={"dataset": payload["data"]})
    options = predict.PredictOptions(output=payload["out"], keep_columns=("label",), num_workers=payload["workers"],
                                     batch_size=payload["batch_size"], overwrite=True)
    started = time.time()
    with ProcessPeaks(interval=2.0) if payload["sample"] else contextlib.nullcontext() as peaks:
        try:
            summary = predict.predict(found, options)
        finally:
            ray.shutdown()
    timing = {"rows": summary["rows"], "predict_seconds": summary["predict_seconds"],
              "rows_per_second": round(summary["rows"] / summary["predict_seconds"], 1),
              "whole_seconds": round(time.time() - started, 1),
              "rows_per_second_whole": round(summary["rows"] / (time.time() - started), 1)}
    if peaks is None:
        return timing
    predictor = lambda name: "Predictor" in name  # noqa: E731  (Ray names the actors' processes after them)
    tasks = lambda name: name.startswith("ray::") and "Predictor" not in name  # noqa: E731
    biggest = sorted(peaks.processes.values(), key=lambda p: -p.own)[:4]
    return {
        **timing,
        "predictor_anon_peak_mib": peaks.largest(predictor, "own"),
        "predictor_rss_peak_mib": peaks.largest(predictor),
        "ray_data_task_anon_peak_mib": peaks.largest(tasks, "own"),
        "driver_peak_mib": round(peak_rss_mib(), 1),
        "object_store_pages_peak_mib": round(peaks.shmem_peak, 1),
        "largest_processes": [[p.name[:60], round(p.own, 1), round(p.rss, 1)] for p in biggest],
    }


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params = preset.params
    scale, batch = int(params["scale"]), int(params["batch_size"])
    sizes = {"1x": int(params["rows"]), f"{scale}x": int(params["rows"]) * scale}
    data = {label: dataset(out, rows, params)[0] for label, rows in sizes.items()}
    trained_run = out / "run"
    if not (trained_run / "model.keras").is_file():
        log.info("training the workload on %s ...", data["1x"])
        run_script([sys.executable, "jobs/train.py", "--backend", "local", "--dataset", str(data["1x"]), "--feature-columns",
                    FEATURES, *workload_flags(preset.workload), "--output", str(trained_run), "--overwrite"],
                   timeout=3600)
    results: dict[str, Any] = {}

    def record(name: str, figures: dict[str, Any]) -> None:
        results[name] = figures
        print(f"{name}: {json.dumps(figures)}", flush=True)

    for threads in (1, 0):
        record(f"model.predict, {threads or 'all'} thread(s)",
               measure("app.bench.predict_cost", "plain", {"run": str(trained_run), "data": str(data["1x"]),
                                                           "threads": threads, "batch_size": batch})[0])
    # rows/s (not sampled): 2 actors on the 1x rows, then 1 and 2 on the scale x rows (the start-up amortised);
    # memory (sampled): 2 actors at 1x and at scale x.
    for workers, label, sample in ((2, "1x", False), (1, f"{scale}x", False), (2, f"{scale}x", False),
                                   (2, "1x", True), (2, f"{scale}x", True)):
        payload = {"run": str(trained_run), "data": str(data[label]), "out": str(out / f"predictions-{workers}-{label}"),
                   "workers": workers, "batch_size": batch, "sample": sample}
        record(f"ray {workers} actor(s), {label}{', memory' if sample else ''}",
               measure("app.bench.predict_cost", "on_ray", payload, timeout=4 * 3600)[0])
    summary = out / "predict.json"
    report.write_json(summary, {"results": results, "rows": sizes, "command": command, "preset": preset.as_dict()})
    print(table(results, scale))
    return [summary]


def table(results: dict[str, Any], scale: int) -> str:
    """The markdown tables of BENCHMARKS.md: rows/s against model.predict, then memory at 1x and scale x."""
    base = results["model.predict, 1 thread(s)"]["rows_per_second"]
    lines = ["| run | rows | rows/s | vs model.predict, 1 thread | rows/s, whole call |", "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if not name.endswith("memory"):
            whole = r.get("rows_per_second_whole")
            lines.append(f"| {name} | {r['rows']:,} | {r['rows_per_second']:,.0f} | {r['rows_per_second'] / base:.2f} | "
                         f"{f'{whole:,.0f}' if whole else ''} |")
    one, big = results["ray 2 actor(s), 1x, memory"], results[f"ray 2 actor(s), {scale}x, memory"]
    lines += ["", f"| 2 actors, peak | 1x ({one['rows']:,} rows) | {scale}x ({big['rows']:,} rows) | ratio |",
              "|---|---:|---:|---:|"]
    for key, what in (("predictor_anon_peak_mib", "a predictor actor, own memory (RssAnon), MiB"),
                      ("predictor_rss_peak_mib", "a predictor actor, RSS, MiB"),
                      ("ray_data_task_anon_peak_mib", "a Ray Data read/repartition/write task, own memory, MiB"),
                      ("driver_peak_mib", "the driver, MiB"), ("object_store_pages_peak_mib", "object store pages, MiB")):
        ratio = big[key] / one[key] if one[key] else float("nan")
        lines.append(f"| {what} | {one[key]:,.0f} | {big[key]:,.0f} | {ratio:.3f} |")
    return "\n".join(lines)

if __name__ == "__main__":
    child_main({"plain": plain, "on_ray": on_ray})
