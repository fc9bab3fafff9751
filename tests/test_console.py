"""The console's parts, one at a time, without a cluster: worker-line sorting, error summaries, data checks.

The whole console (plan, epoch lines, no chatter, train.log) is checked on every command-line run of
tests/test_your_own.py; a frozen worker's line in tests/test_recovery.py; bad data in tests/test_data.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pyarrow as pa
import pytest

from app.data import blocks, streamed
from app.data.files import Located
from app.training.loop import EpochBar
from app.ui import console, failures
from conftest import REPO


@pytest.fixture
def lines(tmp_path):
    """A _WorkerLines in front of a recording "Ray printer", during a run, with its log file."""
    printed: list[dict] = []
    sorter = console._WorkerLines(printed.append)
    log = tmp_path / "train.log"
    handler = logging.FileHandler(log)
    saved = dict(console._people)
    console._people.update(active=True, verbose=False, sticky=False, marked=True)
    yield sorter, printed, log, handler
    console._people.update(saved)
    console._WorkerLines.detach()
    handler.close()


def batch(*lines, pid=123):
    return {"lines": list(lines), "pid": pid, "ip": "10.0.0.1", "actor_name": "RayTrainWorker", "is_err": True}


def test_marked_lines_reach_the_console_and_the_rest_the_log_file(lines, capsys):
    sorter, printed, log, handler = lines
    sorter(batch("(before the file) Ray Data's plan"))  # during the checks: kept until the file exists
    console._WorkerLines.attach(handler)
    sorter(batch(console.MARK + "epoch   1/2  train_loss 0.5", "TrainingReport(metrics=...)"))
    assert capsys.readouterr().err == "epoch   1/2  train_loss 0.5\n"
    text = log.read_text()
    assert "(RayTrainWorker pid=123, ip=10.0.0.1) TrainingReport(metrics=...)" in text
    assert "(before the file) Ray Data's plan" in text and "epoch" not in text
    assert printed == []  # not verbose: nothing through Ray's printer

    console._people["verbose"] = True
    sorter(batch("a TensorFlow notice"))
    assert [b["lines"] for b in printed] == [["a TensorFlow notice"]]


def test_ray_events_still_reach_rays_printer_and_a_bad_batch_never_raises(lines):
    sorter, printed, _, _ = lines
    sorter(batch("Resource request cannot be scheduled", pid="autoscaler"))
    assert printed and printed[0]["pid"] == "autoscaler"
    from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

    broken = batch(f'{{"{RAY_TQDM_MAGIC}": not json')
    sorter(broken)  # on Ray's log thread an exception would end all worker output: handed to Ray instead
    assert printed[-1] is broken


def test_the_clusters_messages_reach_the_log_file_and_the_console_but_for_known_noise(lines):
    _, _, log, handler = lines
    console._WorkerLines.attach(handler)
    shown = []
    messages = console._RayMessages(lambda data, ignore_prefix: shown.append(data["lines"]))
    messages({"lines": ["WARNING: 8 PYTHON worker processes have been started on node: ..."], "pid": "raylet"})
    messages({"lines": ["A worker died or was killed while executing a task"], "pid": "raylet"})
    assert shown == [["A worker died or was killed while executing a task"]]
    text = log.read_text()
    assert "(raylet) WARNING: 8 PYTHON worker processes" in text and "(raylet) A worker died" in text


# Ray 2.60's autoscaler report, as its monitor sends it to the driver every 5 s.
REPORT = ["2026-11-27 22:27:10,112\tINFO autoscaler.py:408 -- ", "======== Autoscaler status: 2026-11-27 22:27:10 ========",
          "Node status", "-" * 63, "Active:", " 1 node_05cef058fb84e50aa93dc563b4ceb80e16b885d33a088b3e08961f18",
          "Resources", "-" * 63, "Total Usage:", " 2.0/3.0 CPU (2.0 used of 2.0 reserved in placement groups)",
          "Pending Demands:", " (no resource demands)"]


def test_the_autoscalers_events_reach_the_log_file_and_its_routine_report_does_not(lines):
    sorter, printed, log, handler = lines
    console._WorkerLines.attach(handler)
    sorter(batch(*REPORT, pid="autoscaler"))
    sorter(batch("2026-11-27 22:27:10,114\tINFO autoscaler.py:469 -- The autoscaler took 0.002 seconds to complete "
                 "the update iteration.", "Resource request cannot be scheduled", pid="autoscaler"))
    assert len(printed) == 2  # Ray's printer still sees all of it (it keeps the events for the console)
    text = log.read_text()
    assert "pid=autoscaler, ip=10.0.0.1) Resource request cannot be scheduled" in text, text
    assert "Autoscaler status" not in text and "Total Usage" not in text and "autoscaler took" not in text, text


def test_in_a_sweep_the_workers_marked_lines_go_to_the_log_file(lines, capsys):
    sorter, _, log, handler = lines
    console._WorkerLines.attach(handler)
    console._people["marked"] = False
    sorter(batch(console.MARK + "epoch   1/2  train_loss 0.5"))
    assert capsys.readouterr().err == ""
    assert "(RayTrainWorker pid=123, ip=10.0.0.1) epoch   1/2  train_loss 0.5" in log.read_text()


def test_a_frozen_peer_is_named_and_an_unrelated_deadline_is_not():
    class Failed(Exception):
        def __init__(self, failures):
            super().__init__("Training failed")
            self.worker_failures = failures

    frozen = Failed({1: Exception(
        "Traceback (most recent call last):\n  ...\ntensorflow.python.framework.errors_impl.UnavailableError: "
        "Graph execution error:\n\nCollective ops is aborted by: Deadline Exceeded\n\n"
        "RPC: /tensorflow.CoordinationService/Heartbeat\n [[{{node sgd/CollectiveReduceV2}}]]")})
    line = failures.summarize(frozen)
    assert "stopped answering in the all-reduce" in line and "Collective ops is aborted" in line and "(rank 1)" in line
    upload = Failed({0: Exception("Traceback ...\nOSError: upload to gs://bucket failed: Deadline Exceeded")})
    assert failures.summarize(upload) == "OSError: upload to gs://bucket failed: Deadline Exceeded (rank 0)"


def test_a_worker_lost_in_a_step_or_while_the_controller_spoke_to_it_names_max_failures(tmp_path):
    """Without a restart budget, a lost worker's line says how to get one, whether Ray reports it as the worker's
    failure (a training step) or as the controller's (a kill that lands while it speaks to the group)."""
    import ray.exceptions
    import ray.train

    from app.config import build_config

    class Failed(Exception):
        def __init__(self, failures):
            super().__init__("Training failed")
            self.worker_failures = failures

    died = ray.exceptions.ActorDiedError()
    for error in (Failed({0: died}), ray.train.ControllerError(died)):
        for budget, hinted in ((0, True), (2, False)):
            config = build_config(None, {"output": str(tmp_path / "run"), "max_failures": budget})
            assert ("rerun with --max-failures 2" in failures.restart_hint(error, config)) == hinted, (error, budget)
    assert failures.restart_hint(Failed({0: ValueError("a bug")}), build_config(None, {"output": str(tmp_path)})) == ""


