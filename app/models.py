"""The built-in models: plain functions of (input_shape, num_outputs, **options), as users' own are.

Each returns an uncompiled Keras 3 model whose last layer outputs float32
logits (one per class, or one for binary and regression), so that mixed
precision never reaches the loss; a regression's outputs are in the targets'
units when the run gives their mean and variance (``in_target_units``).
app.training.model calls them exactly as it calls a user's ``file.py:function``:
with the arguments they declare.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    import keras


# The built-in mlp's first layer when the run gives it the training rows' moments (app.training.model), and what
# the plan says of it.
STANDARDIZE = "standardize"
STANDARDIZED = ", its inputs standardised by the training rows' mean and variance"
# A built-in's last layer in a regression whose targets the run read before training, and what the plan says of it.
IN_TARGET_UNITS = "in_target_units"
RESCALED = ", its output in the targets' units (the training rows' mean and standard deviation)"


def scaled(model: "keras.Model") -> str:
    """What the plan's model line adds for a built-in's constants (``STANDARDIZED``, ``RESCALED``), "" for none."""
    names = {layer.name for layer in model.layers}
    return (STANDARDIZED if STANDARDIZE in names else "") + (RESCALED if IN_TARGET_UNITS in names else "")


def in_target_units(logits, target_mean: Any, target_variance: Any):
    """A regression's output in the targets' units: the Dense layer below predicts them standardised (mean 0,
    variance 1), so a target of 300,000 starts near its mean rather than 0, and with the loss weighted by
    1 / variance (app.training.default_compile) its gradients are those of a target of scale 1 at any scale. A
    constant of the model, as the inputs' standardisation is: the exported model predicts raw targets. A float
    each for one target, a list (one per target) for several."""
    import keras
    import numpy as np

    if target_mean is None or target_variance is None:
        return logits
    return keras.layers.Rescaling(scale=np.sqrt(target_variance).tolist(), offset=target_mean, dtype="float32",
                                  name=IN_TARGET_UNITS)(logits)


def default_loss_weight(model: "keras.Model", task: str) -> Optional[float]:
    """The weight of the task's default loss for ``model``: 1 / the targets' variance (several targets: the mean of
    theirs) for a regression's built-in that predicts in their units (``in_target_units``), so that the loss of
    predicting their mean is 1 and its gradients those of targets of scale 1; None (unweighted) otherwise. Keras's
    fit (app.training.default_compile) and the parameter servers' own loop (app.training.objective) both ask here."""
    import numpy as np

    layer = next((layer for layer in model.layers if layer.name == IN_TARGET_UNITS), None)
    return 1 / float(np.mean(np.square(layer.scale))) if task == "regression" and layer is not None else None


def weighted(loss_weight: Optional[float], of: str = "variance") -> str:
    """What the plan adds to the loss's name for ``default_loss_weight``'s weight ("" for none); ``of``: what the
    weight is 1 over (app.training.default_compile weighs a user's model by the targets' mean square)."""
    return f" weighted by 1 / the targets' {of} ({1 / loss_weight:.4g})" if loss_weight else ""


def build_mlp(
    input_shape: tuple[int, ...], num_outputs: int, hidden_units: Sequence[int] = (256, 128),
    feature_mean: Optional[Sequence[float]] = None, feature_variance: Optional[Sequence[float]] = None,
    target_mean: Any = None, target_variance: Any = None,
) -> "keras.Model":
    """Dense layers over the flattened features, standardised first with the training rows' mean and variance
    (which the run gives for tabular columns it read before training): columns on scales from 0.1 to 1,000s train
    at the default learning rate, and the exported model takes them as they are. In float32 under mixed precision:
    a raw value past 65,504 is no float16."""
    import keras

    inputs = keras.Input(shape=input_shape, name="x")
    h = keras.layers.Flatten()(inputs)
    if feature_mean is not None and feature_variance is not None:
        h = keras.layers.Normalization(mean=feature_mean, variance=feature_variance, dtype="float32",
                                       name=STANDARDIZE)(h)
    for i, units in enumerate(hidden_units):
        h = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(h)
    logits = keras.layers.Dense(num_outputs, dtype="float32", name="logits")(h)
    return keras.Model(inputs, in_target_units(logits, target_mean, target_variance), name="mlp")


