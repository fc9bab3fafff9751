"""app.fit's inputs for a model's own fit, on the driver: a built-in model sized by the arrays; what Keras's fit would
refuse or pass into the graph, refused in one line before any worker starts (labels, the model's input shape,
validation of another structure or shape), validation data read as fit reads it, and a path of files or a
``ray.data.Dataset`` checked and described for the workers (app.data.keras_stream) or, on the local backend, read
into arrays."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from app.backend import backend_of
from app.data import keras_inputs, keras_stream
from app.data.arrays import Moments
from app.data.checks import check_class_count
from app.data.class_names import decided
from app.errors import UserError
from app.training import default_compile

STEPS = ("train_step", "test_step", "compute_loss", "compute_metrics")  # what a model may override


def overrides_step(model) -> list[str]:
    import keras

    return [n for n in STEPS if getattr(type(model), n) is not getattr(keras.Model, n)]


def builtin_for_arrays(name: str, x: Any, y: Any, fields: dict[str, Any], validation_split: float) -> Callable[[], Any]:
    """A built-in model (``mlp``, ``cnn``, ``transformer``) as a function of no arguments, for arrays ``x``, ``y``:
    its input shape x's, its outputs one per class of integer labels (their largest id + 1, at least 2), else one per
    target, the mlp's standardisation the moments of x's training rows (those ``validation_split`` leaves, as Keras
    cuts it), and float targets' moments over those rows its output's units; the model's options
    (``hidden_units``, ...) taken out of ``fields``, and its own optimizer default (registry.MODEL_OPTIMIZERS) put in
    where none is given."""
    import functools
    import inspect

    from app import registry
    from app.training.model import BUILTIN_OPTIONS, check_options, target_moments

    fn = registry.resolve(name, registry.MODELS)
    labels = np.asarray(y)
    if labels.dtype.kind in "iub" and labels.shape[1:] in ((), (1,)):
        outputs = max(2, int(labels.max()) + 1) if labels.size else 2
        check_class_count("y", outputs - 1, len(labels), "give y as floats (y.astype('float32')) if they are numbers "
                          "to predict (a price, a count)", model=name)
    else:
        outputs = int(np.prod(labels.shape[1:])) if labels.ndim > 1 else 1
    takes = inspect.signature(fn).parameters
    options = {k: fields.pop(k) for k in BUILTIN_OPTIONS if k in fields}
    check_options(fn, name, list(options))
    for k, v in registry.MODEL_OPTIMIZERS.get(name, {}).items():
        fields.setdefault(k, v)
    if "feature_mean" in takes and (moments := Moments.of_fit_rows(x, validation_split)) is not None:
        options.update(feature_mean=moments.mean, feature_variance=moments.variance)
    if "target_mean" in takes and labels.dtype.kind == "f" and labels.ndim <= 2 and labels.size and (
            targets := Moments.of_fit_rows(labels.reshape(len(labels), -1), validation_split)) is not None:
        options.update(target_moments(targets))
    return functools.partial(fn, input_shape=tuple(np.shape(x)[1:]), num_outputs=outputs, **options)


def check_labels(model, train, function: str = "") -> None:
    """What Keras's fit refuses at its first step (ValueError: None values not supported), refused before any worker
    starts: a loss given to compile, Keras's own step and loss computation, and batches with no labels."""
    import keras

    _, y, _ = keras.utils.unpack_x_y_sample_weight(train.first_batch())
    own = set(overrides_step(model))
    from app.training.keras_sync import optimizers_of

    if "train_step" in own and not getattr(model, "compiled", False) and not optimizers_of(model):
        raise UserError(f"the model overrides train_step but was never compiled, so it has no optimizer (Keras's fit "
                        f"refuses it too): call compile(optimizer=...) in {function or 'the model function'} before it returns "
                        f"the {type(model).__name__}")
    if y is None and getattr(model, "loss", None) is not None and not {"train_step", "compute_loss"} & own:
        raise UserError("the model is compiled with a loss but x has no labels (y), which Keras's fit refuses too: "
                        "give y, or a dataset of (x, y) elements")
    if y is None or own & {"train_step", "compute_loss"} or not getattr(train, "counted", True) or \
            getattr(train, "streamed", False):
        return
    # The rows Keras's fit would pass straight into the graph: a NaN label, a class id outside the model's outputs
    # (a sparse cross-entropy reads any id; on CPU an id past the end is a graph error from a worker).
    _, y, _ = keras.utils.unpack_x_y_sample_weight(train.rows)
    import tensorflow as tf

    for labels in tf.nest.flatten(y):
        labels = np.asarray(labels)
        if labels.dtype.kind == "f" and np.isnan(labels).any():
            rows = np.flatnonzero(np.isnan(labels.reshape(len(labels), -1)).any(axis=1))
            raise UserError(f"labels are NaN in {len(rows)} row(s) (row {', '.join(map(str, rows[:5]))}"
                            f"{', ...' if len(rows) > 5 else ''}): Keras's fit would train on them; drop or fill them")
    if len(tf.nest.flatten(y)) == 1:
        _check_loss_kind(model, np.asarray(tf.nest.flatten(y)[0]))
    classes = _sparse_classes(model)
    if classes and len(tf.nest.flatten(y)) == 1:
        labels = np.asarray(tf.nest.flatten(y)[0]).reshape(-1)
        bad = np.flatnonzero((labels < 0) | (labels >= classes) | (labels != np.round(labels)))
        if len(bad):
            raise UserError(f"class ids must be 0..{classes - 1} for the model's {classes} outputs; row(s) "
                            f"{', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''} hold "
                            f"{', '.join(str(labels[i]) for i in bad[:5])}")


