"""The split layers of --tensor-parallel (app.training.tensor_parallel places them), in Megatron-LM's layout, and
Megatron's two communication functions, written as gradient rules so that they hold wherever the shards are:

- *f* (``to_shards``): the input to every shard; backward, the shards' input gradients summed (an all-reduce
  when the shards are in different processes);
- *g* (``from_shards``): the shards' partial outputs summed; backward, the gradient to every shard unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence


def to_shards(x, devices: Sequence[str]):
    """Megatron's *f*: ``x`` on every shard's device; backward, the shards' gradients summed (the all-reduce)."""
    import tensorflow as tf

    @tf.custom_gradient
    def f(x):
        copies = []
        for d in devices:
            with tf.device(d):
                copies.append(tf.identity(x))

        def grad(*upstream):
            with tf.device(devices[0]):
                return tf.add_n([tf.convert_to_tensor(g) for g in upstream])

        return copies, grad

    return f(x)


def from_shards(parts, device: str):
    """Megatron's *g*: the shards' partial outputs summed on ``device``; backward, the gradient to every shard."""
    import tensorflow as tf

    @tf.custom_gradient
    def g(*parts):
        with tf.device(device):
            total = tf.add_n(list(parts))

        def grad(upstream):
            outs = []
            for p in parts:
                with tf.device(p.device or device):
                    outs.append(tf.identity(upstream))
            return outs

        return total, grad

    return g(*parts)


