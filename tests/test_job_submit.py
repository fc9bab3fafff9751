"""`ray job submit` of jobs/train.py to a head started with `ray start --head`, token auth on."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    # The `ray` next to this interpreter: the head then runs jobs with this environment's python.
    return str(Path(sys.executable).with_name("ray"))


@pytest.mark.own_ray_cluster
def test_job_submit_runs_train_to_success(no_shared_ray, tmp_path):
    # Token authentication stays on: head and submitter share a token, as Ray documents
    # (RAY_AUTH_MODE=token plus the token in RAY_AUTH_TOKEN).
    env = clean_env(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    gcs_port, dashboard_port = free_port(), free_port()
    # A temp dir of its own keeps this head out of /tmp/ray, where `ray.init()` looks for clusters.
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")
    head = subprocess.Popen(
        [ray_cli(), "start", "--head", "--block", "--num-cpus", "3", "--temp-dir", temp_dir,
         "--port", str(gcs_port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
         "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
         "--disable-usage-stats"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, so we stop exactly what it started
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    out = tmp_path / "run"
    try:
        deadline = time.time() + 90
        while subprocess.run([ray_cli(), "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None, head.stdout.read()
            assert time.time() < deadline, "the head's job server did not come up in 90 s"
            time.sleep(2)

        submit = subprocess.run(
            [ray_cli(), "job", "submit", "--address", address, "--submission-id", "train-smoke",
             "--working-dir", str(REPO), "--",
             "python", "jobs/train.py", "--epochs", "1", "--output", str(out)],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        status = subprocess.run([ray_cli(), "job", "status", "--address", address, "train-smoke"],
                                env=env, capture_output=True, text=True)
        assert "Job 'train-smoke' succeeded" in status.stdout, status.stdout + status.stderr
        result = json.loads((out / "result.json").read_text())
        assert result["epochs_completed"] == 1 and result["num_replicas"] == 2
        assert "outputs written to" in submit.stdout
    finally:
        # `ray start --block` stops the processes it started when it gets SIGTERM.
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        assert_process_group_gone(head.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def assert_process_group_gone(pgid: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)  # signal 0: only asks whether any member is alive
        except ProcessLookupError:
            return
        time.sleep(1)
    raise AssertionError(f"processes of the head's group {pgid} still running after {timeout} s")
