"""A Ray node started with `ray start --block` in a process group of its own, and stopped by that group.

For what needs a cluster that is already running (the start-up benchmark, the
job-submission tests): stopping the group stops exactly what it started, never
another Ray on the machine (`ray stop` would stop them all).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.driver.cluster import free_port

DRAIN_TIMEOUT_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


def ray_cli() -> str:
    # The `ray` next to this interpreter: the head then runs jobs with this environment's python.
    return str(Path(sys.executable).with_name("ray"))


def start_node(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`ray start ... --block` in its own process group, so that we stop exactly what it started.

    Stopped, it goes at once, as a node that is lost: on SIGTERM Ray 2.60's `ray start --block` first drains its
    node for up to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s), and here it waited all of it (31-32 s a node, head
    or not, against 3 s without: measured). A caller's env may set it.
    """
    return subprocess.Popen(
        [ray_cli(), "start", "--block", "--disable-usage-stats", "--dashboard-agent-listen-port", str(free_port()),
         *args],
        env={DRAIN_TIMEOUT_ENV: "0", **env}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
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


class TwoNodes:
    """A head of 1 CPU (`ray start --head --num-cpus 1`) and a second node of 1 CPU that joins and is stopped on
    demand, each in a process group of its own: a cluster that grows and shrinks on one machine. ``close()`` kills
    the ``driver`` given to it if it still runs, then stops what is still up."""

    def __init__(self, env: dict[str, str], cwd: Path, temp: Path, dashboard: bool = False):
        self.env, self.cwd, self.temp = env, cwd, temp
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        shown = ["--include-dashboard", "true", "--dashboard-port", str(free_port())] if dashboard else [
            "--include-dashboard", "false"]
        self.head = start_node(["--head", "--num-cpus", "1", "--port", str(port), "--temp-dir", str(temp / "head"),
                                *shown, "--ray-client-server-port", str(free_port())], env, cwd)
        self.second: subprocess.Popen | None = None
        self.driver: subprocess.Popen | None = None

    def join(self) -> None:
        self.second = start_node(["--address", self.address, "--num-cpus", "1", "--temp-dir",
                                  str(self.temp / "second")], self.env, self.cwd)

    def leave(self) -> None:
        """The second node stopped by its process group: to the run, a node lost."""
        second, self.second = self.second, None
        stop_node(second)

    def close(self) -> None:
        if self.driver is not None and self.driver.poll() is None:
            self.driver.kill()
        if self.second is not None:
            self.leave()
        stop_node(self.head)
