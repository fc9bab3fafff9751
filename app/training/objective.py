"""What is minimised, what is reported and what optimises: from the model's compile(), the flags, or the task.

A model function may return a compiled model, as a Keras script has it
(``model.compile(optimizer=Adam(1e-3), loss="categorical_crossentropy",
metrics=["accuracy", AUC()])``): its optimizer (class and settings; its
learning rate is the base LR the scaling rule starts from), its loss and its
metrics are the run's. A flag the user typed (``--loss``, ``--optimizer``,
``--base-lr``) overrides compile(); the plan says where each setting came from.
An uncompiled model gets the task's:

| task           | default loss                         | default metric              |
|----------------|--------------------------------------|-----------------------------|
| classification | sparse categorical cross-entropy     | accuracy (one-hot: categorical) |
| binary         | binary cross-entropy                 | accuracy (p > 0.5, logit > 0)   |
| regression     | mean squared error                   | mae (mean absolute error)   |

Whether an uncompiled model outputs logits is read from its last activation
(softmax / sigmoid: probabilities), or given with ``--from-logits``.

The driver decides once (``objective_for``), with the model it built to check
the data; each worker binds the decision to the model its own call of the
model function returns (app.training.measures), which is how compile()'s
objects are rebuilt inside every worker's strategy scope.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from app import internals
from app.backend import backend_of
from app.errors import UserError
from app.training.default_compile import DEFAULT_LOSS, check_loss_name

# Which way a metric is better, read from its name (Keras's names, and most users'). The run's metric (the
# first reported one whose way is known; else the loss) ranks epochs, kept checkpoints and Tune's trials.
_HIGHER = re.compile(r"acc|auc|precision|recall|f1|fbeta|iou|r2|specificity|sensitivity|cosine|true_")
_LOWER = re.compile(r"loss|error|crossentropy|hinge|divergence|poisson|cosh|false_|(^|_)(mae|mse|rmse|mape|msle)(_|$)")
# Keys an epoch record already uses as train_<key> / val_<key>: a metric may not be called so.
RESERVED = ("loss", "samples", "seconds")


def metric_mode(metric: str) -> Optional[str]:
    """"max" or "min": which way ``metric`` (a name, or val_/train_<name>) is better; None if its name does not say."""
    name = metric.split("_", 1)[1] if metric.startswith(("val_", "train_")) else metric
    name = name.lower()
    if _HIGHER.search(name):
        return "max"
    return "min" if _LOWER.search(name) else None


def metric_in(record: dict) -> str:
    """The run's metric in an epoch record or result's metrics: the first val_<name> whose way is known."""
    names = [k[4:] for k in record if k.startswith("val_") and k not in ("val_loss", "val_samples")]
    return next((n for n in names if metric_mode(n)), "loss")


def metric_names_in(record: dict) -> list[str]:
    """Every metric an epoch record carries (val_<name> keys), the loss first."""
    return ["loss", *(k[4:] for k in record if k.startswith("val_") and k not in ("val_loss", "val_samples"))]


# The flags that ask for the product's LR scaling features; a compiled optimizer without any of them trains at its
# own LR, as model.fit would (field name -> flag, for messages).
LR_FLAGS = {"base_lr": "--base-lr", "lr_scaling": "--lr-scaling", "reference_batch": "--reference-batch",
            "warmup_epochs": "--warmup-epochs", "lr_decay": "--lr-decay"}


@dataclass(frozen=True)
class Objective:
    """The run's loss, metrics and optimizer source, decided by the driver; handed to every worker."""

    task: str
    loss_name: str
    from_logits: bool
    metric_names: tuple[str, ...] = ("accuracy",)
    label_shape: tuple[int, ...] = ()  # one example's label: () class id or value, (k,) one-hot or k targets
    output_shape: tuple[int, ...] = ()  # one example's model output
    compiled_loss: bool = False  # the loss is the compiled model's (each worker takes it from its own model)
    compiled_metrics: bool = False
    compiled_optimizer: Optional[str] = None  # the compiled optimizer's class; None: --optimizer
    base_lr: Optional[float] = None  # the compiled optimizer's LR, where the scaling rule starts; None: --base-lr
    # The compiled optimizer's LR (a number or its own schedule) trains as compiled, as model.fit would: no scaling
    # rule, warm-up or decay, because the run typed none of LR_FLAGS (app.training.optim.plan_lr).
    lr_as_compiled: bool = False
    class_weights: Optional[tuple[float, ...]] = None  # --class-weight, per class id
    # The default loss's weight (app.models.default_loss_weight); None: not weighted.
    loss_weight: Optional[float] = None
    # A model with several outputs: per output (name, label shape, output shape, label dtype, task); else ().
    outputs: tuple[tuple[str, tuple[int, ...], tuple[int, ...], str, str], ...] = ()
    sources: tuple[tuple[str, str], ...] = field(default=())  # (setting, where it came from), for the plan

    @property
    def metric(self) -> str:
        return next((n for n in self.metric_names if metric_mode(n)), "loss")

    @property
    def mode(self) -> str:
        return metric_mode(self.metric) or "min"

    @property
    def label_dtype(self) -> str:
        return "float32" if self.label_shape or self.task == "regression" else "int64"

    def summary(self, config) -> dict[str, Any]:
        """What result.json says of it: optimizer, loss, metrics, and where each came from."""
        return {"optimizer": self.compiled_optimizer or config.optimizer, "loss": self.loss_name,
                "metrics": list(self.metric_names), "metric": f"val_{self.metric}", "mode": self.mode,
                "from": dict(self.sources), **({"class_weights": list(self.class_weights)} if self.class_weights else {})}


