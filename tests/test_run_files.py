"""A run's own files used again as a user would: its config.yaml as --config, its checkpoints evaluated; and
data functions called in this process, so that a dry run or an evaluation starts no Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.config import build_config
from app.driver import outputs
from conftest import REPO, clean_env, ray_sessions, raylets, run_job, run_jobs_at_once

USER_FILE = '''
import keras

import app


def load_data():
    x, y = app.digits()
    return x[:600], y[:600]


def build_model(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes, activation="softmax")])
'''


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "my_example.py"
    f.write_text(USER_FILE)
    return f


def test_a_local_runs_checkpoints_evaluate_and_its_config_runs_again(user_file, tmp_path):
    out = tmp_path / "first"
    fn = [f"--model={user_file}:build_model", f"--dataset={user_file}:load_data"]
    p = run_job("jobs/train.py", "--backend", "local", *fn, "--epochs", "2", "--output", str(out),
                "--storage-path", str(tmp_path / "unused"), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    # --storage-path is Ray Train's: a local run says where its checkpoints went instead.
    assert f"--storage-path is where Ray Train keeps checkpoints; this run keeps its own in {out / 'checkpoint'}" \
        in p.stderr and not (tmp_path / "unused").exists()
    result = json.loads((out / "result.json").read_text())
    recorded = (out / "config.yaml").read_text()
    assert "\noutput:" not in recorded and f"# Continue this one if it stopped: python jobs/train.py --output {out}" \
        in recorded

    # The run's checkpoint (Keras's fit keeps the last epoch's, with its model.keras), named two ways; the data
    # function runs here.
    before = ray_sessions(), raylets()
    latest, run_dir = run_jobs_at_once(
        ["jobs/evaluate.py", "--checkpoint", str(out / "checkpoint")],
        ["jobs/evaluate.py", "--checkpoint", str(out)], timeout=180)
    for p in (latest, run_dir):
        assert p.returncode == 0, p.stderr[-3000:]
    assert ray_sessions() == before[0] and not raylets() - before[1]
    epoch_2 = json.loads((out / "checkpoint" / "eval.json").read_text())
    assert epoch_2["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)
    assert json.loads(latest.stdout.splitlines()[0])["val_accuracy"] == epoch_2["val_accuracy"]
    assert json.loads(run_dir.stdout.splitlines()[0])["val_accuracy"] == epoch_2["val_accuracy"]

    # The run's own config.yaml as --config: a new run in a new directory (runs/train-<time> where it is typed).
    done = (out / "result.json").stat().st_mtime_ns
    p = subprocess.run([sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(out / "config.yaml")],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    again = json.loads(next((tmp_path / "runs").glob("train-*/result.json")).read_text())
    assert again["config"]["model"] == f"{user_file}:build_model" and again["epochs_completed"] == 2
    assert again["metrics"]["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)
    assert (out / "result.json").stat().st_mtime_ns == done


def test_a_function_passed_from_python_is_recorded_with_what_to_do(tmp_path):
    def build_model(input_shape, num_classes):
        raise AssertionError("never called")

    build_model.__module__, build_model.__qualname__ = "__main__", "build_model"  # as in a script or notebook
    config = build_config(None, {"model": build_model, "backend": "local", "output": str(tmp_path / "o")})
    f = tmp_path / "config.yaml"
    f.write_text(outputs.recorded_config(config, tmp_path / "o"))
    assert "# model: __main__:build_model was a function passed from Python" in f.read_text()
    p = run_job("jobs/train.py", "--config", str(f), "--dry-run", timeout=120)
    assert p.returncode == 2 and "__main__:build_model was a function passed from Python" in p.stderr, p.stderr
    assert "pass it again" in p.stderr and "Traceback" not in p.stderr


def test_a_dry_run_with_a_data_function_starts_no_ray(user_file, tmp_path):
    before = ray_sessions(), raylets()
    p = run_job("jobs/train.py", f"--model={user_file}:build_model", f"--dataset={user_file}:load_data",
                "--num-workers", "2", "--dry-run", "--output", str(tmp_path / "never"), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "run: backend ray, collective all-reduce (one replica per worker), 2 worker(s)" in p.stdout + p.stderr
    assert ray_sessions() == before[0], "a Ray session was started"
    assert not raylets() - before[1]
    assert not (tmp_path / "never").exists()