def build_cnn(
    input_shape: tuple[int, ...], num_outputs: int, conv_filters: Sequence[int] = (32, 64, 128),
    sync_batch_norm: bool = False, image_shape: Optional[tuple[int, ...]] = None,
    target_mean: Any = None, target_variance: Any = None,
) -> "keras.Model":
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

    ``image_shape``: rows that are flattened images (the built-in digits) are reshaped to it inside the model,
    so the data and the exported model keep their flat rows.
    """
    import keras

    flat = len(input_shape) == 1 and image_shape is not None and math.prod(image_shape) == input_shape[0]
    if len(input_shape) not in (2, 3) and not flat:
        raise ValueError(
            f"cnn needs images (height, width[, channels]), got examples of shape {tuple(input_shape)}: "
            "use --model mlp for tabular data, or --feature-shape H W C"
        )
    inputs = keras.Input(shape=input_shape, name="x")
    h = keras.layers.Reshape(tuple(image_shape), name="image")(inputs) if flat else inputs
    h = keras.layers.Reshape((*h.shape[1:], 1), name="channels")(h) if len(h.shape) == 3 else h
    for stage, filters in enumerate(conv_filters):
        if stage > 0 and min(h.shape[1], h.shape[2]) >= 2:
            h = keras.layers.MaxPooling2D(name=f"pool_{stage}")(h)
        for j in range(2):
            h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv_{stage}_{j}")(h)
            h = keras.layers.BatchNormalization(synchronized=sync_batch_norm, name=f"bn_{stage}_{j}")(h)
            h = keras.layers.ReLU(name=f"relu_{stage}_{j}")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    logits = keras.layers.Dense(num_outputs, dtype="float32", name="logits")(h)
    return keras.Model(inputs, in_target_units(logits, target_mean, target_variance), name="cnn")


def build_transformer(
    input_shape: tuple[int, ...], num_outputs: int, vocab_size: int = 8192, embed_dim: int = 64, num_heads: int = 4,
    ff_dim: int = 128, num_blocks: int = 2, embedding_shards: int = 1,
    target_mean: Any = None, target_variance: Any = None,
) -> "keras.Model":
    """The seeds' text classifier: token + position embeddings, N post-norm encoder blocks, mean pooling, head.

    Inputs are token ids (app.text; 0 = padding) carried as float32 like every
    feature, cast back to int32 here. Padding is masked out of the attention
    keys and out of the pooling, so a short text is not diluted by its padding.
    With ``embedding_shards`` K > 1 the token table is an app.layers.ShardedEmbedding
    of K shards (spread over the parameter servers under parameter-server training).
    """
    import keras

    if len(input_shape) != 1:
        raise ValueError(f"transformer needs token id sequences (length,), got examples of shape {tuple(input_shape)}")
    from app.layers import PositionEmbedding, ShardedEmbedding

    inputs = keras.Input(shape=input_shape, name="x")
    ids = keras.ops.cast(inputs, "int32")
    mask = keras.ops.not_equal(ids, 0)
    if embedding_shards > 1:
        tokens = ShardedEmbedding(vocab_size, embed_dim, embedding_shards, name="token_embedding")(ids)
    else:
        tokens = keras.layers.Embedding(vocab_size, embed_dim, name="token_embedding")(ids)
    h = PositionEmbedding(name="position_embedding")(tokens)
    for i in range(num_blocks):
        attn = keras.layers.MultiHeadAttention(
            num_heads, embed_dim // num_heads, name=f"attention_{i}"
        )(h, h, query_mask=mask, value_mask=mask)
        h = keras.layers.LayerNormalization(name=f"norm_attention_{i}")(h + attn)
        ff = keras.layers.Dense(ff_dim, activation="relu", name=f"ff_in_{i}")(h)
        ff = keras.layers.Dense(embed_dim, name=f"ff_out_{i}")(ff)
        h = keras.layers.LayerNormalization(name=f"norm_ff_{i}")(h + ff)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h, mask=mask)
    logits = keras.layers.Dense(num_outputs, dtype="float32", name="logits")(pooled)
    return keras.Model(inputs, in_target_units(logits, target_mean, target_variance), name="transformer")
