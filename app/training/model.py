"""The model of a run: a built-in or a user's function, called with what it declares, checked against the task.

A model function may declare any of ``input_shape`` (one example's shape),
``num_classes`` (classification; 2 for binary), ``num_outputs`` (what the
last layer must produce: classes, or 1 for binary and regression) and the
entries of ``--model-args``; built-in models also take their config fields
(``hidden_units``, ``conv_filters``, ...). It returns a Keras 3 model:
functional, Sequential or subclassed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app import registry
from app.data.arrays import DataFacts
from app.errors import UserError

if TYPE_CHECKING:
    import keras

    from app.config import TrainConfig

PRECISION_POLICIES = {"off": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}
# Config fields the built-in models take by name (users' functions may too).
BUILTIN_OPTIONS = ("hidden_units", "conv_filters", "sync_batch_norm", "vocab_size", "embed_dim", "num_heads",
                   "ff_dim", "num_blocks", "embedding_shards")


def num_outputs(facts: DataFacts) -> int:
    return facts.num_classes if facts.task == "classification" else 1


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
    fn = registry.resolve(config.model, registry.MODELS)
    available: dict[str, Any] = {
        "input_shape": tuple(facts.feature_shape),
        # Images stored as flat rows (the built-in digits) say their shape; image models reshape to it.
        **({"image_shape": facts.image_shape} if facts.image_shape else {}),
        "num_outputs": num_outputs(facts),
        **({"num_classes": facts.num_classes} if facts.num_classes else {}),
        **{k: getattr(config, k) for k in BUILTIN_OPTIONS},
        **config.model_args,
    }
    name = model_name(config)
    model = registry.call_with_declared(fn, available, name, required=tuple(config.model_args))
    if not isinstance(model, keras.Model):
        raise UserError(f"{name} returned a {type(model).__name__}; expected a keras.Model")
    return model


def check_output(model: "keras.Model", facts: DataFacts, name: str) -> tuple[int, ...]:
    """Build the model on one example and check its output against the task; returns the output shape."""
    import numpy as np

    try:
        out = model(np.zeros((2, *facts.feature_shape), np.float32), training=False)
    except Exception as e:
        raise UserError(
            f"{name} does not accept examples of shape {tuple(facts.feature_shape)}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    shape = tuple(out.shape[1:])
    want = num_outputs(facts)
    got = int(np.prod(shape)) if shape else 1
    if got != want:
        what = {"classification": f"{facts.num_classes} classes", "binary": "a binary task",
                "regression": "a regression target"}[facts.task]
        raise UserError(f"{name} outputs {got} value(s) per example (shape {shape}), but {what} needs {want}")
    return shape


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
