"""End to end: `ray up` of the shipped SSH config against this machine, a job, then `ray down`.

The shipped cluster_ssh.yaml is the base; the test changes only what a lab
user would (the machine, the user, the key, no workers) plus what a shared
test machine needs:

- sshd is started by the test on a free port of 127.0.0.1 with a key the test
  makes; `SetEnv HOME=...` gives the "remote" side a home of its own, so the
  launcher's files (~/ray_bootstrap_config.yaml, the key, the token) land in
  the test's temp directory and not in the real home.
- The launcher's start commands run `ray stop`, and `ray down` runs `ray stop`
  over SSH: on a real cluster's dedicated machines that is right, here it
  would stop every Ray process of the user. The start commands are replaced
  (a head in a process group of its own), and on the remote PATH a `ray` shim
  turns `ray stop` into "stop that process group"; every other subcommand is
  the real ray.
- Setup commands are emptied: the venv running the tests already holds the
  project (installing the CUDA build of TensorFlow is for real clusters).

Needs Debian's openssh-server and rsync (`.ci/run` installs them); skipped
without them, and then tests/test_cluster_job.py runs the two-node job instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from app.bench.node import DRAIN_TIMEOUT_ENV
from conftest import (
    REPO,
    SSH_TOOLS_MISSING,
    SSHD,
    assert_process_group_gone,
    clean_env,
    free_port,
    ray_cli,
    start_node,
    stop_node,
)

pytestmark = [
    pytest.mark.own_ray_cluster,
    pytest.mark.skipif(bool(SSH_TOOLS_MISSING), reason=SSH_TOOLS_MISSING),
]

RAY_SHIM = """#!/bin/bash
# Test-only: `ray stop` (what `ray down` runs) stops the head this test started, nothing else.
if [ "$1" = "stop" ]; then
  pgid=$(cat ~/ray-head.pgid 2>/dev/null) || exit 0
  kill -TERM -- "-$pgid" 2>/dev/null || exit 0
  for _ in $(seq 60); do kill -0 -- "-$pgid" 2>/dev/null || exit 0; sleep 1; done
  kill -KILL -- "-$pgid"
  exit 0
fi
exec {real_ray} "$@"
"""


WAIT_FOR_URL = """#!{python}
import sys, time, urllib.error, urllib.request
for _ in range(90):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2)
        sys.exit(0)
    except urllib.error.HTTPError:  # it answers (401 without the token): it is up
        sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
