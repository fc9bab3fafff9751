"""Ray Tune over Ray Train runs: sweep the hyperparameters that change with scale.

Each trial is a Tune *function* trainable (the caller's: app.run.trial.run_trial) that
makes the Ray Train run jobs/train.py would make of its sampled config (Keras's fit,
app.backends.keras_fit) and forwards
every Train report to Tune with ``TuneReportCallback`` (the Ray 2.60 way; passing a
Trainer to the Tuner is deprecated). Search spaces are YAML files whose keys are TrainConfig
field names, so the best trial's config feeds straight back into
``jobs/train.py --config``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import yaml

from app import config_scale, internals, registry
from app.backend import backend_of
from app.config import TrainConfig, build_config, read_yaml
from app.driver import output_guard
from app.errors import RunFailed, UserError
from app.tools.tune_space import NOT_SEARCHABLE, load_space

__all__ = ["NOT_SEARCHABLE", "load_space", "sweep"]

RESULTS_FILE = "results.csv"
BEST_CONFIG_FILE = "best_config.yaml"
PLOT_FILE = "val_accuracy_vs_global_batch.png"
SUMMARY_FILE = "summary.yaml"
TRIAL_MEMORY = 1024**3  # the trial process imports TensorFlow and runs the Train driver


# --------------------------------------------------------------------------- #
# The trial                                                                   #
# --------------------------------------------------------------------------- #


# --------------------------------------------------------------------------- #
# The sweep                                                                   #
# --------------------------------------------------------------------------- #


def _is_domain(value: Any) -> bool:
    from ray.tune.search.sample import Domain

    return isinstance(value, Domain) or (isinstance(value, dict) and "grid_search" in value)


def asha(base: TrainConfig, searched: dict[str, Any]):
    """ASHA on epochs (one Train report = one Tune iteration).

    The grace period outlasts the LR warmup: judged during warmup, the large
    batches (the very thing this sweep is about) would look worst and be cut.
    """
    from ray.tune.schedulers import ASHAScheduler

    max_t, grace = _asha_epochs(base, searched)
    return ASHAScheduler(time_attr="training_iteration", max_t=max_t, grace_period=grace,
                         reduction_factor=ASHA_REDUCTION)


ASHA_REDUCTION = 2  # at each rung, the better half goes on


def _asha_epochs(base: TrainConfig, searched: dict[str, Any]) -> tuple[int, int]:
    """(max_t, grace period) in epochs."""
    max_t = base.epochs if "epochs" not in searched else max(_numbers(searched["epochs"]) or [10_000])
    warmup = max(base.warmup_epochs, *_numbers(searched.get("warmup_epochs")))
    return max_t, min(max_t, math.ceil(warmup) + 1)


def scheduler_line(scheduler: str, base: TrainConfig, searched: dict[str, Any], metric: str) -> str:
    """The plan's words for the scheduler: where ASHA judges the trials (its rungs, as ASHAScheduler places them)."""
    if scheduler != "asha":
        return "fifo: every trial runs all its epochs"
    max_t, grace = _asha_epochs(base, searched)
    rungs = [grace * ASHA_REDUCTION**k for k in range(int(math.log(max_t / grace, ASHA_REDUCTION)) + 1)]
    rungs = [r for r in rungs if r < max_t]  # a rung at the last epoch stops nothing
    if not rungs:
        return f"asha: no rung before the last epoch ({max_t}): every trial runs all its epochs"
    return (f"asha: at epoch {', '.join(map(str, rungs))} a trial not in the better half by {metric} so far is "
            f"stopped early (the first rung follows the LR warmup)")


def _numbers(domain: Any) -> list[float]:
    """The values a fixed or grid/choice entry can take (ranges: none known in advance)."""
    if isinstance(domain, (int, float)):
        return [domain]
    if isinstance(domain, dict) and "grid_search" in domain:
        return list(domain["grid_search"])
    categories = getattr(domain, "categories", None)
    if categories:
        return list(categories)
    upper = getattr(domain, "upper", None)  # a range: its upper bound is the worst case
    return [upper] if upper is not None else [0]


