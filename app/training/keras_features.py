"""The product's training features on Keras's own fit, each one what Keras itself provides.

- ``grad_accum`` K: every optimizer the model holds takes ``gradient_accumulation_steps=K`` (Keras's own: the
  update applied every K steps with the mean of the K gradients; the batch is unchanged, so an update stands
  for K global batches). Each step's gradients are still averaged over the workers first
  (app.training.keras_sync), so N workers accumulate what one process would.
- ``mixed_precision`` bf16 / fp16: the model is built under Keras's ``mixed_bfloat16`` / ``mixed_float16`` dtype
  policy (layers compute in 16 bits, variables stay float32); under fp16 Keras's ``compile`` wraps the optimizer
  in a ``LossScaleOptimizer``, whose loss scale is the same on every worker: a step whose summed gradients
  overflow on any worker holds an inf on all of them, so all skip it together (app.training.keras_sync).

- the learning-rate rule, each part only when asked for (``lr_scaling``, ``warmup_epochs``, ``lr_decay``): a
  Keras ``LearningRateSchedule`` wrapped around each optimizer's own rate (a number or the user's own schedule),
  which scales it by the batch behind one update over ``reference_batch`` (linear, or its square root), warms it
  up linearly over the first epochs and decays it to 0 by a cosine over the rest, counted in batches. Nothing
  asked: the optimizer keeps its rate, as in ``model.fit``.

Applied wherever the model function is called (each worker, and the driver that restores the trained model), so
the checkpoint's variables (accumulators, the loss scale) are the same everywhere.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from app import internals
from app.errors import UserError

POLICIES = {"fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


@dataclass(frozen=True)
class KerasFeatures:
    grad_accum: int = 1
    mixed_precision: str = "off"
    lr_scaling: str = "none"  # linear / sqrt: the rate scaled by the batch behind an update / reference_batch
    reference_batch: int = 32
    warmup_epochs: float = 0.0
    lr_decay: str = "constant"  # cosine: to 0 over the run, after the warmup
    batch_size: int = 0  # the global batch (rows of one step over every worker)
    steps_per_epoch: Optional[int] = None  # batches an epoch (None: counted as the workers read)
    epochs: int = 1

    @classmethod
    def of(cls, config, batch_size: int, steps_per_epoch: Optional[int], epochs: int,
           product_optimizer: bool = False) -> "KerasFeatures":
        """The features the run asks for: the learning-rate rule's parts only where given (fields the user set), or,
        for the optimizer the product compiled in (``product_optimizer``: app.training.default_compile), the whole
        rule with the config's defaults (its warmup and decay only where an epoch's batches are known)."""
        given = set(config.model_fields_set)
        if product_optimizer:
            given |= {"lr_scaling"} | ({"warmup_epochs", "lr_decay"} if steps_per_epoch else set())
        return cls(grad_accum=config.grad_accum, mixed_precision=config.mixed_precision,
                   lr_scaling=config.lr_scaling if "lr_scaling" in given else "none",
                   reference_batch=config.reference_batch,
                   warmup_epochs=config.warmup_epochs if "warmup_epochs" in given else 0.0,
                   lr_decay=config.lr_decay if "lr_decay" in given else "constant",
                   batch_size=batch_size, steps_per_epoch=steps_per_epoch, epochs=epochs)

    @property
    def scale(self) -> float:
        rows = self.batch_size * self.grad_accum / self.reference_batch  # rows behind one update / the reference
        return {"linear": rows, "sqrt": math.sqrt(rows)}.get(self.lr_scaling, 1.0)

    @property
    def schedules(self) -> bool:
        return self.scale != 1.0 or self.warmup_epochs > 0 or self.lr_decay == "cosine"

    def check(self) -> None:
        """What cannot run, in one line before any worker starts."""
        if self.steps_per_epoch is None and (self.warmup_epochs > 0 or self.lr_decay == "cosine"):
            raise UserError("warmup_epochs and lr_decay count an epoch's batches, which this input does not know "
                            "before it is read (a tf.data pipeline that reads files): give steps_per_epoch, or leave "
                            "them out")

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Inside: models are built under the run's dtype policy (the caller's policy is back after)."""
        import keras

        policy = POLICIES.get(self.mixed_precision)
        if policy is None:
            yield
            return
        before = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            yield
        finally:
            keras.config.set_dtype_policy(before)

    def apply(self, model, schedules: bool = True) -> None:
        """Gradient accumulation on every optimizer the model holds, before any is built; with ``schedules`` the
        learning-rate rule (the driver's copy of the trained model keeps the user's own rate, which model.keras
        saves: the rule is the run's, not the model's)."""
        from app.training.keras_sync import optimizers_of

        steps = self.steps_per_epoch or 1
        warmup, total, cosine = int(self.warmup_epochs * steps), self.epochs * steps, self.lr_decay == "cosine"
        for optimizer in optimizers_of(model):
            inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's own
            if self.grad_accum > 1:
                inner.gradient_accumulation_steps = self.grad_accum
            if schedules and self.schedules:
                internals.wrap_learning_rate(inner, lambda base: _rule()(base, self.scale, warmup, total, cosine))

    def lines(self) -> list[str]:
        """The plan's lines: what each feature asked for is, in Keras's terms."""
        lines = []
        if self.grad_accum > 1:
            lines.append(f"grad_accum {self.grad_accum}: every optimizer the model holds takes Keras's "
                         f"gradient_accumulation_steps={self.grad_accum} (an update every {self.grad_accum} steps, "
                         "with the mean of their gradients over all their rows, on every worker or replica)")
        if self.schedules:
            parts = ([f"scaled {self.lr_scaling} by {self.batch_size * self.grad_accum} rows an update / "
                      f"reference_batch {self.reference_batch} = x{self.scale:.4g}"] if self.scale != 1.0 else []) + \
                ([f"warmed up linearly from the unscaled rate over {self.warmup_epochs:g} epoch(s)" if self.scale > 1
                  else "no warmup (the rate is not scaled up)"] if self.warmup_epochs > 0 else []) + \
                (["decayed to 0 by a cosine over the run"] if self.lr_decay == "cosine" else [])
            lines.append("learning rate: each optimizer's own rate, " + ", ".join(parts)
                         + " (a Keras LearningRateSchedule around it, counted in batches)")
        if self.mixed_precision in POLICIES:
            lines.append(f"mixed_precision {self.mixed_precision}: the model is built under Keras's "
                         f"{POLICIES[self.mixed_precision]} dtype policy (variables float32)"
                         + ("; compile() wraps its optimizer in a LossScaleOptimizer, whose skipped steps every "
                            "worker skips together" if self.mixed_precision == "fp16" else ""))
        return lines


