"""Run outputs: the output directory, result.json, the history, the exported model (model.keras, saved_model/)."""

from __future__ import annotations

import csv
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

from app import registry
from app.backend import backend_of
from app.config import CONFIG_FILE, TrainConfig
from app.driver import output_guard
from app.errors import UserError
from app.training.checkpoint import LOCAL_DIR as LOCAL_CHECKPOINTS
from app.training.export import SAVED_MODEL_DIR, export_saved_model
from app.training.metrics import history_row
from app.training.objective import metric_in, metric_mode, metric_names_in
from app.training.optim import AS_COMPILED

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
HISTORY_FILE = "history.csv"
MODEL_FILE = "model.keras"
CURVES_FILE = "curves.png"
AUDIT_FILE = "audit_sample_ids.json"  # per epoch, the ids every replica trained on


def train_reads(config: TrainConfig) -> dict[str, Path]:
    """What a training run reads from disk, by flag: the output guard keeps --output off all of it."""
    return output_guard.reads_of({"--dataset": config.dataset, "--val-dataset": config.val_dataset,
                                  "--model": config.model, "--callbacks": config.callbacks})


def check_output_dir(config: TrainConfig) -> None:
    """Refuse at once (before data, model or Ray) an output directory that a new run may not write or replace
    (app.driver.output_guard)."""
    output_guard.check(config.output_dir(), "train", train_reads(config), overwrite=config.overwrite,
                       resume=config.resume)


def prepare_output_dir(config: TrainConfig, unused: tuple[str, ...] = ()) -> Path:
    """Create the output directory once the run's checks have passed; an existing one is replaced only with
    --overwrite and only when this product wrote it for a run, or continued with --resume (``unused``: the fields
    the run's training does not read, app.training.compile_record)."""
    out = config.output_dir()
    if config.storage_path and not backend_of(config).ray_train:
        log.warning("--storage-path is where Ray Train keeps checkpoints; this run keeps its own in %s",
                    out / LOCAL_CHECKPOINTS)
    check_output_dir(config)
    if config.resume:
        if not (out / CONFIG_FILE).is_file():
            raise UserError(f"nothing to resume: {str(out)!r} holds no {CONFIG_FILE}")
        output_guard.take(out, "train")
        # Whether there is anything left to train (a finished run, more --epochs) was decided in preflight
        # (app.driver.resume). The config now in force (another worker count, more epochs) is what a later
        # --resume reads.
        (out / CONFIG_FILE).write_text(recorded_config(config, out, unused))
        return out
    output_guard.take(out, "train", replace=config.overwrite)
    # Written first, so that even a failed run leaves the config it was started with.
    (out / CONFIG_FILE).write_text(recorded_config(config, out, unused))
    return out


def release_output_dir(config: TrainConfig) -> None:
    """The run is over (finished or failed): another job may now replace or resume its directory."""
    output_guard.release(config.output_dir())


# Where and how a run was started, not what it trains: left out of config.yaml, so that the file
# starts a new run (a new output directory) when given to --config.
_NOT_RECORDED = ("output", "overwrite", "resume")


def recorded_fields(config: TrainConfig) -> dict[str, Any]:
    """The fields the run set, as config.yaml records them (a checkpoint's state records them too)."""
    values = config.model_dump(mode="json")
    return {k: v for k, v in values.items() if k not in _NOT_RECORDED and k in config.model_fields_set}


STARTED_IN = "# Started in: "  # the working directory relative paths were given from (evaluate and predict read it)


