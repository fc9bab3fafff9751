"""Where a run's time went: its start-up links, its steps' split and its end, in result.json and in one line.

The driver marks its own links (its process's start, the plan made, Ray up, the workers asked for, the workers'
fit returned, the outputs written); each worker marks its own (app.training.step_clock: its process, its
TensorFlow and strategy, its inputs, its model, its trace, its first step) and splits every epoch's steps into
input, compute, sync and hooks. A link that gates the first step is the slowest worker's. The line names the
largest part of the steady steps and what the user can change about it; a run of too few steps says so instead of
a ratio of noise.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

DRIVER_MARKS: dict[str, float] = {}  # this process's marks of its current run (wall clock)
STEADY_STEPS = 20  # fewer timed steps than this (per worker, after each fit's first) are no steady state

# Each start-up link: the mark that ends it, and what it is.
START_LINKS = (
    ("plan", "the driver: imports, inputs, model and plan"),
    ("ray", "Ray started or joined"),
    ("fit", "the run's directory and job"),
    ("worker process", "Ray Train: controller and worker processes"),
    ("worker configured", "the worker's process and actor, to its TF_CONFIG"),
    ("worker entered", "Ray Train's set-up to the training function (TensorFlow imported beside it)"),
    ("tensorflow", "the worker's TensorFlow and collectives"),
    ("inputs", "the worker's inputs"),
    ("model", "the worker's model build"),
    ("traced", "the worker's step traced"),
    ("first step", "the first step (fit's own trace)"),
)


def mark(name: str) -> None:
    """The driver reached ``name`` (its first time in this run)."""
    DRIVER_MARKS.setdefault(name, time.time())


_BEGUN: list[bool] = []


def begin() -> None:
    """A run begins in this process: the first one of a script (``python jobs/train.py``, ``python my_script.py``)
    starts from the process's own start (the script's imports and data included: what the user waits for from the
    command); a later one, or one called from a notebook, a test or ``python -m``, from this call."""
    from app.training.step_clock import process_started

    main = sys.modules.get("__main__")
    script = main is not None and getattr(main, "__spec__", None) is None and hasattr(main, "__file__")
    DRIVER_MARKS.clear()
    DRIVER_MARKS["process"] = process_started() if script and not _BEGUN else time.time()
    _BEGUN.append(True)


def startup(worker_marks: list[dict[str, float]]) -> list[dict[str, Any]]:
    """The links from the driver's process start to the first step, each ending when its slowest worker got there
    (a link no worker or driver marked is left out)."""
    at = {**DRIVER_MARKS, **{name: max(m.get(name) or 0.0 for m in worker_marks) for name in
                             (worker_marks[0] if worker_marks else {})}}
    links, last = [], at.get("process")
    if last is None:
        return []
    for name, what in START_LINKS:
        end = at.get(name) or 0.0
        if end <= 0:
            continue
        links.append({"link": what, "seconds": round(max(0.0, end - last), 3)})
        last = max(last, end)
    return links


def report(took: Optional[dict[str, Any]], streamed: bool, workers: int) -> dict[str, Any]:
    """result.json's ``time``: the start-up links, each epoch's split (seconds, every worker's mean), the steady
    steps' shares and the run's verdict and line (``took``: the checkpoint state's ``time``; ``streamed``: the input
    is Ray Data's)."""
    from app.training.step_clock import SHARES, shares, split

    took = took or {}
    links = startup(took.get("marks") or [])
    epochs = []
    rows = []
    for e in took.get("epochs", []):
        seconds = split(e["workers"])
        n = max(1, len(e["workers"]))
        epochs.append({"epoch": e["epoch"], **{k: round(v / n, 4) for k, v in seconds.items() if k != "steps"},
                       "steps": int(seconds["steps"] / n)})
        rows.extend(e["workers"])
    total = split(rows) if rows else None
    steps = int(total["steps"] / max(1, workers)) if total else 0
    # The last epoch's end is rank 0's mark, gathered into the checkpoint's state.
    at = {**DRIVER_MARKS, **({"last epoch": took["epochs"][-1]["at"]} if "at" in (took.get("epochs") or [{}])[-1]
                             else {})}
    end = [{"link": what, "seconds": round(at[b] - at[a], 3)}
           for a, b, what in (("last epoch", "fit returned", "the last checkpoint and the workers' end"),
                              ("fit returned", "outputs", "the outputs (model files, export, history)"))
           if a in at and b in at]
    result: dict[str, Any] = {"startup": links, "startup_seconds": round(sum(k["seconds"] for k in links), 3),
                              "epochs": epochs, "end": end, "steps_timed": steps,
                              "sync_timed": bool(took.get("sync_timed"))}
    share = shares(total) if total and steps >= STEADY_STEPS else {}
    if share:
        result["shares"] = {k: round(share[k], 4) for k in SHARES}
        result["step_ms"] = round(1000 * sum(total[k] for k in SHARES) / max(1.0, total["steps"]), 3)
    result["bound"], result["line"] = verdict(result, share, streamed, steps)
    return result


def verdict(result: dict[str, Any], share: dict[str, float], streamed: bool, steps: int) -> tuple[str, str]:
    """What bounds the run, and the run-end line that says so with the user's lever."""
    start = result["startup_seconds"]
    slowest = max(result["startup"], key=lambda k: k["seconds"], default=None)
    start_text = f"{start:.1f} s to the first step" + (f" (longest: {slowest['link']}, {slowest['seconds']:.1f} s)"
                                                        if slowest else "")
    if not share:
        return "short", (f"time: {start_text}; {steps} steady step(s) a worker: too few for a split of the steps "
                         f"(>= {STEADY_STEPS}), train longer to see where each step goes")
    parts = ", ".join(f"{k} {share[k]:.0%}" for k in sorted(share, key=share.get, reverse=True))
    bound = max(share, key=share.get)
    pct = f"{share[bound]:.0%}"
    lever = {
        "input": f"input-bound: {pct} of each step waits for its batch" + (
            ": give Ray Data's reads CPUs (--cpus-per-worker 0.5, cpus_per_worker=0.5) or keep the data in memory "
            "(--data-cache memory)" if streamed else
            ": prefetch and parallelise the input (a tf.data pipeline's .prefetch(tf.data.AUTOTUNE), .cache()), or "
            "give each step more rows (--per-replica-batch)"),
        "sync": f"sync-bound: {pct} of each step waits on the gradients' all-reduce across workers: more rows a "
                "step per worker (--per-replica-batch), one all-reduce per several batches (--grad-accum N), or "
                "fewer workers",
        "hooks": f"hook-bound: {pct} of each step runs between steps (callbacks, TensorBoard's step scalars, step "
                 "checkpoints): --log-every-steps 0, a larger --checkpoint-every-steps, --steps-per-execution N, "
                 "or callbacks that act per epoch",
        "compute": f"compute-bound: {pct} of each step is the model's own math: the machine's limit (more workers "
                   "or GPUs to go faster)",
    }[bound]
    return bound, f"time: {start_text}; each step {result['step_ms']:.1f} ms: {parts}; {lever}"
