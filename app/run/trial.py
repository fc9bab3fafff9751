"""One Ray Tune trial (app.tools.tune runs a sweep of them): the run jobs/train.py would make of the trial's config,
on Keras's fit (app.run.config_run), its every epoch reported to Tune."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.config import build_config
from app.driver import output_guard


def run_trial(params: dict[str, Any]) -> None:
    """One Tune trial: a full Ray Train run of the sampled config."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from app.backends import keras_fit
    from app.run import config_run

    context = tune.get_context()
    trial_dir = Path(context.get_trial_dir())
    fields = {**params, "output": str(trial_dir / "run"), "overwrite": True}
    storage = str(trial_dir)
    if params.get("storage_path"):  # --storage-path: <storage-path>/<sweep>/<trial>/train, TensorBoard included
        sweep = context.get_experiment_name()
        storage = fields["storage_path"] = f"{params['storage_path'].rstrip('/')}/{sweep}/{trial_dir.name}"
    config = build_config(None, fields)  # valid: the sweep checked every trial's config before the first
    try:
        if config_run.from_config(config, ray_run=keras_fit.RayRun((TuneReportCallback(),), storage, "train")) is None:
            # the sweep refuses what Keras's fit does not train before the first trial (app.tools.tune)
            raise RuntimeError(f"trial {trial_dir.name}: its config trains on the product's own step, not a sweep's")
    finally:
        output_guard.release(config.output_dir())  # a retried trial may run in this process again