def recorded_config(config: TrainConfig, out: Path, unused: tuple[str, ...] = ()) -> str:
    """config.yaml: the resolved config, reusable with --config, and comments saying how to use it; the defaults
    in force, commented out, without the ``unused`` ones (a model's own compile replaced them)."""
    import yaml

    values = config.model_dump(mode="json")
    lines = [f"# The config of the run in {out}.",
             "# Another run of it (a new output directory): python jobs/train.py --config <this file>",
             f"# Continue this one if it stopped: python jobs/train.py --output {out} --resume",
             f"# Not recorded: {', '.join(_NOT_RECORDED)} (output was {out})",
             f"{STARTED_IN}{Path.cwd()}"]
    for name in ("model", "dataset"):
        if not registry.reloadable(getattr(config, name)):
            lines.append(f"# {name}: {values[name]} was a function passed from Python, which this file cannot "
                         f"load: pass it again (app.train({'data' if name == 'dataset' else name}=..., config=<this "
                         f"file>), or --{name} file.py:function)")
    # Only what the run set: a default left to the product stays a default when the file is read back (--config,
    # --resume), where the product decides from the model (a compiled optimizer's own LR, a built-in model's
    # optimizer); the defaults in force follow, commented out.
    chosen = recorded_fields(config)
    defaults = {k: v for k, v in values.items() if k not in _NOT_RECORDED and k not in chosen and k not in unused}
    commented = ["# Defaults in force (not set for this run):",
                 *(f"# {line}" for line in yaml.safe_dump(defaults, sort_keys=False).splitlines())] if defaults else []
    if idle := [k for k in unused if k not in chosen]:
        commented.append(f"# Not in force for this run (result.json's compiled says what trained): {', '.join(idle)}")
    return "\n".join(lines) + "\n" + yaml.safe_dump(chosen, sort_keys=False) + "\n".join(commented) + "\n"


def first_step_seconds(history: list[dict[str, Any]], started_at: float) -> float | None:
    """From the driver's start to the first step it saw (an epoch record's ``first_step_time``, wall clock; a resumed
    run's history starts earlier), on either engine; None: no step yet."""
    return next((h["first_step_time"] - started_at for h in history
                 if (h.get("first_step_time") or 0) >= started_at), None)