def test_nonfinite_values_are_counted_in_every_column_kind():
    nan, inf = float("nan"), float("inf")
    assert blocks._nonfinite(pa.chunked_array([[1.0, nan], [inf, None, 2.0]])) == 2
    assert blocks._nonfinite(pa.array([[1.0, nan], None, [inf, -inf]], type=pa.list_(pa.float32()))) == 3
    assert blocks._nonfinite(pa.array([[1.0, 2.0], [nan, 3.0]], type=pa.list_(pa.float64(), 2))) == 1
    assert blocks._nonfinite(pa.array([[[nan]], [[1.0]]])) == 1
    assert blocks._nonfinite(pa.array([1, 2, 3])) == 0 and blocks._nonfinite(pa.array(["a", "b"])) == 0
    assert blocks._nonfinite(pa.array([], type=pa.float32())) == 0


def test_a_csv_that_does_not_parse_is_named_with_pyarrows_reason(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,label\n1,2,0\n3,4\n")
    ray_text = (f"ray::ReadCSV()\nTraceback (most recent call last):\n  File ...\nValueError: Failed to read CSV "
                f"file: {bad}. Please check the CSV file has correct format, or filter out non-CSV file")
    loc = Located(uri=str(bad), format="csv", filesystem=None, root=str(bad), files=(str(bad),))
    assert streamed._read_failure(loc, RuntimeError(ray_text)) == f"{bad}: CSV parse error: Expected 3 columns, got 2: 3,4"
    other = RuntimeError("Traceback (most recent call last):\n  File ...\npyarrow.lib.ArrowInvalid: bad magic number")
    parquet = Located(uri="x", format="parquet", filesystem=None, root="x", files=("x",))
    assert streamed._read_failure(parquet, other) == "bad magic number"


def test_an_epoch_bar_appears_only_after_its_delay(monkeypatch):
    made = []

    class Bar:
        def __init__(self, total, desc):
            self.n, self.closed = 0, False
            made.append((total, desc, self))

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    quick = EpochBar(Bar, 10, "epoch 1/2")
    quick.update(4)
    quick.close()
    assert made == []  # a short epoch: no bar
    monkeypatch.setattr(EpochBar, "DELAY_S", 0.0)
    slow = EpochBar(Bar, 10, "epoch 2/2")
    slow.update(3)
    slow.update(2)
    slow.close()
    ((total, desc, bar),) = made
    assert (total, desc, bar.n, bar.closed) == (10, "epoch 2/2", 5, True)


def test_tensorflows_absl_info_lines_stay_off_a_job_scripts_stderr(tmp_path):
    script = ("import sys; sys.path.insert(0, 'jobs'); import _bootstrap; import tensorflow as tf; "
              "print('after', file=sys.stderr)")
    # No TF_CPP_MIN_LOG_LEVEL from the tests' environment; a HOME of its own for Keras's and matplotlib's caches.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stderr == "after\n", p.stderr
