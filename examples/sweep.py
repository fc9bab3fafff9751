"""A sweep from Python: which learning-rate scaling rule holds accuracy, each trial a Ray Train run.

    python examples/sweep.py

A space is a YAML file of config fields (`python jobs/train.py --help` lists them) and Tune domains; this one
is written here so that the example stands alone (tune_spaces/ holds others). Arguments after the space fix a
value for every trial.
"""

from pathlib import Path

import app

space = Path("runs/example-sweep-space.yaml")
space.parent.mkdir(parents=True, exist_ok=True)
space.write_text("epochs: 2\nnum_workers: 1\nlr_scaling: {grid: [linear, sqrt]}\n")  # 2 trials, 1 worker each
summary = app.tune(str(space), output="runs/example-sweep", scheduler="fifo", per_replica_batch=64)
best = summary["best"]
print(f"best: lr_scaling {best['config']['lr_scaling']}, val_accuracy {best['val_accuracy']:.4f}")
