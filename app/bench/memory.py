"""The memory suite: peak memory with a streamed parquet dataset at 1x and at ``scale`` times its size.

Writes a synthetic parquet dataset (``rows`` rows of ``shape`` float32 as a
flat list column, ~12 KB a row for 32x32x3: ~150 MB at 12,000 rows) and the
same at ``scale`` times the rows, then trains the preset's workload (one epoch
of a small mlp, ``data_cache: stream``: read and preprocess block by block,
never the whole set in one place) on each with ``workers`` Ray workers. Each
run is a fresh process with its own local Ray
(``python -m app.bench.memory one '<json>'``), so every peak belongs to that
run only (app.bench.sampler says how each is read):

- driver: the run's process (``ru_maxrss``);
- train worker: the largest ``ru_maxrss`` of the Ray Train workers (they
  report it), and its own memory (``rss - shared`` = RssAnon) and USS, sampled;
- other Ray processes: the largest RSS and own memory sampled of Ray Data's
  read/preprocess tasks (and the split coordinator), the Train controller and
  Ray's own daemons;
- the object store's pages: the machine's shared memory above its level at
  the start, every page counted once however many processes map it.

The data is written in files of ``rows_per_file`` rows, so writing it never
holds more than one file in memory either. Datasets are kept in the output
directory and reused; ``only`` runs one phase (write, 1x, scaled) and merges
its result into memory.json (a shared machine: one run at a time).

Measured on the 2-core development machine (2026-11-22, 2 workers, defaults:
16 MiB blocks, --stream-buffer-mib 256; with the /proc sampler this one
replaced, which read the same RssAnon):

    python jobs/benchmark.py memory --rows 24000    # 1x = 290 MB, 10x = 2.9 GB, two runs
                                     1x (MiB)      10x (MiB)     ratio
    driver                          277 / 277      281 / 280     1.014 / 1.010
    train worker, own (RssAnon)     450 / 454      473 / 464     1.051 / 1.021
    Ray Data task, own (RssAnon)  1,033 / 826    1,026 / 942     0.993 / 1.141
    object store's pages            411 / 411      491 / 534     1.195 / 1.301
    train worker, RSS               988 / 996    1,331 / 1,372   1.347 / 1.377

    python jobs/benchmark.py memory                 # 1x = 145 MB, 10x = 1.45 GB
    driver                          274 MiB      279 MiB   1.017
    train worker, own (RssAnon)     448 MiB      460 MiB   1.028
    Ray Data task, own (RssAnon)    863 MiB      962 MiB   1.115
    object store's pages            216 MiB      455 MiB   2.104
    train worker, RSS               931 MiB    1,207 MiB   1.297

What bounds it (app/data/streamed.py, ``streaming``): streamed datasets read
16 MiB blocks instead of Ray Data's 128 MiB, and may hold at most
``--stream-buffer-mib`` of the object store each (Ray Data's own default
budget is half the store, which reads run ahead to fill).

The driver's and a train worker's own memory stay within 5% in every run.
A Ray Data task's own memory lies between 800 and 1,040 MiB at either size
(the parquet reader reads 128 MiB of row groups per task): its ratio is the
luck of the 1x run, 0.99 to 1.14. The object store's pages grow until the
budgets are full: from 145 MB (less than the 2 x 256 MiB budget for train
and val) they double, from 290 MB they grow 20-30%. A worker's RSS maps
those shared pages as it reads blocks from all over the store, hence 1.3x.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import child_main, measure

log = logging.getLogger(__name__)

PARAMS = ("rows", "scale", "rows_per_file", "shape", "workers")
COMPLETE = "_complete"  # written last into a dataset's directory: its size in bytes


def write_dataset(directory: Path, rows: int, rows_per_file: int, shape: tuple[int, ...], seed: int = 0) -> int:
    """Learnable rows (a class pattern under noise), file by file; returns the bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    width = int(np.prod(shape))
    patterns = np.random.default_rng(seed).normal(size=(10, width)).astype(np.float32)
    for i, start in enumerate(range(0, rows, rows_per_file)):
        n = min(rows_per_file, rows - start)
        rng = np.random.default_rng([seed, i])
        y = rng.integers(0, 10, n)
        x = rng.normal(size=(n, width)).astype(np.float32) + 0.5 * patterns[y]
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width)
        pq.write_table(pa.table({"pixels": pixels, "label": y}), directory / f"part-{i:05d}.parquet")
    return sum(f.stat().st_size for f in directory.glob("*.parquet"))