def _check_loss_kind(model, labels: np.ndarray) -> None:
    """A categorical cross-entropy given the other form of labels (Keras's fit fails at its first step, on every
    worker): one line with the fix."""
    name = default_compile.loss_name(model)
    kind = name.lower().replace("categoricalcrossentropy", "categorical_crossentropy")
    one_hot = labels.ndim >= 2 and labels.shape[-1] > 1
    if "sparse_categorical" in kind and one_hot:
        raise UserError(f"loss {name} takes class ids, but the labels are one-hot ({labels.shape[-1]} columns): "
                        "compile with loss='categorical_crossentropy', or give the labels as class ids")
    if "categorical" in kind and "sparse" not in kind and not one_hot:
        raise UserError(f"loss {name} takes one-hot labels, but the labels are class ids: compile with "
                        "loss='sparse_categorical_crossentropy', or one-hot the labels")


def _sparse_classes(model) -> int:
    """The outputs of a one-output model compiled with a sparse categorical cross-entropy (0: another loss)."""
    if "sparse_categorical" not in default_compile.loss_name(model):
        return 0
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return 0
    return int(outputs[0].shape[-1] or 0) if outputs and len(outputs) == 1 else 0


def check_inputs(model, data, what: str) -> None:
    """Examples whose shape the model's one input cannot take (Keras would fail at the first step, on every worker:
    "Exception encountered when calling Sequential.call()"), refused before any worker starts. Only where Keras's
    own step feeds x to the model as it is (a Sequential or functional model of one input)."""
    import keras
    import tensorflow as tf

    if overrides_step(model) or type(model).__name__ not in ("Sequential", "Functional"):
        return
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):  # a Sequential built without an Input: it takes any shape
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data.first_batch())
    from app import internals

    names = internals.input_keys(model)
    if isinstance(x, dict) and (missing := [n for n in names if n not in x]):  # Keras: "Missing data for input"
        raise UserError(f"{what}: a dict keyed by {', '.join(map(repr, x))}, and the model's inputs are named "
                        f"{', '.join(map(repr, names))} ({', '.join(map(repr, missing))} missing): key x by the inputs' "
                        "names, or give one array for a model of one input")
    if len(inputs or ()) != 1 or tf.nest.is_nested(x):
        return
    expected, got = tuple(inputs[0].shape[1:]), tuple(np.shape(x)[1:])
    if len(expected) != len(got) or any(e is not None and e != g for e, g in zip(expected, got)):
        raise UserError(f"{what}: its examples have shape {got}, but the model's input takes "
                        f"{tuple(expected)}: give data of that shape, or build the model for {got}")


