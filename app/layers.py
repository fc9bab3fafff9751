"""Layers for users' own models as well as the built-in ones: ``from app.layers import ShardedEmbedding``.

A leaf module: it imports Keras and TensorFlow only, never the rest of ``app``.
"""

from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="app")
class ShardedEmbedding(keras.layers.Layer):
    """An embedding table held as ``num_shards`` plain variables of consecutive rows, looked up across them.

    Why not one variable with a partitioner: under ParameterServerStrategy a
    ``variable_partitioner`` turns Keras 3 variables into ``ShardedVariable``s,
    and ``tape.gradient`` then fails ("'ShardedVariable' object has no
    attribute 'handle'"). Plain variables work under every strategy:
    ParameterServerStrategy places them round-robin on the parameter servers
    (K shards over P servers: each server holds about K/P of the table and
    serves only the rows looked up in it); MultiWorkerMirrored, Mirrored and
    one device keep all K on each replica, so one model runs under all of
    them. The gradient of each shard stays sparse (``tf.IndexedSlices`` of the
    rows a batch touched), so a step sends each server only its touched rows.

    Rows are split as ``tf.nn.embedding_lookup`` expects ("div"): shard i holds
    ids [start_i, start_i + size_i), the first ``input_dim % num_shards``
    shards one row larger. ``full_table()`` is the (input_dim, output_dim)
    table, equal to a ``keras.layers.Embedding``'s ``embeddings``.
    """

    def __init__(self, input_dim: int, output_dim: int, num_shards: int = 1, embeddings_initializer="uniform",
                 **kwargs):
        super().__init__(**kwargs)
        if num_shards < 1 or num_shards > input_dim:
            raise ValueError(f"num_shards must be between 1 and input_dim ({input_dim}), got {num_shards}")
        self.input_dim, self.output_dim, self.num_shards = input_dim, output_dim, num_shards
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape=None):
        base, extra = divmod(self.input_dim, self.num_shards)
        self.shards = [
            self.add_weight(shape=(base + (i < extra), self.output_dim), initializer=self.embeddings_initializer,
                            name=f"shard_{i}")
            for i in range(self.num_shards)
        ]

    def call(self, ids):
        ids = tf.cast(ids, "int32")
        if self.num_shards == 1:
            return tf.gather(self.shards[0].value, ids)
        return tf.nn.embedding_lookup([s.value for s in self.shards], ids)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def full_table(self):
        return tf.concat([s.value for s in self.shards], axis=0)

    def get_config(self):
        return {
            **super().get_config(),
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "num_shards": self.num_shards,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
        }


@keras.saving.register_keras_serializable(package="app")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a (batch, length, dim) sequence.

    A layer of its own because ``keras.layers.Embedding(length, dim)(keras.ops.arange(length))``
    in a functional model runs once, eagerly, while the model is built: its
    table becomes a constant of the graph, never trained and not in the model's
    weights (the transformer had exactly that until 2026-11-23).
    """

    def __init__(self, embeddings_initializer="uniform", **kwargs):
        super().__init__(**kwargs)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=tuple(input_shape[-2:]), initializer=self.embeddings_initializer,
                                          name="embeddings")

    def call(self, x):
        return x + keras.ops.cast(self.embeddings, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(),
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer)}
