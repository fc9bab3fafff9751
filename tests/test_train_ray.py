"""Real multi-worker training on the shared local Ray: MWMS all-reduce, Ray Data shards, outputs."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from app.config import build_config
from app.run.api import run_training
from conftest import run_job, tensorboard_scalars, venv_env


def train(tmp_path, name, **overrides):
    config = build_config(None, {"output": str(tmp_path / name), **overrides})
    result = run_training(config)
    history = (tmp_path / name / "history.csv").read_text().splitlines()
    return config, result, history


def history_column(out, column):
    import csv

    with open(out / "history.csv") as f:
        return [float(row[column]) for row in csv.DictReader(f)]


def check_learned(out, result, workers):
    losses = history_column(out, "loss")
    assert losses[-1] < losses[0] / 5, losses
    assert result["metrics"]["val_accuracy"] >= 0.95, result["metrics"]
    assert result["num_replicas"] == workers
    assert result["global_batch_size"] == 32 * workers
    assert result["learning_rate"] == pytest.approx(0.1 * workers)  # the mlp's 0.1, linear rule, reference batch 32
    assert result["lr_scaling"] == "linear" and result["base_lr"] == 0.1
    assert result["epochs_completed"] == 6
    # Every worker trains under TensorFlow's default strategy, one replica; a group sums its gradients with the
    # collective all-reduce (app.training.strategy, app.training.collective).
    assert result["strategy"] == ("collective all-reduce (one replica per worker)" if workers > 1
                                  else "default strategy (one replica)")
    assert result["samples_per_second"] > 0 and result["wall_seconds"] > 0
    assert json.loads((out / "result.json").read_text()) == result
    assert len(history_column(out, "epoch")) == 6
    assert (out / "curves.png").stat().st_size > 10_000


def test_two_workers_learn_the_digits(two_worker_run):
    check_learned(*two_worker_run, workers=2)


def test_one_worker_learns_the_digits(ray_cluster, tmp_path):
    config, result, _ = train(tmp_path, "w1", num_workers=1, epochs=6)
    check_learned(tmp_path / "w1", result, workers=1)


def test_exported_model_scores_the_same_in_a_plain_process(two_worker_run):
    out, result = two_worker_run
    p = run_job("jobs/evaluate.py", "--run", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["val_samples"] == 359
    assert evaluated["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)
    assert evaluated["val_loss"] == pytest.approx(result["metrics"]["val_loss"], rel=1e-4)


def test_local_backend_writes_the_same_result_keys(two_worker_run, local_digits_run):
    out, ray_result = two_worker_run
    local = local_digits_run
    local_result = json.loads((local / "result.json").read_text())
    # worker_nodes (each rank's Ray node) is the Ray path's alone.
    # The keys every run's result.json has, whichever engine trained it (Keras's fit here, the own step there).
    shared = {"metrics", "metric", "num_replicas", "global_batch_size", "task", "strategy", "strategy_reason",
              "backend", "per_replica_batch", "epochs_completed", "samples_per_second", "time_to_first_step_seconds",
              "history_file", "model_file", "saved_model", "config"}
    assert shared <= set(local_result) and shared <= set(ray_result), (shared - set(local_result), shared - set(ray_result))
    assert sorted(local_result["metrics"]) == sorted(ray_result["metrics"])
    assert (local / "history.csv").exists() and (local / "model.keras").exists()
    import keras

    assert keras.models.load_model(local / "model.keras").input_shape == (None, 64)  # the digits' 64 features


def regression_rows():
    """A float target: the regression path (mean squared error, a one-output model)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(800, 6)).astype("float32")
    return x, (x @ np.array([1.5, -2.0, 0.5, 0.0, 1.0, 3.0]) + 0.1 * rng.normal(size=800)).astype("float32")


def test_two_workers_equal_one_worker_on_a_regression(ray_cluster, tmp_path):
    """2 x B and 1 x 2B (2 x 320 and 1 x 640 rows), full-batch plain SGD, the product's own optimizer and schedule, a
    regression model: the all-reduce and the 1/global-batch loss scaling make the updates identical. (A compiled
    classifier's, multi-step and with a short last batch: tests/test_keras_parity.py.)"""
    import keras

    common = dict(
        epochs=5, optimizer="sgd", momentum=0.0, base_lr=0.02, lr_scaling="none", warmup_epochs=0,
        lr_decay="constant", shuffle=False, seed=7, dataset=regression_rows, hidden_units=[16],
    )
    _, two, _ = train(tmp_path, "two", num_workers=2, per_replica_batch=320, **common)
    train(tmp_path, "one", num_workers=1, per_replica_batch=640, **common)
    assert two["task"] == "regression"
    assert set(two["metrics"]) == {"train_loss", "train_mae", "val_loss", "val_mae"}
    w2 = keras.models.load_model(tmp_path / "two" / "model.keras").get_weights()
    w1 = keras.models.load_model(tmp_path / "one" / "model.keras").get_weights()
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert history_column(tmp_path / "one", "loss")[-1] < history_column(tmp_path / "one", "loss")[0]


