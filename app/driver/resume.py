"""--resume, decided in the driver before any worker starts: which checkpoint the run goes on from, whether
it fits the model, and what changed since (workers, global batch, LR, epochs).

A run's checkpoints are in one of two places: Ray Train's storage (``<storage>/<ray run name>/checkpoint_*``,
the Ray backend) or ``<output>/checkpoint`` (the local and parameter-server backends). Both hold the same
``tf.train.Checkpoint`` of model and optimizer plus state.json (app.training.checkpoint), so a run goes on
from the newer of the two on whichever backend it is resumed with: a local run continued on Ray, a Ray run
continued locally. How the LR schedule goes on: app.training.lr_position.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from app.backend import backend_of, runs_on_ray
from app.errors import UserError
from app.training import checkpoint

if TYPE_CHECKING:
    from app.config import TrainConfig
    from app.data.plan import EpochPlan
    from app.training.optim import LrPlan

log = logging.getLogger(__name__)

RUN_NAME_FILE = "ray_run_name"  # <output>/ray_run_name: the Ray Train run whose storage holds the checkpoints
RESULT_FILE = "result.json"  # app.driver.outputs writes it when a run finishes


@dataclass(frozen=True)
class Start:
    """The checkpoint a resumed run goes on from."""

    state: dict[str, Any]  # its state.json
    ray_train: bool  # True: in Ray Train's storage; False: in <output>/checkpoint
    where: str  # for people
    path: Optional[str]  # what a process on this machine restores from; None if remote
    ray_run: Optional[str] = None  # the Ray Train run it belongs to (ray_train)

    @property
    def epoch(self) -> int:
        return self.state["epoch"]

    @property
    def position(self) -> tuple[int, int]:
        """(epochs done, steps done in the next one): a checkpoint inside an epoch is after its epoch's start."""
        return self.state["epoch"], self.state.get("step", 0)


def check(config: "TrainConfig", weights: Sequence[tuple[str, tuple[int, ...]]],
          global_batch: Optional[int] = None) -> Optional[Start]:
    """The checkpoint ``config`` (a --resume) goes on from, checked; None when the run has none yet.

    ``weights``: the model's trainable weights as preflight built them, (path, shape) in order; ``global_batch``:
    the resumed run's. Each refusal is one line, before an output or a worker is touched.
    """
    out = config.output_dir()
    start = latest(config)
    if start is None:
        if (out / RESULT_FILE).is_file():
            raise UserError(f"cannot resume {str(out)!r}: it finished, but none of its checkpoints is left")
        return None
    if start.epoch >= config.epochs:
        raise UserError(
            f"the run in {str(out)!r} already finished its {start.epoch} epochs: nothing to resume; pass --epochs N "
            f"(more than {start.epoch}) with --resume to train it further, use a new --output, or --overwrite to "
            "train it again from scratch"
        )
    backend = backend_of(config)
    if start.ray_train and backend.parameter_servers:
        raise UserError(f"the newest checkpoint of {str(out)!r} is a Ray Train one ({start.where}); "
                        "--strategy parameter-server goes on only from checkpoints in <output>/checkpoint")
    if start.path is None and not backend.on_ray:
        raise UserError(f"the newest checkpoint of {str(out)!r} is in remote storage ({start.where}): "
                        "continue it with --backend ray")
    step, before = start.state.get("step", 0), (start.state.get("plan") or {}).get("global_batch")
    if step and global_batch is not None and before != global_batch:
        # Step s of the epoch is rows [s x G, (s + 1) x G) of its order: another G has no step there.
        raise UserError(f"the newest checkpoint of {str(out)!r} is inside epoch {start.epoch + 1}, after {step} steps "
                        f"of a global batch of {before}; this run's is {global_batch}: resume with --global-batch "
                        f"{before} (at any worker count that splits it)")
    _check_weights(start, weights, out)
    return start


def latest(config: "TrainConfig") -> Optional[Start]:
    """The run's newest checkpoint (the highest epoch) among Ray Train's and <output>/checkpoint's."""
    found = [s for s in (_ray_latest(config), _local_latest(config.output_dir())) if s is not None]
    if not found:
        return None
    own = backend_of(config).ray_train
    return max(found, key=lambda s: (s.position, s.ray_train == own))  # a tie: this backend's own


def _local_latest(out: Path) -> Optional[Start]:
    located = checkpoint.located(out / checkpoint.LOCAL_DIR) if (out / checkpoint.LOCAL_DIR).is_dir() else None
    if located is None:
        return None
    state_file = located[0]
    prefix = str(state_file)[: -len(checkpoint.STATE_SUFFIX)]
    return Start(checkpoint.read_state(state_file), False, prefix, prefix)


