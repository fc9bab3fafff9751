"""--tensor-parallel N: one layer's weights split over N devices of this process, in Megatron-LM's layout.

Keras 3's own model parallelism (``keras.distribution.ModelParallel``) places nothing on the TensorFlow backend,
so the split is done here:

- **Column-parallel Dense** (the first Dense of an MLP block): its kernel ``[in, units]`` is cut by output
  columns, shard ``i`` holds ``[in, units/N]`` and its bias part; the input reaches every shard through
  Megatron's *f* (identity forward, sum of the shards' input gradients backward).
- **Row-parallel Dense** (the second Dense of the block): its kernel is cut by input rows, shard ``i`` holds
  ``[in/N, units]`` and multiplies the ``i``-th part of the input (the column layer's shard, which never leaves
  its device when the pair is adjacent); the partial outputs meet in Megatron's *g* (sum forward, identity
  backward), and the bias is added once, after the sum.

Each shard's variables (and the optimizer's slots for them: app.training.tensor_optimizer) are created under its
device and its matmuls run there, forward and backward: the gradient rules are the ``custom_gradient``
functions below, so the backward ops are placed by them, not left to the placer. The step is the usual one
(app.training.step: one traced step, one tape): the gradients are those of the unsplit layer, summed in
another order (1e-6 apart in float32).

The split model is a clone of the user's model in which the layers the layout names are replaced; every other
layer is an ordinary copy. ``TensorParallel.unsplit`` writes the shards back into the original model, which is
what checkpoints, model.keras and the SavedModel hold: evaluate, predict and serving see an ordinary model.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from app import internals
from app.errors import UserError

if TYPE_CHECKING:
    import keras

# The built-in models' layouts: each MLP block's pair of Dense layers (the output layer stays whole).
BUILTIN_LAYOUTS = {
    "mlp": {"dense_0": "column", "dense_1": "row"},
    "transformer": {"ff_in_*": "column", "ff_out_*": "row"},
}


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


def _is_shapes(shape) -> bool:
    """The shapes of several tensors (the column layer's shards), not one tensor's shape."""
    return isinstance(shape, (list, tuple)) and bool(shape) and isinstance(shape[0], (list, tuple))


def _split_layer_class():
    import keras

    class SplitDense(keras.layers.Layer):
        """A Dense layer's kernel in ``len(devices)`` shards, one per device (``mode``: column or row)."""

        def __init__(self, units: int, input_dim: int, devices: Sequence[str], mode: str, activation=None,
                     use_bias: bool = True, gather: bool = True, **kwargs):
            super().__init__(**kwargs)
            self.units, self.input_dim, self.devices, self.mode = units, input_dim, list(devices), mode
            self.use_bias, self.gather = use_bias, gather
            self.activation = keras.activations.get(activation)
            self.kernels: list[Any] = []
            self.biases: list[Any] = []

        def build(self, input_shape):
            import tensorflow as tf

            n = len(self.devices)
            # (a row layer's input may arrive as the column layer's shards: its size is the unsplit layer's)
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
                if not self.gather:  # the row layer after it takes the shards where they are
                    return outs
                with tf.device(self.devices[0]):
                    return ops.concatenate(outs, axis=-1)
            parts = inputs if isinstance(inputs, (list, tuple)) else ops.split(inputs, n, axis=-1)
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
            if self.mode == "column":
                shape = tuple(input_shape[:-1])
                return ([(*shape, self.units // len(self.devices))] * len(self.devices) if not self.gather
                        else (*shape, self.units))
            first = input_shape[0] if _is_shapes(input_shape) else input_shape
            return (*tuple(first[:-1]), self.units)

        def shards_of(self, kernel, bias) -> list:
            """The unsplit layer's weights as this layer's, in its variables' order."""
            import numpy as np

            n = len(self.devices)
            axis = 1 if self.mode == "column" else 0
            kernels = np.split(kernel, n, axis=axis)
            if not self.use_bias:
                return kernels
            if self.mode == "column":
                biases = np.split(bias, n)
                return [w for pair in zip(kernels, biases) for w in pair]
            return [kernels[0], bias, *kernels[1:]]

        def unsplit(self) -> list:
            """[kernel, bias] of the unsplit layer."""
            import numpy as np

            axis = 1 if self.mode == "column" else 0
            kernel = np.concatenate([k.numpy() for k in self.kernels], axis=axis)
            if not self.use_bias:
                return [kernel]
            bias = (np.concatenate([b.numpy() for b in self.biases]) if self.mode == "column"
                    else self.biases[0].numpy())
            return [kernel, bias]

    return SplitDense


@dataclass
class TensorPlan:
    """Which layers are split and how (decided in the driver, before training: ``plan_split``)."""

    devices: list[str]
    splits: dict[str, str]  # layer name -> column / row (replicated layers are not listed)
    gathered: dict[str, bool] = field(default_factory=dict)  # column layer -> its output is concatenated
    device_bytes: dict[str, int] = field(default_factory=dict)  # the split layers' variable bytes per device
    unsplit_bytes: int = 0  # the same layers' bytes unsplit

    def as_dict(self) -> dict[str, Any]:
        """result.json's ``tensor_parallel``."""
        return {"devices": self.devices, "splits": self.splits, "device_bytes": self.device_bytes,
                "unsplit_bytes": self.unsplit_bytes}

    def lines(self) -> list[str]:
        per = ", ".join(f"{d} {b / 2**10:.1f} KiB" for d, b in self.device_bytes.items())
        return [f"tensor parallel: {len(self.devices)} devices; "
                + ", ".join(f"{name} by {'columns' if how == 'column' else 'rows'}" for name, how in self.splits.items()),
                f"tensor parallel: split layers' variables per device: {per} (unsplit {self.unsplit_bytes / 2**10:.1f} KiB)"]


def checked_plan(model: "keras.Model", config, devices: Sequence[str], name: str) -> TensorPlan:
    """The driver's check of --tensor-parallel: the layout (--tensor-layout, else the built-in model's) planned on
    the model, then the model split once here, so that the bytes per device are read from where its variables
    are."""
    layout = dict(item.split("=", 1) for item in config.tensor_layout) if config.tensor_layout \
        else dict(BUILTIN_LAYOUTS.get(config.model, {}) if isinstance(config.model, str) else {})
    plan = plan_split(model, layout, devices, name)
    plan.device_bytes = TensorParallel.place(model, plan, name).variable_bytes()
    return plan


def plan_split(model: "keras.Model", layout: dict[str, str], devices: Sequence[str], name: str) -> TensorPlan:
    """Each layer the layout names, checked: a Dense whose split size divides by the devices; one line otherwise."""
    import keras

    from app.training.pipeline import functional

    model = functional(model, name)
    n = len(devices)
    if not layout:
        raise UserError(f"--tensor-parallel {n}: give --tensor-layout LAYER=column|row ... for {name} (which "
                        "layers to split: the first Dense of each MLP block by columns, the second by rows)")
    splits: dict[str, str] = {}
    for pattern, how in layout.items():
        matched = [layer for layer in model.layers if fnmatch.fnmatchcase(layer.name, pattern)]
        if not matched:
            raise UserError(f"--tensor-layout {pattern}: no layer of {name} is named so (its layers: "
                            f"{', '.join(layer.name for layer in model.layers)})")
        for layer in matched:
            if how == "replicated":
                splits.pop(layer.name, None)
                continue
            if type(layer) is not keras.layers.Dense:
                raise UserError(f"--tensor-layout {layer.name}={how}: {layer.name} is a {type(layer).__name__}; "
                                "tensor parallel splits Dense layers (by columns or rows)")
            size = layer.units if how == "column" else layer.kernel.shape[0]
            if size % n:
                what = "units" if how == "column" else "inputs"
                raise UserError(f"--tensor-layout {layer.name}={how}: its {size} {what} do not split into "
                                f"{n} equal shards: use a --tensor-parallel that divides {size}")
            splits[layer.name] = how
    by_name = {layer.name: layer for layer in model.layers}
    gathered = {}
    for layer_name, how in splits.items():
        if how == "column":
            consumers = [op for op in internals.consumers(by_name[layer_name]) if op in model.layers]
            gathered[layer_name] = not (len(consumers) == 1 and splits.get(consumers[0].name) == "row")
    unsplit = sum(int(v.numpy().nbytes) for layer_name in splits for v in by_name[layer_name].weights)
    return TensorPlan([short_name(d) for d in devices], splits, gathered, unsplit_bytes=unsplit)


class TensorParallel:
    """The user's model (``original``) and its split clone (``model``), which trains."""

    def __init__(self, original: "keras.Model", model: "keras.Model", plan: TensorPlan):
        self.original, self.model, self.plan = original, model, plan

    @classmethod
    def place(cls, original: "keras.Model", plan: TensorPlan, name: str) -> "TensorParallel":
        """The model's graph run again with the split layers in place of those the plan names; every other layer
        is the original's own (its variables shared), so only the split layers' weights are copied."""
        import keras

        from app.training.pipeline import Graph, functional

        graph = functional(original, name)
        split_dense = _split_layer_class()
        inputs = [keras.Input(shape=t.shape[1:], dtype=t.dtype, name=internals.keras_history(t).operation.name)
                  for t in graph.inputs]
        tensors = {id(a): b for a, b in zip(graph.inputs, inputs)}
        split: dict[str, Any] = {}
        for node in Graph.of(graph).nodes:
            op = node.operation
            how = plan.splits.get(op.name)
            if how is not None and op.name not in split:
                split[op.name] = split_dense(op.units, int(op.kernel.shape[0]), plan.devices, how,
                                             activation=op.activation, use_bias=op.use_bias,
                                             gather=plan.gathered.get(op.name, True), name=op.name,
                                             dtype=op.dtype_policy)
            args, kwargs = internals.node_call_arguments(node, tensors)
            out = (split[op.name] if how is not None else op)(*args, **kwargs)
            if how == "column" and not plan.gathered.get(op.name, True):
                tensors[id(node.outputs[0])] = out  # the shards, each on its device, for the row layer after it
            else:
                tensors.update({id(a): b for a, b in zip(node.outputs, keras.tree.flatten(out))})
        model = keras.Model(keras.tree.map_structure(lambda t: tensors[id(t)], graph.input),
                            keras.tree.map_structure(lambda t: tensors[id(t)], graph.output), name=graph.name)
        placed = cls(graph, model, plan)
        placed.resplit()
        return placed

    def unsplit(self) -> "keras.Model":
        """The original model, holding the trained weights (what checkpoints and exports save): the split layers'
        shards written back (the other layers are the original's own)."""
        for layer in self.model.layers:
            if layer.name in self.plan.splits:
                self.original.get_layer(layer.name).set_weights(layer.unsplit())
        return self.original

    def resplit(self) -> None:
        """The original model's weights (a restored checkpoint) into the split layers' shards."""
        for layer in self.model.layers:
            if layer.name in self.plan.splits:
                layer.set_weights(layer.shards_of(*self.original.get_layer(layer.name).get_weights()))

    def variable_bytes(self) -> dict[str, int]:
        """The split layers' variable bytes on each device, read from where the variables are."""
        out = {d: 0 for d in self.plan.devices}
        for layer in self.model.layers:
            if layer.name in self.plan.splits:
                for v in layer.weights:
                    out[device_of(v)] = out.get(device_of(v), 0) + int(v.numpy().nbytes)
        return out


def short_name(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``CPU:1``: one name for a device, however it is spelled."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


def device_of(variable) -> str:
    """The device a Keras variable lives on (its short name)."""
    return short_name(getattr(variable, "value", variable).device)
