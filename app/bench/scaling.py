"""The throughput suite: the Ray path against a plain TensorFlow loop, on a compute-bound model.

In one run, each in a fresh process, on the same model, data and thread count:

  (a) baseline: a plain single-process tf.function loop, no Ray, no strategy
  (b) the Ray path (jobs/train.py) with 1 worker x 1 CPU
  (c) the Ray path with 2 workers x 1 CPU, and more where the machine has them
  (d) for each N > 1: N plain loops at once, each on 1/N of the data, no
      communication: what N single-threaded processes reach on this machine,
      the ceiling for (c)

plus the input pipeline alone (a Ray worker's input for in-memory data: rank 0
of 2 taking its slice of each epoch, no model) and the time from starting
jobs/train.py to its first step. Writes benchmark.json and scaling.png.
Figures are ratios within this run (speedup, efficiency, overhead), because
absolute seconds on a shared machine are noise.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import measure, run_script, steady
from app.errors import UserError

log = logging.getLogger(__name__)

PARAMS = ("workers", "input_workers", "startup")
MEASURE = "app.bench.throughput"


def worker_counts(workers: Any) -> list[int]:
    """``auto``: 1 and 2, 4 where the machine has 4 CPUs, and all of them from 8 on; or the list given."""
    cpus = os.cpu_count() or 1
    if workers == "auto":
        return sorted({1, 2, *([4] if cpus >= 4 else []), *([cpus] if cpus >= 8 else [])})
    counts = sorted({int(w) for w in ([workers] if isinstance(workers, int) else workers)})
    if not counts or counts[0] < 1:
        raise UserError(f"workers: give positive worker counts or auto, got {workers!r}")
    if counts[-1] > cpus:
        raise UserError(f"--workers {counts[-1]} needs {counts[-1]} CPUs, this machine has {cpus}")
    return counts


def plain(workload: dict, processes: int = 1) -> dict[str, Any]:
    """The plain loop; with ``processes`` > 1, that many at once, each on 1/N of the rows, samples/s summed.

    Plain TF loops in N processes at once, with no communication, are what N
    single-threaded workers could reach on this machine at best: the ceiling
    for the N-worker Ray run, measured the same way.
    """
    if processes == 1:
        return measure(MEASURE, "plain", workload)[0]
    part = {**workload, "synthetic_rows": workload["synthetic_rows"] // processes}
    results = measure(MEASURE, "plain", part, processes=processes)
    return {"samples_per_second": sum(r["samples_per_second"] for r in results), "processes": results}


def train_run(workload: dict, workers: Optional[int], out: Path) -> dict[str, Any]:
    """jobs/train.py as a user runs it, the workload as its --config file; steady samples/s from history.csv."""
    import yaml

    config_file = out.parent / f"{out.name}.yaml"
    config_file.write_text(yaml.safe_dump(workload))
    run_script([sys.executable, "jobs/train.py", "--config", str(config_file),
                *(["--num-workers", str(workers)] if workers else []), "--output", str(out), "--overwrite"],
               timeout=1800)
    result = json.loads((out / "result.json").read_text())
    with open(out / "history.csv") as f:
        per_epoch = [float(row["samples_per_second"]) for row in csv.DictReader(f)]
    return {
        "samples_per_second": steady(per_epoch),
        "per_epoch": per_epoch,
        "time_to_first_step_seconds": result["time_to_first_step_seconds"],
        "wall_seconds": result["wall_seconds"],
    }


def _row(run: str, workers: int, sps: float, one: float, baseline: float) -> dict[str, Any]:
    return {"run": run, "workers": workers, "samples_per_second": sps, "speedup": sps / one,
            "efficiency": sps / (one * workers), "vs_baseline": sps / baseline}


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    workers = worker_counts(preset.params["workers"])
    workload = preset.workload
    log.info("workload: %s", json.dumps(workload))

    log.info("(a) plain TensorFlow loop, 1 thread ...")
    baseline = plain(workload)
    log.info("    %.0f samples/s", baseline["samples_per_second"])
    ceilings = {}
    for w in (w for w in workers if w > 1):
        log.info("plain TensorFlow loops in %d processes at once, no communication (the %d-worker ceiling) ...", w, w)
        ceilings[w] = plain(workload, processes=w)
        log.info("    %.0f samples/s", ceilings[w]["samples_per_second"])
    world = int(preset.params["input_workers"])
    log.info("input pipeline alone (train_batches_from_arrays, rank 0 of %d, no model) ...", world)
    pipeline = measure(MEASURE, "input", {**workload, "input_workers": world})[0]
    log.info("    %.0f samples/s", pipeline["samples_per_second"])
    runs = {}
    for w in workers:
        log.info("Ray path, %d worker(s) x 1 CPU ...", w)
        runs[w] = train_run(workload, w, out / f"ray-{w}")
        log.info("    %.0f samples/s", runs[w]["samples_per_second"])
    startup_workload = preset.params["startup"]
    if startup_workload is None:
        startup = {"time_to_first_step_seconds": runs[max(workers)]["time_to_first_step_seconds"],
                   "source": f"the {max(workers)}-worker run above"}
    else:
        line = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in startup_workload.items())
        log.info("start-up: python jobs/train.py %s ...", line)
        started = train_run(startup_workload, None, out / "startup")
        startup = {"time_to_first_step_seconds": started["time_to_first_step_seconds"],
                   "source": f"python jobs/train.py {line}".strip()}

    b = baseline["samples_per_second"]
    one = runs[min(workers)]["samples_per_second"] / min(workers)  # what one worker consumes
    rows = [{**_row("plain TF (baseline)", 1, b, one, b), "efficiency": 1.0}]
    rows += [_row(f"ray {w} worker(s)", w, runs[w]["samples_per_second"], one, b) for w in workers]
    rows += [_row(f"plain TF x{w} processes", w, c["samples_per_second"], one, b) for w, c in ceilings.items()]
    sps = {w: r["samples_per_second"] for w, r in runs.items()}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count() or 1, "platform": sys.platform},
        "command": command,
        "preset": preset.as_dict(),
        "workload": workload,
        "table": rows,
        "baseline": baseline,
        "ray_runs": {str(w): r for w, r in runs.items()},
        "plain_processes_at_once": {str(w): c for w, c in ceilings.items()},
        "input_pipeline": {**pipeline, "vs_one_worker_consumption": pipeline["samples_per_second"] / one},
        "startup": startup,
        "goals": {
            "one_worker_vs_baseline >= 0.97": sps[1] / b if 1 in sps else None,
            "two_workers_vs_one >= 1.8": sps[2] / sps[1] if {1, 2} <= sps.keys() else None,
            **{f"{w}_workers_vs_{w}_plain_processes": sps[w] / c["samples_per_second"] for w, c in ceilings.items()},
            "input_vs_consumption >= 5": pipeline["samples_per_second"] / one,
            "first_step_seconds <= 15": startup["time_to_first_step_seconds"],
        },
    }
    written = [report.write_json(out / "benchmark.json", result), report.scaling_plot(rows, out / "scaling.png")]
    print(report.throughput_summary(result))
    return written
