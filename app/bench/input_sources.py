"""The input suite: the same rows as each source a user can give, against the same rows as arrays in memory.

One synthetic dataset (seeded, learnable) is written once as each source, then trained on the same way
(``jobs/train.py`` with the preset's workload, on Ray workers) from each:

- arrays: an .npz file (read into memory, put in Ray's object store once): the baseline;
- parquet, streamed: a list column read by Ray Data block by block every epoch (``--data-cache stream``);
- parquet, cached: the same files held in Ray's object store after the first pass (``--data-cache memory``);
- tfrecord: ``tf.train.Example`` records (a float-list feature), streamed by Ray Data;
- tf.data: a data function returning a ``tf.data.Dataset`` of the arrays (read into arrays once, at the start).

Steady samples/s (the first epoch, with its tracing and first reads, left out) from each run's history.csv,
as ratios of the arrays' -> input.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from app.bench.keras_fit import _steady_from
from app.bench.preset import Preset
from app.bench.proc import run_script, workload_flags

PARAMS = ("rows", "shape", "files", "runs")

DATA_FUNCTION = '''"""The input suite's tf.data source: the .npz arrays as a tf.data.Dataset."""
import numpy as np
import tensorflow as tf


def dataset():
    data = np.load({npz!r})
    return tf.data.Dataset.from_tensor_slices((data["x"], data["label"]))
'''


def write_sources(out: Path, rows: int, shape: list[int], files: int) -> dict[str, list[str]]:
    """The dataset written once as every source; each source's --dataset and other flags."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    rng = np.random.default_rng(0)
    width = int(np.prod(shape))
    centers = rng.normal(size=(10, width)).astype(np.float32)
    y = rng.integers(0, 10, rows)
    x = (rng.normal(size=(rows, width)) + 0.8 * centers[y]).astype(np.float32)
    npz = out / "data" / "arrays.npz"
    npz.parent.mkdir(parents=True, exist_ok=True)
    np.savez(npz, x=x.reshape(rows, *shape), label=y)
    (out / "data" / "parquet").mkdir(exist_ok=True)
    (out / "data" / "tfrecord").mkdir(exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(rows), files)):
        pq.write_table(pa.table({"x": pa.array(list(x[part]), type=pa.list_(pa.float32())), "label": y[part]}),
                       out / "data" / "parquet" / f"part-{i}.parquet")
        with tf.io.TFRecordWriter(str(out / "data" / "tfrecord" / f"part-{i}.tfrecord")) as writer:
            for r in part:
                feature = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x[r])),
                           "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[r]]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    function = out / "data" / "tf_dataset.py"
    function.write_text(DATA_FUNCTION.format(npz=str(npz)))
    reshape = ["--feature-shape", *map(str, shape)]
    return {
        "arrays": ["--dataset", str(npz)],
        "parquet, streamed": ["--dataset", str(out / "data" / "parquet"), "--data-cache", "stream", *reshape],
        "parquet, cached": ["--dataset", str(out / "data" / "parquet"), "--data-cache", "memory", *reshape],
        "tfrecord": ["--dataset", str(out / "data" / "tfrecord"), "--data-cache", "stream", *reshape],
        "tf.data": ["--dataset", f"{function}:dataset"],
    }


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params = preset.params
    sources = write_sources(out, int(params["rows"]), list(params["shape"]), int(params["files"]))
    flags = workload_flags(preset.workload)
    rates: dict[str, list[float]] = {name: [] for name in sources}
    for i in range(int(params["runs"])):
        for name, source in sources.items():
            run_dir = out / f"{name.replace(', ', '-').replace('.', '')}-{i}"
            run_script([sys.executable, "jobs/train.py", *flags, *source, "--output", str(run_dir)], timeout=1800)
            rates[name].append(_steady_from(run_dir / "history.csv"))
            print(f"run {i + 1}, {name}: {rates[name][-1]:,.0f} samples/s", flush=True)
    best = {name: max(values) for name, values in rates.items()}  # the best of each: the machine drifts
    ratios = {name: best[name] / best["arrays"] for name in sources if name != "arrays"}
    result: dict[str, Any] = {
        "command": command,
        "workload": preset.workload,
        "data": {k: params[k] for k in ("rows", "shape", "files")},
        "samples_per_second": rates,
        "best": best,
        "vs_arrays": ratios,
        "goals": {f"{name} >= 0.9x arrays": ratio >= 0.9 for name, ratio in ratios.items()},
    }
    path = out / "input.json"
    path.write_text(json.dumps(result, indent=2))
    print(", ".join(f"{name} / arrays {ratio:.2f}" for name, ratio in ratios.items()))
    return [path]
