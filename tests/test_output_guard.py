"""Outputs that cannot destroy (app.driver.output_guard): every job that writes a directory refuses, in one line before
any work, an output that is or holds the user's files or the job's own inputs, or that another job is writing; and
--overwrite replaces only what this product wrote for the same job. Each refusal leaves every byte where it was
(the directories are hashed before and after)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.driver import output_guard
from conftest import REPO, clean_env, run_job, run_jobs_at_once

BUILD = """
import keras


def build(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes, activation="softmax")])
"""


def tree_hash(*roots: Path) -> str:
    """Every file's path and bytes (and every directory's name) under ``roots``."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*")):
            digest.update(str(path).encode())
            if path.is_file():
                digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's project (their script, a model file, parquet data, results of their own) and a home directory."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("guard")
    home, work = root / "home", root / "home" / "project"
    (work / "data").mkdir(parents=True)
    (work / "code").mkdir()
    (work / "mine").mkdir()
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"a": rng.normal(size=64), "b": rng.normal(size=64), "label": np.arange(64) % 2}),
                   work / "data" / "part-0.parquet")
    (work / "train_me.py").write_text("# the user's script\n")
    (work / "code" / "models.py").write_text(BUILD)
    (work / "mine" / "notes.txt").write_text("results of my own\n")
    (work / "predictions").mkdir()  # an earlier prediction's directory, as this product leaves it
    (work / "predictions" / output_guard.MARKER).write_text(json.dumps({"kind": "predict"}))
    (work / "predictions" / "part-00000.parquet").write_text("not really parquet")
    return home, work


# (command, what the one line says). {home}, {repo}: the places; the rest is relative to the project's directory.
DANGEROUS = [
    (["jobs/train.py", "--output", ".", "--overwrite"], "is the working directory"),
    (["jobs/train.py", "--output", "..", "--overwrite"], "contains the working directory"),
    (["jobs/train.py", "--output", "{home}", "--overwrite"], "contains the working directory"),
    (["jobs/train.py", "--output", "/", "--overwrite"], "is a filesystem root"),
    (["jobs/train.py", "--output", "{repo}", "--overwrite"], "is this product's repository"),
    (["jobs/train.py", "--dataset", "data", "--output", "data", "--overwrite"], "is the dataset"),
    (["jobs/train.py", "--dataset", "data", "--output", "data/runs"], "is inside the dataset"),
    (["jobs/train.py", "--model", "code/models.py:build", "--output", "code", "--overwrite"],
     "contains the model function's file"),
    (["jobs/train.py", "--output", "mine", "--overwrite"], "was not written by this product"),
    (["jobs/train.py", "--output", "mine"], "already exists: choose another --output (e.g. --output runs/train-"),
    (["jobs/train.py", "--output", "predictions", "--overwrite"], "holds predictions, not a training run"),
    (["jobs/tune.py", "--space", f"{REPO}/tune_spaces/smoke.yaml", "--output", "."], "is the working directory"),
    (["jobs/tune.py", "--space", f"{REPO}/tune_spaces/smoke.yaml", "--output", "mine"],
     "was not written by this product"),
    (["jobs/benchmark.py", "checkpoint", "--output", "{home}"], "contains the working directory"),
    (["jobs/benchmark.py", "checkpoint", "--output", "mine"], "was not written by this product"),
]


def test_each_dangerous_output_is_refused_with_nothing_deleted(project):
    home, work = project
    before = tree_hash(home)
    env = clean_env(HOME=str(home))
    commands = [[str(REPO / a) if a.startswith("jobs/") else a.format(home=home, repo=REPO) for a in argv]
                for argv, _ in DANGEROUS]
    runs = run_jobs_at_once(*commands, timeout=300, env=env, at_once=2, cwd=work)
    for (argv, words), p in zip(DANGEROUS, runs):
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and words in lines[0], (argv, p.stderr[-2000:])
        assert "Traceback" not in p.stdout + p.stderr and p.seconds < 120, (argv, p.seconds)
    assert tree_hash(home) == before
    assert not (work / "runs").exists()  # the suggested default was only suggested


