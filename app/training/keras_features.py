"""The product's training features on Keras's own fit, each one what Keras itself provides.

- ``grad_accum`` K: every optimizer the model holds takes ``gradient_accumulation_steps=K`` (Keras's own: the
  update applied every K steps with the mean of the K gradients; the batch is unchanged, so an update stands
  for K global batches). Each step's gradients are still averaged over the workers first
  (app.training.keras_sync), so N workers accumulate what one process would.
- ``mixed_precision`` bf16 / fp16: the model is built under Keras's ``mixed_bfloat16`` / ``mixed_float16`` dtype
  policy (layers compute in 16 bits, variables stay float32); under fp16 Keras's ``compile`` wraps the optimizer
  in a ``LossScaleOptimizer``, whose loss scale is the same on every worker: a step whose summed gradients
  overflow on any worker holds an inf on all of them, so all skip it together (app.training.keras_sync).

Applied wherever the model function is called (each worker, and the driver that restores the trained model), so
the checkpoint's variables (accumulators, the loss scale) are the same everywhere.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

POLICIES = {"fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


@dataclass(frozen=True)
class KerasFeatures:
    grad_accum: int = 1
    mixed_precision: str = "off"

    @classmethod
    def of(cls, config) -> "KerasFeatures":
        return cls(grad_accum=config.grad_accum, mixed_precision=config.mixed_precision)

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

    def apply(self, model) -> None:
        """Gradient accumulation on every optimizer the model holds, before any is built."""
        from app.training.keras_sync import optimizers_of

        if self.grad_accum > 1:
            for optimizer in optimizers_of(model):
                inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's own
                inner.gradient_accumulation_steps = self.grad_accum

    def lines(self) -> list[str]:
        """The plan's lines: what each feature asked for is, in Keras's terms."""
        lines = []
        if self.grad_accum > 1:
            lines.append(f"grad_accum {self.grad_accum}: every optimizer the model holds takes Keras's "
                         f"gradient_accumulation_steps={self.grad_accum} (an update every {self.grad_accum} steps, "
                         "with the mean of their gradients over every worker's rows)")
        if self.mixed_precision in POLICIES:
            lines.append(f"mixed_precision {self.mixed_precision}: the model is built under Keras's "
                         f"{POLICIES[self.mixed_precision]} dtype policy (variables float32)"
                         + ("; compile() wraps its optimizer in a LossScaleOptimizer, whose skipped steps every "
                            "worker skips together" if self.mixed_precision == "fp16" else ""))
        return lines


def build(model_fn: Any, features: KerasFeatures):
    """The user's model, built as the run's features ask."""
    with features.building():
        model = model_fn()
    features.apply(model)
    return model