def _is_task(name: str) -> bool:
    """Ray Data's read/preprocess tasks and the split coordinator run in Ray's pooled worker processes."""
    return name.startswith("ray::") and not name.startswith(("ray::RayTrainWorker", "ray::TrainController"))


def one(payload: dict[str, Any]) -> dict[str, Any]:
    """One training run in this process: ``{"data": DIR, "out": DIR, "workers": N, "workload": {...}}``."""
    import ray

    from app.bench.sampler import ProcessPeaks
    from app.config import build_config
    from app.driver import cluster
    from app.run.api import run_training
    from app.training.metrics import peak_rss_mib

    config = build_config(None, {**payload["workload"], "dataset": payload["data"], "output": payload["out"],
                                 "overwrite": True, "num_workers": payload["workers"]})
    started = time.time()
    with ProcessPeaks() as peaks:
        cluster.connect(config)  # the local Ray that jobs/train.py would start, shut down below
        try:
            result = run_training(config)
        finally:
            ray.shutdown()
    train_worker = lambda name: name.startswith("ray::RayTrainWorker")  # noqa: E731
    biggest = sorted(peaks.processes.values(), key=lambda p: -p.own)[:4]
    return {
        "rows_trained": result["rows"] - result["dropped_samples_per_epoch"],
        "val_rows": result["val_rows"],
        "seconds": round(time.time() - started, 1),
        "driver_peak_mib": round(peak_rss_mib(), 1),
        "train_worker_peak_mib": peaks.largest(train_worker),
        "train_worker_anon_peak_mib": peaks.largest(train_worker, "own"),
        "train_worker_uss_peak_mib": peaks.largest(train_worker, "uss"),
        "ray_data_process_peak_mib": peaks.largest(_is_task),
        "ray_data_process_anon_peak_mib": peaks.largest(_is_task, "own"),
        "object_store_pages_peak_mib": round(peaks.shmem_peak, 1),
        "train_controller_peak_mib": peaks.largest(lambda name: name.startswith("ray::TrainController")),
        "ray_daemon_peak_mib": peaks.largest(lambda name: not name.startswith("ray::")),
        "val_accuracy": result["metrics"]["val_accuracy"],
        # The four largest processes by own memory, for a look at where it went: [name, own, rss, uss].
        "largest_processes": [[p.name[:60], round(p.own, 1), round(p.rss, 1), round(p.uss, 1)] for p in biggest],
    }


def dataset(root: Path, rows: int, params: dict[str, Any]) -> tuple[Path, int]:
    """The parquet dataset of ``rows`` rows under ``root`` (written unless complete already) and its bytes."""
    data_dir = root / f"data-{rows}"
    if not (data_dir / COMPLETE).exists():
        log.info("writing %d rows to %s ...", rows, data_dir)
        size = write_dataset(data_dir, rows, int(params["rows_per_file"]), tuple(params["shape"]))
        (data_dir / COMPLETE).write_text(str(size))
    return data_dir, int((data_dir / COMPLETE).read_text())


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params, only = preset.params, preset.params.get("only")
    scale = int(params["scale"])
    sizes = {"1x": int(params["rows"]), f"{scale}x": int(params["rows"]) * scale}
    summary = out / "memory.json"
    results = json.loads(summary.read_text()) if only and summary.exists() else {}
    for label, rows in sizes.items():
        data_dir, size = dataset(out, rows, params)
        if only == "write" or (only == "1x" and label != "1x") or (only == "scaled" and label == "1x"):
            continue
        log.info("%s: one epoch on %d rows, %s workers ...", label, rows, params["workers"])
        payload = {"data": str(data_dir), "out": str(out / f"run-{label}"), "workers": int(params["workers"]),
                   "workload": preset.workload}
        results[label] = {"rows": rows, "parquet_mib": round(size / 2**20, 1),
                          **measure("app.bench.memory", "one", payload, timeout=4 * 3600)[0]}
        print(f"{label}: {json.dumps(results[label])}", flush=True)
        report.write_json(summary, {**results, "command": command, "preset": preset.as_dict()})
    if "1x" in results and f"{scale}x" in results:
        print(report.memory_table(results["1x"], results[f"{scale}x"], scale))
    return [summary] if summary.exists() else [out]


if __name__ == "__main__":
    child_main({"one": one})
