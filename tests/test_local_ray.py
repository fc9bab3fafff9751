"""The local Ray a run starts itself (no RAY_ADDRESS, none running): app.driver.cluster._start_local."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, clean_env

PROBE = """
import json, os
import ray
from app.driver.cluster import _start_local

_start_local()
try:
    print(json.dumps({"driver": os.nice(0), "worker": ray.get(ray.remote(lambda: os.nice(0)).remote(), timeout=120)}))
finally:
    ray.shutdown()
"""


@pytest.mark.own_ray_cluster
def test_its_workers_run_at_the_drivers_priority(no_shared_ray):
    """Ray's default puts its worker processes at nice 15, below its own daemons and the driver: a run's training
    workers would yield to them. The Ray a run starts gives them the driver's priority (the environment of this
    test's Rays sets it too: taken out here, so the product's own start is what is checked)."""
    env = {k: v for k, v in clean_env().items() if k != "RAY_worker_niceness"}
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    niceness = json.loads(p.stdout.strip().splitlines()[-1])
    assert niceness["worker"] == niceness["driver"], niceness
