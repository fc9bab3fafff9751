"""The model of a run: a built-in or a user's function, called with what it declares, checked against the task.

A model function may declare any of ``input_shape`` (one example's shape),
``num_classes`` (classification; 2 for binary), ``num_outputs`` (what the
last layer must produce: classes, 1 for binary, one per regression target),
``feature_mean`` and ``feature_variance`` (tabular data: each column's over
the training rows, DataFacts.feature_moments), ``target_mean`` and
``target_variance`` (a regression's targets: theirs over the training rows,
DataFacts.label_moments; floats for one target, lists for several) and the
entries of ``--model-args``; built-in models also take their config fields
(``hidden_units``, ``conv_filters``, ...). It returns a Keras 3 model:
functional, Sequential or subclassed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from app import registry
from app.data.arrays import DataFacts, Moments
from app.errors import UserError

if TYPE_CHECKING:
    import keras

    from app.config import TrainConfig

PRECISION_POLICIES = {"off": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}
# Config fields the built-in models take by name (users' functions may too).
BUILTIN_OPTIONS = ("hidden_units", "conv_filters", "sync_batch_norm", "vocab_size", "embed_dim", "num_heads",
                   "ff_dim", "num_blocks", "embedding_shards")


def num_outputs(facts: DataFacts) -> int:
    """What the last layer produces per example: a value per class, per target (several: the label's size), or
    one (binary, one target)."""
    if facts.task == "classification":
        return facts.num_classes
    return math.prod(facts.label_shape) if facts.task == "regression" and facts.label_shape else 1


def target_moments(moments: "Moments") -> dict[str, Any]:
    """``target_mean`` and ``target_variance`` as a model function takes them: floats for one target, lists (one
    per target) for several."""
    one = len(moments.mean) == 1
    return {"target_mean": moments.mean[0] if one else moments.mean,
            "target_variance": moments.variance[0] if one else moments.variance}


def not_taken(fn: Any, given: Sequence[str]) -> tuple[list[str], list[str]]:
    """Of the built-in options ``given``, those the model function ``fn`` does not take; and the ones it takes."""
    import inspect

    takes = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
        return [], list(BUILTIN_OPTIONS)
    return [k for k in given if k not in takes], [k for k in takes if k in BUILTIN_OPTIONS]


def check_options(fn: Any, name: str, given: Sequence[str]) -> None:
    """app.fit's keywords: the built-in model ``fn`` must take every option ``given`` (one line naming what it
    takes), or the option would size nothing (``sync_batch_norm`` with the mlp, which has no batch norm)."""
    refused, options = not_taken(fn, given)
    if refused:
        raise UserError(f"the built-in {name} does not take {', '.join(refused)} (it takes "
                        f"{', '.join(options) or 'none of the built-in options'}): leave it out")


def unused_options_line(config: "TrainConfig") -> Optional[str]:
    """The plan's line for the built-in options a run's config sets (to other than their defaults) that its model
    function does not take (--sync-batch-norm with the mlp): they size nothing. A line, not a refusal: a config
    file or a sweep may hold the options of several models and pick one."""
    fields = type(config).model_fields
    given = [k for k in BUILTIN_OPTIONS if k in config.model_fields_set
             and getattr(config, k) != fields[k].get_default(call_default_factory=True)]
    if not given:
        return None
    unused, options = not_taken(registry.resolve(config.model, registry.MODELS), given)
    if not unused:
        return None
    flags = ", ".join("--" + k.replace("_", "-") for k in unused)
    return (f"options: {flags} size nothing here: {model_name(config)} does not take "
            f"{'it' if len(unused) == 1 else 'them'} (it takes {', '.join(options) or 'none of them'})")


def model_name(config: "TrainConfig") -> str:
    return config.model if isinstance(config.model, str) else registry.describe(config.model)


def build_model(config: "TrainConfig", facts: DataFacts) -> "keras.Model":
    """Seeded, with the precision policy set; call it under ``strategy.scope()``."""
    import keras

    # Same seed on every worker: replicas start identical (MWMS also broadcasts
    # the initial values, but a seeded init makes runs reproducible).
    keras.utils.set_random_seed(config.seed)
    # Layers take the policy when they are created: compute in fp16/bf16, variables in float32.
    keras.mixed_precision.set_global_policy(PRECISION_POLICIES[config.mixed_precision])
    if facts.input_shapes is not None and isinstance(config.model, str) and config.model in registry.MODELS:
        raise UserError(f"the built-in {config.model} takes one input, but the data has named inputs "
                        f"({', '.join(facts.input_shapes)}): give x as one array, or train your own model")
    fn = registry.resolve(config.model, registry.MODELS)
    available: dict[str, Any] = {
        "input_shape": facts.example_shape,  # {name: shape} for named inputs
        # Images stored as flat rows (the built-in digits) say their shape; image models reshape to it.
        **({"image_shape": facts.image_shape} if facts.image_shape else {}),
        "num_outputs": num_outputs(facts),
        **({"num_classes": facts.num_classes} if facts.num_classes else {}),
        **{k: getattr(config, k) for k in BUILTIN_OPTIONS},
        # The training rows' per-feature moments, when the data's numbers were read before training: the mlp
        # standardises its inputs with them (a constant of the model, the same on every worker).
        **({"feature_mean": facts.feature_moments.mean, "feature_variance": facts.feature_moments.variance}
           if facts.feature_moments is not None else {}),
        # A regression's targets', likewise: the built-ins predict in their units (app.models.in_target_units).
        **(target_moments(facts.label_moments) if facts.task == "regression" and facts.label_moments else {}),
        **config.model_args,
    }
    name = model_name(config)
    model = registry.call_with_declared(fn, available, name, required=tuple(config.model_args))
    if not isinstance(model, keras.Model):
        raise UserError(f"{name} returned a {type(model).__name__}; expected a keras.Model")
    return model


def task_with_model(facts: DataFacts, model: "keras.Model", requested: str = "auto") -> DataFacts:
    """The task once the model is known, decided here for training, evaluation and the plan: labels of two classes
    and a model with one output (a sigmoid head) are a binary task, unless a task was asked for (--task)."""
    if requested == "auto" and facts.task == "classification" and facts.num_classes == 2 \
            and _single_output(model, facts) == 1:
        return replace(facts, task="binary")
    return facts


def task_without_labels(model: "keras.Model") -> str:
    """The task of a model no run recorded, for rows without labels (prediction): its output alone decides
    (one value is a regression, unless a sigmoid makes it binary)."""
    try:
        shape = tuple(model.output_shape)
    except AttributeError:  # a subclassed model has none: its output on one example of the shape it was built for
        import numpy as np

        shape = tuple(model(np.zeros((1, *model.get_build_config()["input_shape"][1:]), np.float32)).shape)
    outputs = int(shape[-1]) if len(shape) > 1 else 1
    return "classification" if outputs > 1 else "binary" if ends_in_probabilities(model) else "regression"


def _single_output(model: "keras.Model", facts: DataFacts) -> int:
    """The size of the model's one output for one example (-1: several outputs, or a model that does not run)."""
    import numpy as np

    try:
        out = model(facts.zeros(1), training=False)
    except Exception:
        return -1
    if isinstance(out, (dict, list, tuple)):  # several outputs: not a binary head
        return -1
    return int(np.prod(out.shape[1:])) if len(out.shape) > 1 else 1