def concurrency(base: TrainConfig, max_concurrent: int | None) -> int:
    """How many trials fit at once: the cluster's CPUs (minus one for Ray Data) over one trial's workers."""
    import ray

    cpus = ray.cluster_resources().get("CPU", 1.0)
    per_trial = base.min_workers * base.cpus_per_worker  # an elastic trial starts with MIN
    fits = max(1, math.floor((cpus - 1) / per_trial))
    if base.use_gpu:
        fits = max(1, min(fits, int(ray.cluster_resources().get("GPU", 0) // base.min_workers)))
    return min(fits, max_concurrent) if max_concurrent else fits


def sweep(
    space_file: str | Path,
    fixed: dict[str, Any],
    output: str | Path,
    num_samples: int = 1,
    scheduler: str = "asha",
    metric: str | None = None,
    mode: str | None = None,
    max_concurrent: int | None = None,
    *,
    trial: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """``trial``: one trial's training, called with its sampled config's fields in the trial's own process
    (app.run.trial.run_trial: the run jobs/train.py would make of it)."""
    from app.driver import cluster
    from app.ui import console

    fixed = _anchored(fixed)
    space, searched, base, out, restoring = _checked(space_file, fixed, output, num_samples=num_samples,
                                                     max_concurrent=max_concurrent)
    cluster.check_fits_locally(base)
    # Ray's and the libraries' lines stay off the console from Ray's start on (app.ui.console).
    with console.for_people(base.show_logs, marked=False):
        cluster.connect(base)
        if metric is None or mode is None:
            from app.driver import preflight
            from app.training.objective import metric_mode

            # The run's metric: the model's first compiled metric, or the task's (accuracy, or mae).
            objective = preflight.check_model(base, preflight.load_data(base, base.max_workers).facts)[1]
            metric = metric or f"val_{objective.metric}"
            mode = mode or metric_mode(metric) or "min"
        at_once = concurrency(base, max_concurrent)
        output_guard.take(out, "tune")  # every check passed; a sweep resumed keeps what it has
        try:
            return _swept(trial, space_file, space, fixed, searched, base, out, restoring, scheduler, metric, mode,
                          num_samples, at_once)
        finally:
            output_guard.release(out)


def _swept(trial: Callable, space_file, space: dict[str, Any], fixed: dict[str, Any], searched: set[str],
           base: TrainConfig, out: Path, restoring: bool, scheduler: str, metric: str, mode: str, num_samples: int,
           at_once: int) -> dict[str, Any]:
    """The sweep itself, Ray joined and its directory taken: the plan, the trials, the outputs."""
    import ray

    from app.ui import console, tune_console

    with console.routed(out / tune_console.LOG_FILE, base.show_logs, marked=False):
        for line in tune_console.plan_lines(
                space_file, read_yaml(space_file), searched, tune_console.trial_count(space, num_samples),
                scheduler_line(scheduler, base, {k: space[k] for k in searched}, metric), metric, mode, base,
                at_once, ray.cluster_resources().get("CPU", 0), out, restoring):
            console.say(line)
        # Tune's own reporter off (app.internals): the console above is the sweep's. Put back after: a
        # notebook's own Tune runs are not ours.
        saved = os.environ.get(internals.TUNE_NEW_OUTPUT_ENV_VAR)
        os.environ[internals.TUNE_NEW_OUTPUT_ENV_VAR] = "0"
        try:
            results = _tuner(trial, base, space, fixed, searched, out, restoring, scheduler, metric, mode, num_samples,
                             at_once).fit()
        finally:
            if saved is None:
                os.environ.pop(internals.TUNE_NEW_OUTPUT_ENV_VAR, None)
            else:
                os.environ[internals.TUNE_NEW_OUTPUT_ENV_VAR] = saved
        return write_outputs(results, out, base, metric, mode)


def _anchored(fixed: dict[str, Any]) -> dict[str, Any]:
    """The files every trial reads (--model, --dataset, --val-dataset, --callbacks), relative to this directory, made
    absolute: each trial runs in a working directory of Tune's own."""
    # A file.py:function, or a dataset's path (a built-in's name stays a name, whatever this directory holds).
    named = {k: v for k, v in fixed.items() if k in ("model", "dataset", "val_dataset", "callbacks")
             and isinstance(v, str) and (registry.is_plugin(v) or (k.endswith("dataset") and registry.looks_like_path(v)))}
    anchored = dict(fixed)
    for key, path in output_guard.reads_of(named).items():  # the local files among them, resolved
        anchored[key] = f"{path}:{named[key].rpartition(':')[2]}" if registry.is_plugin(named[key]) else str(path)
    return anchored


def _checked(space_file: str | Path, fixed: dict[str, Any], output: str | Path, **counts: int | None):
    """Everything a sweep can refuse before Ray starts: its counts (num_samples, max_concurrent), the space and every
    trial's config, the sweep-wide rules, the output directory. (space, searched keys, base config, output, whether
    it resumes an earlier sweep)."""
    from ray import tune

    for name, count in counts.items():
        if count is not None and count < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {count})")
    space = load_space(space_file, fixed)
    searched = {k for k, v in space.items() if _is_domain(v)}
    # The values every trial shares (flags, and the space's plain values) make the base config.
    base = build_config(None, {**fixed, **{k: v for k, v in space.items() if k not in searched}, "output": "x"})
    out = Path(output).expanduser().resolve()
    if base.checkpoint_every_steps or "checkpoint_every_steps" in searched:
        raise UserError("--checkpoint-every-steps: a trial reports to Tune once per epoch (ASHA compares trials by "
                        "those reports); leave it out of a sweep")
    if backend_of(base).parameter_servers or "strategy" in searched:
        raise UserError("a sweep's trials are Ray Train runs (MultiWorkerMirroredStrategy): leave --strategy out of "
                        "it and train parameter-server runs with jobs/train.py")
    _check_files(base, searched)
    restoring = out.is_dir() and tune.Tuner.can_restore(str(out))
    # A sweep's directory is added to (resumed), never replaced; one that stopped before Tune wrote anything holds
    # only its log and marker.
    reads = output_guard.reads_of({"--space": space_file, "--dataset": base.dataset, "--val-dataset": base.val_dataset,
                                   "--model": base.model, "--callbacks": base.callbacks})
    output_guard.check(out, "tune", reads, resume=restoring, reuse=True)
    return space, searched, base, out, restoring


def _check_files(base: TrainConfig, searched: set[str]) -> None:
    """The files every trial reads, there: the dataset's and the user's code files (not imported here)."""
    from app.data import files

    for name in ("model", "dataset", "callbacks"):
        value = getattr(base, name)
        if name not in searched and isinstance(value, str) and registry.is_plugin(value):
            where = value.split(":", 1)[0]
            if where.endswith(".py") and not Path(where).expanduser().is_file():
                raise UserError(f"--{name} {value}: file {where!r} does not exist (paths are relative to {Path.cwd()})")
    if not {"dataset", "val_dataset", "data_format"} & searched:
        files.located(base)  # lists the files: a dataset that is not there is refused by name
        if base.val_dataset:
            files.locate(base.val_dataset, base.data_format)


def dry_run_lines(space_file: str | Path, fixed: dict[str, Any], output: str | Path, num_samples: int = 1,
                  scheduler: str = "asha", metric: str | None = None, max_concurrent: int | None = None) -> list[str]:
    """jobs/tune.py --dry-run: the sweep's checks (every trial's config included) and its plan; no Ray, no data."""
    from app.ui import tune_console

    space, searched, base, out, restoring = _checked(space_file, fixed, output, num_samples=num_samples,
                                                     max_concurrent=max_concurrent)
    trials = tune_console.trial_count(space, num_samples)
    metric = metric or "the run's metric"
    return [f"sweep: {space_file}: {trials} trial(s) of {', '.join(sorted(searched)) or 'the fixed values'}; every "
            "trial's config is valid",
            f"scheduler: {scheduler_line(scheduler, base, {k: space[k] for k in searched}, metric)}",
            f"output: {out} ({'resumed' if restoring else 'not created'}: --dry-run)"]


def _tuner(trial: Callable, base: TrainConfig, space: dict[str, Any], fixed: dict[str, Any], searched: set[str], out: Path,
           restoring: bool, scheduler: str, metric: str, mode: str, num_samples: int, at_once: int):
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from app.ui import tune_console

    # A trial's own process (the Train driver) reserves memory, not CPU: its
    # workers reserve their CPUs through Train's placement group, and a CPU
    # fraction here would eat into the CPU that Ray Data's shuffle tasks need
    # (0.99 free CPU never fits a 1-CPU task: the run waits forever). Concurrency
    # is capped so the trials running at once can all place their workers: on
    # 2 CPUs, one trial at a time instead of a deadlock.
    trainable = tune.with_resources(trial, tune.PlacementGroupFactory([{"CPU": 0, "memory": TRIAL_MEMORY}]))
    if restoring:
        # The run config comes back with the sweep: Tune's reporter off, our trial lines on.
        return tune.Tuner.restore(str(out), trainable=trainable, resume_errored=True)
    sched = asha(base, {k: space[k] for k in searched}) if scheduler == "asha" else FIFOScheduler()
    return tune.Tuner(
        trainable,
        param_space={**fixed, **space},
        tune_config=tune.TuneConfig(metric=metric, mode=mode, scheduler=sched, num_samples=num_samples,
                                    max_concurrent_trials=at_once),
        # verbose=0 (with Tune's older engine: app.internals): Tune's own reporter (status tables, a box per
        # trial config and result) is replaced by TrialLines, one line per trial event (app.ui.tune_console).
        run_config=tune.RunConfig(name=out.name, storage_path=str(out.parent), verbose=0,
                                  callbacks=[tune_console.TrialLines(sorted(searched), metric, base.epochs)]),
    )


def write_outputs(results, out: Path, base: TrainConfig, metric: str, mode: str) -> dict[str, Any]:
    import pandas as pd

    from app.ui import console, tune_console

    rows = []
    for number, r in enumerate(results, 1):  # Tune's order of trials, as the console numbered them
        cfg = r.config or {}
        m = r.metrics or {}
        workers = config_scale.sizes(cfg.get("num_workers", base.num_workers))[-1]  # elastic: at most MAX
        rows.append({
            "trial": number,
            "trial_id": m.get("trial_id"),
            **{f"config/{k}": v for k, v in cfg.items()},
            "global_batch": cfg.get("per_replica_batch", base.per_replica_batch) * workers
            * cfg.get("grad_accum", base.grad_accum),
            "epochs_run": m.get("epoch", 0),
            metric: m.get(metric),
            "val_loss": m.get("val_loss"),
            "train_loss": m.get("train_loss"),
            "wall_seconds": m.get("time_total_s"),
            "worker_seconds": (m.get("time_total_s") or 0) * workers,
            "epoch_seconds": m.get("epoch_seconds"),
            "error": tune_console.one_line(r.error) if r.error else "",
        })
    table = pd.DataFrame(rows)
    table.to_csv(out / RESULTS_FILE, index=False)
    finished = table.dropna(subset=[metric])
    if finished.empty:
        raise RunFailed(f"no trial reported {metric!r}; see {out / RESULTS_FILE} and the trial logs in {out}")

    best = results.get_best_result(metric=metric, mode=mode, scope="last")
    # What the best trial set (the sweep's fixed flags and its point in the space), not the defaults: read back, a
    # default stays the product's to decide from the model, as in the trial (app.driver.outputs.recorded_config).
    best_config = {**base.model_dump(mode="json", exclude_unset=True), **best.config}
    for key in ("output", "overwrite", "resume"):
        best_config.pop(key, None)
    (out / BEST_CONFIG_FILE).write_text(yaml.safe_dump(best_config, sort_keys=False))
    plot(finished, out / PLOT_FILE, metric)

    # Worker-seconds had every trial run all its epochs: what it spent, plus its
    # remaining epochs at its own last epoch time (start-up is not paid again).
    epochs = table.get("config/epochs", base.epochs)
    workers = (table["config/num_workers"].map(lambda n: config_scale.sizes(n)[-1]) if "config/num_workers" in table
               else base.max_workers)
    remaining = (epochs - table["epochs_run"]).clip(lower=0) * table["epoch_seconds"].fillna(0) * workers
    full = (table["worker_seconds"] + remaining).sum()
    summary = {
        "metric": metric,
        "trials": len(table),
        "stopped_early": int((table["epochs_run"] < epochs).sum()),
        "best": {metric: best.metrics.get(metric), "config": best.config},
        "worker_seconds_spent": float(table["worker_seconds"].sum()),
        "worker_seconds_if_all_ran_to_the_end": float(full),
    }
    (out / SUMMARY_FILE).write_text(yaml.safe_dump(summary, sort_keys=False))
    # The searched columns; as text, because fixed values may be lists (--hidden-units 64 32), which do not hash.
    shown = [c for c in table.columns if c.startswith("config/") and table[c].astype(str).nunique() > 1]
    for line in tune_console.summary_lines(table, metric, mode, base.epochs, out / BEST_CONFIG_FILE, shown):
        console.say(line)
    return summary


def plot(table, path: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from app.training.objective import metric_mode

    fig, ax = plt.subplots(figsize=(6, 4))
    rule_col = "config/lr_scaling"
    groups = table.groupby(rule_col) if rule_col in table else [("all trials", table)]
    for rule, group in groups:
        pick = "idxmax" if metric_mode(metric) == "max" else "idxmin"
        best = group.loc[getattr(group.groupby("global_batch")[metric], pick)()].sort_values("global_batch")
        ax.plot(best["global_batch"], best[metric], marker="o", label=str(rule))
        for _, row in best.iterrows():  # ASHA stops trials at different epochs: say which
            ax.annotate(f"{int(row['epochs_run'])} ep", (row["global_batch"], row[metric]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch size")
    ax.set_ylabel(f"final {metric} (best trial per point)")
    ax.set_title("LR scaling rules across global batch sizes")
    ax.grid(alpha=0.3)
    ax.legend(title="lr_scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