def write_history(path: Path, history: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(k for row in history for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)


def plot_curves(history: list[dict[str, Any]], path: Path, subtitle: str = "") -> None:
    """The loss and every metric per epoch, train against val, side by side; the run metric's best epoch marked.

    Train numbers are means over the epoch's steps as the weights moved; val
    numbers are measured after the epoch. Early on, val can therefore beat train.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [h["epoch"] for h in history]
    metric = metric_in(history[-1])
    higher_is_better = metric_mode(metric) == "max"
    # A run without validation ranks its epochs by the training numbers.
    ranked = f"val_{metric}" if all(f"val_{metric}" in h for h in history) else f"train_{metric}"
    best = (max if higher_is_better else min)(history, key=lambda h: h[ranked])
    names = metric_names_in(history[-1]) if ranked.startswith("val_") else \
        ["loss", *(k[6:] for k in history[-1] if k.startswith("train_") and k[6:] not in ("loss", "samples", "seconds"))]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    for ax, key in zip(axes[0], names):
        ax.plot(epochs, [h[f"train_{key}"] for h in history], marker="o", label=f"train {key} (mean over epoch)")
        if all(f"val_{key}" in h for h in history):
            ax.plot(epochs, [h[f"val_{key}"] for h in history], marker="s", label=f"val {key} (end of epoch)")
        ax.axvline(best["epoch"], color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(key)
    if all(0 < v < math.inf for h in history for v in (h["train_loss"], h.get("val_loss", 1.0))):
        # A loss that went NaN, or one that can be 0 or negative (a GAN's, a cosine one), stays on a linear scale.
        axes[0][0].set_yscale("log")
        axes[0][0].set_title("loss (log scale)")
    shown = ranked.replace("_", " ", 1)
    axes[0][names.index(metric)].set_title(f"{metric}; best {shown.split()[0]} {best[ranked]:.4f} at epoch "
                                           f"{best['epoch']} (dotted)")
    last = history[-1]
    title = f"{shown} {last[ranked]:.4f} after {last['epoch']} epochs"
    fig.suptitle(f"{title}\n{subtitle}" if subtitle else title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _subtitle(config: TrainConfig, state: dict[str, Any], strategy: str, num_replicas: int) -> str:
    """curves.png's second line: what trained, how wide, with which batch and LR."""
    lr_plan = state["lr_plan"]
    accumulated = f" x {config.grad_accum} accumulated" if config.grad_accum > 1 else ""
    return (f"{state['config']['model']} on {state['config']['dataset']}, {strategy}, {num_replicas} replica(s) x "
            f"{state['plan']['per_replica_batch']}{accumulated} = global batch {lr_plan['global_batch']}, "
            + (f"peak LR {lr_plan['peak_lr']:.3g} ({lr_plan['rule']} rule)" if lr_plan.get("decay") != AS_COMPILED
               else "LR as compiled"))


def write_outputs(
    config: TrainConfig,
    state: dict[str, Any],
    model_file: str | Path,
    *,
    strategy: str,
    started_at: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """From the last checkpoint (its state and model file): model.keras and saved_model/ (--export), history.csv,
    curves.png, result.json."""
    out = config.output_dir()
    history = state["history"]
    last = history[-1]
    metric = metric_in(last)
    if "keras" in config.export:
        shutil.copyfile(model_file, out / MODEL_FILE)
    # From the checkpoint's model file, in this process (the driver: it built the model for the checks, so
    # TensorFlow is imported already): one ordinary model, whatever the strategy trained it.
    saved_model = export_saved_model(model_file, out / SAVED_MODEL_DIR) if "savedmodel" in config.export else None
    write_history(out / HISTORY_FILE, [history_row(h) for h in history])  # its logs under Keras's names
    lr_plan = state["lr_plan"]
    num_replicas = state["plan"]["workers"] * state["plan"]["replicas_per_worker"]
    plot_curves(history, out / CURVES_FILE, subtitle=_subtitle(config, state, strategy, num_replicas))

    train_samples = sum(h["train_samples"] for h in history)
    train_seconds = sum(h["train_seconds"] for h in history)
    result = {
        "strategy": strategy,
        "restarts": history[-1].get("attempt", 0),
        "num_replicas": num_replicas,
        "backend": config.backend,
        "per_replica_batch": state["plan"]["per_replica_batch"],  # --global-batch: the last size's part of it
        "grad_accum": config.grad_accum,
        "mixed_precision": config.mixed_precision,
        "global_batch_size": lr_plan["global_batch"],
        "lr_scaling": lr_plan["rule"],
        "base_lr": lr_plan["base_lr"],
        "learning_rate": lr_plan["peak_lr"],
        "lr_plan": lr_plan,
        "epochs_completed": last["epoch"],
        # A callback that set model.stop_training: the epoch it stopped after and why (None: not stopped).
        "stopped_early": state.get("stopped_early"),
        "steps_per_epoch": state["plan"]["steps"],
        "dropped_samples_per_epoch": last["dropped_samples"],
        "task": state.get("task", "classification"),
        # Every metric the run reported (the run's own, val_{metric}, ranks epochs and trials).
        "metric": f"val_{metric}",
        "metrics": {f"{part}_{name}": last[f"{part}_{name}"] for part in ("train", "val")
                    for name in metric_names_in(last)},
        **({"objective": state["objective"]} if "objective" in state else {}),
        "samples_per_second": train_samples / train_seconds,
        "wall_seconds": time.time() - started_at,
        "time_to_first_step_seconds": first_step_seconds(history, started_at),
        **({"worker_nodes": state["worker_nodes"]} if "worker_nodes" in state else {}),
        # Each size the run had and since when (an elastic run's resizes: --num-workers MIN:MAX).
        "workers_over_time": state.get("workers_over_time", []),
        **(extra or {}),  # what the backend knows better (a parameter-server run's replicas and steps)
        "history_file": HISTORY_FILE,
        "model_file": MODEL_FILE if "keras" in config.export else None,
        "saved_model": saved_model,  # its directory, serving signature, inputs and outputs (app.training.export)
        "config": config.model_dump(mode="json"),
    }
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
    output_guard.release(out)  # the run is written: evaluate, predict or another run may use the directory now
    return result
