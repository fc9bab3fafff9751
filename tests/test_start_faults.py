"""Faults while a run starts: a worker killed while Ray Train starts its group (at several moments); a token
cluster joined without its token."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from conftest import REPO, clean_env, run_jobs_at_once


def train_workers() -> set[int]:
    """PIDs of the Ray Train worker processes of this session's Ray (its raylet is our child)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.Error:
            pass  # ended while we looked
    return found


def kill_during_starts(driver: subprocess.Popen, delays: list[float], timeout: float = 180) -> list[float]:
    """For each delay: wait for a new worker process, SIGKILL it ``delay`` s after it appeared.

    Returns when each was killed (or the driver ended first)."""
    seen, killed = train_workers(), []
    for delay in delays:
        deadline, new = time.time() + timeout, set()
        while not new and driver.poll() is None:
            assert time.time() < deadline, f"no new Ray Train worker within {timeout} s"
            new = train_workers() - seen
            time.sleep(0.02)
        if driver.poll() is not None:
            break
        appeared = time.time()
        time.sleep(max(0.0, appeared + delay - time.time()))
        pid = min(new)
        with contextlib.suppress(ProcessLookupError):  # by PID, a process of the Ray this test session started
            os.kill(pid, signal.SIGKILL)
        killed.append(time.time())
        # The other worker(s) of that start die with the group: none of them counts as "new" next time.
        time.sleep(0.5)
        seen |= new | train_workers()
    return killed


def driver_for(ray_cluster, out, *flags: str) -> subprocess.Popen:
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    cmd = [sys.executable, "jobs/train.py", "--output", str(out), "--epochs", "2", *flags]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_workers_killed_while_the_group_starts_are_replaced_under_max_failures(ray_cluster, tmp_path):
    """Kills 0.2 s, 0.9 s and 1.4 s after a start's worker appears (Ray 2.60 hung 3 times in 13 at 1-1.5 s).

    Ray counts each kill once most times, but a kill that lands while the controller talks to the group can count
    twice (the start's failure, then the dead actor in its next control-loop step): the budget leaves room for that."""
    out = tmp_path / "killed-at-start"
    driver = driver_for(ray_cluster, out, "--max-failures", "6", "--worker-start-timeout-s", "30")
    try:
        killed = kill_during_starts(driver, [0.2, 0.9, 1.4])
        # Bounded: three restarts (a few seconds each) and two short epochs, not a wait for CPUs never freed.
        stdout, stderr = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert len(killed) == 3, stderr[-3000:]
    assert driver.returncode == 0, stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["epochs_completed"] == 2 and result["metrics"]["val_accuracy"] > 0.5
    assert "Traceback" not in stdout + stderr


def test_a_worker_killed_at_start_without_max_failures_ends_in_one_line(ray_cluster, tmp_path):
    out = tmp_path / "killed-once"
    driver = driver_for(ray_cluster, out, "--worker-start-timeout-s", "30")
    try:
        killed = kill_during_starts(driver, [0.5])
        stdout, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert killed and driver.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "--max-failures" in errors[0] and "Traceback" not in stdout + stderr
    assert not (out / "result.json").exists()


def test_a_token_cluster_joined_without_its_token_or_with_a_wrong_one_is_one_line(ray_cluster, tmp_path):
    """The session's Ray has token authentication on (ray.init's default), as a `ray start` head does
    once ~/.ray/auth_token exists: a driver joining it with no token, or a wrong one, gets one line, from the
    cluster's first answer (ray.init alone tries 20 times, a second apart, before it says so)."""
    address = ray_cluster.get_runtime_context().gcs_address
    cmd = ["jobs/train.py", "--epochs", "1", "--output"]
    no_token, wrong_token = run_jobs_at_once(
        [*cmd, str(tmp_path / "a")], [*cmd, str(tmp_path / "b")], envs=[clean_env(RAY_ADDRESS=address),
                        clean_env(RAY_ADDRESS=address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)],
        timeout=120,
    )
    for p, given in ((no_token, "no token"), (wrong_token, "a token that it does not accept")):
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
        assert f"requires token authentication and we sent {given}" in errors[0] and "RAY_AUTH_MODE=token" in errors[0]
        assert "Traceback" not in p.stdout + p.stderr
        assert p.seconds < 18, f"{p.seconds:.0f} s to refuse {given}"  # its imports and one call, not 20 retries
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything was written


def test_workers_that_cannot_be_placed_end_within_the_start_timeout_in_one_line(ray_cluster, tmp_path):
    """The cluster is busy (a placement group of ours holds 2 of its 3 CPUs): each start waits at most
    --worker-start-timeout-s, is retried under --max-failures, and the run ends with one line saying what
    Ray was waiting for, instead of waiting for CPUs forever."""
    from ray.util.placement_group import placement_group, remove_placement_group

    busy = placement_group([{"CPU": 2}])
    ray_cluster.get(busy.ready(), timeout=30)
    started = time.time()
    try:
        driver = driver_for(ray_cluster, tmp_path / "unplaced", "--worker-start-timeout-s", "5", "--max-failures", "1")
        stdout, stderr = driver.communicate(timeout=180)
    finally:
        remove_placement_group(busy)
    took = time.time() - started
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert driver.returncode == 1 and len(errors) == 1, stderr[-3000:]
    assert "could not be placed within --worker-start-timeout-s (5 s) after 1 restarts" in errors[0], errors[0]
    assert "2 x {CPU: 1} (PACK)" in errors[0] and "Traceback" not in stdout + stderr
    assert took < 120, f"{took:.0f} s for two starts of at most 5 s each"
