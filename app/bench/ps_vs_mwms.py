"""The ps suite: parameter-server training against MultiWorkerMirroredStrategy on the same model and CPUs.

Two whole ``python jobs/train.py`` runs, each starting its own local Ray: the
default strategy (all-reduce) with ``workers`` workers, and
``--strategy parameter-server`` with the same workers plus ``num_ps``
parameter servers, the CPUs shared out so that both reserve the same total.
From each run's result.json and history.csv: steady-state samples/s (epochs
after the first), the whole run's samples/s, the time to the first step, the
final val accuracy and the optimizer updates. -> ps.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import run_script, workload_flags

PARAMS = ("workers", "num_ps", "cpus")


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    workers, num_ps, cpus = int(preset.params["workers"]), int(preset.params["num_ps"]), float(preset.params["cpus"])
    # Same reservation for both: MWMS workers take cpus/workers each; under PS the servers take a share too.
    ps_share = math.floor(100 * cpus / (workers + num_ps)) / 100
    runs = {
        "mwms": ["--num-workers", str(workers), "--cpus-per-worker", f"{cpus / workers:g}"],
        "parameter-server": ["--strategy", "parameter-server", "--num-workers", str(workers), "--num-ps",
                             str(num_ps), "--cpus-per-worker", f"{ps_share:g}", "--cpus-per-ps", f"{ps_share:g}"],
    }
    rows: dict[str, dict[str, Any]] = {}
    for name, flags in runs.items():
        output = out / name
        run_script([sys.executable, "jobs/train.py", "--output", str(output), *workload_flags(preset.workload),
                    *flags], timeout=1800)
        rows[name] = _summary(output)
        print(f"{name}: {rows[name]}", flush=True)
    result = {
        "command": command,
        "runs": {name: " ".join(["python jobs/train.py", *workload_flags(preset.workload), *flags])
                 for name, flags in runs.items()},
        "results": rows,
        "ps_over_mwms_steady": rows["parameter-server"]["steady_samples_per_s"] / rows["mwms"]["steady_samples_per_s"],
        "ps_over_mwms_whole_run": rows["parameter-server"]["samples_per_s"] / rows["mwms"]["samples_per_s"],
    }
    print(f"parameter-server / MWMS samples/s: steady {result['ps_over_mwms_steady']:.2f}, "
          f"whole run {result['ps_over_mwms_whole_run']:.2f}")
    return [report.write_json(out / "ps.json", result)]


def _summary(output: Path) -> dict[str, Any]:
    result = json.loads((output / "result.json").read_text())
    lines = (output / "history.csv").read_text().splitlines()
    header = lines[0].split(",")
    per_epoch = [float(dict(zip(header, line.split(",")))["samples_per_second"]) for line in lines[1:]]
    return {
        "steady_samples_per_s": round(statistics.median(per_epoch[1:] or per_epoch), 1),
        "samples_per_s": round(result["samples_per_second"], 1),
        "time_to_first_step_s": round(result["time_to_first_step_seconds"] or 0, 1),
        "wall_s": round(result["wall_seconds"], 1),
        "val_accuracy": round(result["metrics"]["val_accuracy"], 4),
        "optimizer_updates": result.get("optimizer_steps", result["steps_per_epoch"] * result["epochs_completed"]),
        "global_batch": result["global_batch_size"],
    }
