"""A model whose inputs are named after columns of its files is fed by those names.

``keras.Input(name="age")`` and ``keras.Input(name="tokens")`` over a parquet, CSV or TFRecord dataset with the
columns ``age``, ``tokens`` and ``label``: the run reads each input from its column of the same name, as
``--inputs age tokens`` would. ``--inputs`` stays for renaming (``NAME=COLUMN``) and for inputs whose names are
not columns; ``--feature-columns`` and ``--text-column`` keep their meaning (one features input).

The model's input names are read by building the user's model once before the data is read (the data's shapes
are what reading decides, so the build is given one features input of the columns' count). A model function
that cannot be built that way (it reads its shapes off the data, say) keeps the one-features-input reading, and
its refusal names ``--inputs``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from app.config import TrainConfig
    from app.data.files import Located

log = logging.getLogger(__name__)

# The file formats whose rows are columns by name.
COLUMNS = ("parquet", "csv", "tfrecord")


def by_name(config: "TrainConfig", loc: Optional["Located"], names: Optional[list[str]] = None) -> "TrainConfig":
    """``config`` with ``inputs`` set to the model's input names when every one is a column of ``loc``'s files.

    ``names``: the input names of a model already in hand (a trained model evaluated); else the model function's
    model is built to read them."""
    from app import registry

    builtin = names is None and isinstance(config.model, str) and config.model in registry.MODELS
    if loc is None or loc.format not in COLUMNS or config.inputs or config.feature_columns or config.text_column \
            or builtin:
        return config
    from app.data.local_files import file_schema

    columns = [name for name in file_schema(loc).names if name != config.label_column]
    names = names if names is not None else model_input_names(config, len(columns))
    # One input named like the data's only column: the usual features input reads it as well.
    if not names or not set(names) <= set(columns) or names == columns == names[:1]:
        return config
    log.info("inputs read by name: %s (columns of %s; --inputs NAME=COLUMN renames)", ", ".join(names), loc.uri)
    return config.model_copy(update={"inputs": list(names)})


def model_input_names(config: "TrainConfig", width: int) -> Optional[list[str]]:
    """The names of the model's ``keras.Input``s, built for one features input of ``width`` values; None when it
    cannot be built so (its shapes come from the data) or has no named inputs."""
    from app.data.arrays import DataFacts
    from app.training.model import build_model

    task = "classification" if config.task == "auto" else config.task
    facts = DataFacts(feature_shape=(max(width, 1),), task=task,
                      num_classes=None if task == "regression" else (config.num_classes or 2),
                      num_train_rows=0, num_val_rows=0)
    try:
        model = build_model(config, facts)
    except Exception as e:  # the data decides its shapes: the run reads it as one features input
        log.debug("the model's input names are not known before the data is read: %s", e)
        return None
    names = [getattr(t, "name", None) for t in (getattr(model, "inputs", None) or [])]
    return names if names and all(names) else None