def validation(validation_data: Any, batch_size: int, steps: Optional[int], train) -> keras_inputs.KerasData:
    import keras
    import tensorflow as tf

    if isinstance(validation_data, tuple) and keras_inputs.is_array_input(validation_data[0]):
        vx, vy, vw = keras.utils.unpack_x_y_sample_weight(validation_data)
        val = keras_inputs.read(vx, vy, vw, batch_size=batch_size, shuffle=False, what="validation_data")
    elif isinstance(validation_data, (list, tuple)):
        raise UserError("validation_data must be (x_val, y_val) or (x_val, y_val, sample_weight_val) arrays, or a "
                        "tf.data.Dataset or PyDataset, as in Keras")
    else:
        val = keras_inputs.read(validation_data, batch_size=None, shuffle=False, steps_per_epoch=steps,
                                what="validation_data", rerun="files")
    if steps is not None and val.steps_per_epoch is None:
        val.steps_per_epoch = steps
    # The model's input must have the same structure; labels and weights may differ (sample or class weights
    # on the training data alone, as Keras takes them).
    (tx, ty, _), (vx, vy, _) = (keras.utils.unpack_x_y_sample_weight(r) for r in (train.rows, val.rows))
    try:
        tf.nest.assert_same_structure(tx, vx)
        tf.nest.assert_same_structure(ty, vy)
        if (ty is None) != (vy is None):
            raise ValueError("labels on one side only")
    except (ValueError, TypeError):
        raise UserError(f"validation_data's elements are {structure(val.rows)} but the training data's are "
                        f"{structure(train.rows)}: give both the same x (and y) structure") from None
    shapes = [(tuple(a.shape[1:]), tuple(b.shape[1:])) for a, b in zip(tf.nest.flatten(tx), tf.nest.flatten(vx))]
    if any(a != b for a, b in shapes):
        raise UserError(f"validation_data's x has examples of shape {', '.join(str(b) for _, b in shapes)} but the "
                        f"training data's {', '.join(str(a) for a, _ in shapes)}: give both the same shape")
    return val


def streamed_inputs(config, world: int, x: Any, y: Any, validation_data: Any, validation_split: float, sample_weight: Any,
              class_weight: Any, steps_per_epoch: Optional[int], validation_steps: Optional[int],
              batch_size: Optional[int], validation_batch_size: Optional[int], shuffle: Any, holdout: bool = False,
              default_batch: int = 32):
    """Paths and ray.data.Datasets (app.data.keras_stream): on Ray, each one's description and its Ray Dataset
    (by the name the workers ask for); on the local backend (one process), a path read here into arrays.
    ``holdout``: ``val_fraction`` was given, a seeded part of x held out for validation (the command line's
    --val-fraction, for a data set with no validation part). Returns (x, y, validation_data, datasets, x's columns,
    the config with the class names a label column of names was read with: app.data.class_names.decided)."""
    if holdout and validation_data is not None:
        raise UserError("val_fraction holds out a part of x for validation, and validation_data is given: pass one "
                        "or the other")
    given = [name for name, value in (("y", y), ("sample_weight", sample_weight), ("steps_per_epoch", steps_per_epoch),
                                      ("validation_steps", validation_steps))
             if value is not None]
    if given:
        raise UserError(f"{', '.join(given)} with a path or a ray.data.Dataset: its columns hold the labels "
                        f"(label_column={config.label_column!r}) and every epoch streams every row; leave "
                        f"{'it' if len(given) == 1 else 'them'} out")
    if validation_split:
        raise UserError("validation_split takes the last rows of arrays, as in Keras; with a path or a "
                        "ray.data.Dataset give validation_data (a path or a Dataset of the same columns)")
    for value, what in ((x, "x"), (validation_data, "validation_data")):
        if value is not None and not keras_stream.is_streamed(value):
            raise UserError(f"{what} is a {type(value).__name__} beside a streamed input: give x and "
                            "validation_data both as paths or ray.data.Datasets")
    if not backend_of(config).on_ray:
        if holdout:
            raise UserError("val_fraction with backend='local': the path is read into memory here; give "
                            "validation_split (its last rows) or validation_data")
        x, y, spec = keras_stream.read_local(x, config, "x")
        keras_stream.check_weighed(class_weight, y is not None, config)
        config = decided(config, spec)
        val = None if validation_data is None else keras_stream.read_local(validation_data, config,
                                                                            "validation_data")[:2]
        return x, y, val, {}, spec.features, config
    from app.driver import cluster

    # What is known without Ray first: the files exist, the batch cuts over the workers.
    train_batch = batch_size or default_batch
    val_batch = validation_batch_size or train_batch
    keras_stream.check_batch(train_batch, world, "x")
    keras_stream.check_batch(val_batch, world, "validation_data")
    train_loc = keras_stream.locate_input(x, config)
    val_loc = None if validation_data is None else keras_stream.locate_input(validation_data, config)
    config = cluster.connect_for_data(config, reads=True)
    split = (lambda side: (side, config.val_fraction)) if holdout else (lambda side: None)
    train, train_ds = keras_stream.prepare(train_loc, config, name="train", what="x", batch_size=train_batch,
                                           world=world, shuffle=bool(shuffle), training=True, holdout=split("train"),
                                           class_weight=class_weight)  # weighed on the workers, as fit() weighs tf.data
    datasets = {"train": train_ds}
    val = None
    config = decided(config, train.spec)
    if val_loc is not None or holdout:
        val, datasets["val"] = keras_stream.prepare(val_loc or train_loc, config, name="val", what="validation_data",
                                                    batch_size=val_batch, world=world, shuffle=False, training=False,
                                                    holdout=split("val"))
    return train, None, val, datasets, train.spec.features, config


