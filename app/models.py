"""Model registry: name -> a function that builds a Keras 3 model.

Models output logits in float32; the loss applies the softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import keras

    from app.config import TrainConfig


def build_mlp(config: "TrainConfig", feature_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
    import keras

    inputs = keras.Input(shape=feature_shape, name="x")
    h = keras.layers.Flatten()(inputs)
    for i, units in enumerate(config.hidden_units):
        h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(h)
    return keras.Model(inputs, logits, name="mlp")


MODELS: dict[str, Callable[..., "keras.Model"]] = {"mlp": build_mlp}


def build_model(config: "TrainConfig", feature_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
    import keras

    # Same seed on every worker: replicas start identical (MWMS also broadcasts
    # the initial values, but a seeded init makes runs reproducible).
    keras.utils.set_random_seed(config.seed)
    return MODELS[config.model](config, feature_shape, num_classes)