def _ray_latest(config: "TrainConfig") -> Optional[Start]:
    """The complete checkpoint furthest on (epoch, then step) in the recorded Ray Train run's storage (read with pyarrow,
    local or remote; no Ray needed)."""
    import pyarrow.fs as pafs

    out = config.output_dir()
    if not (out / RUN_NAME_FILE).is_file():
        return None
    name = (out / RUN_NAME_FILE).read_text().strip()
    storage = config.storage_path or str(out / "ray")
    if "://" in storage:
        fs, root = pafs.FileSystem.from_uri(storage)
    else:
        fs, root = pafs.LocalFileSystem(), str(Path(storage).resolve())
    run_dir = f"{root.rstrip('/')}/{name}"
    entries = fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True))
    best = None
    for entry in entries:
        if entry.type != pafs.FileType.Directory or not entry.base_name.startswith("checkpoint_"):
            continue
        try:  # a checkpoint being written has no state.json yet (it is written last)
            with fs.open_input_stream(f"{entry.path}/{checkpoint.STATE_FILE}") as f:
                state = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if best is None or (state["epoch"], state.get("step", 0)) > (best[0]["epoch"], best[0].get("step", 0)):
            best = state, entry.path
    if best is None:
        return None
    state, path = best
    local = isinstance(fs, pafs.LocalFileSystem)
    where = path if local else f"{storage.rstrip('/')}/{name}/{path.rsplit('/', 1)[-1]}"
    return Start(state, True, where, path if local else None, ray_run=name)


def _trainable_shapes(start: Start) -> list[tuple[int, ...]]:
    """The checkpoint's trainable weight shapes, from its index file alone (copied here when it is remote)."""
    if start.path is not None:
        prefix = str(Path(start.path) / checkpoint.TRAIN_STATE) if start.ray_train else start.path
        # Every byte read once here: a damaged checkpoint is refused before the run rewrites its outputs.
        checkpoint.verify(prefix)
        return checkpoint.trainable_shapes(prefix)
    import pyarrow.fs as pafs

    with tempfile.TemporaryDirectory() as tmp:
        index = f"{checkpoint.TRAIN_STATE}.index"
        pafs.copy_files(f"{start.where}/{index}", str(Path(tmp) / index))
        return checkpoint.trainable_shapes(Path(tmp) / checkpoint.TRAIN_STATE)


def _check_weights(start: Start, weights: Sequence[tuple[str, tuple[int, ...]]], out: Path) -> None:
    saved = _trainable_shapes(start)
    if not saved:  # not a checkpoint of a built optimizer: the workers' restore says what is wrong
        return
    differ = [f"{name} is {shape_text(saved[i])} in the checkpoint, {shape_text(shape)} in the model"
              for i, (name, shape) in enumerate(weights[: len(saved)]) if tuple(saved[i]) != tuple(shape)]
    differ += [f"{name} {shape_text(shape)} is not in the checkpoint" for name, shape in weights[len(saved):]]
    differ += [f"the checkpoint's weight #{i + 1} {shape_text(saved[i])} is not in the model"
               for i in range(len(weights), len(saved))]
    if differ:
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise UserError(
            f"the checkpoint of epoch {start.epoch} in {str(out)!r} does not fit the model: {'; '.join(differ[:3])}"
            f"{more}: resume with the run's own model settings (its config.yaml), or train the new model with a new "
            "--output"
        )


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def plan_line(config: "TrainConfig", start: Optional[Start], plan: "EpochPlan", lr: "LrPlan") -> str:
    """What a resume goes on from and what changed since, for the plan printed at the start."""
    out = config.output_dir()
    if start is None:
        return f"resume: {out} has no checkpoint yet: the run starts at epoch 1"
    state = start.state
    before_config, before_plan, before_lr = state.get("config", {}), state.get("plan", {}), state.get("lr_plan", {})
    finished = before_config.get("epochs", config.epochs) <= start.epoch
    head = (f"resume: the finished run {out.name} ({_epochs(start.epoch)}) goes on to {config.epochs} epochs"
            if finished else f"resume: run {out.name} goes on from epoch {start.epoch} of {config.epochs}"
            + (f", {start.position[1]} steps into epoch {start.epoch + 1}" if start.position[1] else ""))
    steps = (state.get("history") or [{}])[-1].get("optimizer_steps")
    carried = f"optimizer state ({steps} steps taken) carries over" if steps is not None else \
        "optimizer state carries over"
    before = _setup(runs_on_ray(before_config.get("backend", "ray")), before_plan.get("workers"),
                    before_plan.get("replicas_per_worker", 1), before_plan.get("global_batch"),
                    before_lr.get("peak_lr"), before_plan.get("steps"))
    now = _setup(runs_on_ray(config.backend), plan.num_workers, plan.replicas_per_worker, plan.global_batch,
                 lr.peak_lr, plan.steps)
    if before == now:
        return f"{head} on the same {now}; {carried}; from {start.where}"
    schedule = "the LR schedule re-planned for the new steps per epoch goes on from that epoch's end"
    return f"{head}: it ran on {before}, now {now}; {carried}, {schedule}; from {start.where}"


def _setup(on_ray: bool, workers, replicas, global_batch, peak_lr, steps) -> str:
    who = f"{workers} worker{'s' if workers != 1 else ''}" if on_ray else \
        f"{replicas} local replica{'s' if replicas != 1 else ''}"
    lr = f"{peak_lr:.4g}" if isinstance(peak_lr, (int, float)) else "as compiled"  # None: a compiled schedule
    return f"{who} (global batch {global_batch}, lr {lr}, {steps} steps per epoch)"


def _epochs(n: int) -> str:
    return f"{n} epoch{'s' if n != 1 else ''}"