def split_dense_class():
    import keras

    class SplitDense(keras.layers.Layer):
        """A Dense layer's kernel in ``len(devices)`` shards, one per device (``mode``: column or row)."""

        def __init__(self, units: int, input_dim: int, devices: Sequence[str], mode: str, activation=None,
                     use_bias: bool = True, **kwargs):
            super().__init__(**kwargs)
            self.units, self.input_dim, self.devices, self.mode = units, input_dim, list(devices), mode
            self.use_bias = use_bias
            self.activation = keras.activations.get(activation)
            self.kernels: list[Any] = []
            self.biases: list[Any] = []

        def build(self, input_shape):
            import tensorflow as tf

            n = len(self.devices)
            in_dim, out_dim = (self.input_dim, self.units // n) if self.mode == "column" \
                else (self.input_dim // n, self.units)
            for i, d in enumerate(self.devices):
                with tf.device(d):
                    self.kernels.append(self.add_weight(shape=(in_dim, out_dim), name=f"kernel_shard_{i}",
                                                        initializer="glorot_uniform"))
                    if self.use_bias and (self.mode == "column" or i == 0):
                        self.biases.append(self.add_weight(shape=(out_dim,), name=f"bias_shard_{i}",
                                                           initializer="zeros"))

        def call(self, inputs):
            import tensorflow as tf
            from keras import ops

            n = len(self.devices)
            if self.mode == "column":
                xs = to_shards(ops.cast(inputs, self.compute_dtype), self.devices)
                outs = []
                for i, d in enumerate(self.devices):
                    with tf.device(d):
                        y = ops.matmul(xs[i], ops.cast(self.kernels[i], self.compute_dtype))
                        if self.use_bias:
                            y = y + ops.cast(self.biases[i], self.compute_dtype)
                        outs.append(self.activation(y) if self.activation is not None else y)
                with tf.device(self.devices[0]):
                    return ops.concatenate(outs, axis=-1)
            parts = ops.split(inputs, n, axis=-1)
            partials = []
            for i, d in enumerate(self.devices):
                with tf.device(d):
                    partials.append(ops.matmul(ops.cast(parts[i], self.compute_dtype),
                                               ops.cast(self.kernels[i], self.compute_dtype)))
            y = from_shards(partials, self.devices[0])
            with tf.device(self.devices[0]):
                if self.use_bias:
                    y = y + ops.cast(self.biases[0], self.compute_dtype)
                return self.activation(y) if self.activation is not None else y

        def compute_output_shape(self, input_shape):
            return (*tuple(input_shape[:-1]), self.units)

        def pieces(self, original) -> list[tuple[Any, list, Any]]:
            """(a variable of the unsplit layer ``original``, its pieces here, the axis they join on or None)."""
            out = [(original.kernel, self.kernels, 1 if self.mode == "column" else 0)]
            if self.use_bias:
                out.append((original.bias, self.biases, 0 if self.mode == "column" else None))
            return out

    return SplitDense


def split_attention_class():
    import keras

    class SplitAttention(keras.layers.Layer):
        """A MultiHeadAttention's heads in ``len(devices)`` groups, one per device (Megatron's head-parallel
        attention): each device holds its heads' query, key and value projections (split by columns: heads) and
        their rows of the output projection, computes their attention, and the partial outputs meet in *g*; the
        output bias is added once, after the sum. The attention itself is Keras's (``ops.dot_product_attention``,
        as MultiHeadAttention computes it without dropout)."""

        def __init__(self, num_heads: int, key_dim: int, value_dim: int, dims: tuple[int, int, int, int],
                     devices: Sequence[str], use_bias: bool = True, **kwargs):
            super().__init__(**kwargs)
            self.num_heads, self.key_dim, self.value_dim, self.use_bias = num_heads, key_dim, value_dim, use_bias
            self.dims, self.devices = dims, list(devices)  # (query, key, value, output) widths
            self.shards: list[list[tuple[Any, Any]]] = []  # per device: (kernel, bias) of query, key, value
            self.out_kernels: list[Any] = []
            self.out_bias: Any = None

        def build(self, query_shape=None, value_shape=None, key_shape=None):
            import tensorflow as tf

            for i, d in enumerate(self.devices):
                with tf.device(d):
                    _add_head_group(self, i, self.num_heads // len(self.devices))
            if self.use_bias:
                with tf.device(self.devices[0]):
                    self.out_bias = self.add_weight(shape=(self.dims[3],), name="output_bias", initializer="zeros")

        def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None, attention_mask=None,
                 return_attention_scores=False, training=None, use_causal_mask=False):
            import tensorflow as tf
            from keras import ops

            from app.errors import UserError

            if return_attention_scores or use_causal_mask:
                raise UserError(f"{self.name}: tensor parallel splits attention called without "
                                "return_attention_scores or use_causal_mask")
            mask = _attention_mask(query_mask, value_mask, key_mask if key is not None and key is not value else
                                   None, attention_mask)
            key = value if key is None else key
            inputs = [to_shards(ops.cast(t, self.compute_dtype), self.devices) for t in (query, key, value)]
            partials = []
            for i, d in enumerate(self.devices):
                with tf.device(d):
                    partials.append(_attend(self, i, [t[i] for t in inputs], mask))
            y = from_shards(partials, self.devices[0])
            with tf.device(self.devices[0]):
                return y + ops.cast(self.out_bias, self.compute_dtype) if self.use_bias else y

        def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
            return (*tuple(query_shape[:-1]), self.dims[3])

        def pieces(self, original) -> list[tuple[Any, list, Any]]:
            """(a variable of the unsplit layer ``original``, its pieces here, the axis they join on or None)."""
            out = []
            for j, dense in enumerate((original.query_dense, original.key_dense, original.value_dense)):
                out.append((dense.kernel, [shard[j][0] for shard in self.shards], 1))
                if self.use_bias:
                    out.append((dense.bias, [shard[j][1] for shard in self.shards], 0))
            out.append((original.output_dense.kernel, self.out_kernels, 0))
            if self.use_bias:
                out.append((original.output_dense.bias, [self.out_bias], None))
            return out

    return SplitAttention


def _add_head_group(layer, i: int, heads: int) -> None:
    """Device ``i``'s weights of a SplitAttention: its ``heads`` heads' query, key and value projections (kernel and
    bias each) and their rows of the output projection."""
    shard = []
    for what, width, size in zip(("query", "key", "value"), layer.dims[:3], (layer.key_dim, layer.key_dim,
                                                                            layer.value_dim)):
        kernel = layer.add_weight(shape=(width, heads, size), name=f"{what}_kernel_shard_{i}",
                                  initializer="glorot_uniform")
        bias = layer.add_weight(shape=(heads, size), name=f"{what}_bias_shard_{i}",
                                initializer="zeros") if layer.use_bias else None
        shard.append((kernel, bias))
    layer.shards.append(shard)
    layer.out_kernels.append(layer.add_weight(shape=(heads, layer.value_dim, layer.dims[3]),
                                              name=f"output_kernel_shard_{i}", initializer="glorot_uniform"))


def _attend(layer, i: int, inputs: list, mask) -> Any:
    """Device ``i``'s part of a SplitAttention's output: its heads' attention over its shards of the query, key and
    value (``inputs``), through its rows of the output projection."""
    import math

    from keras import ops

    q, k, v = (_project(layer, x, kernel, bias) for x, (kernel, bias) in zip(inputs, layer.shards[i]))
    attended = ops.dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(float(layer.key_dim)))
    return ops.einsum("abcd,cde->abe", attended, ops.cast(layer.out_kernels[i], layer.compute_dtype))


def _project(layer, x, kernel, bias):
    from keras import ops

    y = ops.einsum("abc,cde->abde", x, ops.cast(kernel, layer.compute_dtype))
    return y + ops.cast(bias, layer.compute_dtype) if bias is not None else y


def _attention_mask(query_mask, value_mask, key_mask, attention_mask):
    """MultiHeadAttention's mask, [B, 1, T, S]: the query's [B, T, 1], the value's and key's [B, 1, S] and the
    attention mask [B, T, S], ANDed (as its _compute_attention_mask merges them), a heads axis added."""
    from keras import ops

    masks = [ops.expand_dims(ops.cast(m, "bool"), axis) for m, axis in ((query_mask, -1), (value_mask, -2),
                                                                         (key_mask, -2)) if m is not None]
    masks += [ops.cast(attention_mask, "bool")] if attention_mask is not None else []
    if not masks:
        return None
    mask = masks[0]
    for m in masks[1:]:
        mask = mask & m
    return ops.expand_dims(mask, 1)
