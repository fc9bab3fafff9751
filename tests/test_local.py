"""--backend local, without Ray: one device by Keras's fit, MirroredStrategy and central storage on the product's own step."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, clean_env, refusals_at_once, run_job, run_jobs_at_once

FULL_BATCH_SGD = [
    "--epochs", "5", "--optimizer", "sgd", "--momentum", "0", "--base-lr", "0.5", "--lr-scaling", "none",
    "--warmup-epochs", "0", "--lr-decay", "constant", "--no-shuffle", "--seed", "7",
]


def local_run(out, *args):
    return local_runs((out, *args))[0]


def local_runs(*runs):
    """(out, *flags) runs of jobs/train.py --backend local, side by side; their result.json."""
    done = run_jobs_at_once(*(["jobs/train.py", "--backend", "local", "--output", str(out), *args]
                              for out, *args in runs), timeout=300)
    for p in done:
        assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / "result.json").read_text()) for out, *_ in runs]


def test_mirrored_over_two_cpus_equals_one_device(tmp_path):
    import keras

    two, one = local_runs(
        (tmp_path / "two", "--strategy", "mirrored", "--devices", "2", "--per-replica-batch", "719", *FULL_BATCH_SGD),
        (tmp_path / "one", "--strategy", "one-device", "--per-replica-batch", "1438", *FULL_BATCH_SGD),
    )
    assert two["strategy"] == "MirroredStrategy" and two["num_replicas"] == 2
    assert one["strategy"] == "default strategy (one replica)" and one["num_replicas"] == 1
    assert two["global_batch_size"] == one["global_batch_size"] == 1438
    w2 = keras.models.load_model(tmp_path / "two" / "model.keras").get_weights()
    w1 = keras.models.load_model(tmp_path / "one" / "model.keras").get_weights()
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # One device trains by Keras's fit (its History's keys), the two replicas on the product's own step: the same
    # weights from either.
    losses = [float(row["loss"]) for row in csv.DictReader((tmp_path / "one" / "history.csv").open())]
    assert one["backend"] == "local" and "loss" in one["history"][0]
    assert losses[-1] < losses[0] - 0.3  # the 5 full-batch steps really trained


@pytest.fixture(scope="module")
def local_set(tmp_path_factory):
    """Local runs that do not depend on each other, side by side: {name: (output, result.json)}."""
    root = tmp_path_factory.mktemp("local-set")
    runs = {"auto": ["--epochs", "4"],
            "audit": ["--strategy", "mirrored", "--devices", "2", "--epochs", "2", "--per-replica-batch", "50",
                      "--audit-sample-ids"],
            "cs": ["--strategy", "central-storage", "--devices", "2", "--epochs", "3"],
            "cnn": ["--strategy", "mirrored", "--devices", "2", "--dataset", "synthetic", "--synthetic-rows", "512",
                    "--synthetic-shape", "8", "8", "3", "--model", "cnn", "--conv-filters", "4", "8", "--epochs", "2",
                    "--per-replica-batch", "16"]}
    results = local_runs(*((root / name, *flags) for name, flags in runs.items()))
    return {name: (root / name, result) for name, result in zip(runs, results)}


def test_auto_picks_one_cpu_device_here_and_says_why(local_set):
    out, result = local_set["auto"]
    assert result["strategy"] == "default strategy (one replica)"
    assert result["strategy_reason"] == "no TPU, no GPU -> one replica on the CPU"
    assert result["metrics"]["val_accuracy"] >= 0.95
    # The exported model scores the same in a plain process.
    p = run_job("jobs/evaluate.py", "--run", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "eval.json").read_text())["val_accuracy"] == pytest.approx(
        result["metrics"]["val_accuracy"], abs=1e-6
    )


def test_mirrored_sees_every_sample_once_per_epoch(local_set):
    out, result = local_set["audit"]
    per_epoch = json.loads((out / "audit_sample_ids.json").read_text())
    assert result["dropped_samples_per_epoch"] == 0  # 14 batches of 100, then a short one of 38 split over the replicas
    for ids in per_epoch:
        assert len(ids) == len(set(ids)) == 1438
    assert per_epoch[0] != per_epoch[1]  # reshuffled


def test_a_mirrored_run_goes_on_locally_only_and_ray_says_so_in_one_line(local_set, tmp_path):
    """A run of several local replicas (the product's own step) resumed on Ray's workers, which train by Keras's fit:
    one line naming where it goes on, before any Ray starts; nothing of the run is touched."""
    from app.config import build_config
    from app.errors import UserError
    from app.run.api import dry_run

    out, _ = local_set["audit"]
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UserError) as e:
        dry_run(build_config(None, {"output": str(out), "resume": True, "backend": "ray", "strategy": "auto",
                                    "devices": None, "epochs": 3}))
    assert "holds checkpoints of the product's own step" in str(e.value) and "--backend local" in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == before


def test_central_storage_trains(local_set):
    _, result = local_set["cs"]
    assert result["strategy"] == "CentralStorageStrategy" and result["num_replicas"] == 2
    assert result["metrics"]["val_accuracy"] > 0.9


def test_several_steps_per_call_equal_one_step_per_call(tmp_path):
    """steps_per_execution is how TPUs are fed; the update sequence must not change."""
    import keras

    common = ["--strategy", "one-device", "--epochs", "2", "--no-shuffle", "--optimizer", "sgd"]
    # 44 steps/epoch: 8 calls of 5 + one of 4
    local_runs((tmp_path / "k1", *common), (tmp_path / "k5", *common, "--steps-per-execution", "5"))
    assert json.loads((tmp_path / "k5" / "result.json").read_text())["config"]["steps_per_execution"] == 5
    w1 = keras.models.load_model(tmp_path / "k1" / "model.keras").get_weights()
    w5 = keras.models.load_model(tmp_path / "k5" / "model.keras").get_weights()
    for a, b in zip(w1, w5):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


IMPOSSIBLE = [
    (["--strategy", "tpu"], "--strategy tpu: no TPU found"),
    (["--strategy", "mirrored", "--devices", "1"], "--strategy mirrored needs 2 or more devices, found 0 GPU(s), 1 CPU"),
    (["--strategy", "central-storage"], "--strategy central-storage needs 2 or more compute devices"),
]


@pytest.fixture(scope="module")
def impossible_runs(tmp_path_factory):
    return refusals_at_once(tmp_path_factory, "impossible", lambda i, out: [
        "jobs/train.py", "--backend", "local", "--output", str(out), *IMPOSSIBLE[i][0]], len(IMPOSSIBLE), timeout=300)


@pytest.mark.parametrize("case", range(len(IMPOSSIBLE)), ids=[" ".join(args) for args, _ in IMPOSSIBLE])
def test_impossible_strategy_requests_fail_clearly(impossible_runs, case):
    out, p = impossible_runs[case]
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and IMPOSSIBLE[case][1] in errors[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_ray_flags_are_refused_for_local_and_vice_versa(tmp_path):
    p = run_job("jobs/train.py", "--strategy", "mirrored", "--output", str(tmp_path / "o"), timeout=300)
    assert p.returncode == 2 and "use it with --backend local" in p.stderr


def test_local_backend_never_imports_ray(tmp_path):
    code = f"""
import sys
from app.config import build_config
from app.backends import local as local_train
local_train.run(build_config(None, {{"backend": "local", "epochs": 1, "output": {str(tmp_path / "o")!r}}}))
assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
print("no ray")
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "no ray" in p.stdout, p.stderr[-3000:]


def test_cnn_batch_norm_state_is_one_value_across_replicas(local_set):
    """Each replica updates its own batch-norm moving statistics; the loop averages them every epoch.

    Without that, replica 1 evaluates with different statistics from the ones
    rank 0 exports, and the in-training val metrics disagree with the exported
    model's.
    """
    out, result = local_set["cnn"]
    p = run_job("jobs/evaluate.py", "--run", str(out), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    scored = json.loads((out / "eval.json").read_text())
    assert scored["val_loss"] == pytest.approx(result["metrics"]["val_loss"], rel=1e-5)
    assert scored["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)


class _Accuracy:
    """The measures of an uncompiled classifier, as far as the driver sees them: accuracy = total / count."""

    size = 4

    @staticmethod
    def results(state):
        return {"accuracy": state[0] / state[1]}


MEASURES = _Accuracy()


class ChunkedSteps:
    """A StepRunner that runs its steps in chunks of 16, as the parameter servers' ScheduledSteps does."""

    def __init__(self, bad_step=None):
        self.bad_step, self.numbers = bad_step, []

    def steps_taken(self):
        return 100

    def run(self, iterator, first_step, remaining):
        n = min(16, remaining)
        self.numbers += range(first_step, first_step + n)
        loss = np.nan if self.bad_step in self.numbers[-n:] else 0.5 * n
        return np.array([loss, n, n / 2, n], dtype=np.float64), n, None  # [loss, count, accuracy's total, count]

    def total(self, local):
        return local

    def evaluate(self, val):
        from app.training.metrics import EpochStats

        return EpochStats.from_sums(np.array([1.0, 8.0, 4.0, 8.0]), 0.1, MEASURES.results)

    def learning_rate(self, global_step):
        return 1.0 / global_step

    def extra_metrics(self):
        return {}


def test_the_epoch_driver_numbers_chunked_steps_and_names_a_non_finite_chunk():
    """The one epoch driver under a runner that schedules numbered steps in chunks (parameter servers): the steps
    are numbered on from the restored count, the record carries optimizer_steps, a NaN names its chunk."""
    from app.training.loop import EpochDriver, NonFiniteLoss

    runner = ChunkedSteps()
    driver = EpochDriver(runner, MEASURES)
    metrics, train = driver.run_epoch(1, None, 40, None, dropped=0)
    assert runner.numbers == list(range(100, 140)) and train.samples == 40
    assert metrics["optimizer_steps"] == 140 and metrics["learning_rate"] == 1 / 140
    assert metrics["train_loss"] == 0.5 and metrics["val_accuracy"] == 0.5

    with pytest.raises(NonFiniteLoss, match=r"non-finite training loss in epoch 2, steps 17-32 of 40"):
        EpochDriver(ChunkedSteps(bad_step=120), MEASURES).train_epoch(None, 40, epoch=2)
