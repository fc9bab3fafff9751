"""What a checkpoint holds, and how it is written and restored.

A checkpoint directory holds:

- ``train_state.*``: a ``tf.train.Checkpoint`` of the model and the optimizer.
  It restores the optimizer exactly (momentum/Adam slots and ``iterations``,
  which is where the learning-rate schedule is), and restores into
  distributed variables under any strategy.
- ``model.keras``: the model alone, openable by ``keras.models.load_model`` in
  any process (what evaluation and export use).
- ``state.json``: epoch counter, the history so far, the LR and epoch plans,
  the seed the data order derives from, and the run config.

On the Ray path, rank 0 writes into a temporary directory and Ray Train
copies it into storage; a checkpoint becomes visible to ``get_checkpoint()``
only after the copy is registered, so a crash mid-save leaves the previous one
in place. The local path gets the same guarantee from
``tf.train.CheckpointManager`` (``LocalCheckpoints``), which moves its pointer
file atomically after the checkpoint is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import UserError

if TYPE_CHECKING:
    import keras

MODEL_FILE = "model.keras"
STATE_FILE = "state.json"
TRAIN_STATE = "train_state"


@dataclass
class Progress:
    """Where a run is: what a checkpoint's state.json carries besides the weights."""

    epoch: int = 0  # epochs completed
    attempt: int = 0  # 0 for the first start; +1 for every restart or resume
    history: list[dict[str, Any]] = field(default_factory=list)
    worker_nodes: list[str] = field(default_factory=list)  # Ray node id of each rank, this attempt
    step: int = 0  # steps done in the epoch after ``epoch`` (a checkpoint inside it: --checkpoint-every-steps)
    # The run's size since each (re)start that changed it: {time, workers, epoch, step[, joined, lost]}.
    workers_over_time: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def resumed_from(cls, state: dict[str, Any], current: "Progress | None" = None) -> "Progress":
        """The progress a checkpoint records, continued by a new attempt (whose placement is ``current``'s)."""
        return cls(
            state["epoch"],
            state.get("attempt", 0) + 1,
            state["history"],
            current.worker_nodes if current else [],
            state.get("step", 0),
            state.get("workers_over_time", []),
        )

    def sized(self, workers: int, nodes_before: "list[str] | None" = None) -> str | None:
        """Record this attempt's size if it is a new one; the console's line for a resize (None: no resize)."""
        last = self.workers_over_time[-1]["workers"] if self.workers_over_time else None
        if last == workers:
            return None
        entry = {"time": time.time(), "workers": workers, "epoch": self.epoch + 1, "step": self.step}
        self.workers_over_time.append(entry)
        if last is None:
            return None
        before, now = set(nodes_before or []), set(self.worker_nodes)
        entry["joined"], entry["lost"] = sorted(now - before), sorted(before - now)
        causes = [f"node {', '.join(n[:12] for n in entry[k])} {k}" for k in ("lost", "joined") if entry[k]]
        return f"resized {last} -> {workers} workers" + (f": {'; '.join(causes)}" if causes else "")

    def position(self) -> str:
        """Where training goes on, the one naming of a checkpoint on the console: "epoch E step S" (step 0: the
        epoch's start, after an end-of-epoch checkpoint of epoch E-1)."""
        return f"epoch {self.epoch + 1} step {self.step}"

    def record(self, metrics: dict[str, Any]) -> None:
        metrics["attempt"] = self.attempt
        self.history.append(metrics)
        self.epoch, self.step = metrics["epoch"], 0

    def state(self, *, config, lr_plan, plan, task: str = "classification") -> dict[str, Any]:
        state = {
            "epoch": self.epoch,
            "task": task,
            "attempt": self.attempt,
            "history": self.history,
            "lr_plan": lr_plan.as_dict(),
            "plan": plan.as_dict(),
            "data_seed": config.seed,  # the data order is a function of (seed, epoch)
            "config": config.model_dump(mode="json"),
        }
        if self.worker_nodes:
            state["worker_nodes"] = self.worker_nodes
        if self.step:
            state["step"] = self.step
        if self.workers_over_time:
            state["workers_over_time"] = self.workers_over_time
        return state


def save(directory: str | Path, model: "keras.Model", optimizer, state: dict[str, Any]) -> None:
    import tensorflow as tf

    directory = Path(directory)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(directory / TRAIN_STATE))
    model.save(directory / MODEL_FILE)
    # state.json last: its presence marks a complete checkpoint.
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))


def load_state(directory: str | Path) -> dict[str, Any]:
    return read_state(Path(directory) / STATE_FILE)


