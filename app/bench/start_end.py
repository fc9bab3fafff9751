"""Start and end: ``python jobs/train.py`` (and ``app.fit`` from a fresh script) against a plain Keras script.

Each round runs, one after another (interleaved, so a slow minute of the machine hits every command alike):

- ``plain``: a one-process Keras script of the same model and data (``model.fit`` of the built-in MLP on the
  embedded digits, its own validation split, ``model.keras`` saved), as a user has it before this product;
- ``train.py``: ``python jobs/train.py --epochs E`` (a local Ray it starts, 2 workers);
- ``app.fit``: a fresh script that calls ``app.fit(build, x, y, ...)`` on the same arrays, 2 workers.

For each: the seconds from its process's start to the end of its first training step (the plain script's first
batch; the product's result.json ``time.startup_seconds``), and the whole command's wall seconds. The ratios are
medians over the rounds; the machine's CPU steal (/proc/stat) over each round is logged beside them.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from app.bench.proc import REPO, cpu_times, local_env, steal_fraction

log = logging.getLogger(__name__)

PARAMS = ("rounds", "epochs", "num_workers")

# The process's age at its first batch's end: /proc/uptime less its start tick (as app.training.step_clock does).
_FIRST_STEP = """
import os, time
import keras

def age():
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    return float(open("/proc/uptime").read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")

class FirstBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            print("FIRST_STEP", age(), flush=True)
"""

PLAIN = _FIRST_STEP + """
import numpy as np
data = np.load({digits!r})
x, y = data["x"].astype("float32"), data["y"].astype("int64")
model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.fit(x, y, batch_size=64, epochs={epochs}, validation_split=0.2, callbacks=[FirstBatch()], verbose=0)
model.save({out!r})
"""

APP_FIT = _FIRST_STEP + """
import numpy as np
import app

def build():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model

data = np.load({digits!r})
x, y = data["x"].astype("float32"), data["y"].astype("int64")
app.fit(build, x, y, batch_size=64, epochs={epochs}, validation_split=0.2, num_workers={workers}, verbose=0,
        output={out!r}, overwrite=True)
"""


def _timed(command: list[str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=local_env(), capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started, done.stdout


def _first_step(stdout: str) -> float:
    return float(next(line.split()[1] for line in stdout.splitlines() if line.startswith("FIRST_STEP")))


def one_round(out: Path, epochs: int, workers: int) -> dict[str, Any]:
    """One of each command, in a fixed order; their first steps and wall seconds, and the round's steal."""
    digits = str(REPO / "app" / "data" / "digits.npz")
    out.mkdir(parents=True, exist_ok=True)
    before = cpu_times()
    plain = out / "plain.py"
    plain.write_text(textwrap.dedent(PLAIN.format(digits=digits, epochs=epochs, out=str(out / "plain.keras"))))
    wall, stdout = _timed([sys.executable, str(plain)], out)
    row: dict[str, Any] = {"plain": {"first_step": _first_step(stdout), "wall": wall}}
    wall, _ = _timed([sys.executable, "jobs/train.py", "--epochs", str(epochs), "--num-workers", str(workers),
                      "--output", str(out / "train"), "--overwrite"], REPO)
    result = json.loads((out / "train" / "result.json").read_text())
    row["train.py"] = {"first_step": result["time"]["startup_seconds"], "wall": wall}
    script = out / "app_fit.py"
    script.write_text(textwrap.dedent(APP_FIT.format(digits=digits, epochs=epochs, workers=workers,
                                                     out=str(out / "app-fit"))))
    wall, _ = _timed([sys.executable, str(script)], REPO)
    result = json.loads((out / "app-fit" / "result.json").read_text())
    row["app.fit"] = {"first_step": result["time"]["startup_seconds"], "wall": wall}
    row["steal"] = steal_fraction(before, cpu_times())
    return row


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of each command's first step and wall, and of its ratios to the plain script's in the same round."""
    summary: dict[str, Any] = {}
    for name in ("plain", "train.py", "app.fit"):
        summary[name] = {k: statistics.median(r[name][k] for r in rounds) for k in ("first_step", "wall")}
        if name != "plain":
            for k in ("first_step", "wall"):
                summary[name][f"{k}_ratio"] = statistics.median(r[name][k] / r["plain"][k] for r in rounds)
    summary["steal"] = [r["steal"] for r in rounds]
    return summary


def run(preset, out: Path, command: str) -> list[Path]:
    p = preset.params
    rounds = []
    for i in range(p["rounds"]):
        rounds.append(one_round(out / f"round-{i}", p["epochs"], p["num_workers"]))
        log.info("round %d: %s", i + 1, json.dumps(rounds[-1]))
    summary = summarise(rounds)
    for name in ("train.py", "app.fit"):
        s = summary[name]
        log.info("%s: first step %.1f s (%.2fx the plain script's first batch), whole command %.1f s (%.2fx)",
                 name, s["first_step"], s["first_step_ratio"], s["wall"], s["wall_ratio"])
    path = out / "start.json"
    path.write_text(json.dumps({"command": command, "rounds": rounds, "summary": summary}, indent=1))
    return [path]
