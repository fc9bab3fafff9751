"""The elastic suite: Ray Train's own elastic scaling under this product's TF_CONFIG backend, on two nodes.

What elastic runs (``--num-workers MIN:MAX``) stand on, the resize mechanism alone: a head started with
`ray start --head --num-cpus 1`, a Ray Train run with ``ScalingConfig(num_workers=(1, 2))`` and the product's
TF_CONFIG backend (app.backends.tf_config), whose workers run MultiWorkerMirroredStrategy when there are two of them
and all-reduce every step. While it runs, a second node joins (`ray start --address ... --num-cpus 1`) and is
later stopped by its process group. Ray 2.60 resizes by restarting the group from the latest checkpoint, so each
resize costs the seconds from the event to the first step at the new size, plus the steps done since that
checkpoint, done again. The workload is a bare step (an all-reduce and a sleep), not jobs/train.py: the
figures are the resize mechanism's. -> elastic.json
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from app.bench.node import TwoNodes
from app.bench.preset import Preset
from app.bench.proc import REPO, local_env
from app.bench.startup import wait_until_up
from app.errors import RunFailed

PARAMS = ("steps", "checkpoint_every", "step_seconds", "monitor_s", "wait_s", "start_timeout_s")

# The driver, in a process of its own: it imports Ray with the token settings of the cluster it joins.
_DRIVER = """
import json, sys
import ray, ray.train
from app.bench.elastic import worker_loop
from app.backends import tf_config
p = json.loads(sys.argv[1])
ray.init(logging_level="WARNING")
trainer = tf_config.trainer(
    train_loop_per_worker=worker_loop, train_loop_config=p,
    scaling_config=ray.train.ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1},
                                           elastic_resize_monitor_interval_s=p["monitor_s"]),
    run_config=ray.train.RunConfig(name="elastic", storage_path=p["storage"],
                                   failure_config=ray.train.FailureConfig(max_failures=10)))
result = trainer.fit()
print(json.dumps({"error": None if result.error is None else str(result.error), "metrics": result.metrics}))
"""


def worker_loop(p: dict[str, Any]) -> None:
    """One Ray Train worker: steps from the latest checkpoint on, each an all-reduce of 1.0 over the group (its
    sum is the group's size when the collective is whole) written to the events file; a checkpoint every few steps.
    Its imports are here: it runs in the worker's process."""
    import ray.train
    import tensorflow as tf

    context = ray.train.get_context()
    size, rank = context.get_world_size(), context.get_world_rank()
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if size > 1 else tf.distribute.get_strategy()
    start, largest = 0, size
    if ray.train.get_checkpoint():
        with ray.train.get_checkpoint().as_directory() as d:
            state = json.loads((Path(d) / "state.json").read_text())
        start, largest = state["step"], max(size, state.get("largest", size))
    # Once the group has shrunk, both resizes are behind it: it ends at its next checkpoint, without sleeping
    # (``steps`` is a budget for slow resizes, not a duration).
    every = p["checkpoint_every"]
    pause, end = (p["step_seconds"], p["steps"]) if size >= largest else (0.0, (start // every + 1) * every)
    for step in range(start, min(end, p["steps"])):
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
        with open(p["events"], "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "size": size, "rank": rank, "sum": float(total)}) + "\n")
        time.sleep(pause)
        if (step + 1) % every == 0:
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "state.json").write_text(json.dumps({"step": step + 1, "largest": largest}))
                checkpoint = ray.train.Checkpoint.from_directory(d) if rank == 0 else None
                ray.train.report({"step": step + 1, "size": size}, checkpoint=checkpoint)


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    p = {k: preset.params[k] for k in PARAMS}
    events, storage = out / "events.jsonl", out / "storage"
    events.unlink(missing_ok=True)
    shutil.rmtree(storage, ignore_errors=True)
    env = {**local_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    temp = Path(tempfile.mkdtemp(prefix="ray-elastic-", dir="/tmp"))
    nodes = TwoNodes(env, REPO, temp, dashboard=True)
    address = nodes.address
    try:
        wait_until_up(nodes.head, address, env)
        with open(out / "driver.log", "w") as log:
            driver = nodes.driver = subprocess.Popen(
                [sys.executable, "-c", _DRIVER, json.dumps({**p, "events": str(events), "storage": str(storage)})],
                cwd=REPO, env={**env, "RAY_ADDRESS": address,
                               "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(p["start_timeout_s"])},
                stdout=log, stderr=subprocess.STDOUT, text=True)
        _first(events, driver, lambda e: True, 300, "the first step")
        time.sleep(p["wait_s"])
        joined_at = time.time()
        nodes.join()
        grown = _first(events, driver, lambda e: e["size"] == 2 and e["t"] > joined_at, 300, "a step on 2 workers")
        time.sleep(p["wait_s"])
        stopped_at = time.time()
        nodes.leave()
        shrunk = _first(events, driver, lambda e: e["size"] == 1 and e["t"] > stopped_at, 300,
                        "a step on 1 worker after the node stopped")
        driver.wait(timeout=60 + p["steps"] * p["step_seconds"] * 2)
        # The driver's own last word, among the lines Ray forwards from the workers after it.
        said = [line for line in (out / "driver.log").read_text().splitlines() if line.startswith('{"error": ')]
        if driver.returncode != 0 or not said:
            raise RunFailed(f"the elastic run failed (exit {driver.returncode}): see {out / 'driver.log'}")
        ended = json.loads(said[-1])
    finally:
        nodes.close()
        shutil.rmtree(temp, ignore_errors=True)
    every = _events(events)
    result = {
        "command": command,
        "params": p,
        "grow": _resize(every, joined_at, grown, 1),
        "shrink": _resize(every, stopped_at, shrunk, 2),
        "sizes": [[e["step"], e["size"]] for i, e in enumerate(every) if i == 0 or every[i - 1]["size"] != e["size"]],
        "all_reduce_whole": all(e["sum"] == e["size"] for e in every),
        "steps_completed": ended["metrics"].get("step"),
        "error": ended["error"],
    }
    path = out / "elastic.json"
    path.write_text(json.dumps(result, indent=2))
    for what in ("grow", "shrink"):
        r = result[what]
        print(f"{what}: {r['seconds_to_first_step']:.1f} s from the node {'joining' if what == 'grow' else 'stopping'} "
              f"to the first step on {r['to']} worker(s); {r['steps_redone']} step(s) done again", flush=True)
    print(f"sizes (from step, workers): {result['sizes']}; every all-reduce whole: {result['all_reduce_whole']}; "
          f"ended at step {result['steps_completed']}, the first checkpoint after the shrink (a budget of {p['steps']})",
          flush=True)
    return [path]


def _resize(every: list[dict], at: float, first: dict, before: int) -> dict[str, Any]:
    """A resize: from the event at ``at`` to the first step at the new size, and the steps the old group had done
    past the checkpoint the new one resumed from."""
    last_old = max(e["step"] for e in every if e["size"] == before and e["t"] < first["t"])
    return {"from": before, "to": first["size"], "seconds_to_first_step": first["t"] - at,
            "resumed_at_step": first["step"], "steps_redone": last_old + 1 - first["step"]}


def _events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _first(path: Path, driver: subprocess.Popen, matches: Callable[[dict], bool], timeout: float, what: str) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in _events(path) if matches(e)]
        if found:
            return found[0]
        if driver.poll() is not None:
            raise RunFailed(f"the elastic run ended before {what} (exit {driver.returncode}): see its driver.log "
                            f"beside {path}")
        time.sleep(0.5)
    raise RunFailed(f"no {what} within {timeout:.0f} s")