def read_state(file: str | Path) -> dict[str, Any]:
    """A checkpoint's state (epoch, config, task, ...); a truncated or foreign file as one line naming it."""
    try:
        state = json.loads(Path(file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint state {str(file)!r} cannot be read ({type(e).__name__}: {e}): the checkpoint is "
                        "incomplete or damaged; give an earlier checkpoint, or train anew without --resume") from None
    if not isinstance(state, dict) or "epoch" not in state:
        raise UserError(f"checkpoint state {str(file)!r} holds no epoch: it is not a checkpoint this product wrote")
    return state


@contextlib.contextmanager
def _readable(prefix: str | Path, doing: str = "read"):
    """TensorFlow's errors on a damaged checkpoint (truncated, foreign, another model's) as one line naming it."""
    import tensorflow as tf

    try:
        yield
    except (tf.errors.OpError, ValueError, IndexError) as e:  # IndexError: a data file cut short
        message = " ".join((e.message if isinstance(e, tf.errors.OpError) else str(e)).split())[:300]
        raise UserError(f"checkpoint {str(prefix)!r} cannot be {doing} ({message}): it is damaged, incomplete or "
                        "another model's; give an earlier checkpoint, or train anew without --resume") from None


def _read_into(checkpoint: Any, prefix: str) -> None:
    with _readable(prefix, "restored"):
        checkpoint.read(prefix).assert_existing_objects_matched()


def restore(directory: str | Path, model: "keras.Model", optimizer) -> dict[str, Any]:
    """Load weights and optimizer state into already-built objects; return state.json."""
    import tensorflow as tf

    _read_into(tf.train.Checkpoint(model=model, optimizer=optimizer), str(Path(directory) / TRAIN_STATE))
    return load_state(directory)


def verify(prefix: str | Path) -> None:
    """Read every tensor of the checkpoint at ``prefix`` (TensorFlow checks each one's length and checksum as it
    reads it): a truncated or damaged file as one line, before anything is restored or written."""
    import tensorflow as tf

    with _readable(prefix):
        reader = tf.train.load_checkpoint(str(prefix))
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)


def trainable_shapes(prefix: str | Path) -> list[tuple[int, ...]]:
    """The shapes of the model's trainable weights in a checkpoint (``prefix``: its ``.index`` file, no data read)."""
    import tensorflow as tf

    from app import internals

    with _readable(prefix):
        listed = tf.train.list_variables(str(prefix))
    return internals.checkpoint_trainable_shapes(listed)


# --- the local backend: tf.train.CheckpointManager, the model file and state beside each checkpoint ---


class LocalCheckpoints:
    """``root/epoch-N``: the manager's checkpoint, plus ``epoch-N.keras`` and ``epoch-N.state.json``.

    The extras are written first and the manager's pointer (``root/checkpoint``,
    replaced atomically) moves last, so a crash at any moment leaves the latest
    checkpoint complete, extras included.
    """

    def __init__(self, root: str | Path, model: "keras.Model", optimizer, keep: int):
        import tensorflow as tf

        self.root, self.model = Path(root), model
        self.manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model, optimizer=optimizer), str(self.root), max_to_keep=keep,
            checkpoint_name="epoch",
        )

    def save(self, state: dict[str, Any]) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        prefix = str(self.root / f"epoch-{state['epoch']}")
        self.model.save(prefix + MODEL_SUFFIX)
        partial = Path(prefix + STATE_SUFFIX + ".partial")
        partial.write_text(json.dumps(state, indent=1))
        os.replace(partial, prefix + STATE_SUFFIX)
        saved = self.manager.save(checkpoint_number=state["epoch"])
        kept = set(self.manager.checkpoints)
        for extra in self.root.glob(f"epoch-*{STATE_SUFFIX}"):
            if str(extra)[: -len(STATE_SUFFIX)] not in kept:
                extra.unlink(missing_ok=True)
                Path(str(extra)[: -len(STATE_SUFFIX)] + MODEL_SUFFIX).unlink(missing_ok=True)
        return saved

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore(self) -> dict[str, Any] | None:
        """Load the latest checkpoint into the model and optimizer; its state, or None when there is none."""
        if self.latest is None:
            return None
        _read_into(self.manager.checkpoint, self.latest)
        return read_state(self.latest + STATE_SUFFIX)


MODEL_SUFFIX = ".keras"
STATE_SUFFIX = ".state.json"
LOCAL_DIR = "checkpoint"  # <output>/checkpoint: the parameter-server backend's LocalCheckpoints, Keras's fit's local runs'


def located(path: str | Path) -> tuple[Path, Path] | None:
    """(state.json, model file) of the checkpoint ``path`` names, or None when it names none.

    ``path`` is a Ray Train checkpoint directory (state.json and model.keras in it; a run by Keras's fit leaves
    one in its output directory's checkpoint/), a
    ``LocalCheckpoints`` directory (its latest checkpoint, by the manager's pointer file),
    one of its checkpoints (``.../checkpoint/epoch-3``), or a local or parameter-server
    run's output directory (its latest checkpoint).
    """
    path = Path(path)
    for directory in (path, path / LOCAL_DIR):  # a checkpoint directory, or the one a Keras-fit run left in its output
        if (directory / STATE_FILE).is_file():
            return directory / STATE_FILE, directory / MODEL_FILE
    if Path(str(path) + STATE_SUFFIX).is_file():
        return Path(str(path) + STATE_SUFFIX), Path(str(path) + MODEL_SUFFIX)
    for root in (path, path / LOCAL_DIR):
        if (root / "checkpoint").is_file():  # tf.train.CheckpointManager's pointer file
            import tensorflow as tf

            latest = tf.train.latest_checkpoint(str(root))
            return located(latest) if latest else None
    return None
