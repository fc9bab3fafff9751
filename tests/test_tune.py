"""Ray Tune sweeps: every trial a real Ray Train run (app.run.ray_train); bad spaces refused before any trial."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from app.errors import UserError
from app.run import tune
from conftest import REPO, clean_env, run_job, run_jobs_at_once


def test_smoke_sweep_from_the_command_line_then_its_best_config_trains_and_a_trial_evaluates(
        ray_cluster, tmp_path):
    """jobs/tune.py as a user runs it, joined to a cluster (two trials at once: 2 x 2 workers x 0.5 CPU); its best
    config fed back into jobs/train.py; a trial's checkpoint scored by jobs/evaluate.py in another process."""
    out = tmp_path / "sweep"
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    # A list-valued field fixed for every trial (--hidden-units) once crashed the summary after the whole sweep.
    # --storage-path: every trial's Ray Train checkpoints under <storage-path>/<sweep>/<trial>/train.
    storage = tmp_path / "storage"
    p = run_job("jobs/tune.py", "--space", str(REPO / "tune_spaces" / "smoke.yaml"), "--cpus-per-worker", "0.5",
                "--hidden-units", "32", "16", "--scheduler", "fifo", "--output", str(out),
                "--storage-path", str(storage), timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "best val_accuracy" in p.stdout
    assert yaml.safe_load((out / tune.SUMMARY_FILE).read_text())["trials"] == 2

    table = pd.read_csv(out / tune.RESULTS_FILE)
    assert len(table) == 2
    assert set(table["config/lr_scaling"]) == {"linear", "sqrt"}
    assert (table["epochs_run"] == 1).all() and table["val_accuracy"].notna().all()
    assert (table["error"].fillna("").astype(str) == "").all()
    # Each trial was a real multi-worker Train run: its own Train storage with checkpoints.
    states = list(storage.glob("sweep/run_trial_*/train/checkpoint_*/state.json"))
    assert len(states) >= 2 and not list(out.glob("run_trial_*/train/checkpoint_*"))
    assert len(list(storage.glob("sweep/run_trial_*/train/tensorboard"))) == 2
    assert (out / tune.PLOT_FILE).stat().st_size > 10_000

    # The best config trained again, and a trial's checkpoint evaluated on the validation split, each in a
    # process of its own: independent of each other, so side by side (their start-ups overlap).
    best_file = out / tune.BEST_CONFIG_FILE
    best = yaml.safe_load(best_file.read_text())
    p, e = run_jobs_at_once(["jobs/train.py", "--config", str(best_file), "--output", str(tmp_path / "again")],
                            ["jobs/evaluate.py", "--checkpoint", str(states[0].parent)], timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "result.json").read_text())
    assert again["config"]["lr_scaling"] == best["lr_scaling"] and again["epochs_completed"] == 1
    assert best["hidden_units"] == again["config"]["hidden_units"] == [32, 16]
    assert again["metrics"]["val_accuracy"] == pytest.approx(table["val_accuracy"].max(), abs=0.03)

    assert e.returncode == 0, e.stderr[-3000:]
    evaluated = json.loads((states[0].parent / "eval.json").read_text())
    trained = json.loads(states[0].read_text())["history"][-1]
    assert evaluated["val_accuracy"] == pytest.approx(trained["val_accuracy"], abs=1e-6)


@pytest.mark.parametrize(
    "space, message",
    [
        ("learning_rate: {grid: [0.1, 0.2]}\n", "unknown key 'learning_rate'"),
        ("base_lr: {logspace: [0.01, 0.1]}\n", "key 'base_lr' has a malformed domain"),
        ("base_lr: {uniform: [0.1]}\n", "'base_lr': bad uniform arguments"),
        ("base_lr: {grid: 0.1}\n", "'base_lr': grid needs a non-empty list"),
        ("lr_scaling: {grid: [linear, cubic]}\n", "'lr_scaling' = 'cubic' is invalid"),
        ("per_replica_batch: {choice: [32, 0]}\n", "'per_replica_batch' = 0 is invalid"),
        ("output: {grid: [a, b]}\n", "'output' cannot be searched"),
    ],
)
def test_bad_spaces_are_refused_by_name(tmp_path, space, message):
    f = tmp_path / "space.yaml"
    f.write_text(space)
    with pytest.raises(UserError) as e:
        tune.load_space(f, {})
    assert message in str(e.value)


def test_a_key_both_fixed_and_searched_is_refused(tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("epochs: {grid: [1, 2]}\n")
    with pytest.raises(UserError, match="both fixed by a flag and searched"):
        tune.load_space(f, {"epochs": 3})


def test_shipped_spaces_parse():
    for f in (REPO / "tune_spaces").glob("*.yaml"):
        assert tune.load_space(f, {})


def test_bad_space_fails_before_ray_starts(tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("momentun: {grid: [0.0, 0.9]}\n")
    p = run_job("jobs/tune.py", "--space", str(f), "--output", str(tmp_path / "o"), timeout=120)
    assert p.returncode == 2 and "unknown key 'momentun'" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "o").exists()


def test_asha_judges_trials_only_after_the_warmup():
    from app.config import build_config

    space = tune.load_space(REPO / "tune_spaces" / "lr_scaling.yaml", {})
    searched = {k: v for k, v in space.items() if tune._is_domain(v)}
    base = build_config(None, {"output": "x", **{k: v for k, v in space.items() if k not in searched}})
    scheduler = tune.asha(base, searched)
    assert scheduler._max_t == 6
    assert min(milestone for milestone, _ in scheduler._brackets[0]._rungs) == 2  # warmup 1 epoch + 1
