"""A trained model applied to raw rows: what each actor of a prediction pool holds (and the local backend, one).

A raw batch (pyarrow) -> the features exactly as in training (app.data.blocks.features with the run's Spec) ->
the model in inference mode -> the output columns, with the columns kept from the input beside them:

| task           | columns                                                                             |
|----------------|-------------------------------------------------------------------------------------|
| classification | ``prediction`` (the class id), ``probabilities`` (one per class; softmax of logits)   |
| binary         | ``prediction`` (0/1), ``probabilities`` ([1 - p, p]; sigmoid of a logit)              |
| regression     | ``prediction`` (the value; a list for several outputs)                              |

A run whose labels were class names (its config's ``class_names``) predicts the name, not the id.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np

from app.data.blocks import features

if TYPE_CHECKING:
    import pyarrow as pa

    from app.data.schema import Spec

PREDICTION, PROBABILITIES = "prediction", "probabilities"


@dataclass(frozen=True)
class Recipe:
    """Everything a predictor needs besides the model: small and picklable (it goes to every actor)."""

    spec: "Spec"  # the features, as in training, reshaped to the model's input
    task: str  # classification, binary or regression
    from_logits: bool
    keep: tuple[str, ...]  # input columns written beside the predictions
    batch_size: int  # rows per model call
    cpus: float = 0  # an actor's CPUs: TensorFlow's compute threads (0: leave TensorFlow's own, as in the driver)
    class_names: tuple[str, ...] = ()  # the run's labels were these names (its config's class_names): predict names


class Predictor:
    """``Predictor(model, recipe)(raw batch) -> output batch``; ``model`` is a .keras file or its bytes (an actor
    may run on a node that cannot see the driver's files)."""

    def __init__(self, model: Union[str, Path, bytes], recipe: Recipe):
        if recipe.cpus:
            from app.training.strategy import set_thread_counts

            set_thread_counts(recipe.cpus)  # before TensorFlow initialises: an actor's own process
        from app.training import model_file

        self.recipe = recipe
        if isinstance(model, bytes):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.keras")
                Path(path).write_bytes(model)
                self.model = model_file.load(path, compile=False)
        else:
            self.model = model_file.load(model, compile=False)

    def __call__(self, table: "pa.Table") -> "pa.Table":
        import pyarrow as pa

        r = self.recipe
        x = features(table, r.spec)  # an array, or a dict of them (a model of named inputs)
        rows = lambda i: {k: v[i : i + r.batch_size] for k, v in x.items()} if isinstance(x, dict) \
            else x[i : i + r.batch_size]  # noqa: E731
        # predict_on_batch: one traced function for every batch of a size (the last, smaller one traces once more).
        out = [np.asarray(self.model.predict_on_batch(rows(i))) for i in range(0, table.num_rows, r.batch_size)]
        outputs = output_columns(np.concatenate(out) if out else np.zeros((0, 1), np.float32), r.task, r.from_logits,
                                 r.class_names)
        return pa.table({**outputs, **{name: table.column(name) for name in r.keep}})


def output_columns(out: np.ndarray, task: str, from_logits: bool, class_names: tuple[str, ...] = ()
                   ) -> dict[str, "pa.Array"]:
    """The model's outputs (n, k) as columns: class (by name, given the classes' names) and probabilities, or the
    value(s)."""
    import pyarrow as pa

    out = out.astype(np.float32, copy=False).reshape(len(out), -1)
    if task == "regression":
        value = out[:, 0] if out.shape[1] == 1 else out
        return {PREDICTION: _column(value)}
    if task == "binary":
        p = 1 / (1 + np.exp(-out[:, 0])) if from_logits else out[:, 0]
        probabilities = np.stack([1 - p, p], axis=1)
    else:
        probabilities = _softmax(out) if from_logits else out
    ids = probabilities.argmax(axis=1).astype(np.int64)
    named = len(class_names) == probabilities.shape[1]  # a run's recorded names, one per output
    predicted = pa.array(np.asarray(class_names, dtype=object)[ids]) if named else pa.array(ids)
    return {PREDICTION: predicted, PROBABILITIES: _column(probabilities)}


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _column(values: np.ndarray) -> "pa.Array":
    import pyarrow as pa

    if values.ndim == 1:
        return pa.array(values)
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
