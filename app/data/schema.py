"""From a file dataset's schema (no rows read) to a Spec: how to turn its raw rows into x / y / id."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from app.data.arrays import Moments
from app.data.checks import NONFINITE_FIX, check_labels, missing
from app.data.class_names import with_class_names
from app.data.files import Located
from app.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

    from app.config import TrainConfig


# Columns of one number each (tabular data), each on a scale of its own: the built-in mlp standardises them
# (DataFacts.feature_moments). A list or tensor column (an image's pixels, an embedding) is one scale: left as it is.
TABULAR = ("scalars",)


@dataclass(frozen=True)
class Spec:
    """How to turn one block of raw rows into x / y / id: a plain, picklable recipe sent to Ray Data tasks."""

    kind: str  # scalars, list, tensor, text, images (a folder), encoded (image bytes in a column)
    features: tuple[str, ...]
    label: str
    stored_shape: tuple[int, ...] = ()  # one example as stored (before --feature-shape)
    feature_shape: tuple[int, ...] = ()  # one example as the model sees it
    vocab_size: int = 0
    sequence_length: int = 0
    classes: tuple[str, ...] = ()  # image folders, a label column of class names: the names, index = class id
    label_names: bool = False  # the label column holds class names (strings), mapped to ids by ``classes``
    root: str = ""  # image folders: the root the class folders sit under
    val_fraction: Optional[float] = None  # None: no split (a separate validation source)
    seed: int = 0
    task: str = "classification"  # from the label column's type and --task, decided once here
    # kind "named" (a model of several inputs, fed a dict of arrays): each input's name and one example's shape,
    # read from the column features[i] (() until a list column's length is known from the data)
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def input_shapes(self) -> Optional[dict[str, tuple[int, ...]]]:
        """{input name: one example's shape} for named inputs (DataFacts.input_shapes), else None."""
        return dict(self.inputs) if self.kind == "named" else None

    def values_per_row(self, unknown: int = 1024) -> int:
        """float32 values of one example's features (``unknown`` per list whose length the data has not told)."""
        shapes = [s for _, s in self.inputs] if self.kind == "named" else [self.feature_shape or self.stored_shape]
        return sum(math.prod(s) if s else unknown for s in shapes)


def _type_kind(t: "pa.DataType") -> str:
    import pyarrow as pa

    if isinstance(t, pa.ExtensionType):
        if "VariableShaped" in type(t).__name__:
            return "ragged"
        if getattr(t, "shape", None) is not None:
            return "tensor"
        return "other"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        value = t.value_type
        return "list" if pa.types.is_integer(value) or pa.types.is_floating(value) else "other"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return "scalar"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or (
            pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type))):
        return "string"  # a pandas category column of strings is a dictionary of them
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):  # TFRecord's bytes features are binary
        return "binary"
    return "other"


