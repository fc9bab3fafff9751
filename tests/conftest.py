"""Shared fixtures: one local Ray for the whole session, and helpers to run the jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# `ray start` heads in a process group of their own; the benchmark starts its heads the same way.
from app.bench.node import assert_process_group_gone, free_port, ray_cli, start_node, stop_node  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Ray Data 2.60 lists parquet files with a pool of 32 FooterReader actors per read (each pass of a
# streamed dataset is one), made for object stores over big clusters. On this 2-core machine, with
# the workers holding their CPUs, they start one after another: ~60 s for 4 local files. One actor
# reads the same footers (the same files, rows and seeded file shuffle): what a test checks does not
# change. Ray reads it where the dataset is created (read_parquet, in the driver), so it is set for
# this process and for every job a test starts (clean_env keeps it).
KEPT_RAY_ENV = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1"}
for _name, _value in KEPT_RAY_ENV.items():
    os.environ.setdefault(_name, _value)


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

    # As app.run.cluster does for a local Ray it starts (this is one): nothing preempts its node, so the runs
    # made in this process start no preemption watcher (one more process on their critical path). Jobs that
    # join this Ray from the command line keep theirs, as on any cluster they join.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(address="local", num_cpus=3, include_dashboard=True, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def two_worker_run(ray_cluster, tmp_path_factory):
    """One undisturbed default 2-worker run (6 epochs), shared by the tests that compare against it."""
    from app.config import build_config
    from app.run import ray_train

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k in KEPT_RAY_ENV}
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


def run_jobs_at_once(*commands: list[str], timeout: float = 600, env: dict[str, str] | None = None,
                     envs: list[dict[str, str]] | None = None) -> list[subprocess.CompletedProcess]:
    """Independent job runs side by side (two local trainings a test compares): their start-ups overlap.

    ``envs`` gives each command its own environment (else all get ``env``)."""
    import concurrent.futures

    envs = envs or [env] * len(commands)
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args, e: run_job(*args, timeout=timeout, env=e), commands, envs))


# --- clusters a test starts itself (ray start, ray up) -----------------------

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_TOOLS_MISSING = (
    "" if os.path.exists(SSHD) and shutil.which("rsync") and shutil.which("ssh-keygen")
    else "needs sshd, ssh-keygen and rsync (Debian: apt-get install openssh-server rsync; .ci/run does)"
)