def describe(obj: Any) -> str:
    """A loss, metric or optimizer as the plan names it."""
    if isinstance(obj, str):
        return obj
    return getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__


def describe_each(obj: Any) -> str:
    """A loss per output (a dict or list) as the plan names it: "out_a: mse, out_b: crossentropy"."""
    if isinstance(obj, dict):
        return ", ".join(f"{k}: {describe(v)}" for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return ", ".join(describe(v) for v in obj)
    return describe(obj)


def objective_for(config, facts, model, output_shape: Any) -> Objective:
    """The run's objective from the flags, the model's compile() and the data's task and labels.

    ``output_shape``: one example's output shape, or {output name: shape} (app.training.model.check_output).
    """
    from app.models import default_loss_weight
    from app.training.model import ends_in_probabilities

    args = internals.compile_arguments(model) or {}
    typed = config.model_fields_set
    sources: list[tuple[str, str]] = []
    outputs = ()
    if isinstance(output_shape, dict):
        if args.get("loss") is None or config.loss is not None:
            raise UserError("a model with several outputs takes its losses from compile(loss=...): compile it with "
                            "a loss per output (a dict by output name), and leave out --loss")
        outputs = tuple((name, shape, tuple(output_shape[name]), "float32" if shape or task == "regression"
                         else "int64", task) for name, (shape, task) in facts.outputs.items())
        output_shape = ()

    compiled_loss = config.loss is None and args.get("loss") is not None
    loss = _loss(config, facts, args, compiled_loss, sources)
    from_logits = config.from_logits if config.from_logits is not None else not ends_in_probabilities(model)

    compiled_metrics = bool(args.get("metrics") or args.get("weighted_metrics"))
    sources.append(("metrics", "compile()" if compiled_metrics else f"the {facts.task} default"))

    compiled = args.get("optimizer") is not None and "optimizer" not in typed
    as_compiled = compiled and not typed & set(LR_FLAGS)
    optimizer, base_lr = _compiled_lr(config, model, as_compiled, sources) if compiled else (None, None)
    sources.insert(0, ("optimizer", "compile()" if compiled else "--optimizer" if "optimizer" in typed else "default"))

    objective = Objective(
        task=facts.task, loss_name=loss,
        loss_weight=None if compiled_loss or config.loss else default_loss_weight(model, facts.task),
        from_logits=from_logits if facts.task != "regression" else False,
        label_shape=tuple(facts.label_shape), output_shape=tuple(output_shape),
        compiled_loss=compiled_loss, compiled_metrics=compiled_metrics,
        compiled_optimizer=optimizer, base_lr=base_lr, lr_as_compiled=as_compiled,
        class_weights=class_weights(config, facts), sources=tuple(sources), outputs=outputs,
    )
    return objective


def _loss(config, facts, args: dict, compiled_loss: bool, sources: list) -> str:
    """The loss's name: compile()'s (each output's), --loss, or the task's default (checked against Keras)."""
    if compiled_loss:
        sources.append(("loss", "compile()"))
        return describe_each(args["loss"])
    one_hot = facts.task == "classification" and bool(facts.label_shape)
    loss = config.loss or ("categorical_crossentropy" if one_hot else DEFAULT_LOSS[facts.task])
    check_loss_name(loss)
    sources.append(("loss", "--loss" if config.loss else f"the {facts.task} default"))
    return loss


def _compiled_lr(config, model, as_compiled: bool, sources: list) -> tuple[str, Optional[float]]:
    """The compiled optimizer's class and its LR as a number (None: a schedule, or --base-lr's)."""
    typed = config.model_fields_set
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # compile() may wrap it for fp16
    optimizer = type(inner).__name__
    lr = inner.get_config().get("learning_rate")
    if "base_lr" in typed:
        sources.append(("learning rate", "--base-lr"))
    elif isinstance(lr, (int, float)):
        sources.append(("learning rate", "compile()"))
        return optimizer, float(lr)
    elif as_compiled and not backend_of(config).parameter_servers:
        # Its own LearningRateSchedule, stepped by the optimizer's iterations as in model.fit.
        sources.append(("learning rate", "compile()'s schedule"))
    elif as_compiled:
        raise UserError(f"the compiled optimizer {optimizer} has a learning-rate schedule, which asynchronous "
                        "parameter-server workers cannot step (they lose counts of the optimizer's iterations): "
                        "compile with a number as the learning rate, or use the default strategy")
    else:
        flag = LR_FLAGS[sorted(typed & set(LR_FLAGS))[0]]
        raise UserError(f"the compiled optimizer {optimizer} has a learning-rate schedule, and {flag} "
                        "asks this product to schedule the LR itself: drop the flag to train with the compiled "
                        "schedule as it is, or compile with a number (the base LR the scaling starts from)")
    return optimizer, None


def class_weights(config, facts) -> Optional[tuple[float, ...]]:
    """--class-weight: "balanced" (n / (classes x count), as scikit-learn's) or a JSON object {class: weight}."""
    spec = config.class_weight
    if spec is None:
        return None
    if facts.task == "regression":
        raise UserError("--class-weight weighs classes, but this is a regression task: drop it")
    if facts.outputs is not None:
        raise UserError("--class-weight weighs the classes of one label, but the model has several outputs: "
                        "give sample weights from the data function, (x, y, sample_weight), instead")
    k = facts.num_classes
    if spec == "balanced" and facts.class_counts is not None:
        counts = facts.class_counts
        total = sum(counts)
        return tuple(total / (k * c) if c else 0.0 for c in counts)
    weights = [1.0] * k
    for key, w in given_class_weights(spec, k).items():
        weights[key] = w
    return tuple(weights)


def given_class_weights(spec: str, k: Optional[int] = None) -> dict[int, float]:
    """--class-weight's JSON object as Keras's class_weight {class id: weight} (ids that index ``k`` classes, where
    they are known); "balanced" here is one line: its counts are not known (streamed data, before training)."""
    import json

    example = "e.g. '{\"0\": 1.0, \"1\": 5.0}'"
    if spec == "balanced":
        raise UserError(f"--class-weight balanced needs the labels' counts, which streamed data does not give before "
                        f"training: give the weights as JSON, {example}")
    try:
        given = {int(key): float(w) for key, w in json.loads(spec).items()}
        if k is not None and any(not -k <= key < k for key in given):  # as a list of k weights indexes them
            raise IndexError
    except (ValueError, TypeError, AttributeError, IndexError):
        ids = f"class ids 0..{k - 1}" if k is not None else "class ids"
        raise UserError(f"--class-weight {spec!r}: give 'balanced' or a JSON object of {ids} to weights, "
                        f"{example}") from None
    return given
