"""Shared fixtures: one local Ray for the whole session, and helpers to run the jobs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_collection_modifyitems(config, items):
    # Tests that start a Ray cluster of their own run last, after the shared
    # one is shut down: only one Ray instance at a time on this machine.
    items.sort(key=lambda item: item.get_closest_marker("own_ray_cluster") is not None)


def pytest_configure(config):
    config.addinivalue_line("markers", "own_ray_cluster: the test starts (and stops) its own Ray cluster")


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray: 2 worker CPUs + 1 for Ray Data's tasks (see app.run.cluster.connect)."""
    import ray

    ray.init(address="local", num_cpus=3, include_dashboard=True, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def two_worker_run(ray_cluster, tmp_path_factory):
    """One undisturbed default 2-worker run (6 epochs), shared by the tests that compare against it."""
    from app.run import ray_train
    from app.config import build_config

    out = tmp_path_factory.mktemp("runs") / "w2"
    result = ray_train.run(
        build_config(None, {"output": str(out), "num_workers": 2, "epochs": 6, "log_every_steps": 10})
    )
    return out, result


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log directory, read back the way TensorBoard reads it."""
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


@pytest.fixture
def no_shared_ray():
    """Stop the session's Ray (if any) before a test that runs a cluster of its own."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(extra)
    return env


def run_job(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_jobs_at_once(*commands: list[str], timeout: float = 600,
                     env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Independent job runs side by side (two local trainings a test compares): their start-ups overlap."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_job(*args, timeout=timeout, env=env), commands))


# --- clusters a test starts itself (ray start, ray up) -----------------------

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_TOOLS_MISSING = (
    "" if os.path.exists(SSHD) and shutil.which("rsync") and shutil.which("ssh-keygen")
    else "needs sshd, ssh-keygen and rsync (Debian: apt-get install openssh-server rsync; .ci/run does)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    # The `ray` next to this interpreter: the head then runs jobs with this environment's python.
    return str(Path(sys.executable).with_name("ray"))


def start_node(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`ray start ... --block` in its own process group, so that we stop exactly what it started."""
    return subprocess.Popen(
        [ray_cli(), "start", "--block", "--disable-usage-stats", "--dashboard-agent-listen-port", str(free_port()),
         *args],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def stop_node(node: subprocess.Popen) -> None:
    # `ray start --block` stops the processes it started when it gets SIGTERM.
    os.killpg(node.pid, signal.SIGTERM)
    try:
        node.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=30)
    assert_process_group_gone(node.pid)


def assert_process_group_gone(pgid: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)  # signal 0: only asks whether any member is alive
        except ProcessLookupError:
            return
        time.sleep(1)
    raise AssertionError(f"processes of group {pgid} still running after {timeout} s")
