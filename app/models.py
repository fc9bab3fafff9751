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


def build_cnn(config: "TrainConfig", feature_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
    """The seeds' CIFAR-style conv net: stages of two 3x3 conv + batch norm + ReLU, 2x2 max pooling between.

    Batch norm is not synchronised across workers by default (--sync-batch-norm
    turns it on): each replica normalises with its own batch's statistics, as
    Horovod and PyTorch DDP do by default. With 32+ images per replica those
    statistics are good, and synchronising costs one all-reduce per BN layer per
    step in the forward pass, on the critical path. Synchronise when the
    per-replica batch is small (detection, segmentation: a handful per replica).
    The moving averages used at inference are updated by each replica from its
    own batch and averaged over all replicas at the end of every epoch
    (``Loop``), so evaluation and the exported model use one value.
    """
    import keras

    if len(feature_shape) == 2:  # (h, w) grayscale
        feature_shape = (*feature_shape, 1)
    if len(feature_shape) != 3:
        raise ValueError(f"cnn needs images (height, width[, channels]), got examples of shape {feature_shape}")
    inputs = keras.Input(shape=feature_shape, name="x")
    h = inputs
    for stage, filters in enumerate(config.conv_filters):
        if stage > 0 and min(h.shape[1], h.shape[2]) >= 2:
            h = keras.layers.MaxPooling2D(name=f"pool_{stage}")(h)
        for j in range(2):
            h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv_{stage}_{j}")(h)
            h = keras.layers.BatchNormalization(synchronized=config.sync_batch_norm, name=f"bn_{stage}_{j}")(h)
            h = keras.layers.ReLU(name=f"relu_{stage}_{j}")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(h)
    return keras.Model(inputs, logits, name="cnn")


def build_transformer(config: "TrainConfig", feature_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
    """The seeds' text classifier: token + position embeddings, N post-norm encoder blocks, mean pooling, head.

    Inputs are token ids (app.text; 0 = padding) carried as float32 like every
    feature, cast back to int32 here. Padding is masked out of the attention
    keys and out of the pooling, so a short text is not diluted by its padding.
    """
    import keras

    if len(feature_shape) != 1:
        raise ValueError(f"transformer needs token id sequences (length,), got examples of shape {feature_shape}")
    length = feature_shape[0]
    inputs = keras.Input(shape=feature_shape, name="x")
    ids = keras.ops.cast(inputs, "int32")
    mask = keras.ops.not_equal(ids, 0)
    tokens = keras.layers.Embedding(config.vocab_size, config.embed_dim, name="token_embedding")(ids)
    positions = keras.layers.Embedding(length, config.embed_dim, name="position_embedding")(
        keras.ops.arange(length, dtype="int32")
    )
    h = tokens + positions
    for i in range(config.num_blocks):
        attn = keras.layers.MultiHeadAttention(
            config.num_heads, config.embed_dim // config.num_heads, name=f"attention_{i}"
        )(h, h, query_mask=mask, value_mask=mask)
        h = keras.layers.LayerNormalization(name=f"norm_attention_{i}")(h + attn)
        ff = keras.layers.Dense(config.ff_dim, activation="relu", name=f"ff_in_{i}")(h)
        ff = keras.layers.Dense(config.embed_dim, name=f"ff_out_{i}")(ff)
        h = keras.layers.LayerNormalization(name=f"norm_ff_{i}")(h + ff)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h, mask=mask)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(pooled)
    return keras.Model(inputs, logits, name="transformer")


MODELS: dict[str, Callable[..., "keras.Model"]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "transformer": build_transformer,
}

PRECISION_POLICIES = {"off": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}


def build_model(config: "TrainConfig", feature_shape: tuple[int, ...], num_classes: int) -> "keras.Model":
    import keras

    # Same seed on every worker: replicas start identical (MWMS also broadcasts
    # the initial values, but a seeded init makes runs reproducible).
    keras.utils.set_random_seed(config.seed)
    # Layers take the policy when they are created: compute in fp16/bf16, variables in float32.
    # Every model's last layer is float32 (dtype="float32"), so logits and the loss are.
    keras.mixed_precision.set_global_policy(PRECISION_POLICIES[config.mixed_precision])
    return MODELS[config.model](config, feature_shape, num_classes)
