"""Where a run's time went (app.driver.time_report): the verdict and its lever from the workers' epoch splits, the
start-up chain from the driver's and the workers' marks. The split itself is measured on real Ray workers in
tests/test_train_ray.py::test_every_run_says_where_its_time_went."""

import pytest

from app.driver import time_report
from app.training.step_clock import EPOCH_FIELDS


def row(steps=40, calls=1.0, body=0.8, sync=0.1, hooks=0.1, epoch_start=0.05, validation=0.2, checkpoint=0.1,
        first_step=0.0):
    values = dict(steps=steps, calls=calls, body=body, sync=sync, hooks=hooks, epoch_start=epoch_start,
                  validation=validation, checkpoint=checkpoint, first_step=first_step)
    return [values[k] for k in EPOCH_FIELDS]


def took(*rows_per_epoch, sync_timed=True):
    return {"epochs": [{"epoch": i + 1, "workers": rows} for i, rows in enumerate(rows_per_epoch)],
            "sync_timed": sync_timed}


@pytest.fixture(autouse=True)
def driver_marks():
    time_report.DRIVER_MARKS.clear()
    yield
    time_report.DRIVER_MARKS.clear()


def test_each_part_of_the_steady_steps_and_the_largest_named_with_its_lever():
    # 2 workers: input = calls - body, compute = body - sync; the hooks are between the calls.
    report = time_report.report(took([row(), row(calls=1.2, body=0.8)]), streamed=False, workers=2)
    assert report["shares"] == pytest.approx({"input": 0.6 / 2.4, "compute": 1.4 / 2.4, "sync": 0.2 / 2.4,
                                              "hooks": 0.2 / 2.4}, abs=1e-4)
    assert report["bound"] == "compute" and report["steps_timed"] == 40
    assert report["step_ms"] == pytest.approx(1000 * 2.4 / 80)
    assert "compute-bound: 58%" in report["line"]


def test_an_input_bound_stream_is_told_to_give_ray_data_cpus_or_memory():
    report = time_report.report(took([row(calls=2.0, body=0.5, sync=0.1)]), streamed=True, workers=1)
    assert report["bound"] == "input"
    assert "--cpus-per-worker 0.5" in report["line"] and "--data-cache memory" in report["line"]
    arrays = time_report.report(took([row(calls=2.0, body=0.5, sync=0.1)]), streamed=False, workers=1)
    assert "prefetch" in arrays["line"] and "--data-cache" not in arrays["line"]


def test_a_sync_bound_run_is_told_to_send_fewer_all_reduces():
    report = time_report.report(took([row(body=0.9, sync=0.7)], [row(body=0.9, sync=0.7)]), streamed=False,
                                workers=1)
    assert report["bound"] == "sync" and "--grad-accum N" in report["line"]


def test_a_run_too_short_for_a_steady_state_says_so_and_gives_no_ratio():
    report = time_report.report(took([row(steps=5)]), streamed=False, workers=1)
    assert report["bound"] == "short" and "shares" not in report
    assert "5 steady step(s) a worker: too few" in report["line"] and "%" not in report["line"]
    nothing = time_report.report(None, streamed=False, workers=1)
    assert nothing["bound"] == "short" and nothing["epochs"] == [] and nothing["startup"] == []


def test_the_start_up_chain_waits_for_the_slowest_worker_and_counts_a_prestarted_process_as_no_time():
    time_report.DRIVER_MARKS.update({"process": 100.0, "plan": 104.0, "ray": 107.0, "fit": 108.0})
    workers = [{"worker process": 105.0, "worker entered": 110.0, "tensorflow": 112.0, "inputs": 112.5,
                "model": 113.0, "traced": 114.0, "first step": 115.0},
               {"worker process": 106.0, "worker entered": 111.0, "tensorflow": 113.0, "inputs": 113.0,
                "model": 113.5, "traced": 114.5, "first step": 115.0}]
    links = {k["link"]: k["seconds"] for k in time_report.startup(workers)}
    assert links["the driver: imports, inputs, model and plan"] == 4
    assert links["Ray Train: controller and worker processes"] == 0  # Ray started them before the run asked
    # the slowest worker's: 111 - 108
    assert links["Ray Train's set-up to the training function (TensorFlow imported beside it)"] == 3
    assert links["the worker's TensorFlow and collectives"] == 2
    assert sum(links.values()) == 15
