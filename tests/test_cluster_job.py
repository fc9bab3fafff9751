"""`ray job submit` of jobs/train.py to a two-node cluster started with `ray start`, token auth on."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, SSH_TOOLS_MISSING, clean_env, free_port, ray_cli, start_node, stop_node


@pytest.mark.own_ray_cluster
# tests/test_ray_up.py runs this same two-node SPREAD job on a cluster made by `ray up` wherever sshd is
# installed (CI installs it); this test is the path for machines without it. Both cost ~100 s.
@pytest.mark.skipif(not SSH_TOOLS_MISSING, reason="tests/test_ray_up.py runs the two-node job through ray up")
def test_job_submit_to_a_two_node_cluster_spreads_the_workers(no_shared_ray, tmp_path):
    """The cross-node path of a real cluster, on one machine: a head and a second node joined with
    `ray start --address`, a job submitted with the token, and workers placed SPREAD on both nodes."""
    # Token authentication stays on: head and submitter share a token, as Ray documents
    # (RAY_AUTH_MODE=token plus the token in RAY_AUTH_TOKEN).
    env = clean_env(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    )
    gcs_port, dashboard_port = free_port(), free_port()
    # A temp dir of its own keeps this cluster out of /tmp/ray, where `ray.init()` looks for clusters.
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")
    # 2 CPUs on the head (one worker + Ray Data's tasks), 1 on the second node (the other worker).
    head = start_node(
        ["--head", "--num-cpus", "2", "--temp-dir", temp_dir, "--port", str(gcs_port),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
         "--ray-client-server-port", str(free_port())],
        env, tmp_path,
    )
    nodes = [head]
    address = f"http://127.0.0.1:{dashboard_port}"
    out = tmp_path / "run"
    try:
        deadline = time.time() + 90
        while subprocess.run([ray_cli(), "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None, head.stdout.read()
            assert time.time() < deadline, "the head's job server did not come up in 90 s"
            time.sleep(2)
        nodes.append(start_node(["--address", f"127.0.0.1:{gcs_port}", "--num-cpus", "1"], env, tmp_path))

        submit = subprocess.run(
            [ray_cli(), "job", "submit", "--address", address, "--submission-id", "train-smoke",
             "--working-dir", str(REPO), "--",
             "python", "jobs/train.py", "--epochs", "1", "--output", str(out), "--placement-strategy", "SPREAD",
             "--worker-start-timeout-s", "60"],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        status = subprocess.run([ray_cli(), "job", "status", "--address", address, "train-smoke"],
                                env=env, capture_output=True, text=True)
        assert "Job 'train-smoke' succeeded" in status.stdout, status.stdout + status.stderr
        result = json.loads((out / "result.json").read_text())
        assert result["epochs_completed"] == 1 and result["num_replicas"] == 2
        assert "outputs written to" in submit.stdout
        # Each rank reported the node it ran on: two different nodes, both of this cluster.
        listed = subprocess.run([ray_cli(), "list", "nodes", "--address", address, "--format", "json"],
                                env=env, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        cluster_nodes = {n["node_id"] for n in json.loads(listed.stdout)}
        assert len(cluster_nodes) == 2
        assert len(set(result["worker_nodes"])) == 2 and set(result["worker_nodes"]) == cluster_nodes
    finally:
        for node in reversed(nodes):
            stop_node(node)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.own_ray_cluster
# tests/test_ray_up.py's cluster is exactly the workers' size too, and makes the same two checks there.
@pytest.mark.skipif(not SSH_TOOLS_MISSING, reason="tests/test_ray_up.py runs an exact-size cluster through ray up")
def test_a_cluster_exactly_the_size_of_the_workers_runs_to_the_end(no_shared_ray, tmp_path):
    """`ray start --head --num-cpus 2` and 2 workers x 1 CPU: no CPU left beside the workers.

    In-memory data needs no Ray task per epoch, so it runs to the end; streamed data (Ray Data's reads need a
    CPU) is refused with one line that says what to change, instead of waiting forever."""
    env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                    PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    gcs_port, dashboard_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayfull", dir="/tmp")
    head = start_node(["--head", "--num-cpus", "2", "--temp-dir", temp_dir, "--port", str(gcs_port),
                       "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                       "--ray-client-server-port", str(free_port())], env, tmp_path)
    address = f"http://127.0.0.1:{dashboard_port}"

    def submit(*args, timeout=400):
        return subprocess.run([ray_cli(), "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
                               "python", "jobs/train.py", "--epochs", "1", *args],
                              env=env, capture_output=True, text=True, timeout=timeout)

    try:
        deadline = time.time() + 90
        while subprocess.run([ray_cli(), "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            assert time.time() < deadline, "the head's job server did not come up in 90 s"
            time.sleep(2)
        done = submit("--output", str(tmp_path / "memory"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert json.loads((tmp_path / "memory" / "result.json").read_text())["epochs_completed"] == 1

        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        rng = np.random.default_rng(0)
        (tmp_path / "pq").mkdir()
        pq.write_table(pa.table({"x": pa.array(list(rng.normal(size=(256, 4)).astype("float32")),
                                               type=pa.list_(pa.float32())), "label": rng.integers(0, 2, 256)}),
                       tmp_path / "pq" / "p.parquet")
        refused = submit("--dataset", str(tmp_path / "pq"), "--output", str(tmp_path / "refused"), timeout=200)
        assert refused.returncode != 0
        lines = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
        # (ray job submit may show the job's log twice: once streamed, once at the end)
        assert len(set(lines)) == 1 and "streamed data needs 1 CPU for Ray Data's reads" in lines[0], lines
        assert "Traceback" not in refused.stdout + refused.stderr
        # (What the fix leads to, a CPU free beside the workers, is the session's 3-CPU cluster that every
        # streamed test runs on.)
    finally:
        stop_node(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