def check_output(model: "keras.Model", facts: DataFacts, name: str) -> Any:
    """Build the model on two examples and check its inputs and outputs against the data and the task.

    Returns the output shape of one example: a tuple, or {output name: shape} for a model with several outputs.
    """
    import numpy as np

    check_inputs(model, facts, name)
    try:
        out = model(facts.zeros(2), training=False)
    except Exception as e:
        raise UserError(
            f"{name} does not accept examples of shape {facts.example_shape}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    if facts.outputs is not None or isinstance(out, (dict, list, tuple)):
        return _named_outputs(model, out, facts, name)
    shape = tuple(out.shape[1:])
    want = num_outputs(facts)
    got = int(np.prod(shape)) if shape else 1
    if got != want:
        what = {"classification": f"{facts.num_classes} classes", "binary": "a binary task",
                "regression": f"{want} target(s)"}[facts.task]
        raise UserError(f"{name} outputs {got} value(s) per example (shape {shape}), but {what} needs {want}")
    return shape


def check_inputs(model: "keras.Model", facts: DataFacts, name: str) -> None:
    """The data's named inputs are the model's keras.Input names; one features input for a model of one input."""
    if facts.input_shapes is not None:
        given, wanted = sorted(facts.input_shapes), sorted(getattr(t, "name", "") for t in (model.inputs or []))
        if getattr(model, "inputs", None) and given != wanted:
            raise UserError(f"the data's inputs are named {', '.join(given)}, but {name}'s inputs are "
                            f"{', '.join(wanted)}: name the arrays (or, from file columns, --inputs NAME=COLUMN) as "
                            "the model's keras.Input(name=...)")
    elif len(getattr(model, "inputs", None) or []) > 1:
        # Files (and arrays) give one features input: several named inputs come from a data function.
        wanted = ", ".join(getattr(t, "name", "?") for t in model.inputs)
        raise UserError(f"{name} takes {len(model.inputs)} inputs ({wanted}), but the data gives one features input "
                        f"of shape {facts.example_shape}: name each input's file column with --inputs "
                        f"{' '.join(getattr(t, 'name', '?') for t in model.inputs)} (or NAME=COLUMN), return a dict of "
                        f"arrays keyed {wanted} from a data function, or give the model one input")


def check_output_names(model: "keras.Model", facts: DataFacts, name: str) -> None:
    """A model built with several named outputs, and labels named by them (what Keras's fit would fail on in every
    worker), without calling the model."""
    if facts.outputs is None or len(getattr(model, "outputs", None) or []) < 2:
        return
    names = list(getattr(model, "output_names", None) or [])
    if sorted(names) != sorted(facts.outputs):
        raise UserError(_output_names_problem(sorted(facts.outputs), names, name))


def _output_names_problem(labels: list[str], outputs: list[str], name: str) -> str:
    shown = ", ".join(outputs) or "one unnamed tensor"
    return (f"the labels are named {', '.join(labels)}, but {name}'s outputs are {shown}: key y by the model's output "
            "names (keras.layers.Dense(..., name=...) on each output)")


def _named_outputs(model, out, facts: DataFacts, name: str) -> dict[str, tuple[int, ...]]:
    """A model with several outputs: its outputs by name, which must be the names of the data's labels."""
    names = list(out) if isinstance(out, dict) else list(getattr(model, "output_names", None) or [])
    values = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (list, tuple)) else [out]
    labels = sorted(facts.outputs or {})
    if facts.outputs is None:
        raise UserError(f"{name} has {len(values)} outputs ({', '.join(names)}), but the labels are one array: "
                        "give y as a dict of arrays by output name")
    if sorted(names) != labels or len(names) != len(values):
        raise UserError(_output_names_problem(labels, names, name))
    return {n: tuple(v.shape[1:]) for n, v in zip(names, values)}


def ends_in_probabilities(model: "keras.Model") -> bool:
    """True when the last layer applies softmax or sigmoid (the loss then takes probabilities, not logits)."""
    layers = [layer for layer in getattr(model, "layers", []) if hasattr(layer, "activation") or
              type(layer).__name__ in ("Softmax", "Activation")]
    if not layers:
        return False
    last = layers[-1]
    if type(last).__name__ == "Softmax":
        return True
    activation = getattr(last, "activation", None)
    return getattr(activation, "__name__", "") in ("softmax", "sigmoid")
