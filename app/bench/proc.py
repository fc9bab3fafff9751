"""Measurements in processes of their own: start them, read their one JSON result line, and the steady state.

A fresh process per measurement means TensorFlow's thread pools are set up
exactly as in a Ray worker (threads are fixed at start-up), no measurement
warms a cache for the next one, and a process's peak memory is its own.
Every measuring module ends with ``child_main``: it prints ``RESULT <json>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from app.errors import RunFailed

REPO = Path(__file__).resolve().parents[2]
RESULT = "RESULT "


def steady(per_epoch: list[float]) -> float:
    """Samples/s of the epochs after the first (tracing, the first shuffle); all of them if there is only one."""
    return statistics.mean(per_epoch[1:] or per_epoch)


def epoch_timer(seconds: list[float]):
    """A Keras callback that appends each epoch's wall seconds to ``seconds`` (a plain model.fit's epochs)."""
    import time

    import keras

    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)

    return EpochTimes()


def fit_seconds(history) -> tuple[int, list[float]]:
    """The rows an app.fit run trained each epoch and each epoch's seconds, from its History's records."""
    return (history.result["rows"] - (history.result.get("dropped_samples_per_epoch") or 0),
            [r["seconds"] for r in history.records])


def cpu_times() -> list[int]:
    """/proc/stat's cpu line: the machine's CPU ticks (user, nice, system, idle, iowait, irq, softirq, steal)."""
    return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def steal_fraction(before: list[int], after: list[int]) -> float:
    """The share of the CPU time between two ``cpu_times`` readings that the hypervisor took (steal)."""
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])
    return round(delta[7] / total, 4) if total else 0.0


def local_env() -> dict[str, str]:
    """This environment without RAY_ADDRESS: every measurement starts a local Ray of its own, if any."""
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def workload_flags(workload: dict[str, Any]) -> list[str]:
    """TrainConfig fields as jobs/train.py flags: {"hidden_units": [32, 16]} -> --hidden-units 32 16."""
    flags = []
    for key, value in workload.items():
        values = value if isinstance(value, list) else [value]
        flags += [f"--{key.replace('_', '-')}", *map(str, values)]
    return flags


def run_script(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A command (e.g. jobs/train.py) from the repository's root; RunFailed with its stderr's tail on failure.

    ``env``: by default this environment without RAY_ADDRESS (a local Ray of its own).
    """
    p = subprocess.run(cmd, cwd=REPO, env=env or local_env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RunFailed(f"{' '.join(cmd[:4])} ... failed:\n{p.stderr[-3000:]}")
    return p


def measure(module: str, kind: str, payload: dict[str, Any] | list[dict[str, Any]], processes: int = 1,
            timeout: float = 1800) -> list[dict[str, Any]]:
    """``python -m module KIND '<payload JSON>'`` in ``processes`` processes started at once (or one process per
    payload of a list); each one's result.

    Their output goes to files, not pipes: a process whose pipe filled while
    another was being read would stall, and its figure with it.
    """
    import tempfile

    payloads = payload if isinstance(payload, list) else [payload] * processes
    cmds = [[sys.executable, "-m", module, kind, json.dumps(one)] for one in payloads]
    with contextlib.ExitStack() as files:
        outputs = [tuple(files.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe") for _ in cmds]
        procs = [subprocess.Popen(cmd, cwd=REPO, env=local_env(), stdout=out, stderr=err)
                 for cmd, (out, err) in zip(cmds, outputs)]
        results = []
        try:
            for p, (out, err) in zip(procs, outputs):
                p.wait(timeout=timeout)
                out.seek(0)
                err.seek(0)
                line = next((x for x in reversed(out.read().splitlines()) if x.startswith(RESULT)), None)
                if p.returncode != 0 or line is None:
                    raise RunFailed(f"{module} {kind} failed:\n{err.read()[-3000:]}")
                results.append(json.loads(line[len(RESULT):]))
        finally:
            for p in procs:  # one failed or timed out: stop the others we started
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return results


def child_main(kinds: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """A measuring module's ``__main__``: ``python -m module KIND '<payload JSON>'``; prints its result line."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    kind, payload = sys.argv[1], json.loads(sys.argv[2])
    print(RESULT + json.dumps(kinds[kind](payload)), flush=True)