def schema_spec(loc: Located, config: "TrainConfig", schema, labelled: bool = True) -> Spec:
    """Columns and dtypes from the schema alone (no data read): the cheap checks first.

    ``labelled=False``: rows to predict on (app.data.inference), whose label column may be absent."""

    names = list(schema.names)
    types = dict(zip(names, schema.types))
    if loc.format == "tfrecord":  # a record's features have no order (a map): by name, the same in every run
        names.sort()
    common = dict(
        label=config.label_column, vocab_size=config.vocab_size, sequence_length=config.sequence_length,
        seed=config.seed,
    )
    if labelled and config.label_column not in types:
        raise missing("label column", config.label_column, loc.uri, names, "--label-column")
    common["task"] = _task(config, types[config.label_column]) if labelled else config.task
    if labelled and _type_kind(types[config.label_column]) == "string":  # class names, each mapped to its id
        common.update(label_names=True, classes=tuple(config.class_names or ()))
    elif labelled and config.class_names:
        raise UserError(f"--class-names names the classes of a label column of names (strings), and column "
                        f"{config.label_column!r} holds {types[config.label_column]}: leave --class-names out")
    if config.text_column:
        if config.text_column not in types:
            raise missing("text column", config.text_column, loc.uri, names, "--text-column")
        if _type_kind(types[config.text_column]) not in ("string", "binary"):  # binary: UTF-8 bytes
            raise UserError(f"text column {config.text_column!r} has type {types[config.text_column]}, expected strings")
        return Spec(kind="text", features=(config.text_column,), stored_shape=(config.sequence_length,), **common)
    if config.inputs:
        return _named_spec(loc, config, names, types, common)
    features = config.feature_columns or [n for n in names if n != config.label_column]
    for name in features:
        if name not in types:
            raise missing("feature column", name, loc.uri, names, "--feature-columns")
    if not features:
        raise UserError(f"dataset {loc.uri!r} has no feature columns besides the label {config.label_column!r}")
    kinds = {name: _type_kind(types[name]) for name in features}
    for name, kind in kinds.items():
        if kind == "ragged":
            raise UserError(f"feature column {name!r} has ragged feature shapes (tensors of varying shape)")
        if kind == "string":
            raise UserError(
                f"feature column {name!r} has type {types[name]}, expected numbers: pick numeric columns with "
                "--feature-columns, or tokenize it with --text-column"
            )
        if kind == "other":
            raise UserError(f"feature column {name!r} has type {types[name]}, expected numbers, lists of numbers "
                            "or encoded images: convert it to numbers first (a date or time, pandas: "
                            "pd.to_datetime(df[column]).astype('int64')), or leave it out with --feature-columns")
    if set(kinds.values()) == {"scalar"}:
        return Spec(kind="scalars", features=tuple(features), stored_shape=(len(features),), **common)
    if len(features) > 1:
        raise UserError(
            f"feature columns {', '.join(features)} mix list/tensor/image-bytes and other columns: name one list, "
            "tensor or image-bytes column, or only scalar columns, with --feature-columns (a model of several named "
            "inputs: give each one its column with --inputs NAME or NAME=COLUMN)"
        )
    (name,) = features
    if kinds[name] == "binary":  # encoded images (PNG, JPEG), decoded as an image folder's files are
        return Spec(kind="encoded", features=(name,), stored_shape=_image_shape(config), **common)
    shape = tuple(types[name].shape) if kinds[name] == "tensor" else ()  # lists: length from the data
    return Spec(kind=kinds[name], features=(name,), stored_shape=shape, **common)


def _named_spec(loc: Located, config: "TrainConfig", names: list[str], types: dict, common: dict) -> Spec:
    """--inputs: each named input from its own column; a number per row is shape (1,), a list's length comes from
    the data (app.data.blocks.block_stats), a tensor column keeps its shape."""
    import pyarrow as pa

    inputs = []
    for name, column in config.input_columns().items():
        if column not in types:
            raise missing(f"column for input {name!r} (--inputs)", column, loc.uri, names)
        kind, t = _type_kind(types[column]), types[column]
        if kind not in ("scalar", "list", "tensor"):
            raise UserError(f"column {column!r} (input {name!r}) has type {t}: a named input takes numbers or lists "
                            "of numbers (tokenize text or decode images in your model, or train on one input)")
        fixed = kind == "list" and pa.types.is_fixed_size_list(t)
        shape = (1,) if kind == "scalar" else tuple(t.shape) if kind == "tensor" else (t.list_size,) if fixed else ()
        inputs.append((name, shape))
    return Spec(kind="named", features=tuple(config.input_columns().values()), inputs=tuple(inputs), **common)


