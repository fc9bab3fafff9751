"""The throughput suite: the Ray path against a plain TensorFlow loop, on a compute-bound model.

In one run, each in a fresh process, on the same model, data and thread count:

  (a) baseline: a plain single-process tf.function loop, no Ray, no strategy; and Keras's own
      model.fit in one process (the built-in model compiled with Adam and the task's loss)
  (b) the Ray path (jobs/train.py) with 1 worker x 1 CPU
  (c) the Ray path with 2 workers x 1 CPU, and more where the machine has them
  (d) for each N > 1: N plain loops at once, each on 1/N of the data, no
      communication, timed over the same window once all have warmed up: what
      N single-threaded processes reach on this machine, the ceiling for (c);
      measured before and after the Ray runs, and averaged (it drifts)

Steady state: samples/s after the first epoch. Over the whole run (first epoch,
tracing included, as result.json reports it), with ``whole_run``: (b) against
``--backend local`` on one device, and (c) against N local runs at once on 1/N
of the rows each. Plus the input pipeline alone (a Ray worker's input for
in-memory data, no model) and the time to first step (app.bench.startup): on a
Ray the run starts itself and, with ``running_cluster``, on one already running.
Writes benchmark.json and scaling.png. Figures are ratios within this run,
because absolute seconds on a shared machine are noise.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from app.bench import report, startup
from app.bench.preset import Preset
from app.bench.proc import measure, run_script, steady, workload_flags
from app.errors import UserError

log = logging.getLogger(__name__)

PARAMS = ("workers", "input_workers", "ceiling_window_s", "whole_run", "startup", "startup_runs", "running_cluster")
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


def plain(workload: dict, processes: int = 1, window_s: float = 30.0) -> dict[str, Any]:
    """The plain loop; with ``processes`` > 1, that many at once, each on 1/N of the rows, samples/s summed.

    Plain TF loops in N processes at once, with no communication, are what N
    single-threaded workers could reach on this machine at best: the ceiling
    for the N-worker Ray run. They are timed over the same ``window_s`` seconds,
    after all have run their first epoch.
    """
    import tempfile

    if processes == 1:
        return measure(MEASURE, "plain", workload)[0]
    part = {**workload, "synthetic_rows": workload["synthetic_rows"] // processes}
    with tempfile.TemporaryDirectory(prefix="barrier-") as barrier:
        together = {"processes": processes, "barrier": barrier, "window_s": window_s}
        results = measure(MEASURE, "plain", {**part, "together": together}, processes=processes)
    return {"samples_per_second": sum(r["samples_per_second"] for r in results), "processes": results}


def train_run(workload: dict, workers: Optional[int], out: Path, *flags: str) -> dict[str, Any]:
    """jobs/train.py as a user runs it, the workload as its --config file; steady samples/s from history.csv."""
    import yaml

    config_file = out.parent / f"{out.name}.yaml"
    config_file.write_text(yaml.safe_dump(workload))
    run_script([sys.executable, "jobs/train.py", "--config", str(config_file),
                *(["--num-workers", str(workers)] if workers else []), *flags, "--output", str(out), "--overwrite"],
               timeout=1800)
    return read_run(out)


def read_run(out: Path) -> dict[str, Any]:
    result = json.loads((out / "result.json").read_text())
    with open(out / "history.csv") as f:
        history = list(csv.DictReader(f))
    per_epoch = [float(row["samples_per_second"]) for row in history]
    return {
        "samples_per_second": steady(per_epoch),
        "whole_run_samples_per_second": result["samples_per_second"],
        # (the own step's counts; a run by Keras's fit times whole epochs, validation included)
        "train_samples": sum(int(row.get("train_samples") or 0) or float(row["samples_per_second"]) * float(row["seconds"])
                             for row in history),
        "train_seconds": sum(float(row.get("train_seconds") or row["seconds"]) for row in history),
        "per_epoch": per_epoch,
        "time_to_first_step_seconds": result["time_to_first_step_seconds"],
        "wall_seconds": result["wall_seconds"],
    }


def local_runs(workload: dict, processes: int, out: Path) -> dict[str, Any]:
    """``processes`` jobs/train.py --backend local runs (one device) at once, each on 1/N of the rows.

    Together: all their training samples over the longest one's training time (a run that
    finishes first leaves the other alone on the machine: their own rates summed would read high).
    """
    import concurrent.futures

    part = {**workload, "synthetic_rows": workload["synthetic_rows"] // processes}
    with concurrent.futures.ThreadPoolExecutor(processes) as pool:
        runs = list(pool.map(lambda i: train_run(part, None, out / f"local-{processes}-{i}", "--backend", "local",
                                                 "--strategy", "one-device"), range(processes)))
    together = sum(r["train_samples"] for r in runs) / max(r["train_seconds"] for r in runs)
    return {"whole_run_samples_per_second": together, "runs": runs}


def _row(run: str, workers: int, sps: float, one: float, baseline: float) -> dict[str, Any]:
    return {"run": run, "workers": workers, "samples_per_second": sps, "speedup": sps / one,
            "efficiency": sps / (one * workers), "vs_baseline": sps / baseline}


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    params, workload = preset.params, preset.workload
    workers = worker_counts(params["workers"])
    log.info("workload: %s", json.dumps(workload))

    log.info("(a) plain TensorFlow loop, 1 thread ...")
    baseline = plain(workload)
    log.info("    %.0f samples/s", baseline["samples_per_second"])
    log.info("Keras's own model.fit in one process, 1 thread ...")
    keras_fit = measure("app.bench.keras_fit", "fit", {**workload, "output": str(out / "keras-fit")})[0]
    log.info("    %.0f samples/s", keras_fit["samples_per_second"])
    ceilings: dict[int, list[dict]] = {w: [] for w in workers if w > 1}

    def measure_ceilings(when: str) -> None:
        for w in ceilings:
            log.info("plain TensorFlow loops in %d processes at once, no communication (the %d-worker ceiling, %s) ...",
                     w, w, when)
            ceilings[w].append(plain(workload, processes=w, window_s=float(params["ceiling_window_s"])))
            log.info("    %.0f samples/s", ceilings[w][-1]["samples_per_second"])

    # Before and after the Ray runs: what two processes get here drifts with the host's load, by 10% and more.
    measure_ceilings("before the Ray runs")
    world = int(params["input_workers"])
    log.info("input pipeline alone (train_batches_from_arrays, rank 0 of %d, no model) ...", world)
    pipeline = measure(MEASURE, "input", {**workload, "input_workers": world})[0]
    log.info("    %.0f samples/s", pipeline["samples_per_second"])
    runs = {}
    for w in workers:
        log.info("Ray path, %d worker(s) x 1 CPU ...", w)
        runs[w] = train_run(workload, w, out / f"ray-{w}")
        log.info("    %.0f samples/s (whole run %.0f)", runs[w]["samples_per_second"],
                 runs[w]["whole_run_samples_per_second"])
    measure_ceilings("after the Ray runs")
    ceiling = {w: statistics.mean(c["samples_per_second"] for c in both) for w, both in ceilings.items()}
    local = {}
    for w in workers if params["whole_run"] else ():
        log.info("whole runs: jobs/train.py --backend local on one device, %d at once on 1/%d of the rows ...", w, w)
        local[w] = local_runs(workload, w, out)
        log.info("    %.0f samples/s", local[w]["whole_run_samples_per_second"])
    first_steps = _first_steps(params, runs, out)

    b = baseline["samples_per_second"]
    one = runs[min(workers)]["samples_per_second"] / min(workers)  # what one worker consumes
    rows = [{**_row("plain TF (baseline)", 1, b, one, b), "efficiency": 1.0}]
    rows += [_row(f"ray {w} worker(s)", w, runs[w]["samples_per_second"], one, b) for w in workers]
    rows += [_row(f"plain TF x{w} processes", w, c, one, b) for w, c in ceiling.items()]
    rows += [_row("Keras model.fit, 1 process", 1, keras_fit["samples_per_second"], one, b)]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count() or 1, "platform": sys.platform},
        "command": command,
        "preset": preset.as_dict(),
        "workload": workload,
        "table": rows,
        "baseline": baseline,
        "keras_fit": keras_fit,
        "ray_runs": {str(w): r for w, r in runs.items()},
        "plain_processes_at_once": {str(w): {"samples_per_second": ceiling[w], "before_and_after": both}
                                    for w, both in ceilings.items()},
        "local_runs_at_once": {str(w): r for w, r in local.items()},
        "input_pipeline": {**pipeline, "vs_one_worker_consumption": pipeline["samples_per_second"] / one},
        "startup": first_steps,
        "goals": _goals(runs, local, ceiling, b, keras_fit["samples_per_second"],
                        pipeline["samples_per_second"] / one, first_steps),
    }
    written = [report.write_json(out / "benchmark.json", result), report.scaling_plot(rows, out / "scaling.png")]
    print(report.throughput_summary(result))
    return written


def _goals(runs: dict[int, dict], local: dict[int, dict], ceiling: dict[int, float], baseline: float,
           keras_fit: float, input_vs_consumption: float, first_steps: dict[str, dict]) -> dict[str, Any]:
    """Each figure the suite is asked for, beside its goal (samples/s ``baseline``: the plain loop's; ``keras_fit``:
    Keras's model.fit in one process)."""
    sps = {w: r["samples_per_second"] for w, r in runs.items()}
    whole = {w: r["whole_run_samples_per_second"] for w, r in runs.items()}
    return {
        "1 worker vs plain loop, steady >= 0.97": sps[1] / baseline if 1 in sps else None,
        **({"1 worker vs local one device, whole run >= 0.97": whole[1] / local[1]["whole_run_samples_per_second"]}
           if 1 in local and 1 in whole else {}),
        **{f"{w} workers vs {w} plain processes, steady >= 0.90": sps[w] / c for w, c in ceiling.items()},
        **{f"{w} workers vs {w} local runs at once, whole run >= 0.90": whole[w] / r["whole_run_samples_per_second"]
           for w, r in local.items() if w > 1 and w in whole},
        "2 workers vs 1": sps[2] / sps[1] if {1, 2} <= sps.keys() else None,
        "2 workers vs Keras model.fit in one process, steady >= 1.2": sps[2] / keras_fit if 2 in sps else None,
        "input vs consumption >= 5": input_vs_consumption,
        **{f"first step, {where} (s) <= 15": s["time_to_first_step_seconds"] for where, s in first_steps.items()},
    }


def _first_steps(params: dict[str, Any], runs: dict[int, dict], out: Path) -> dict[str, dict[str, Any]]:
    """Time to first step (app.bench.startup): on a Ray the run starts, and on a running cluster if asked."""
    if params["startup"] is None:
        largest = max(runs)
        return {"own Ray": {"time_to_first_step_seconds": runs[largest]["time_to_first_step_seconds"],
                            "runs": [runs[largest]["time_to_first_step_seconds"]],
                            "source": f"the {largest}-worker run above"}}
    flags = workload_flags(params["startup"])
    count = int(params["startup_runs"])
    log.info("start-up: python jobs/train.py %s, %d times ...", " ".join(flags), count)
    found = {"own Ray": startup.fresh(flags, count, out / "startup")}
    log.info("    median %.1f s", found["own Ray"]["time_to_first_step_seconds"])
    if params["running_cluster"]:
        cpus = (os.cpu_count() or 1) + 1  # the size of the local Ray that jobs/train.py starts
        log.info("start-up on a running cluster (ray start --head --num-cpus %d), %d times ...", cpus, count)
        found["running cluster"] = startup.running_cluster(flags, count, out / "startup", cpus)
        log.info("    median %.1f s", found["running cluster"]["time_to_first_step_seconds"])
    return found