"""


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start_sshd(root: Path, port: int, remote_home: Path) -> subprocess.Popen:
    keygen(root / "host_key")
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\nPidFile {root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
        f"SetEnv HOME={remote_home}\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(root / "sshd_config")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 30
    while subprocess.run(["ssh-keyscan", "-p", str(port), "127.0.0.1"], capture_output=True).returncode != 0:
        assert sshd.poll() is None, sshd.stdout.read()
        assert time.time() < deadline, "sshd did not come up in 30 s"
        time.sleep(0.5)
    return sshd


def cluster_config(root: Path, key: Path, ssh_port: int, gcs_port: int, dashboard_port: int) -> dict:
    user = os.environ.get("USER") or subprocess.check_output(["id", "-un"], text=True).strip()
    config = yaml.safe_load((REPO / "cluster_ssh.yaml").read_text())
    ray_temp = root / "ray"  # short: Ray's socket paths must stay under 107 characters
    # Stopped (the shim's `ray stop`), the head goes at once, as app.bench.node's nodes do: Ray's own SIGTERM
    # drain waited out all of its 30 s here.
    start = (
        f"RAY_AUTH_MODE=token {DRAIN_TIMEOUT_ENV}=0 exec ray start --head --block --port={gcs_port} --num-cpus=1 "
        f"--dashboard-host=127.0.0.1 --dashboard-port={dashboard_port} --temp-dir={ray_temp} "
        f"--ray-client-server-port={free_port()} --dashboard-agent-listen-port={free_port()} "
        "--autoscaling-config=~/ray_bootstrap_config.yaml --disable-usage-stats"
    )
    config.update(
        cluster_name=f"test-{secrets.token_hex(4)}",
        provider={"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
        auth={"ssh_user": user, "ssh_private_key": str(key),
              # The launcher has no SSH-port setting (and ssh reads ~/.ssh/config from the passwd home,
              # not $HOME): reach the test's sshd through itself, the standard jump-host idiom.
              "ssh_proxy_command": f"ssh -q -i {key} -p {ssh_port} -o StrictHostKeyChecking=no "
              f"-o UserKnownHostsFile=/dev/null -o IdentitiesOnly=yes -W 127.0.0.1:{ssh_port} {user}@127.0.0.1"},
        min_workers=0,
        max_workers=0,
        file_mounts={"~/.ray/auth_token": str(root / "local" / ".ray" / "auth_token")},
        setup_commands=[],
        head_start_ray_commands=[
            # A process group of its own (its id in ~/ray-head.pgid), detached from the SSH session.
            f"setsid bash -c 'echo $$ > ~/ray-head.pgid; {start}' > ~/ray-head.log 2>&1 < /dev/null &",
            # Up means the job server answers, not only the GCS (a script on the remote PATH: no nested quoting).
            f"wait-for-url http://127.0.0.1:{dashboard_port}/api/version || {{ cat ~/ray-head.log; exit 1; }}",
        ],
        worker_start_ray_commands=[],
    )
    return config


def test_ray_up_then_a_spread_job_on_two_nodes_then_ray_down(no_shared_ray):
    """ray up (head), a second node joins with `ray start --address` (as a lab machine would), a job with
    --placement-strategy SPREAD puts one worker on each node, then ray down leaves nothing running.

    The cluster is exactly the size of the workers (1 CPU per node, 2 workers x 1 CPU): in-memory data needs no
    Ray task per epoch, so the job runs to the end; a streamed job is refused in one line."""
    root = Path(tempfile.mkdtemp(prefix="rayup", dir="/tmp"))
    remote_home, local_home = root / "remote", root / "local"
    for d in (remote_home / "bin", local_home / ".ray"):
        d.mkdir(parents=True)
    key = root / "id_ed25519"
    keygen(key)
    shutil.copyfile(f"{key}.pub", root / "authorized_keys")
    # The "remote" login shell: the shim, then this venv (a job's python is the head's python).
    (remote_home / "bin" / "ray").write_text(RAY_SHIM.format(real_ray=ray_cli()))
    (remote_home / "bin" / "ray").chmod(0o755)
    (remote_home / "bin" / "wait-for-url").write_text(WAIT_FOR_URL.format(python=sys.executable))
    (remote_home / "bin" / "wait-for-url").chmod(0o755)
    (remote_home / ".bash_profile").write_text(
        f'export PATH="{remote_home / "bin"}:{Path(sys.executable).parent}:$PATH"\n'
    )
    (remote_home / ".bashrc").write_text("")  # the launcher sources it
    ssh_port, gcs_port, dashboard_port = free_port(), free_port(), free_port()
    config = cluster_config(root, key, ssh_port, gcs_port, dashboard_port)
    config_path = root / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    local_env = clean_env(HOME=str(local_home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # The guide's step 2: the cluster's token, made on "your machine" (this home) for ray up to copy to the head.
    made = subprocess.run([ray_cli(), "get-auth-token", "--generate"], env=local_env, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    token = (local_home / ".ray" / "auth_token").read_text()
    assert made.stdout.strip() == token and len(token) >= 32
    state_files = [Path(f"/tmp/ray/cluster-{config['cluster_name']}.{ext}") for ext in ("state", "lock")]
    out = root / "run"

    sshd = start_sshd(root, ssh_port, remote_home)
    nodes_started = []
    tunnels: list[subprocess.Popen] = []
    try:
        up = subprocess.run([ray_cli(), "up", "-y", "--no-config-cache", str(config_path)], env=local_env,
                            capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        assert (remote_home / "ray_bootstrap_config.yaml").is_file()  # the launcher really set up the head
        assert (remote_home / ".ray" / "auth_token").read_text() == token  # file_mounts copied the token

        job_env = clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
                            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        # Its own temp dir, as on a second machine: two nodes sharing one unpack the job's working_dir
        # into the same directory at once, and the driver can import from a half-written package.
        second = start_node(["--address", f"127.0.0.1:{gcs_port}", "--num-cpus", "1", "--temp-dir",
                             str(root / "ray2")], job_env, root)
        nodes_started.append(second)
        # The guide's step 4: `ray dashboard` forwards a local port to the head's job server over SSH (a port of
        # its own here, not 8265); the jobs are submitted through that tunnel, as from a laptop.
        tunnel_port = free_port()
        tunnel = subprocess.Popen([ray_cli(), "dashboard", "--port", str(tunnel_port), "--remote-port",
                                   str(dashboard_port), "--no-config-cache", str(config_path)], env=local_env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        tunnels.append(tunnel)
        address = f"http://127.0.0.1:{tunnel_port}"
        waited = subprocess.run([str(remote_home / "bin" / "wait-for-url"), f"{address}/api/version"], timeout=120)
        assert waited.returncode == 0 and tunnel.poll() is None, "the ray dashboard tunnel did not come up"
        submit = subprocess.run(
            [ray_cli(), "job", "submit", "--address", address, "--submission-id", "digits-spread", "--working-dir",
             str(REPO), "--", "python", "jobs/train.py", "--epochs", "1", "--output", str(out),
             "--placement-strategy", "SPREAD", "--worker-start-timeout-s", "60", "--mixed-precision", "bf16",
             "--grad-accum", "2"],
            env=job_env, capture_output=True, text=True, timeout=600,
        )
        assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
        assert "succeeded" in submit.stdout
        # The guide's step 5, after the job: its status and log by the submission id, its outputs copied back.
        status = subprocess.run([ray_cli(), "job", "status", "--address", address, "digits-spread"], env=job_env,
                                capture_output=True, text=True, timeout=60)
        assert "Job 'digits-spread' succeeded" in status.stdout, status.stdout + status.stderr
        logs = subprocess.run([ray_cli(), "job", "logs", "--address", address, "--follow", "digits-spread"],
                              env=job_env, capture_output=True, text=True, timeout=120)
        assert logs.returncode == 0 and re.search(r"^epoch +1/1 ", logs.stdout, re.M), logs.stdout[-3000:] + logs.stderr[-3000:]
        copied = root / "copied"
        down_copy = subprocess.run([ray_cli(), "rsync-down", str(config_path), f"{out}/", str(copied)],
                                   env=local_env, capture_output=True, text=True, timeout=120)
        assert down_copy.returncode == 0, down_copy.stdout[-3000:] + down_copy.stderr[-3000:]
        assert (copied / "result.json").read_text() == (out / "result.json").read_text()
        result = json.loads((out / "result.json").read_text())
        assert result["epochs_completed"] == 1 and result["num_replicas"] == 2
        # The performance levers across nodes: bf16 policy in every worker, 2 micro-batches per all-reduce.
        assert result["mixed_precision"] == "bf16" and result["global_batch_size"] == 32 * 2 * 2
        # Each rank reported the node it ran on: two different nodes, both of this cluster.
        listed = subprocess.run([ray_cli(), "list", "nodes", "--address", address, "--format", "json"],
                                env=job_env, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        cluster_nodes = {n["node_id"] for n in json.loads(listed.stdout) if n["state"] == "ALIVE"}
        assert len(cluster_nodes) == 2
        assert len(set(result["worker_nodes"])) == 2 and set(result["worker_nodes"]) == cluster_nodes

        # The cluster is exactly the workers' size (1 CPU per node): streamed data, whose reads need a CPU of
        # Ray Data's beside the workers, is refused with one line that says what to change, not left waiting.
        pq_dir = root / "pq"
        pq_dir.mkdir()
        rng = np.random.default_rng(0)
        pq.write_table(pa.table({"x": pa.array(list(rng.normal(size=(256, 4)).astype("float32")),
                                               type=pa.list_(pa.float32())), "label": rng.integers(0, 2, 256)}),
                       pq_dir / "p.parquet")
        refused = subprocess.run(
            [ray_cli(), "job", "submit", "--address", address, "--working-dir", str(REPO), "--", "python",
             "jobs/train.py", "--epochs", "1", "--dataset", str(pq_dir), "--output", str(root / "refused")],
            env=job_env, capture_output=True, text=True, timeout=300,
        )
        assert refused.returncode != 0
        lines = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
        # (ray job submit may show the job's log twice: once streamed, once at the end)
        assert len(set(lines)) == 1 and "streamed data needs 1 CPU for Ray Data's reads" in lines[0], lines
        assert "Traceback" not in refused.stdout + refused.stderr
        stop_node(nodes_started.pop())

        head_pgid = int((remote_home / "ray-head.pgid").read_text())
        down = subprocess.run([ray_cli(), "down", "-y", str(config_path)], env=local_env, capture_output=True,
                              text=True, timeout=300)
        assert down.returncode == 0, down.stdout[-4000:] + down.stderr[-4000:]
        assert_process_group_gone(head_pgid)  # `ray down` left nothing of the cluster running
    finally:
        for tunnel in tunnels:  # the SSH port forward `ray dashboard` left running, by its process group
            with contextlib.suppress(ProcessLookupError):  # already ended (a failed tunnel): the test's error stands
                os.killpg(tunnel.pid, 15)
            tunnel.wait(timeout=30)
        for node in nodes_started:
            stop_node(node)
        pgid_file = remote_home / "ray-head.pgid"
        if pgid_file.is_file():  # a failed run: stop the head ourselves
            subprocess.run(["bash", "-c", f"kill -TERM -- -{pgid_file.read_text().strip()}"], capture_output=True)
        os.killpg(sshd.pid, 15)
        sshd.wait(timeout=30)
        for f in state_files:  # the local provider's node state, ours alone (a unique cluster name)
            f.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