def _task(config: "TrainConfig", label_type: "pa.DataType") -> str:
    """As for arrays (app.data.checks.task_of), from the label column's type: integers are classes, floats
    targets; an explicit --task must fit it."""
    import pyarrow as pa

    integral = pa.types.is_integer(label_type) or pa.types.is_boolean(label_type)
    if _type_kind(label_type) == "string":  # class names
        if config.task == "regression":
            raise UserError(f"label column {config.label_column!r} holds strings (class names), but --task regression "
                            "needs numbers to predict: leave --task out to classify by the names")
        return "classification" if config.task == "auto" else config.task
    if not integral and not pa.types.is_floating(label_type):
        raise UserError(f"label column {config.label_column!r} has type {label_type}, expected numbers (class ids "
                        f"0..K-1, or float targets with --task regression) or class names (strings)")
    if config.task == "auto":
        return "classification" if integral else "regression"
    if config.task in ("classification", "binary") and not integral:
        raise UserError(f"label column {config.label_column!r} has type {label_type}, but --task {config.task} "
                        "needs integer class ids: use --task regression for continuous targets")
    return config.task


def image_spec(loc: Located, config: "TrainConfig") -> Spec:
    classes = sorted({class_of(f, loc.root) for f in loc.files})
    loose = [f for f in loc.files if os.path.dirname(os.path.relpath(f, loc.root)) == ""]
    if loose:
        raise UserError(
            f"image folder {loc.uri!r} must hold one subfolder per class; found images directly in it "
            f"({os.path.basename(loose[0])})"
        )
    return Spec(
        kind="images", features=("image",), label="<class folder>", stored_shape=_image_shape(config),
        classes=tuple(classes), root=loc.root, seed=config.seed,
    )


def _image_shape(config: "TrainConfig") -> tuple[int, ...]:
    h, w = config.image_size
    return (h, w, 3) if config.image_channels == 3 else (h, w)



def class_of(path: str, root: str) -> str:
    return os.path.relpath(path, root).split(os.sep)[0]


def totals(loc: Located, config: "TrainConfig", spec: Spec, stats: list[dict]) -> tuple[Spec, dict[str, Any]]:
    """The checks over every block's statistics (app.data.blocks.block_stats), and the spec they complete
    (a list column's length, --feature-shape): the same for Ray Data's blocks and the local backend's batches."""
    total: dict[str, Any] = {k: sum(s[k] for s in stats) for k in ("rows", "val_rows", "label_nulls", "nulls")}
    total["moments"] = None
    total["label_moments"] = _moments(stats, "label_moments") if spec.task == "regression" else None
    if total["rows"] == 0:
        raise UserError(f"dataset {loc.uri!r} is empty: 0 rows")
    if total["label_nulls"]:
        raise UserError(f"label column {spec.label!r} has {_values(total['label_nulls'])} missing: drop those rows "
                        f"first (pandas: df.dropna(subset=[{spec.label!r}]))")
    if total["nulls"]:
        column = next(s["nulls_column"] for s in stats if s["nulls"])
        count = sum(s["nulls"] for s in stats if s["nulls_column"] == column)
        raise UserError(f"feature column {column!r} has {_values(count)} missing: drop or fill those rows first "
                        f"(pandas: df.dropna() or df.fillna(...)), or leave the column out with --feature-columns")
    if any(s["nonfinite"] for s in stats):
        column = next(s["nonfinite_column"] for s in stats if s["nonfinite"])
        count = sum(s["nonfinite"] for s in stats if s["nonfinite_column"] == column)
        raise UserError(f"column {column!r} has {count} NaN or infinite values {NONFINITE_FIX}")
    if spec.label_names:  # the names every block holds
        import json

        spec = with_class_names(spec, (n for s in stats if s["label_names"] for n in json.loads(s["label_names"])),
                                repr(loc.uri))
    length = _list_lengths(stats)
    if spec.kind == "list":
        spec = replace(spec, stored_shape=(length[spec.features[0]],))
    if spec.kind == "named":  # numbers and lists: (length,) per example; a tensor column keeps its shape
        inputs = tuple((name, (length[column],) if column in length else shape)
                       for (name, shape), column in zip(spec.inputs, spec.features))
        return replace(spec, inputs=inputs), _label_totals(config, spec, stats, total)
    spec = with_feature_shape(spec, config)
    if spec.kind in TABULAR and len(spec.feature_shape) == 1:  # not columns that --feature-shape makes an image
        total["moments"] = _moments(stats, "moments")
    return spec, _label_totals(config, spec, stats, total)


