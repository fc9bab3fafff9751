"""Elastic runs (--num-workers MIN:MAX) on a real two-node Ray cluster on this machine: a head started with
`ray start --head --num-cpus 1`, a second node that joins while the run trains and is stopped by its own process
group. The run grows and shrinks by itself, its optimizer's state sharded over the workers of each size, and its
weights are those of a fixed-size run with the same seed and global batch: the math does not depend on the
resizes."""

from __future__ import annotations

import concurrent.futures
import json
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from app.bench.node import TwoNodes
from conftest import REPO, clean_env, ray_sessions, refusals_at_once, run_job, user_module

# Rows and a rank-0 callback that makes each epoch last long enough for the cluster to change under the run
# (it sleeps while the file HOLD exists, which the test removes once the cluster has changed twice: the math is
# untouched); the fixed-size run takes a callback that does nothing, so that both runs have the same callbacks
# machinery.
USER = '''
import os
import time

import keras
import numpy as np


def rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 12)).astype("float32")
    return x, (x[:, :4].sum(axis=1) > 0).astype("int64") + 2 * (x[:, 4] > 0.5).astype("int64")


class Pause(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_epoch_end(self, epoch, logs=None):
        if os.path.exists(os.path.join(os.path.dirname(__file__), "HOLD")):
            time.sleep(self.seconds)


def slow():
    return [Pause(1.5)]


def fast():
    return [Pause(0.0)]
'''
COMMON = ["--global-batch", "32", "--epochs", "24", "--seed", "3", "--hidden-units", "16", "--optimizer", "sgd",
          "--momentum", "0.5", "--lr-decay", "constant", "--warmup-epochs", "0"]


