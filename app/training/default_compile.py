"""The product's ``compile()`` for a model that compiles nothing and brings no step of its own.

Keras's fit refuses such a model; the product compiles it, decided once in the driver (``decide``) from the
labels and the model's output, and applied by every worker to the model its own call of the model function
returns (``CompiledWithDefaults``):

| labels                                        | loss                              | metric   |
|-----------------------------------------------|-----------------------------------|----------|
| integer class ids, several outputs            | sparse categorical cross-entropy  | accuracy |
| integers 0/1 (or booleans), one output        | binary cross-entropy              | accuracy |
| one-hot rows as wide as the output            | categorical cross-entropy         | accuracy |
| targets shaped as the output (floats)         | mean squared error                | mae      |

Whole, non-negative floats with several outputs are class ids too (labels read from a table often are floats);
labels that fit none of these (a width other than the output's) are refused in one line.

The loss takes logits unless the model's last layer applies softmax or sigmoid. A built-in that predicts a
regression's targets in their units (app.models.in_target_units) has its mean squared error weighted by 1 / their
variance (several targets: the mean of theirs): targets of any scale train at the default rate, and a loss of 1 is
predicting their mean. A model of the user's, by 1 / their mean square when above 1 (``in_their_units``): finite at
any scale, and the plan says how to reach targets far from 0. The optimizer is the run's
``optimizer`` (SGD with ``momentum``, or Adam) at ``base_lr``; the learning-rate rule around it (scaling by the
global batch, warmup, cosine decay) is app.training.keras_features's, with the config's defaults. Models with
several outputs or labels in a structure are refused: a loss per output is the user's to choose.

A model the user compiled is checked here too (``check_names``): a loss or metric named by a string Keras does not
know is one line in the driver, not an error traced by every worker at its first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from app.errors import UserError
from app.models import default_loss_weight, weighted

DEFAULT_LOSS = {
    "classification": "sparse_categorical_crossentropy",
    "binary": "binary_crossentropy",
    "regression": "mean_squared_error",
}
DEFAULT_METRIC = {"classification": "accuracy", "binary": "accuracy", "regression": "mae"}
# The config fields a compile() is made of (the product's, or the flags over a model's own): what a model's own
# compile leaves without effect (app.training.compile_record), what the route to Keras's fit takes (app.run.keras_step).
COMPILE_FIELDS = frozenset({"optimizer", "base_lr", "momentum", "task", "loss", "from_logits", "steps_per_execution"})
# Names Keras's compile resolves from the labels' and outputs' shapes (keras/src/trainers/compile_utils.py), not
# by keras.losses.get / keras.metrics.get.
_SHAPED = {"loss": ("crossentropy", "ce"), "metric": ("accuracy", "acc", "crossentropy", "ce")}


def unknown_name(kind: str, identifier: Any, error: Exception) -> UserError:
    """The one line for a compile() ``kind`` ("loss" or "metric") that Keras does not know."""
    return UserError(f"the model's compile() names {kind} {identifier!r}, which Keras does not know "
                     f"({' '.join(str(error).split())[:200]}): give a name keras.{kind}{'es' if kind == 'loss' else 's'}"
                     f".get() takes or a keras.{'losses.Loss' if kind == 'loss' else 'metrics.Metric'}")


def check_loss_name(loss: str) -> None:
    """A loss named by --loss (or a task's default) is one Keras knows, else one line naming it."""
    import keras

    try:
        keras.losses.get(loss)
    except (ValueError, TypeError):
        raise UserError(f"unknown loss {loss!r}: give a Keras loss name such as "
                        f"{', '.join(DEFAULT_LOSS.values())}, huber or mean_absolute_error") from None


def check_names(model) -> None:
    """Every loss and metric compile() was given by name is one Keras knows (else ``unknown_name``)."""
    import keras

    from app import internals

    args = internals.compile_arguments(model) or {}
    for kind, key in (("loss", "loss"), ("metric", "metrics"), ("metric", "weighted_metrics")):
        for identifier in keras.tree.flatten(args.get(key)):
            if not isinstance(identifier, str) or identifier.lower() in _SHAPED[kind]:
                continue
            try:
                (internals.resolve_loss if kind == "loss" else internals.resolve_metric)(identifier, None, None)
            except ValueError as e:
                raise unknown_name(kind, identifier, e) from None


def loss_name(model) -> str:
    """The compiled loss's name (a string, a Loss's name or a function's), "" for none."""
    loss = getattr(model, "loss", None)
    return str(loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", ""))


def loss_object(name: str, from_logits: bool) -> Any:
    """A Keras loss by name; a cross-entropy's ``from_logits`` as given."""
    import keras

    losses = {"sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy,
              "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
              "binary_crossentropy": keras.losses.BinaryCrossentropy}
    return losses[name](from_logits=from_logits) if name in losses else keras.losses.get(name)


def product_optimizer(name: str, learning_rate: float, momentum: float) -> Any:
    """--optimizer's optimizer: SGD with --momentum, or Adam, at ``learning_rate``."""
    import keras

    return keras.optimizers.SGD(learning_rate, momentum=momentum) if name == "sgd" \
        else keras.optimizers.Adam(learning_rate)


@dataclass(frozen=True)
class Recompile:
    """What the run's flags change in the compile() of a model the user compiled, the rest of it kept as given
    (its losses, metrics, loss weights): ``optimizer`` (--optimizer: the product's, at ``learning_rate``), else the
    compiled optimizer's class and settings with ``learning_rate`` (--base-lr) and ``momentum`` (--momentum) where
    given; ``loss`` (--loss, with ``from_logits``); ``steps_per_execution``. Decided in the driver
    (``recompile_of``), applied by every worker to its own build (``CompiledWithDefaults``)."""

    optimizer: Optional[str] = None
    learning_rate: Optional[float] = None
    momentum: Optional[float] = None
    loss: Optional[str] = None
    from_logits: bool = False
    steps_per_execution: Optional[int] = None

    def compile(self, model) -> Any:
        from app import internals

        args = internals.compile_arguments(model)
        if self.optimizer is not None:
            args["optimizer"] = product_optimizer(self.optimizer, self.learning_rate, self.momentum)
        elif self.learning_rate is not None or self.momentum is not None:
            args["optimizer"] = self._changed(model.optimizer)  # compile()'s, resolved (it may name it: "adam")
        if self.loss is not None:
            args["loss"] = loss_object(self.loss, self.from_logits)
        if self.steps_per_execution is not None:
            args["steps_per_execution"] = self.steps_per_execution
        model.compile(**args)
        return model

    def _changed(self, optimizer) -> Any:
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # compile() wraps it again for fp16 if it must
        config = inner.get_config()
        if self.learning_rate is not None:
            config["learning_rate"] = self.learning_rate
        if self.momentum is not None:
            config["momentum"] = self.momentum
        return type(inner).from_config(config)

    def line(self) -> str:
        """The plan's line."""
        changes = []
        if self.optimizer is not None:
            which = f"SGD (momentum {self.momentum:g})" if self.optimizer == "sgd" else "Adam"
            changes.append(f"its optimizer replaced by {which} at base_lr {self.learning_rate:g} (--optimizer)")
        else:
            changes += [f"its optimizer's {what} {value:g} ({flag})" for what, value, flag in (
                ("learning rate", self.learning_rate, "--base-lr"), ("momentum", self.momentum, "--momentum"))
                if value is not None]
        if self.loss is not None:
            changes.append(f"its loss {self.loss}{' (from logits)' if self.from_logits else ''} (--loss)")
        if self.steps_per_execution is not None:
            changes.append(f"{self.steps_per_execution} steps per execution (--steps-per-execution)")
        return "compile: the model's own compile(), with " + ", ".join(changes) + "; its other arguments as given"


def recompile_of(model, config, chosen: set[str]) -> Optional[Recompile]:
    """The Recompile the flags ``chosen`` ask of a model the user compiled (None: none asked), or one line for a
    flag that has nothing to change in it."""

    name = getattr(config.model, "__name__", config.model)
    if "task" in chosen:
        raise UserError(f"--task chooses the compile of a model that compiles nothing; {name} compiles itself: leave "
                        "--task out (its compile() decides its loss), or give --loss")
    if "from_logits" in chosen and "loss" not in chosen:
        raise UserError(f"--from-logits goes with --loss; {name}'s compiled loss says whether it takes logits itself: "
                        "leave --from-logits out, or give --loss too")
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # compile()'s, resolved from its name too
    if "momentum" in chosen and "optimizer" not in chosen and "momentum" not in inner.get_config():
        raise UserError(f"--momentum {config.momentum:g}: {name}'s compiled optimizer {type(inner).__name__} has no "
                        "momentum; leave --momentum out, or give --optimizer sgd too")
    if "base_lr" in chosen and "optimizer" not in chosen and not isinstance(inner.get_config().get("learning_rate"),
                                                                            (int, float)):
        raise UserError(f"--base-lr {config.base_lr:g}: {name}'s compiled optimizer follows its own learning-rate "
                        "schedule; leave --base-lr out to train with it, or compile with a number")
    if "loss" in chosen:
        check_loss_name(config.loss)
    if not chosen & {"optimizer", "base_lr", "momentum", "loss", "steps_per_execution"}:
        return None
    product = "optimizer" in chosen
    return Recompile(
        optimizer=config.optimizer if product else None,
        learning_rate=config.base_lr if product or "base_lr" in chosen else None,
        momentum=config.momentum if product or "momentum" in chosen else None,
        loss=config.loss if "loss" in chosen else None, from_logits=bool(config.from_logits),
        steps_per_execution=config.steps_per_execution if "steps_per_execution" in chosen else None)


@dataclass(frozen=True)
class Defaults:
    task: str  # classification / binary / regression
    loss: str  # a Keras loss name
    from_logits: bool
    optimizer: str  # sgd / adam
    learning_rate: float
    momentum: float
    steps_per_execution: int = 1  # train steps per call of Keras's train function (--steps-per-execution)
    # The default loss's weight (app.models.default_loss_weight, or ``in_their_units``); None: not weighted.
    loss_weight: Optional[float] = None
    weight_of: str = "variance"  # what the weight is 1 over, for the plan
    advice: str = ""  # what the plan adds (targets far from 0 for a model that predicts them in their units)

    def compile(self, model) -> Any:
        import keras

        loss = loss_object(self.loss, self.from_logits)
        if self.task == "binary":  # Keras's "accuracy" thresholds at 0.5, which a logit is not
            metric = keras.metrics.BinaryAccuracy(name="accuracy", threshold=0.0 if self.from_logits else 0.5)
        else:
            metric = DEFAULT_METRIC[self.task]
        model.compile(optimizer=product_optimizer(self.optimizer, self.learning_rate, self.momentum), loss=loss,
                      loss_weights=self.loss_weight, metrics=[metric], steps_per_execution=self.steps_per_execution)
        return model

    def line(self, built_by_product: bool = False) -> str:
        """The plan's line; ``built_by_product``: a built-in model or a function of the product's arguments, whose
        compile the flags choose."""
        optimizer = f"SGD (momentum {self.momentum:g})" if self.optimizer == "sgd" else "Adam"
        what = "the product builds the model, and compiles it" if built_by_product else \
            "the model compiles nothing, so it is compiled"
        choose = "--optimizer, --base-lr, --momentum, --task, --loss, --from-logits choose them" if built_by_product else \
            "compile() it in the model function to choose them"
        return (f"compile: {what} with the {self.task} defaults: loss "
                f"{self.loss}{' (from logits)' if self.from_logits and self.task != 'regression' else ''}"
                + weighted(self.loss_weight, self.weight_of)
                + ", metric "
                f"{DEFAULT_METRIC[self.task]}, optimizer {optimizer} at base_lr {self.learning_rate:g}"
                + (f", {self.steps_per_execution} steps per execution" if self.steps_per_execution > 1 else "")
                + f" ({choose}){self.advice}")


@dataclass(frozen=True)
class CompiledWithDefaults:
    """The user's model function, its model compiled with the run's defaults (or recompiled as the flags ask:
    ``Recompile``; picklable: Ray ships it)."""

    model_fn: Callable[[], Any]
    defaults: Defaults | Recompile

    def __call__(self):
        return self.defaults.compile(self.model_fn())


def decide(model, first_batch: Any, labels: Any, config) -> Defaults:
    """The defaults for ``model`` from its training input: ``first_batch`` (x, y, sample weights) gives the output's
    width, ``labels`` every label the driver holds (or the first batch's)."""
    import keras

    from app.training.model import ends_in_probabilities

    x, y, _ = keras.utils.unpack_x_y_sample_weight(first_batch)
    fix = ("compile it in the model function (model.compile(optimizer=..., loss=..., metrics=[...])) to choose its "
           "loss")
    if y is None:
        raise UserError(f"the model compiles nothing and x has no labels (y), so no loss can be chosen for it: {fix}, "
                        "or give labels")
    output = model(x)
    if not (hasattr(y, "shape") and hasattr(output, "shape")):
        raise UserError(f"the model compiles nothing and its labels or outputs are a {type(y).__name__} / "
                        f"{type(output).__name__}: the product's defaults are for one output; {fix}")
    labels = np.asarray(labels)
    width = int(output.shape[-1]) if len(output.shape) > 1 else 1
    outputs, per_example = tuple(output.shape[1:]), tuple(labels.shape[1:])
    ids = per_example in ((), (1,)) and (labels.dtype.kind in "iub" or labels.dtype.kind == "f" and width > 1 and bool(
        np.isfinite(labels).all() and (labels == np.round(labels)).all() and labels.min() >= 0))  # 0., 1., 2. too
    if ids:
        binary = width == 1 and bool(np.isin(labels, (0, 1)).all())
        task = "binary" if binary else "classification" if width > 1 else "regression"
    elif labels.dtype.kind in "fiu" and per_example == (width,) and width > 1 and _one_hot(labels):
        task = "classification"
    elif per_example == outputs or {per_example, outputs} <= {(), (1,)}:  # a target per output: (n,) for (n, 1) too
        task = "regression"
    else:
        raise UserError(f"the model compiles nothing, its labels are {labels.dtype} of shape {per_example} per "
                        f"example and its output {outputs}: no default loss takes both (class ids with an output "
                        f"per class, one-hot rows as wide as the output, or one target per output); {fix}")
    if config.task != "auto" and config.task != task:
        task = _as_requested(config.task, task, labels, ids, width, per_example, outputs)
    loss = "categorical_crossentropy" if task == "classification" and per_example == (width,) and width > 1 \
        else DEFAULT_LOSS[task]
    from_logits = task != "regression" and not ends_in_probabilities(model)
    if config.loss:
        check_loss_name(config.loss)
    weight = None if config.loss else default_loss_weight(model, task)
    own = task == "regression" and not config.loss and weight is None  # the model predicts in the targets' units
    return Defaults(task=task, loss=config.loss or loss,
                    from_logits=from_logits if config.from_logits is None else config.from_logits,
                    optimizer=config.optimizer, learning_rate=config.base_lr, momentum=config.momentum,
                    steps_per_execution=config.steps_per_execution,
                    **(in_their_units(labels) if own else {"loss_weight": weight}))


# Targets whose mean square passes this are slow to reach from weights near 0 (measured: a Dense model that
# compiles nothing predicts targets of mean 100 no better than 0 after 10 epochs): the plan says what to do.
FAR_TARGETS = 100.0


def in_their_units(labels: np.ndarray) -> dict[str, Any]:
    """The mean squared error's weight for a model of the user's predicting regression targets in their units.

    Targets of scale s give that error gradients of scale s, which the default SGD rate turns into an overflow from
    s = 10 on (measured: the loss is NaN in the first or second epoch). Weighted by 1 / their mean square (when
    above 1), predicting 0 is a loss of 1 and the gradients are those of targets of scale 1: training stays finite
    at any scale. Targets far from 0 stay slow to reach for such a model, and the plan says how to help it."""
    y = labels.astype(np.float64)
    square = float(np.mean(np.square(y))) if y.size and np.isfinite(y).all() else 0.0
    if square <= 1:
        return {}
    advice = ""
    if square > FAR_TARGETS:
        mean, std = float(y.mean()), float(y.std()) or 1.0
        advice = (f"; targets of mean {mean:.4g} and std {std:.4g} are slow to reach from weights near 0: end the "
                  f"model in keras.layers.Rescaling(scale={std:.4g}, offset={mean:.4g}), as the built-in models do, "
                  "or standardise them")
    return {"loss_weight": 1 / square, "weight_of": "mean square", "advice": advice}


def _as_requested(requested: str, found: str, labels: np.ndarray, ids: bool, width: int, per_example: tuple,
                  outputs: tuple) -> str:
    """--task (``task=``) where the labels and the output allow it, else one line naming what they are."""
    if requested == "regression" and labels.dtype.kind in "fiub" and (
            per_example == outputs or {per_example, outputs} <= {(), (1,)}):
        return requested
    if requested == "binary" and ids and width == 1 and bool(np.isin(labels, (0, 1)).all()):
        return requested
    if requested == "classification" and ids and width > 1:
        return requested
    need = {"regression": "one numeric target per output",
            "binary": "labels 0 and 1 and one output (a sigmoid or a logit)",
            "classification": "integer class ids and an output per class"}[requested]
    raise UserError(f"--task {requested} needs {need}; the labels are {labels.dtype} of shape {per_example} per "
                    f"example and the model's output {outputs}, which is a {found} task: leave --task out (auto), or "
                    "give a model and labels of that task")


def _one_hot(labels: np.ndarray) -> bool:
    return bool(np.isin(labels, (0.0, 1.0)).all() and (labels.sum(axis=-1) == 1).all())