def test_every_sample_is_seen_once_per_epoch(two_worker_run):
    """The shared run's audit: 1438 training rows, a global batch of 64: 22 whole steps and a short one of 30 rows
    (15 per worker), so every row once per epoch, in a new order each epoch."""
    from app.config import build_config
    from app.data import memory

    out, result = two_worker_run
    per_epoch = json.loads((out / "audit_sample_ids.json").read_text())
    train_ids = set(memory.load_source(build_config(None, {"output": str(out)})).train.ids.tolist())
    assert result["dropped_samples_per_epoch"] == 0 and result["steps_per_epoch"] == 23 and len(per_epoch) == 6
    for ids in per_epoch:
        assert len(ids) == len(set(ids)) == len(train_ids) == 1438 and set(ids) == train_ids  # no repeats, none missing
    # The shuffle deals a new order every epoch.
    assert per_epoch[0] != per_epoch[1]


def test_rank0_writes_tensorboard_scalars_per_epoch_and_every_n_steps(two_worker_run):
    out, result = two_worker_run
    scalars = tensorboard_scalars(out / "tensorboard")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    history = {k: history_column(out, k) for k in ("loss", "val_accuracy")}
    for name in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "learning_rate", "samples_per_second"):
        assert [step for step, _ in scalars[f"epoch/{name}"]] == [1, 2, 3, 4, 5, 6], name
    for name, column in (("train_loss", "loss"), ("val_accuracy", "val_accuracy")):  # the numbers of history.csv
        np.testing.assert_allclose([v for _, v in scalars[f"epoch/{name}"]], history[column], rtol=1e-6)
    assert [v for _, v in scalars["epoch/workers"]] == [2] * 6  # the run's size (an elastic run's changes)
    total_steps = result["steps_per_epoch"] * 6  # 23 x 6 = 138: a point every 10 steps
    for name in ("train_loss", "train_accuracy", "learning_rate"):
        assert [step for step, _ in scalars[f"step/{name}"]] == list(range(10, total_steps + 1, 10)), name
    step_loss = [v for _, v in scalars["step/train_loss"]]
    assert step_loss[-1] < step_loss[0] / 3
    # The configuration guide's `tensorboard --logdir`, in its mode that prints what it would show.
    shown = subprocess.run(["tensorboard", "--logdir", str(out / "tensorboard"), "--inspect"], env=venv_env(),
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "epoch/val_accuracy" in shown.stdout + shown.stderr, shown.stderr[-3000:]


def test_every_run_says_where_its_time_went(two_worker_run):
    """result.json's time: the start-up links to the first step, every epoch's steps split on both workers (the
    gradients' all-reduce timed inside the step), the steady shares and the line that names the largest; TensorBoard
    has the split per epoch; --profile-steps wrote TensorFlow's profile of each worker."""
    from app.training.step_clock import SHARES

    out, result = two_worker_run
    took = result["time"]
    links = [k["link"] for k in took["startup"]]
    assert links[-1] == "the first step (fit's own trace)" and "the worker's TensorFlow and collectives" in links
    assert all(k["seconds"] >= 0 for k in took["startup"])
    assert took["startup_seconds"] == pytest.approx(sum(k["seconds"] for k in took["startup"]), abs=0.01)
    assert [e["epoch"] for e in took["epochs"]] == [1, 2, 3, 4, 5, 6]
    # Every epoch's steps but each fit's first (which traces) are timed, on each worker; the parts add up to them.
    assert [e["steps"] for e in took["epochs"]] == [22, 23, 23, 23, 23, 23] and took["steps_timed"] == 137
    assert all(e["sync"] > 0 and e["compute"] > 0 and e["checkpoint"] >= 0 for e in took["epochs"])
    assert took["epochs"][0]["first_step"] > 0 and took["sync_timed"]
    assert set(took["shares"]) == set(SHARES) and sum(took["shares"].values()) == pytest.approx(1, abs=1e-3)
    assert took["bound"] == max(took["shares"], key=took["shares"].get)
    assert took["line"].startswith("time: ") and f"{took['bound']}-bound" in took["line"]
    assert [e["link"] for e in took["end"]] == ["the last checkpoint and the workers' end",
                                                "the outputs (model files, export, history)"]
    scalars = tensorboard_scalars(out / "tensorboard")
    for part in SHARES:
        assert [step for step, _ in scalars[f"epoch/time_{part}_ms"]] == [1, 2, 3, 4, 5, 6], part
    for rank in (0, 1):
        assert list((out / "tensorboard" / "profile" / f"worker-{rank}").glob("plugins/profile/*/*.xplane.pb")), rank


def test_result_records_where_each_rank_ran(two_worker_run, ray_cluster):
    _, result = two_worker_run
    node = ray_cluster.get_runtime_context().get_node_id()
    assert result["worker_nodes"] == [node, node]  # one node here; tests/test_ray_up.py and test_cluster_job.py spread them



def test_the_state_api_in_this_rays_processes_answers_for_this_ray(ray_cluster):
    """Ray Train's placement-group cleaner asks Ray's state API, from a process of the run's Ray, whether the run's
    controller still lives, and the run's end waits for its last answer. The API must answer for this Ray (never the
    cluster /tmp/ray/ray_current_cluster names: a `ray start` stopped since, or another live one), and at once:
    app.driver.cluster.init_local_ray, which started the session's Ray as it starts a run's."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def ask(self):
            import time

            from ray.util.state import get_actor

            start = time.monotonic()
            state = get_actor(ray.get_runtime_context().get_actor_id(), timeout=10)
            return (state.state if state else None), time.monotonic() - start

    state, seconds = ray.get(Probe.remote().ask.remote(), timeout=120)
    assert state == "ALIVE" and seconds < 5, (state, seconds)
