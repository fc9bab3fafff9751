"""A run's checkpoints by Keras's fit: replaced whole in its output directory, found (its own and those in its Ray
storage) for --resume, and checked against the model before any worker starts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from app.config import TrainConfig
from app.errors import UserError
from app.training import checkpoint


def replace(final: Path, fresh: Path) -> None:
    """This run's checkpoint directory ``final`` (only this product writes there) replaced by the complete ``fresh``
    one. The previous one is moved aside first and removed last: a process killed at any point leaves one whole
    checkpoint, ``final`` or ``previous(final)`` (``whole`` finds it)."""
    old = previous(final)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(fresh, final)
    if old.exists():
        shutil.rmtree(old)


def previous(final: Path) -> Path:
    return final.with_name(final.name + ".previous")


def whole(final: Path) -> Optional[Path]:
    """The whole checkpoint ``_replace`` left: ``final``, or the previous one where a kill came between the moves."""
    return next((d for d in (final, previous(final)) if (d / checkpoint.STATE_FILE).is_file()), None)


def last_checkpoint(config: TrainConfig, out: Path) -> Optional[str]:
    """--resume: the run's latest whole checkpoint, if any: the one it left in its output directory, or one of a
    stopped Ray run's in its storage (every epoch's; the output directory's is written at the end)."""
    if not config.resume:
        return None
    found = checkpoints(out, config.storage_path)
    return str(max(found, key=_position)) if found else None


def _position(directory: Path) -> tuple[int, int, int]:
    """Where a checkpoint is: epochs done, and steps done in the next (--checkpoint-every-steps); at the same place,
    the one written as training ended, its weights set by a callback (app.training.keras_callbacks), last."""
    state = checkpoint.read_state(directory / checkpoint.STATE_FILE)
    return state["epoch"], state.get("step", 0), state.get("settled", 0)


def checkpoints(out: Path, storage_path: Optional[str] = None) -> list[Path]:
    """The whole checkpoints of a run by Keras's fit in ``out`` (its final one, and those in its Ray storage)."""
    storage = Path(storage_path) if storage_path and "://" not in storage_path else out / "ray"
    candidates = [d for d in [whole(out / "checkpoint")] if d] + list(storage.glob("**/checkpoint_*"))
    found = []
    for directory in candidates:
        state = directory / checkpoint.STATE_FILE
        # The product's own step writes state.json too, with its epoch plan: not this run's kind.
        if state.is_file() and "plan" not in checkpoint.read_state(state):
            found.append(directory)
    return found


def check_resumable(config: TrainConfig) -> None:
    """--resume of an output that holds a finished run (its result.json) but no checkpoint of it to go on from: one
    line, before any work, every file left as it is. A run stopped before its first checkpoint (its config.yaml
    alone) has nothing to lose: it starts as a new run would."""
    from app.driver.outputs import RESULT_FILE

    out = config.output_dir()
    if not config.resume or not (out / RESULT_FILE).is_file() or checkpoints(out, config.storage_path):
        return
    raise UserError(f"--resume: nothing to resume in {out}: it holds a finished run but no checkpoint of it (its "
                    "checkpoint/ and Ray's checkpoint_* directories are gone); train anew with another --output, or "
                    "replace it with --overwrite instead of --resume")


def check_fits(model, config: TrainConfig) -> None:
    """The resumed checkpoint reads whole (every tensor: a truncated or damaged file is one line naming it) and
    holds this model's variables, shape for shape (their order is the model's: the same function builds them in the
    same order; a model not built yet is checked by the workers' restore), else one line naming the first that
    differ. Before any worker starts, and before the run rewrites anything."""
    import tensorflow as tf

    from app.driver.resume import shape_text

    prefix = str(Path(last_checkpoint(config, config.output_dir())) / checkpoint.TRAIN_STATE)
    checkpoint.verify(prefix)
    if not model.built:
        return
    saved = {name: shape for name, shape in tf.train.list_variables(prefix)}
    held = [saved.get(f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE") for i in range(len(model.variables))]
    differ = [f"{v.path} is {shape_text(s)} in the checkpoint, {shape_text(v.shape)} in the model"
              for v, s in zip(model.variables, held) if s is not None and tuple(s) != tuple(v.shape)]
    differ += [f"{v.path} {shape_text(v.shape)} is not in the checkpoint" for v, s in zip(model.variables, held)
               if s is None]
    if differ:
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise UserError(f"the checkpoint in {config.output_dir()} does not fit the model: {'; '.join(differ[:3])}{more}: "
                        "resume with the run's own model settings (its config.yaml), or train the new model with a new "
                        "--output")


def epochs_done(config: TrainConfig) -> int:
    """Epochs a resumed run has already trained (0 for a new run)."""
    last = last_checkpoint(config, config.output_dir())
    return checkpoint.read_state(Path(last) / checkpoint.STATE_FILE)["epoch"] if last else 0
