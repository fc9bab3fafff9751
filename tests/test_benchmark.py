"""jobs/benchmark.py --quick works end to end: it measures every configuration and writes its table and plot.

Speed is not asserted here (a shared 2-core machine is noise); BENCHMARKS.md has the full run's figures.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_job


@pytest.mark.own_ray_cluster
def test_quick_benchmark_writes_its_table_and_plot(no_shared_ray, tmp_path):
    p = run_job("jobs/benchmark.py", "--quick", "--output", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "plain TF (baseline)" in p.stdout and "ray 2 worker(s)" in p.stdout and "vs baseline" in p.stdout
    report = json.loads((tmp_path / "benchmark.json").read_text())
    # baseline, Ray 2 workers, and 2 plain processes at once (the 2-worker ceiling); the quick preset runs 2 workers
    # only (the full one 1 and 2: the same code for each count)
    assert [row["workers"] for row in report["table"]] == [1, 2, 2]
    assert report["table"][-1]["run"] == "plain TF x2 processes"
    # measured before and after the Ray runs, each time in 2 processes at once
    assert [len(c["processes"]) for c in report["plain_processes_at_once"]["2"]["before_and_after"]] == [2, 2]
    assert all(row["samples_per_second"] > 0 for row in report["table"])
    assert report["input_pipeline"]["samples_per_second"] > 0
    assert report["startup"]["own Ray"]["time_to_first_step_seconds"] > 0
    # Whole runs (first epoch included) against local runs: two at once, each on half the rows.
    assert list(report["local_runs_at_once"]) == ["2"] and len(report["local_runs_at_once"]["2"]["runs"]) == 2
    goals = report["goals"]
    assert goals["2 workers vs 2 local runs at once, whole run >= 0.90"] > 0
    assert goals["2 workers vs 2 plain processes, steady >= 0.90"] > 0
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
