"""What trained: the compile in force for a run by Keras's fit, and the config fields it left without effect.

A model compiled by the user trains with its own optimizer, rate, loss and metrics; the product's ``optimizer``,
``base_lr``, ``momentum``, ``loss`` and the learning-rate rule's defaults then do nothing (nor do the built-in models' options
--hidden-units, ... for a model function that does not take them), and the run's record
(the plan, ``result.json``, ``config.yaml``) must not list them as in force. Decided once in the driver, from the
driver's model after any compile the product made (``app.training.default_compile``), and read by every record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Who compiled what trained.
BY_MODEL = "the model's own compile()"
BY_FLAGS = "the model's own compile(), with the run's flags over it"
BY_PRODUCT = "the product's defaults"


@dataclass(frozen=True)
class Compiled:
    by: str  # BY_MODEL / BY_FLAGS / BY_PRODUCT
    optimizers: list[dict[str, Any]] = field(default_factory=list)  # {"name", "class", "learning_rate"} each
    loss: Any = None  # the compiled loss's name(s); None: the model's own step computes its own
    metrics: list[str] = field(default_factory=list)
    unused: tuple[str, ...] = ()  # config fields this run's training did not read (their defaults: not in force)

    def as_dict(self) -> dict[str, Any]:
        return {"by": self.by, "optimizers": self.optimizers, "loss": self.loss, "metrics": self.metrics,
                "not_in_force": list(self.unused)}

    def line(self) -> str:
        """The plan's line for a model that compiled itself (the product's own compiles say theirs)."""
        optimizers = ", ".join(f"{o['class']} at learning rate {o['learning_rate']}"
                               + (f" ({o['name']})" if len(self.optimizers) > 1 else "") for o in self.optimizers)
        parts = ([f"optimizer {optimizers}"] if optimizers else []) + \
            ([f"loss {self.loss}"] if self.loss else []) + ([f"metrics {', '.join(self.metrics)}"] if self.metrics else [])
        return (f"compile: {BY_MODEL}: " + ("; ".join(parts) or "no optimizer, loss or metric")
                + " (--optimizer, --base-lr, --momentum and --loss change them; the product's defaults of these do not "
                "apply)")


def of(model, by: str, chosen: set[str], features: Any, config: Any) -> Compiled:
    """The compile ``model`` holds (after the product's own, if any) and the fields without effect: the compile's
    fields the model's compile decided (``chosen``: the fields the run set), and the LR rule's parts not applied."""
    from app import internals
    from app.training.default_compile import COMPILE_FIELDS, loss_name
    from app.training.keras_sync import optimizers_of

    if by == BY_PRODUCT:
        unused = {"momentum"} if config.optimizer != "sgd" else set()
    elif by == BY_FLAGS:
        unused = {f for f in COMPILE_FIELDS if f not in chosen}
        unused -= {"base_lr", "momentum"} if "optimizer" in chosen else set()
        unused -= {"from_logits"} if "loss" in chosen else set()
    else:
        unused = set(COMPILE_FIELDS)
    unused |= {f for f, off in (("lr_scaling", "none"), ("warmup_epochs", 0.0), ("lr_decay", "constant"))
               if getattr(features, f) == off and getattr(config, f) != off}
    if features.lr_scaling == "none":
        unused.add("reference_batch")
    unused |= set(_options_not_taken(config))
    args = internals.compile_arguments(model) or {}
    names = {id(v): k for k, v in vars(model).items() if not k.startswith("_")}
    optimizers = [{"name": names.get(id(o), "optimizer"), "class": type(_inner(o)).__name__,
                   "learning_rate": _rate(_inner(o))} for o in optimizers_of(model)]
    metrics = [_name(m) for key in ("metrics", "weighted_metrics") for m in _flat(args.get(key))]
    return Compiled(by=by, optimizers=optimizers, loss=loss_name(model) or None, metrics=metrics,
                    unused=tuple(f for f in type(config).model_fields if f in unused and f not in chosen))


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's own


def _rate(optimizer) -> Any:
    """The rate as compiled: a number as written (a float32 variable reads 0.0010000000475), or the schedule's
    class."""
    from app import internals

    given = internals.learning_rate_schedule(optimizer)
    if hasattr(given, "numpy"):
        return float(f"{float(given.numpy()):.7g}")
    return type(given).__name__ if not isinstance(given, (int, float)) else given


def _flat(value) -> list:
    import keras

    return [v for v in keras.tree.flatten(value) if v is not None] if value is not None else []


def _name(metric) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "name", None) or getattr(metric, "__name__", "?")


def _options_not_taken(config) -> list[str]:
    """The built-in models' options (--hidden-units, ...) the run's model function does not take: they size
    nothing (a function the registry cannot resolve here: none named)."""
    from app import registry
    from app.training.model import BUILTIN_OPTIONS, not_taken

    try:
        return not_taken(registry.resolve(config.model, registry.MODELS), BUILTIN_OPTIONS)[0]
    except Exception:  # a record, not a check: the model was resolved and built before this
        return []