def _values(count: int) -> str:
    return f"{count:,} value{'' if count == 1 else 's'}"


def _moments(stats: list[dict], key: str) -> Optional[Moments]:
    """The training rows' moments (DataFacts.feature_moments, label_moments): the sums of every block that has
    some."""
    found = None
    for block in (Moments.from_text(s[key]) for s in stats if s.get(key)):
        found = block if found is None else found + block
    return found


def with_feature_shape(spec: Spec, config: "TrainConfig") -> Spec:
    """One example as the model sees it: --feature-shape (its values as many as the column holds per example), else
    the shape the spec already knows (a Ray Data tensor column read by pyarrow alone: app.data.local_files), else the
    column's stored shape."""
    shape = tuple(config.feature_shape) if config.feature_shape else (spec.feature_shape or spec.stored_shape)
    if math.prod(shape) != math.prod(spec.stored_shape):
        raise UserError(
            f"--feature-shape {'x'.join(map(str, shape))} holds {math.prod(shape)} values, but column "
            f"{spec.features[0]!r} has {math.prod(spec.stored_shape)} per example"
        )
    return replace(spec, feature_shape=shape)


def _list_lengths(stats: list[dict]) -> dict[str, int]:
    """Each list column's length (every example's must be the same), from the blocks' {column: [min, max]}."""
    import json

    spans: dict[str, list[int]] = {}
    for s in stats:
        for column, (low, high) in json.loads(s["lengths"]).items():
            span = spans.setdefault(column, [low, high])
            span[:] = min(span[0], low), max(span[1], high)
    for column, (low, high) in spans.items():
        if low != high:
            raise UserError(f"feature column {column!r} has ragged feature shapes: lists of length {low} to {high} "
                            "(every example must have the same shape)")
    return {column: low for column, (low, _) in spans.items()}


def _label_totals(config: "TrainConfig", spec: Spec, stats: list[dict], total: dict[str, int]) -> dict[str, int]:
    """The label range over every block, checked against the task."""
    if spec.kind == "images" or spec.label_names:
        total["label_min"], total["label_max"] = 0, len(spec.classes) - 1
    else:
        real = [s for s in stats if s["rows"]]
        total["label_min"] = min(s["label_min"] for s in real)
        total["label_max"] = max(s["label_max"] for s in real)
    if spec.task != "regression":
        check_labels(f"label column {spec.label!r}", total["label_min"], total["label_max"], config.num_classes,
                     total["rows"])
    if spec.task == "binary" and total["label_max"] > 1:
        raise UserError(f"label column {spec.label!r} has values {total['label_min']}..{total['label_max']}, "
                        "but --task binary needs labels 0 or 1")
    return total


def check_val_spec(spec: Spec, val_spec: Spec) -> None:
    """--val-dataset's examples must look like the training data's."""
    if (val_spec.feature_shape, val_spec.inputs) != (spec.feature_shape, spec.inputs):
        shape = lambda s: s.input_shapes or s.feature_shape  # noqa: E731
        raise UserError(f"--val-dataset examples have shape {shape(val_spec)}, the training data {shape(spec)}")
    if spec.kind == "images" and val_spec.classes != spec.classes:
        raise UserError(
            f"--val-dataset has class folders {', '.join(val_spec.classes)}, the training data "
            f"{', '.join(spec.classes)}"
        )


def num_classes_of(config: "TrainConfig", spec: Spec, label_max: int) -> Optional[int]:
    """None for regression; image folders have one class per folder; else --num-classes or the largest label + 1."""
    if spec.kind == "images":
        return config.num_classes or len(spec.classes)
    return {"regression": None, "binary": 2}.get(spec.task, config.num_classes or int(label_max) + 1)
