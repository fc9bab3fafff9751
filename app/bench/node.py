"""A Ray node started with `ray start --block` in a process group of its own, and stopped by that group.

For what needs a cluster that is already running (the start-up benchmark, the
job-submission tests): stopping the group stops exactly what it started, never
another Ray on the machine (`ray stop` would stop them all).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


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
