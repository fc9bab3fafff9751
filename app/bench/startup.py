"""Time to first step: `python jobs/train.py` on a local Ray it starts, and on a cluster already running.

A run that starts its own Ray pays for Ray's daemons (GCS, raylet, dashboard)
on top of Ray Train's processes and the workers' TensorFlow import; a run that
joins a cluster started beforehand with `ray start --head` (RAY_ADDRESS set, as
`ray job submit` and a long-lived cluster do) does not. Each is run ``runs``
times, one after another, and reported as the median: these start-ups vary by
seconds on a shared machine. The figure is ``time_to_first_step_seconds`` from
result.json: from the script's start to the end of its first training step.
"""

from __future__ import annotations

import json
import logging
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.bench.node import free_port, ray_cli, start_node, stop_node
from app.bench.proc import REPO, local_env, run_script
from app.errors import RunFailed

log = logging.getLogger(__name__)


def _first_step(flags: list[str], out: Path, env: dict[str, str] | None = None) -> float:
    run_script([sys.executable, "jobs/train.py", *flags, "--output", str(out), "--overwrite"], timeout=600, env=env)
    return json.loads((out / "result.json").read_text())["time_to_first_step_seconds"]


def _summary(seconds: list[float], source: str) -> dict[str, Any]:
    return {"time_to_first_step_seconds": statistics.median(seconds), "runs": seconds, "source": source}


def fresh(flags: list[str], runs: int, out: Path) -> dict[str, Any]:
    """``runs`` runs, each starting (and stopping) its own local Ray."""
    seconds = [_first_step(flags, out / f"fresh-{i}") for i in range(runs)]
    return _summary(seconds, "python jobs/train.py " + " ".join(flags))


def running_cluster(flags: list[str], runs: int, out: Path, cpus: int) -> dict[str, Any]:
    """``runs`` runs joining one `ray start --head --num-cpus CPUS` cluster started beforehand (token auth on)."""
    env = {**local_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    # A temp dir of its own: this cluster stays out of /tmp/ray, where a local `ray.init()` looks.
    temp_dir = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
    head = start_node(["--head", "--num-cpus", str(cpus), "--port", str(port), "--temp-dir", temp_dir,
                       "--include-dashboard", "true", "--dashboard-port", str(free_port()),
                       "--ray-client-server-port", str(free_port())], env, REPO)
    try:
        wait_until_up(head, f"127.0.0.1:{port}", env)
        env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        seconds = [_first_step(flags, out / f"cluster-{i}", env) for i in range(runs)]
    finally:
        stop_node(head)
    return _summary(seconds, f"ray start --head --num-cpus {cpus}; RAY_ADDRESS=... python jobs/train.py "
                    + " ".join(flags))


def wait_until_up(head, address: str, env: dict[str, str], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while subprocess.run([ray_cli(), "status", "--address", address], env=env, capture_output=True).returncode != 0:
        if head.poll() is not None:
            raise RunFailed(f"`ray start --head` exited: {head.stdout.read()[-2000:]}")
        if time.time() > deadline:
            raise RunFailed(f"`ray start --head` was not up after {timeout:.0f} s")
        time.sleep(1)
