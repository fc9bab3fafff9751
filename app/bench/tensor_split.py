"""The tensor-parallel suite: the built-in transformer with its feed-forward pairs split over N devices of one
process (``jobs/train.py --backend local --tensor-parallel N``), against the same run on one device.

For each N in ``degrees`` (1: ``--tensor-parallel 1 --strategy one-device``, no split), one whole run on the same
data, model, seed and threads; from its result.json and history.csv: steady samples/s (the epochs after the first),
the whole run's, and the bytes each device holds of the split layers' variables (result.json's ``tensor_parallel``, read from the
variables' devices; N = 1: the unsplit layers' bytes, all on one device). -> tensor-parallel.json

On a CPU the N logical devices share the same cores: the split shows the placement and the memory per device, not
a speed-up (BENCHMARKS.md says what a GPU box would change).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from app.bench import report, scaling
from app.bench.preset import Preset
from app.bench.proc import run_script, workload_flags

PARAMS = ("degrees",)


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    degrees = sorted({int(n) for n in preset.params["degrees"]})
    flags = workload_flags(preset.workload)
    rows: dict[int, dict[str, Any]] = {}
    for n in degrees:
        # N = 1 as --tensor-parallel 1: the built-in's one device, unsplit (app.run.config_run)
        split = ["--tensor-parallel", str(n)] + ([] if n > 1 else ["--strategy", "one-device"])
        output = out / f"tp-{n}"
        run_script([sys.executable, "jobs/train.py", "--backend", "local", *flags, *split, "--output", str(output),
                    "--no-tensorboard"], timeout=1800)
        rows[n] = _summary(output)
        print(f"N={n}: {rows[n]['steady_samples_per_s']:,.0f} samples/s steady, split layers per device: "
              f"{rows[n]['device_bytes']}", flush=True)
    unsplit = next((r["unsplit_bytes"] for r in rows.values() if r["unsplit_bytes"]), None)
    for r in rows.values():
        if not r["device_bytes"] and unsplit:  # one device: it holds the whole layers
            r["device_bytes"], r["unsplit_bytes"] = {"CPU:0": unsplit}, unsplit
    first = rows[degrees[0]]["steady_samples_per_s"]
    result = {
        "command": command,
        "workload": preset.workload,
        "results": {str(n): r for n, r in rows.items()},
        "vs_one_device_steady": {str(n): r["steady_samples_per_s"] / first for n, r in rows.items()},
        "largest_device_share": {str(n): max(r["device_bytes"].values()) / r["unsplit_bytes"]
                                 for n, r in rows.items() if r["unsplit_bytes"]},
    }
    for n in rows:
        print(f"N={n}: {result['vs_one_device_steady'][str(n)]:.2f}x one device's samples/s; the largest device "
              f"holds {result['largest_device_share'].get(str(n), 1):.2f} of the split layers' bytes")
    return [report.write_json(out / "tensor-parallel.json", result)]


def _summary(output: Path) -> dict[str, Any]:
    run = scaling.read_run(output)  # steady and whole-run samples/s, as the throughput suite reads a run
    result = json.loads((output / "result.json").read_text())
    tensor = result.get("tensor_parallel") or {}
    return {"steady_samples_per_s": run["samples_per_second"], "samples_per_s": run["whole_run_samples_per_second"],
            "per_epoch": run["per_epoch"], "device_bytes": tensor.get("device_bytes", {}),
            "unsplit_bytes": tensor.get("unsplit_bytes", 0), "val_accuracy": result["metrics"].get("val_accuracy")}
