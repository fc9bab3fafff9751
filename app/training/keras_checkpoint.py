"""A run's checkpoint by Keras's fit, written by rank 0 and read by every worker (and the driver): the model's
variables and every optimizer's state as one ``tf.train.Checkpoint``, the epoch's state (state.json), and the model
as a .keras file beside them."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from app.training import zero_state
from app.training.checkpoint import MODEL_FILE, STATE_FILE, TRAIN_STATE
from app.training.zero import ShardedOptimizer

if TYPE_CHECKING:
    from app.training.tensor_optimizer import Split

log = logging.getLogger(__name__)


def checkpoint_of(model, optimizers: Optional[list] = None) -> Any:
    """Every variable of the model and every optimizer it holds (or ``optimizers``: their unsharded copies, in the
    same order), as one ``tf.train.Checkpoint``.

    By the model's ``variables`` (in their order: the same model function builds them in the same order), not by
    the model object: Keras 3 layers do not expose their variables to TensorFlow's object graph, so
    ``Checkpoint(model=model)`` would keep only what the optimizers reach (the trainable weights), and lose
    batch-norm statistics and a seed generator's state."""
    import tensorflow as tf

    from app.training.keras_sync import optimizers_of

    return tf.train.Checkpoint(variables=list(model.variables),
                               optimizers=optimizers if optimizers is not None else optimizers_of(model))


def read_state(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / STATE_FILE).read_text())


def save(model, directory: str | Path, state: dict[str, Any], parts: Optional[Path] = None,
         split: Optional["Split"] = None) -> None:
    """A whole checkpoint: the model and its optimizers, then state.json (the epoch, the history). ``parts``: the
    sharded optimizers' state as app.training.zero_state wrote it, which the checkpoint takes instead; ``split``:
    a tensor-parallel model's, unsplit."""
    import tensorflow as tf

    if split is not None:
        split.checkpoint(gather=True).write(str(Path(directory) / TRAIN_STATE))
    elif parts is None:
        checkpoint_of(model).write(str(Path(directory) / TRAIN_STATE))
    else:
        shutil.move(str(parts), str(Path(directory) / zero_state.DIRECTORY))
        tf.train.Checkpoint(variables=list(model.variables)).write(str(Path(directory) / TRAIN_STATE))
    if split is None and parts is None:
        _save_model(model, Path(directory) / MODEL_FILE)
    (Path(directory) / STATE_FILE).write_text(json.dumps(state, indent=1))


def weights_of(sharded: Sequence) -> Any:
    """The model's weights cut over the workers (stage 3: app.training.zero_weights), else None."""
    return next((s.weights for s in sharded if hasattr(s, "weights")), None)


class Writer:
    """A run's checkpoint as the workers make it: every worker's part gathered (``gather``: a sharded optimizer's
    state, stage 3's weights each in turn), then rank 0 writes it (``write``) with the whole weights in place."""

    def __init__(self, model, state: dict[str, Any], sharded: Sequence, split: Optional["Split"], rank: int):
        self.model, self.state, self.sharded, self.split, self.rank = model, state, sharded, split, rank
        self.weights = weights_of(sharded)
        self.held: dict[str, Any] = {}

    def gather(self) -> None:
        """Every worker, before rank 0 writes the checkpoint."""
        self.held["parts"] = zero_state.gather(self.sharded, self.rank)
        if self.weights is not None:  # kept by rank 0 to write
            self.held["weights"] = self.weights.gathered(self.rank)

    def write(self, directory: str) -> None:
        weights = self.weights.whole(self.held.pop("weights"), keep=False) if self.weights is not None else None
        with weights if weights is not None else contextlib.nullcontext():
            save(self.model, directory, self.state, self.held.pop("parts", None), self.split)


# Whether a model's .keras file loads back, learnt at its first checkpoint: the same classes save the same way at
# every later one, which then skips the load (a second model and optimizer state in rank 0's memory, and seconds
# the other workers wait for at their next all-reduce).
_LOADS_BACK: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _save_model(model, path: Path) -> None:
    """The model as a .keras file beside its checkpoint, for jobs/evaluate.py and jobs/predict.py --checkpoint (a
    stopped run has no model.keras of its own yet). A model Keras cannot save (a class it cannot rebuild) is left
    out: its checkpoint still resumes, and evaluate names what to do instead. A sharded or split model's optimizer
    state is not Keras's layout: none is written for them."""
    import warnings

    import keras

    if _LOADS_BACK.get(model) is False:
        return
    try:
        model.save(path)
        if model not in _LOADS_BACK:
            with warnings.catch_warnings():  # Keras's note that an unbuilt optimizer skips the saved one's variables
                warnings.simplefilter("ignore", UserWarning)
                keras.models.load_model(path)  # what evaluate does with it: a file it cannot load is not written
            _LOADS_BACK[model] = True
    except Exception as e:  # whatever Keras's serialisation raises for a model it cannot save or load back
        path.unlink(missing_ok=True)
        _LOADS_BACK.setdefault(model, False)  # a model that loaded back once keeps trying (a full disk passes)
        log.debug("no %s in the checkpoint: %s", path.name, e)


def restore(model, directory: str | Path, sharded: Sequence[ShardedOptimizer] = (),
            split: Optional["Split"] = None) -> dict[str, Any]:
    """Weights and every optimizer's state from a checkpoint directory, sharded or not whichever wrote it (a sharded
    optimizer keeps its part; a split model cuts them into its shards); its state.json."""
    import tensorflow as tf

    from app.training.keras_sync import optimizers_of

    path = str(Path(directory) / TRAIN_STATE)
    if split is not None:
        split.checkpoint(gather=False).read(path).assert_existing_objects_matched()
        split.optimizer.scatter()
        return read_state(directory)
    if zero_state.written(directory):
        tf.train.Checkpoint(variables=list(model.variables)).read(path).assert_existing_objects_matched()
        zero_state.read(directory, optimizers_of(model), sharded)
        return read_state(directory)
    # An unsharded checkpoint: a sharded optimizer reads it whole into an unsharded copy, then keeps its part.
    twins = {id(s.optimizer): s.twin() for s in sharded}
    optimizers = [twins[id(o)].optimizer if id(o) in twins else o for o in optimizers_of(model)]
    checkpoint_of(model, optimizers).read(path).assert_existing_objects_matched()
    for s in sharded:
        s.take_from(twins[id(s.optimizer)])
    return read_state(directory)