def test_overwrite_replaces_its_own_output_only_after_the_checks_and_a_running_job_is_left_alone(
        local_digits_run, tmp_path):
    """A real run writes a directory (its marker and lock appear); while it trains, another --overwrite of it, a
    --resume of it and a prediction into it are refused. A run of this product is then replaced by --overwrite
    (a bad one first, which deletes nothing); a prediction's directory is replaced by the next prediction, unless
    a file of the user's is in it."""
    busy = tmp_path / "busy"
    # Epochs enough that it is still training when the refused jobs ask, however loaded the machine (killed below);
    # a callback of the user's rests after each one, so that it leaves the CPU to the rest of the suite meanwhile.
    (tmp_path / "resting.py").write_text(
        "import time\nimport keras\n\n\nclass Rest(keras.callbacks.Callback):\n"
        "    def on_epoch_end(self, epoch, logs=None):\n        time.sleep(2)\n\n\n"
        "def callbacks():\n    return [Rest()]\n")
    writer = subprocess.Popen([sys.executable, "jobs/train.py", "--backend", "local", "--epochs", "100000",
                               "--callbacks", f"{tmp_path / 'resting.py'}:callbacks", "--output", str(busy)],
                              cwd=REPO, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (busy / "config.yaml").is_file() and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (busy / output_guard.MARKER).is_file() and (busy / output_guard.LOCK).is_file(), writer.poll()
        refused = run_jobs_at_once(
            ["jobs/train.py", "--backend", "local", "--output", str(busy), "--overwrite"],
            ["jobs/train.py", "--backend", "local", "--output", str(busy), "--resume"],
            ["jobs/predict.py", "--run", str(local_digits_run), "--output", str(busy), "--overwrite", "--backend",
             "local"], timeout=300, at_once=2)
        for p in refused:
            assert p.returncode == 2 and f"another job is writing '{busy}' (train, pid {writer.pid}" in p.stderr, \
                p.stderr[-2000:]
        assert writer.poll() is None  # still training, untouched
    finally:
        if writer.poll() is None:
            os.killpg(writer.pid, signal.SIGKILL)
        writer.wait(timeout=60)
    # The killed job's lock went with it: the directory can be resumed or replaced now (below: replaced).

    earlier = tmp_path / "earlier"
    shutil.copytree(local_digits_run, earlier)
    before = tree_hash(earlier)
    bad = run_job("jobs/train.py", "--backend", "local", "--output", str(earlier), "--overwrite", "--dataset",
                  str(tmp_path / "missing.parquet"), timeout=300)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and tree_hash(earlier) == before, bad.stderr
    # An evaluation's eval.json, written into the run, is the product's too: --overwrite replaces it.
    scored = run_job("jobs/evaluate.py", "--run", str(earlier), timeout=300)
    assert scored.returncode == 0 and (earlier / "eval.json").is_file(), scored.stderr[-2000:]
    preds = tmp_path / "preds"
    again, first = run_jobs_at_once(
        ["jobs/train.py", "--backend", "local", "--epochs", "1", "--output", str(earlier), "--overwrite"],
        ["jobs/predict.py", "--run", str(local_digits_run), "--output", str(preds), "--backend", "local"],
        timeout=300)
    assert again.returncode == 0 and first.returncode == 0, again.stderr[-2000:] + first.stderr[-2000:]
    assert output_guard.kind_of(earlier) == "train" and (earlier / "result.json").is_file()
    assert output_guard.kind_of(preds) == "predict"
    second = run_job("jobs/predict.py", "--run", str(local_digits_run), "--output", str(preds), "--overwrite",
                     "--backend", "local", timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert json.loads((preds / "_predict.json").read_text())["rows"] > 0
    # A file of the user's, put in a directory the product wrote: --overwrite would delete it, and is refused.
    (preds / "notes.txt").write_text("mine")
    before = tree_hash(preds)
    third = run_job("jobs/predict.py", "--run", str(local_digits_run), "--output", str(preds), "--overwrite",
                    "--backend", "local", timeout=300)
    assert third.returncode == 2 and tree_hash(preds) == before, third.stderr[-2000:]
    assert f"error: output '{preds}' holds notes.txt, which this product did not write and --overwrite would " \
           "delete: move them out" in third.stderr
    busy_files = {p.name for p in busy.iterdir()}
    replaced = run_job("jobs/train.py", "--backend", "local", "--epochs", "1", "--output", str(busy), "--overwrite",
                       timeout=300)
    assert replaced.returncode == 0, (busy_files, replaced.stderr[-2000:])
