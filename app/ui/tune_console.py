"""A sweep's console for people: the plan, one line per trial event, the trials sorted by the metric, the best.

Tune's own reporter (status tables every 30 s, each trial's config and result as a box) is off
(``RunConfig(verbose=0)``). ``TrialLines``, a ``ray.tune.Callback``, is told each event by Tune's
controller in the driver and says it in one line: a trial started (its sampled values), each epoch's
metric, stopped early by the scheduler, finished, failed (its one-line reason). What Ray and TensorFlow
print in the driver and in every trial's processes goes to ``<output>/tune.log`` (app.ui.console.routed,
as for a training run; the workers' own epoch lines too), and with --show-logs to the console as well.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ray.tune import Callback

from app import config_scale
from app.errors import RunFailed, UserError
from app.ui import console

LOG_FILE = "tune.log"


def plan_lines(space_file: str, raw: dict[str, Any], searched: set[str], trials: Optional[int], scheduler: str,
               metric: str, mode: str, base, at_once: int, cpus: float, out, restoring: bool) -> list[str]:
    """What the sweep will do, before any trial starts."""
    domains = "; ".join(f"{key} {_domain(raw[key])}" for key in raw if key in searched)
    count = f"{trials} trial(s)" if trials else "trials"
    fixed = ", ".join(f"{k} {raw[k]}" for k in raw if k not in searched)
    per_trial = (f"{config_scale.describe(base.num_workers)} worker(s) x {base.cpus_per_worker:g} CPU"
                 + (" + 1 GPU" if base.use_gpu else ""))
    return [
        f"sweep: {space_file}: {count} of {domains or 'the fixed values'}" + (f" (fixed: {fixed})" if fixed else ""),
        f"scheduler: {scheduler}; metric {metric} ({mode})",
        f"each trial: a Ray Train run of {per_trial}, "
        f"{'its sampled number of' if 'epochs' in searched else base.epochs} epochs; "
        f"{at_once} trial(s) at once on {cpus:g} CPUs",
        f"output: {out} (Ray's and TensorFlow's own lines: {out / LOG_FILE})"
        + ("; resuming it: finished trials are kept, the others resume" if restoring else ""),
    ]


def _domain(value: Any) -> str:
    if isinstance(value, dict):
        kind, args = next(iter(value.items()))
        return ", ".join(map(str, args)) if kind == "grid" else f"{kind}({', '.join(map(str, args))})"
    return str(value)


def trial_count(space: dict[str, Any], num_samples: int) -> int:
    """Grid points x samples: what Tune's default search (BasicVariantGenerator) makes."""
    grids = [len(v["grid_search"]) for v in space.values() if isinstance(v, dict) and "grid_search" in v]
    return math.prod(grids) * num_samples


class TrialLines(Callback):
    """One console line per trial event, in the driver, as Tune's controller sees them.

    Trials are numbered by their place in Tune's list of trials (the order they
    were created, which is also the order of the ResultGrid and of results.csv).
    """

    def __init__(self, searched: list[str], metric: str, epochs: int):
        self.searched, self.metric, self.epochs = searched, metric, epochs

    def _name(self, trials, trial) -> str:
        return f"trial {trials.index(trial) + 1}"

    def _epochs(self, trial) -> int:
        return int(trial.config.get("epochs", self.epochs))

    def on_trial_start(self, iteration, trials, trial, **info):
        values = "  ".join(f"{k}={trial.config.get(k)}" for k in self.searched)
        console.say(f"{self._name(trials, trial)} started  {values}".rstrip())

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "epoch" not in result:  # Tune's own bookkeeping results, if any
            return
        console.say(f"{self._name(trials, trial)}  epoch {result['epoch']}/{self._epochs(trial)}  "
                    f"{_metrics(result, self.metric)}  {result.get('epoch_seconds', 0):.1f} s")

    def on_trial_complete(self, iteration, trials, trial, **info):
        last = trial.last_result or {}
        done, planned = int(last.get("epoch", 0)), self._epochs(trial)
        what = "finished" if done >= planned else f"stopped early by the scheduler after {done} of {planned} epochs"
        console.say(f"{self._name(trials, trial)} {what}: {_metrics(last, self.metric)}  "
                    f"{last.get('time_total_s', 0):.0f} s")

    def on_trial_error(self, iteration, trials, trial, **info):
        error = _error_of(trial)
        name = self._name(trials, trial)
        path = console.write_trace(f"{name} ({trial.path}) failed:", str(error))
        where = f" (full traceback in {path})" if path else ""
        console.say(f"{name} failed: {one_line(error)}{where}")


def _error_of(trial) -> Any:
    """The error Tune has just written beside the trial (its driver-side copy: storage is synced later)."""
    from ray import cloudpickle

    try:
        if trial.pickled_error_file:  # the exception itself, when the trial's process raised or died
            with open(trial.pickled_error_file, "rb") as f:
                return cloudpickle.load(f)
        if trial.error_file:  # else its text
            with open(trial.error_file) as f:
                return f.read()
    except (OSError, EOFError, ImportError, AttributeError):  # unreadable: the line says where to look
        pass
    return None


def _metrics(result: dict[str, Any], metric: str) -> str:
    shown = [metric] + [m for m in ("val_loss", "train_loss") if m != metric]
    return "  ".join(f"{m} {result[m]:.4f}" for m in shown if isinstance(result.get(m), (int, float)))


def one_line(error: Any) -> str:
    """A trial's error in one line: our own errors' messages as they are, else the exception's type and first line.

    Tune hands over a RayTaskError (the trial function raised: ``cause`` is what it
    raised), a RayActorError (the trial's process died), or the error file's text.
    """
    if error is None:
        return "unknown error (see the trial's error.txt)"
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, (UserError, RunFailed)):  # already one line (app.ui.failures for Train's errors)
        return str(cause)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    if isinstance(cause, str):  # the error file's text: its last line is the exception
        return lines[-1] if lines else "unknown error"
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def summary_lines(table, metric: str, mode: str, epochs: int, best_file, shown: list[str]) -> list[str]:
    """The trials sorted by the metric (best first; failed ones last), then the best and its config file."""
    table = table.copy()
    planned = table["config/epochs"].astype(int) if "config/epochs" in table else epochs
    run = table["epochs_run"].astype(int)
    table["epochs"] = run.astype(str) + "/" + (planned.astype(str) if "config/epochs" in table else str(epochs))
    table["status"] = "finished"
    table.loc[run < planned, "status"] = "stopped early"
    table.loc[table["error"].astype(bool), "status"] = "failed"
    table = table.sort_values(metric, ascending=(mode == "min"), na_position="last")
    view = table[["trial", *shown, "epochs", metric, "val_loss", "wall_seconds", "status"]].rename(
        columns={**{c: c.removeprefix("config/") for c in shown}, "wall_seconds": "seconds"})
    text = view.to_string(index=False, na_rep="-", formatters={
        metric: _number, "val_loss": _number, "seconds": lambda v: "-" if v != v else f"{v:.0f}"})
    best = table.iloc[0]
    values = "  ".join(f"{c.removeprefix('config/')}={best[c]}" for c in shown)
    return [
        f"trials by {metric}, best first:",
        *("  " + line for line in text.splitlines()),
        f"best: trial {best['trial']}, {metric} {best[metric]:.4f}  {values}".rstrip(),
        f"best config: {best_file} (train it: python jobs/train.py --config {best_file})",
    ]


def _number(v: float) -> str:
    return "-" if v != v else f"{v:.4f}"
