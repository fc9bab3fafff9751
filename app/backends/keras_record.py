"""What a run by Keras's fit records (app.backends.keras_fit writes it): result.json's keys every run has, and the
trained model exported as far as Keras can save it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

from app.backend import runs_on_ray
from app.driver import outputs
from app.training import keras_checkpoint, keras_worker
from app.training.export import SAVED_MODEL_DIR, export_saved_model
from app.training.keras_worker import KerasJob
from app.training.strategy import one_replica_reason, ray_strategy_name, ray_strategy_reason

log = logging.getLogger(__name__)

WEIGHTS_FILE = "weights.weights.h5"


def trained_model(job: KerasJob, directory: str, names: Optional[Callable[[], None]] = None) -> tuple[Any, dict]:
    """The model the user's function builds, with the checkpoint's weights (and optimizers' state), its objects
    named as the workers' builds named them (Keras numbers a second ``AUC()`` of a process ``auc_1``; model.keras
    and evaluation then name its metrics as the run's History): in a new process's counters (a Ray worker's), or
    ``names`` (restores this process's counters as they were when its own worker built its model)."""
    import keras

    from app import internals
    from app.training import keras_features

    after = internals.keep_keras_names(fresh=names is None)
    if names is not None:
        names()
    try:
        keras.utils.set_random_seed(job.seed)
        model = keras_features.build(job.model_fn, job.features, schedules=False)
        keras_worker.build(model, job.train)
    finally:
        after()
    return model, keras_checkpoint.restore(model, directory)


def summary(job: KerasJob, state: dict[str, Any], world: int, started: float, model, backend: str,
            local: Any = None) -> dict[str, Any]:
    """The keys every run's result.json has, whichever way it trained (the command line, app.train, a sweep and
    result_line read them): the last epoch's logs as ``metrics`` (``loss`` -> ``train_loss``, ``val_loss`` as it is),
    the ``metric`` that ranks epochs and trials (app.training.objective), the replicas, the global batch and the
    learning rate the rule gave (``model``: the trained model, its optimizer at the rate it was compiled with;
    ``local``: the LocalReplicas of a local run of several replicas)."""
    import numpy as np

    from app.training.keras_callbacks import as_metrics  # the driver holds Keras already: it built the model
    from app.training.keras_sync import optimizers_of
    from app.training.objective import metric_in

    records = state["history"]
    final = records[-1] if records else {}
    metrics = {k: v for k, v in as_metrics(final).items() if k != "learning_rate"}
    name = metric_in(metrics)
    trained = [r for r in records if r["epoch"] > job.initial_epoch]  # this run's epochs (not a resumed run's first)
    rows = keras_worker.trained_rows(job.train, world)
    seconds = sum(r["seconds"] for r in trained)
    optimizers = optimizers_of(model)
    first = getattr(optimizers[0], "inner_optimizer", optimizers[0]) if optimizers else None  # a loss scaler's own
    # The rate it was compiled with (a float32 variable: 0.05 reads 0.0500000007), as it was written.
    base = float(f"{float(np.asarray(first.learning_rate)):.7g}") if first is not None else None
    features = job.features
    replicas = local.replicas if local is not None else world
    return {"metrics": metrics, "metric": f"val_{name}" if f"val_{name}" in metrics else f"train_{name}",
            # the rows of an optimizer update (grad_accum steps' batches), as the own step counts them
            "num_replicas": replicas, "global_batch_size": features.batch_size * features.grad_accum
            if features.batch_size else None,
            "task": job.task,  # what the product compiled the model for (jobs/predict.py reads it); None: compiled
            "strategy": local.name if local is not None else ray_strategy_name(world), "backend": backend,
            "strategy_reason": local.reason if local is not None else ray_strategy_reason(world)
            if runs_on_ray(backend) else one_replica_reason(),
            # --strategy pipeline: one replica, its stages on this process's devices
            **({"strategy": "pipeline", "strategy_reason": f"requested; {len(job.stages.stages)} stages, one per "
                "device", "stages": list(job.stages.stages)} if job.stages is not None else {}),
            # a replica's part of a global batch (a batch that does not divide: its largest part)
            "per_replica_batch": -(-features.batch_size // replicas) if features.batch_size else None,
            "grad_accum": features.grad_accum, "mixed_precision": features.mixed_precision,
            "base_lr": base, "lr_scaling": features.lr_scaling,
            "learning_rate": base * features.scale if base is not None else None,  # the peak, after any warmup
            "epochs_completed": final.get("epoch", job.initial_epoch),
            "restarts": final.get("attempt", 0),  # the worker group's restarts (a lost worker, a resize)
            "stopped_early": state.get("stopped_early"),  # a callback that stopped the run: after which epoch, why
            "steps_per_epoch": job.train.steps, "rows": job.train.num_rows,
            # the validation rows (0: none; None: counted only as the workers read them)
            "val_rows": (job.val.num_rows if job.val is not None else 0),
            "dropped_samples_per_epoch": job.train.dropped_rows(world),
            "samples_per_second": rows * len(trained) / seconds if rows is not None and seconds else None,
            "worker_nodes": state.get("worker_nodes", []),
            # the run's size since each (re)start that changed it: {time, workers, epoch, step[, joined, lost]}
            "workers_over_time": state.get("workers_over_time", []),
            "time_to_first_step_seconds": outputs.first_step_seconds(records, started),
            # --tensor-parallel: the split and what each of a worker's devices held of it (rank 0's count)
            **({"tensor_parallel": {**job.tensor.as_dict(), "device_bytes": state.get("tensor_device_bytes") or {}}}
               if job.tensor is not None else {}),
            "wall_seconds": round(time.time() - started, 2)}


def export(model, out: Path, formats: tuple = ("keras", "savedmodel")) -> dict[str, Any]:
    """The weights; model.keras and a SavedModel (``formats``: --export) where the model can be saved and loaded;
    else one line each, and on."""
    import keras

    done: dict[str, Any] = {"saved_model": None}  # None: not asked for (--export keras) or not exportable
    try:
        model.save_weights(out / WEIGHTS_FILE)
        done["weights_file"] = WEIGHTS_FILE
    except Exception as e:
        log.warning("%s not written (%s): the trained weights are in checkpoint/ (tf.train.Checkpoint)",
                    WEIGHTS_FILE, _short(e))
    path = out / outputs.MODEL_FILE
    try:
        model.save(path)
        keras.models.load_model(path, compile=False)
        done["model_file"] = outputs.MODEL_FILE
    except Exception as e:
        path.unlink(missing_ok=True)
        log.warning("model.keras not written: Keras cannot save and load this model (%s); the trained weights are "
                    "in checkpoint/ and, where Keras could write them, %s", _short(e), WEIGHTS_FILE)
    if "savedmodel" not in formats:
        return done
    try:
        # Its serving signature, as every run's result.json: an unnamed keras.Input's is "x" (app.training.export)
        done["saved_model"] = export_saved_model(model, out / SAVED_MODEL_DIR)
    except Exception as e:
        log.warning("no SavedModel: Keras cannot export this model for serving (%s)", _short(e))
    return done


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:160] or type(e).__name__