def same_structure(train, val) -> None:
    """Streamed validation rows of another x / y structure or shape than training's: one line before any worker."""
    import tensorflow as tf

    try:
        tf.nest.assert_same_structure(train.rows, val.rows)
    except (ValueError, TypeError):
        raise UserError(f"validation_data's elements are {structure(val.rows)} but the training data's are "
                        f"{structure(train.rows)}: give both the same x (and y) columns") from None
    shapes = [(a.shape[1:], b.shape[1:]) for a, b in zip(tf.nest.flatten(train.rows), tf.nest.flatten(val.rows))]
    if any(a != b for a, b in shapes):
        raise UserError(f"validation_data's examples have shapes {[b for _, b in shapes]} but the training data's "
                        f"{[a for a, _ in shapes]}: give both the same columns")


def structure(rows: Any) -> str:
    import tensorflow as tf

    if isinstance(rows, tuple):
        return "(" + ", ".join(structure(r) for r in rows) + ")"
    if isinstance(rows, dict):
        return "{" + ", ".join(f"{k!r}: {structure(v)}" for k, v in rows.items()) + "}"
    return "array" if not tf.nest.is_nested(rows) else type(rows).__name__


def example_shapes(data) -> str:
    """The shape of one example of x (each input's, for several), as the plan's data line says it."""
    import keras
    import numpy as np

    x = keras.utils.unpack_x_y_sample_weight(data.rows)[0]  # the element as Keras's fit unpacks it
    shapes = [tuple(np.shape(a)[1:]) for a in keras.tree.flatten(x)]
    return f", examples of shape {shapes[0]}" if len(shapes) == 1 else \
        f", examples of shapes {', '.join(map(str, shapes))}" if shapes else ""


def file_names(names: tuple[str, ...]) -> str:
    """The first few files a pipeline reads, for the plan."""
    shown = ", ".join(n for n in names[:3] if n != "?") or "named in the graph"
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_audit(config, train, row_ids: Optional[np.ndarray]) -> None:
    """--audit-sample-ids counts rows by their ids: arrays' (given, or their positions) and streamed files' (their
    content hash); said before any worker starts. Sets the arrays' ``row_ids``."""
    if not config.audit_sample_ids:
        return
    if getattr(train, "pipeline", None) is not None:
        raise UserError("--audit-sample-ids (audit_sample_ids) counts rows by their ids, and a tf.data.Dataset's "
                        "elements carry none: give the rows as arrays or files, or leave the audit out")
    if config.checkpoint_every_steps:
        raise UserError("--audit-sample-ids with --checkpoint-every-steps: an epoch that goes on from a step inside it "
                        "would audit only the rows after that step; leave one of them out")
    if row_ids is not None and not getattr(train, "streamed", False):
        train.ids = np.asarray(row_ids, np.int64)