class Lines:
    """The driver's console, read as it comes."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.lines = process, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for i, line in enumerate(self.lines[after:], after):
                if re.search(pattern, line):
                    return i
            if self.process.poll() is not None:
                time.sleep(1)  # the last lines
                if not any(re.search(pattern, line) for line in self.lines[after:]):
                    raise AssertionError(f"the run ended before {pattern!r}:\n{''.join(self.lines)[-4000:]}")
            time.sleep(0.5)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{''.join(self.lines)[-4000:]}")


@pytest.mark.own_ray_cluster
def test_an_elastic_run_grows_and_shrinks_with_the_cluster_and_trains_as_a_fixed_size_run(no_shared_ray, tmp_path,
                                                                                         tmp_path_factory):
    user = user_module(tmp_path_factory, "elastic_user.py", USER)
    hold = user.parent / "HOLD"
    hold.touch()
    # The same seed and global batch at a fixed size (one replica, no Ray), trained while the elastic run waits on
    # its pauses and resizes: the same weights at the end.
    fixed = tmp_path / "fixed"
    fixed_run = concurrent.futures.ThreadPoolExecutor(1).submit(
        run_job, "jobs/train.py", "--backend", "local", "--strategy", "one-device",
        "--dataset", f"{user}:rows",
        "--callbacks", f"{user}:fast", "--output", str(fixed), *COMMON, timeout=600)
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    nodes = TwoNodes(env, REPO, Path(tempfile.mkdtemp(prefix="ray-elastic-", dir="/tmp")))
    out = tmp_path / "elastic"
    try:
        driver = nodes.driver = subprocess.Popen(
            # --shard-optimizer 2: each resize re-cuts the momentum over the new size from the checkpoint's whole
            # state (one worker: nothing to shard), and the weights are still the fixed-size unsharded run's
            [sys.executable, "jobs/train.py", "--num-workers", "1:2", "--checkpoint-every-steps", "4",
             "--shard-optimizer", "2",
             "--resize-check-s", "2", "--worker-start-timeout-s", "15",
             "--dataset", f"{user}:rows", "--callbacks", f"{user}:slow", "--output", str(out), *COMMON],
            cwd=REPO, env={**env, "RAY_ADDRESS": nodes.address}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        console = Lines(driver)
        # --dry-run's plan, logged first: the same steps per epoch at each size.
        console.wait_for(r"elastic: 1 to 2 workers, .*the global batch 32 stays at every size.*; at 1: 32 per "
                         r"replica, global 32, (\d+) steps; 2: 16 per replica, global 32, \1 steps", 120)
        at = console.wait_for(r"epoch +2/24", 300)
        nodes.join()
        # One line from rank 0: the resize and where training goes on, named once (epoch and step).
        at = console.wait_for(r"resized 1 -> 2 workers: node \w+ joined; resumed at epoch \d+ step \d+ from its "
                              r"checkpoint", 180, at)
        # An epoch trained by 2 workers and checkpointed: the epoch after it has ended too (a report is a barrier).
        for _ in range(2):
            at = console.wait_for(r"epoch +\d+/24", 120, at + 1)
        nodes.leave()
        console.wait_for(r"resized 2 -> 1 workers: node \w+ lost; resumed at epoch \d+ step \d+ from", 240, at)
        hold.unlink()  # the cluster has changed twice: the epochs left need no pause
        assert driver.wait(timeout=600) == 0, "".join(console.lines)[-4000:]
    finally:
        nodes.close()

    result = json.loads((out / "result.json").read_text())
    sizes = result["workers_over_time"]
    assert [s["workers"] for s in sizes] == [1, 2, 1], sizes
    assert sizes[1]["joined"] and sizes[2]["lost"] and sizes[0]["time"] < sizes[1]["time"] < sizes[2]["time"]
    # Every resize went on from a checkpoint at a multiple of --checkpoint-every-steps.
    assert all(s["step"] % 4 == 0 for s in sizes)
    assert result["global_batch_size"] == 32 and result["epochs_completed"] == 24
    header, *rows = (out / "history.csv").read_text().splitlines()
    column = header.split(",").index("workers")
    workers = [int(float(r.split(",")[column])) for r in rows]
    assert 2 in workers and workers[0] == 1 and workers[-1] == 1, workers

    p = fixed_run.result(timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    import keras

    elastic_weights = keras.models.load_model(out / "model.keras").get_weights()
    fixed_weights = keras.models.load_model(fixed / "model.keras").get_weights()
    for a, b in zip(elastic_weights, fixed_weights):
        np.testing.assert_allclose(a, b, atol=1e-4)



REFUSED = [
    (["--num-workers", "3:1"], "MIN 3 is larger than MAX 1; give 1:3"),
    (["--num-workers", "0:2"], "MIN 0 must be at least 1"),
    (["--num-workers", "1:x"], "num_workers: takes N or MIN:MAX"),
    (["--num-workers", "1:2", "--backend", "local"], "--num-workers 1:2 is for Ray workers: use it with --backend ray"),
    (["--num-workers", "1:2", "--strategy", "parameter-server"], "parameter-server runs have a fixed number of workers"),
    (["--num-workers", "1:3", "--global-batch", "64"],
     "--global-batch 64 does not split evenly over 3 worker(s) (every step's batch is split into equal parts, one per "
     "worker); it does over 1, 2; use --global-batch 60 or 66"),
    (["--global-batch", "64", "--per-replica-batch", "32"], "--global-batch and --per-replica-batch both set the batch"),
    (["--checkpoint-every-steps", "5", "--backend", "local"], "--checkpoint-every-steps checkpoints Ray Train's"),
    (["--checkpoint-every-steps", "5", "--steps-per-execution", "2"], "must be a multiple of --steps-per-execution 2"),
    (["--num-workers", "1:2", "--dataset", "PARQUET"], "streams through Ray Data, split per worker"),
]


@pytest.fixture(scope="module")
def refused_runs(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path_factory.mktemp("parquet") / "rows.parquet"
    pq.write_table(pa.table({"f0": [0.1, 0.2, 0.3, 0.4] * 16, "label": [0, 1] * 32}), data)
    before = ray_sessions()
    runs = refusals_at_once(tmp_path_factory, "elastic-refused", lambda i, out: [
        "jobs/train.py", "--output", str(out), *[str(data) if a == "PARQUET" else a for a in REFUSED[i][0]]],
        len(REFUSED), timeout=120)
    return runs, ray_sessions() - before


@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[" ".join(args) for args, _ in REFUSED])
def test_an_impossible_range_or_batch_is_refused_in_one_line_before_ray_starts(refused_runs, case):
    runs, new_sessions = refused_runs
    assert not new_sessions, "a refused run started a Ray"
    out, p = runs[case]
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and REFUSED[case][1] in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not out.exists()


def test_the_plan_splits_the_global_batch_of_an_update_at_every_size_with_accumulated_steps(tmp_path):
    """--global-batch is the rows of an update at every size: with --grad-accum 2, 64 is 32 a step on 1 worker and
    16 on each of 2, each twice (the plan's run line and its elastic line say the same; nothing trained)."""
    from app.config import build_config
    from app.run.api import dry_run

    lines = dry_run(build_config(None, {"output": str(tmp_path / "plan"), "num_workers": "1:2", "global_batch": 64,
                                        "grad_accum": 2}))
    text = "\n".join(lines)
    assert "global batch 64 (= 16 per worker x 2 accumulated steps)" in text, text
    assert "the global batch 64 stays at every size" in text and "at 1: 32 per replica x 2 accumulated steps, " \
        "global 64, " in text and "; 2: 16 per replica x 2 accumulated steps, global 64, " in text, text
