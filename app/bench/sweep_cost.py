"""The sweep suite: ASHA against the full grid on the same search space, in worker-seconds and best accuracy.

Two ``python jobs/tune.py`` runs of ``space``, each starting its own local Ray:
``--scheduler fifo`` (every trial to its last epoch: the grid) and
``--scheduler asha`` (poor trials stopped at its rungs). From each sweep's
summary.yaml and results.csv: the best val metric, the worker-seconds spent
(each trial's wall time from its start, Ray Train's start-up included, times
its workers), the trials stopped early, and the epochs run. ASHA pays off when
an epoch costs more than a trial's start-up: the space's epochs should be
long. -> sweep.json
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import yaml

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import run_script, workload_flags

PARAMS = ("space",)
SCHEDULERS = ("fifo", "asha")


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    space = str(preset.params["space"])
    fixed = workload_flags(preset.workload)
    runs, commands = {}, {}
    for scheduler in SCHEDULERS:
        output = out / scheduler
        cmd = ["jobs/tune.py", "--space", space, "--scheduler", scheduler, *fixed, "--output", str(output)]
        print(f"python {' '.join(cmd)} ...", flush=True)
        run_script([sys.executable, *cmd], timeout=7200)
        runs[scheduler], commands[scheduler] = _summary(output), "python " + " ".join(cmd)
        print(f"  {scheduler}: {runs[scheduler]}", flush=True)
    grid, asha = runs["fifo"], runs["asha"]
    result = {
        "command": command,
        "sweeps": commands,
        "results": runs,
        "asha_worker_seconds_over_grid": asha["worker_seconds"] / grid["worker_seconds"],
        "asha_best_minus_grid_best": asha["best"] - grid["best"],
    }
    print(f"ASHA / grid worker-seconds: {result['asha_worker_seconds_over_grid']:.2f}; best {asha['metric']}: "
          f"ASHA {asha['best']:.4f}, grid {grid['best']:.4f} ({result['asha_best_minus_grid_best']:+.4f})")
    return [report.write_json(out / "sweep.json", result)]


def _summary(output: Path) -> dict[str, Any]:
    summary = yaml.safe_load((output / "summary.yaml").read_text())
    with open(output / "results.csv") as f:
        trials = list(csv.DictReader(f))
    metric = summary["metric"]
    return {
        "metric": metric,
        "best": summary["best"][metric],
        "best_config": summary["best"]["config"],
        "trials": summary["trials"],
        "stopped_early": summary["stopped_early"],
        "epochs_run": sum(int(float(t["epochs_run"] or 0)) for t in trials),
        "worker_seconds": summary["worker_seconds_spent"],
    }
