"""--resume onto another worker count or backend, a finished run trained further, a checkpoint that does not fit."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

from app.config import build_config
from app.run.api import run_training
from conftest import run_job, run_jobs_at_once


def history(out: Path) -> list[dict]:
    with open(out / "history.csv") as f:
        return list(csv.DictReader(f))


def errors(p) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith("error:")]


def test_a_two_worker_run_goes_on_on_one_worker_then_locally(two_worker_run, tmp_path):
    """The session's finished 6-epoch run on 2 Ray workers (a copy) goes on to epoch 7 on 1 worker, then to 8
    without Ray: its optimizer (momentum and step count) comes back and goes on, every epoch is recorded once."""
    import keras

    out = tmp_path / "w2"
    shutil.copytree(two_worker_run[0], out)  # its Ray storage (out/ray) too: checkpoints are named relative to it
    before = history(out)
    steps_2 = two_worker_run[1]["steps_per_epoch"]  # per epoch on 2 workers (global batch 64)

    result = run_training(build_config(None, {"output": str(out), "resume": True, "num_workers": 1, "epochs": 7}))
    rows = history(out)
    assert [int(r["epoch"]) for r in rows] == list(range(1, 8))
    assert rows[:6] == before  # the first 6 epochs as they were recorded
    steps_1 = result["steps_per_epoch"]
    assert steps_1 > steps_2  # half the global batch: about twice the steps
    assert result["global_batch_size"] == 32 and result["epochs_completed"] == 7 and rows[6]["workers"] == "1"
    # The optimizer (its momentum slots and step count) came back: the count goes on from the checkpoint's.
    assert int(keras.models.load_model(out / "model.keras").optimizer.iterations) == 6 * steps_2 + steps_1

    # The same run goes on without Ray, from the Ray checkpoint: one local replica, same global batch.
    seven = rows
    p = run_job("jobs/train.py", "--output", str(out), "--resume", "--backend", "local", "--epochs", "8")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = history(out)
    assert [int(r["epoch"]) for r in rows] == list(range(1, 9)) and rows[:7] == seven
    assert int(keras.models.load_model(out / "model.keras").optimizer.iterations) == 6 * steps_2 + 2 * steps_1


LOCAL = ["--backend", "local", "--optimizer", "adam", "--base-lr", "0.01", "--seed", "5"]


def test_a_finished_local_run_trains_further_and_a_changed_model_is_refused(tmp_path):
    out = tmp_path / "run"
    p = run_job("jobs/train.py", *LOCAL, "--epochs", "3", "--output", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    first = history(out)
    kept = {name: (out / name).read_bytes() for name in ("result.json", "history.csv", "config.yaml", "model.keras")}

    # A copy of the finished run whose checkpoints are gone: nothing to go on from.
    gone = tmp_path / "gone"
    shutil.copytree(out, gone)
    shutil.rmtree(gone / "checkpoint")
    left = {str(f.relative_to(gone)): f.read_bytes() for f in gone.rglob("*") if f.is_file()}

    # Three refusals that only read the runs, side by side.
    finished, changed, nothing = run_jobs_at_once(
        ["jobs/train.py", "--output", str(out), "--resume"],
        ["jobs/train.py", "--output", str(out), "--resume", "--epochs", "5", "--hidden-units", "32"],
        ["jobs/train.py", "--output", str(gone), "--resume", "--epochs", "5"])
    p = nothing
    assert p.returncode == 2 and len(errors(p)) == 1, p.stderr[-2000:]
    assert f"nothing to resume in {gone}: it holds a finished run but no checkpoint of it" in errors(p)[0]
    assert {str(f.relative_to(gone)): f.read_bytes() for f in gone.rglob("*") if f.is_file()} == left
    # Nothing left to train: one line.
    p = finished
    assert p.returncode == 2 and len(errors(p)) == 1, p.stderr[-2000:]
    assert "already finished its 3 epochs" in errors(p)[0] and "--epochs" in errors(p)[0]

    # A model that is not the checkpoint's: which weights differ, names and shapes, before any training.
    p = changed
    assert p.returncode == 2 and len(errors(p)) == 1, p.stderr[-2000:]
    assert "does not fit the model: dense_0/kernel is (64, 256) in the checkpoint, (64, 32) in the model" \
        in errors(p)[0], errors(p)
    assert "Traceback" not in p.stderr
    assert {name: (out / name).read_bytes() for name in kept} == kept  # earlier results untouched

    # More epochs: it goes on from epoch 3, as Keras's initial_epoch would.
    p = run_job("jobs/train.py", "--output", str(out), "--resume", "--epochs", "5")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed at epoch 4 step 0 from its checkpoint" in p.stdout + p.stderr
    rows = history(out)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4, 5]
    assert rows[:3] == first  # the first run's epochs, as it recorded them
    assert len(re.findall(r"^epoch \d+/5", p.stdout + p.stderr, re.M)) == 2  # only epochs 4 and 5 trained
    assert json.loads((out / "result.json").read_text())["epochs_completed"] == 5


def test_the_schedule_goes_on_from_the_restored_epoch_boundary():
    """Same steps per epoch: where it was (an offset recorded by an earlier re-plan is kept); other: re-planned."""
    from app.training.lr_position import continued
    from app.training.optim import LrPlan

    def plan(steps: int, epochs: int, offset: int = 0) -> LrPlan:
        return LrPlan("linear", 0.05, 32, 32, 0.05, steps, steps * epochs, offset)

    def state(steps: int, epochs: int, offset: int = 0) -> dict:
        return {"lr_plan": plan(steps, epochs, offset).as_dict(), "config": {"epochs": epochs}}

    assert continued(plan(22, 8), state(22, 3), 3, 66, 22).step_offset == 0  # more epochs, same workers
    assert continued(plan(44, 3), state(22, 3), 2, 44, 44).step_offset == 2 * 44 - 44  # 2 workers -> 1
    assert continued(plan(44, 3), state(44, 3, 44), 2, 44, 44).step_offset == 44  # restarted later in that run