def build(model_fn: Any, features: KerasFeatures, schedules: bool = True):
    """The user's model, built as the run's features ask."""
    with features.building():
        model = model_fn()
    features.apply(model, schedules)
    return model


def _rule():
    """The learning-rate rule's schedule class (made on first use: Keras is imported only where the model is)."""
    global _Rule
    if _Rule is None:
        import keras

        # Registered, and its base (de)serialized: a copy of the optimizer (ZeRO's unsharded template is a deepcopy,
        # which Keras makes by saving and loading) rebuilds it.
        @keras.saving.register_keras_serializable(package="app")
        class Rule(keras.optimizers.schedules.LearningRateSchedule):
            """The user's rate (a number or their schedule) x scale, warmed up and decayed, at a batch ``step``: on a
            number, what Keras's ``CosineDecay(min(rate, peak), total - warmup, warmup_target=peak,
            warmup_steps=warmup)`` gives (tests/test_keras_features.py), also with the user's own schedule or without
            the decay. The warmup ramps from the unscaled rate up to the scaled one, as Goyal et al. do (never from
            above it), as the product's own step does (app.training.optim.lr_schedule)."""

            def __init__(self, base, scale: float, warmup: int, total: int, cosine: bool):
                self.base, self.scale, self.warmup, self.total, self.cosine = base, scale, warmup, total, cosine

            def __call__(self, step):
                from keras import ops

                step = ops.cast(step, "float32")
                rate = (self.base(step) if callable(self.base) else self.base) * self.scale
                if self.warmup:
                    start = min(1.0, 1.0 / self.scale)  # the unscaled rate, as a part of the scaled one
                    rate = rate * (start + (1.0 - start) * ops.minimum(1.0, step / self.warmup))
                if self.cosine:
                    done = ops.clip((step - self.warmup) / max(1, self.total - self.warmup), 0.0, 1.0)
                    rate = rate * 0.5 * (1.0 + ops.cos(math.pi * done))
                return rate

            def get_config(self):
                base = keras.saving.serialize_keras_object(self.base) if callable(self.base) else self.base
                return {"base": base, "scale": self.scale, "warmup": self.warmup, "total": self.total,
                        "cosine": self.cosine}

            @classmethod
            def from_config(cls, config):
                base = config["base"]
                return cls(**{**config, "base": keras.saving.deserialize_keras_object(base)
                              if isinstance(base, dict) else base})

        _Rule = Rule
    return _Rule


_Rule = None
