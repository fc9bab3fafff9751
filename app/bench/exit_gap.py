"""The exit suite: how long ``python jobs/train.py`` takes to end after its last epoch line.

For each data path (in-memory arrays, and parquet streamed through Ray Data,
written here), ``runs`` whole runs of jobs/train.py, each starting its own
local Ray. The console is read line by line as it comes: the gap is from the
last epoch line to the process's exit. Between the two the run writes its
outputs (result.json, history.csv, curves.png, the model copied from the last
checkpoint, and the SavedModel exported from it: each run is checked to have
written saved_model/, so the gap covers the export) and Ray shuts down; a tf.data iterator destroyed while its
autotuning thread sleeps can add 7-60 s here (docs/design.md). -> exit.json

``checkout`` runs another checkout's jobs/train.py (a git worktree of an older
commit, say) with the same workload: the baseline, measured in the same run.
Its workload flags must exist there too.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from app.bench.preset import Preset
from app.bench.proc import REPO, local_env, workload_flags

PARAMS = ("runs", "rows", "checkout")

# Before and after the console work: the rank-0 worker's line, with or without Ray's "(pid=...)" prefix.
_EPOCH_LINE = re.compile(r"epoch +\d+/\d+ +train_loss")


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    runs, rows = int(preset.params["runs"]), int(preset.params["rows"])
    checkout = Path(preset.params["checkout"] or REPO).resolve()
    data = _parquet(out / "data", rows)
    paths = {"in-memory": ["--dataset", "synthetic", "--synthetic-rows", str(rows)],
             "streamed": ["--dataset", str(data), "--data-cache", "stream"]}
    gaps: dict[str, list[float]] = {}
    for name, flags in paths.items():
        for i in range(runs):
            gap = _one_run(checkout, out / f"{name}-{i}", [*workload_flags(preset.workload), *flags])
            gaps.setdefault(name, []).append(gap)
            print(f"{name} run {i + 1}/{runs}: {gap:.1f} s from the last epoch line to exit", flush=True)
    result = {
        "command": command,
        "checkout": str(checkout),
        "gaps_s": gaps,
        "median_s": {k: statistics.median(v) for k, v in gaps.items()},
        "max_s": {k: max(v) for k, v in gaps.items()},
    }
    path = out / "exit.json"
    path.write_text(json.dumps(result, indent=2))
    for name in gaps:
        print(f"{name}: median {result['median_s'][name]:.1f} s, max {result['max_s'][name]:.1f} s "
              f"over {runs} runs")
    return [path]


def _one_run(checkout: Path, output: Path, flags: list[str]) -> float:
    cmd = [sys.executable, "jobs/train.py", "--output", str(output), *flags]
    proc = subprocess.Popen(cmd, cwd=checkout, env=local_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    last_epoch, tail = None, []
    for line in proc.stdout:
        tail = [*tail[-40:], line]
        if _EPOCH_LINE.search(line):
            last_epoch = time.monotonic()
    proc.wait(timeout=600)
    ended = time.monotonic()
    if proc.returncode != 0 or last_epoch is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{''.join(tail)}")
    # This checkout's runs export a SavedModel by default, and the gap must include it (an older --checkout's need not).
    if checkout == REPO.resolve() and "--export" not in flags and not (output / "saved_model" / "saved_model.pb").is_file():
        raise RuntimeError(f"{output} has no saved_model/: the gap would not cover the export")
    return ended - last_epoch


def _parquet(directory: Path, rows: int) -> Path:
    """A learnable 16-feature, 4-class parquet dataset in two files (kept for the next run)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if directory.is_dir():
        return directory
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, rows)
    x = (rng.normal(size=(rows, 16)) + 2 * rng.normal(size=(4, 16))[y]).astype("float32")
    for i, part in enumerate(np.array_split(np.arange(rows), 2)):
        pq.write_table(pa.table({"features": pa.array(list(x[part]), type=pa.list_(pa.float32())), "label": y[part]}),
                       directory / f"part-{i}.parquet")
    return directory
