"""--tensor-parallel N: one layer's weights split over N devices of this process, in Megatron-LM's layout.

Keras 3's own model parallelism (``keras.distribution.ModelParallel``) places nothing on the TensorFlow backend,
so the split is done here:

- **Column-parallel Dense** (the first Dense of an MLP block): its kernel ``[in, units]`` is cut by output
  columns, shard ``i`` holds ``[in, units/N]`` and its bias part; the input reaches every shard through
  Megatron's *f* (identity forward, sum of the shards' input gradients backward).
- **Row-parallel Dense** (the second Dense of the block): its kernel is cut by input rows, shard ``i`` holds
  ``[in/N, units]`` and multiplies the ``i``-th part of the input; the partial outputs meet in Megatron's *g* (sum
  forward, identity backward), and the bias is added once, after the sum.

Each shard's variables (and the optimizer's slots for them: app.training.tensor_optimizer) are created under its
device and its matmuls run there, forward and backward: the gradient rules are the ``custom_gradient``
functions of app.training.tensor_layers (the split layers), so the backward ops are placed by them, not left to
the placer. The step is Keras's (one traced step, one tape): the gradients are those of the unsplit layer, summed
in another order (1e-6 apart in float32).

A run trains the user's own model split in place (``SplitInPlace``), by Keras's fit: each named layer computes
through its split layer, so a model's own ``train_step`` and any model class (subclassed too) run it unchanged;
each column layer's output is gathered on its first device, since the model's own code passes it on. The shards
are written back into the unsplit layers before a save, which is what checkpoints, model.keras and the SavedModel hold: evaluate,
predict and serving see an ordinary model.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from app import internals
from app.errors import UserError
from app.training import tensor_layers

if TYPE_CHECKING:
    import keras

# The built-in models' layouts: each MLP block's pair of Dense layers (the output layer stays whole), and each
# transformer block's attention by heads.
BUILTIN_LAYOUTS = {
    "mlp": {"dense_0": "column", "dense_1": "row"},
    # attention_<block> (not the EinsumDense "attention_output" inside each, which Keras's fit's split walks into)
    "transformer": {"attention_[0-9]*": "heads", "ff_in_*": "column", "ff_out_*": "row"},
}
BY = {"column": "columns", "row": "rows", "heads": "heads"}


@dataclass
class TensorPlan:
    """Which layers are split and how (decided in the driver, before training: ``plan_split``)."""

    devices: list[str]
    splits: dict[str, str]  # layer name -> column / row / heads (replicated layers are not listed)
    device_bytes: dict[str, int] = field(default_factory=dict)  # the split layers' variable bytes per device
    unsplit_bytes: int = 0  # the same layers' bytes unsplit

    def as_dict(self) -> dict[str, Any]:
        """result.json's ``tensor_parallel``."""
        return {"devices": self.devices, "splits": self.splits, "device_bytes": self.device_bytes,
                "unsplit_bytes": self.unsplit_bytes}

    def on(self, devices: Sequence[str]) -> "TensorPlan":
        """The same split on this process's devices (a Ray worker's GPUs where the driver planned on its CPU).
        ``devices`` may list the other workers' too (TensorFlow lists a cluster's): a short name is this process's."""
        names = list(dict.fromkeys(short_name(d) for d in devices))[:len(self.devices)]
        return TensorPlan(names, self.splits,
                          {new: self.device_bytes[old] for old, new in zip(self.devices, names)
                           if old in self.device_bytes}, self.unsplit_bytes)

    def lines(self, per_worker: bool = False) -> list[str]:
        per = ", ".join(f"{d} {b / 2**10:.1f} KiB" for d, b in self.device_bytes.items()) \
            or ("counted in each worker" if per_worker else "counted where the run places them (result.json)")
        return [f"tensor parallel: {len(self.devices)} devices{' in each worker' if per_worker else ''}; "
                + ", ".join(f"{name} by {BY[how]}" for name, how in self.splits.items()),
                f"tensor parallel: split layers' variables per device: {per} (unsplit {self.unsplit_bytes / 2**10:.1f} KiB)"]


def plan_in_place(model: "keras.Model", name: str, config, optimizers: int, on_ray: bool,
                  first_batch: Any) -> TensorPlan:
    """The driver's check of tensor_parallel on Keras's fit (``SplitInPlace``): the layout planned on the model
    (built on ``first_batch`` if it is not yet; ``name``: the model as the user knows it). On Ray each worker
    splits its own devices (counted there); this process must hold them already."""
    n = config.tensor_degree
    if config.shard_optimizer in (1, 2):
        raise UserError(f"tensor_parallel={n} with shard_optimizer: each splits the optimizer's state its own way; "
                        "use one of them")
    if optimizers != 1:
        raise UserError(f"tensor_parallel={n} splits the state of the model's one optimizer, and {name} holds "
                        f"{optimizers}: compile it with one optimizer, or leave tensor_parallel out")
    if on_ray:
        devices = [f"{'GPU' if config.use_gpu else 'CPU'}:{i}" for i in range(n)]
    else:
        from app.training.strategy import StrategyUnavailable, tensor_devices

        try:
            devices = tensor_devices(n)
        except StrategyUnavailable as e:
            raise UserError(f"{e}: this process's TensorFlow started with them already; run on Ray (each worker "
                            f"splits its own CPU), or split the CPU before any TensorFlow op: tf.config."
                            f"set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * {n})"
                            ) from None
    built_on(model, first_batch)
    plan = plan_split(model, layout_of(config), devices, name)
    if config.shard_optimizer == 3:
        raise UserError(f"tensor_parallel={n} with shard_optimizer=3: {', '.join(plan.splits)} compute through their "
                        "devices' shards, which a gather of a layer's whole weights cannot stand in for; use one of "
                        "them")
    return plan


def built_on(model: "keras.Model", batch: Any) -> None:
    """A model not built yet (a subclassed one before its first call) built by a call on ``batch``'s inputs, as
    its first step would: its layers' variables are what the split cuts."""
    import keras

    if not model.built:
        model(keras.utils.unpack_x_y_sample_weight(batch)[0])


def layout_of(config) -> dict[str, str]:
    """--tensor-layout's LAYER=how, else the built-in model's layout (none for a user's model)."""
    return dict(item.split("=", 1) for item in config.tensor_layout) if config.tensor_layout \
        else dict(BUILTIN_LAYOUTS.get(config.model, {}) if isinstance(config.model, str) else {})


def plan_split(model: "keras.Model", layout: dict[str, str], devices: Sequence[str], name: str) -> TensorPlan:
    """Each layer the layout names (any of the model's layers, nested ones too), checked: a Dense whose split size
    divides by the devices, a MultiHeadAttention whose heads do; one line otherwise."""
    layers = internals.sublayers(model)
    n = len(devices)
    if not layout:
        raise UserError(f"--tensor-parallel {n}: give --tensor-layout LAYER=column|row|heads ... for {name} (which "
                        "layers to split: the first Dense of each MLP block by columns, the second by rows, attention "
                        "by heads)")
    splits: dict[str, str] = {}
    for pattern, how in layout.items():
        matched = [layer for layer in layers if fnmatch.fnmatchcase(layer.name, pattern)]
        if not matched:
            raise UserError(f"--tensor-layout {pattern}: no layer of {name} is named so (its layers: "
                            f"{', '.join(layer.name for layer in layers)})")
        for layer in matched:
            if how == "replicated":
                splits.pop(layer.name, None)
                continue
            _check_splits(layer, how, n)
            splits[layer.name] = how
    by_name = {layer.name: layer for layer in layers}
    unsplit = sum(int(v.numpy().nbytes) for layer_name in splits for v in by_name[layer_name].weights)
    return TensorPlan([short_name(d) for d in devices], splits, unsplit_bytes=unsplit)


def _check_splits(layer, how: str, n: int) -> None:
    import keras

    kind = "MultiHeadAttention" if how == "heads" else "Dense"
    if type(layer) is not getattr(keras.layers, kind):
        raise UserError(f"--tensor-layout {layer.name}={how}: {layer.name} is a {type(layer).__name__}; tensor "
                        "parallel splits Dense layers (by columns or rows) and MultiHeadAttention (by heads)")
    if how == "heads":
        config = layer.get_config()
        plain = {"dropout": 0.0, "use_gate": False, "sliding_window": None, "output_shape": None,
                 "attention_axes": (1,)}
        other = [f"{k}={config.get(k)!r}" for k, v in plain.items() if k in config and config[k] not in (v, [1])]
        if other:
            raise UserError(f"--tensor-layout {layer.name}=heads: tensor parallel splits a MultiHeadAttention with "
                            f"no dropout, gate, sliding window, output shape or attention axes of its own ({layer.name}"
                            f" has {', '.join(other)})")
    size = layer.num_heads if how == "heads" else layer.units if how == "column" else layer.kernel.shape[0]
    if size % n:
        what = {"heads": "heads", "column": "units", "row": "inputs"}[how]
        raise UserError(f"--tensor-layout {layer.name}={how}: its {size} {what} do not split into "
                        f"{n} equal shards: use a --tensor-parallel that divides {size}")


def _split_layer(layer, how: str, plan: TensorPlan, name: str):
    """The split layer that computes what ``layer`` (a Dense or a MultiHeadAttention the plan names) computes."""
    if how == "heads":
        dims = (*(int(d.kernel.shape[0]) for d in (layer.query_dense, layer.key_dense, layer.value_dense)),
                int(layer.output_dense.kernel.shape[-1]))
        return tensor_layers.split_attention_class()(layer.num_heads, layer.key_dim, layer.value_dim, dims,
                                                     plan.devices, use_bias=layer.use_bias, name=name,
                                                     dtype=layer.dtype_policy)
    return tensor_layers.split_dense_class()(layer.units, int(layer.kernel.shape[0]), plan.devices, how,
                                             activation=layer.activation, use_bias=layer.use_bias, name=name,
                                             dtype=layer.dtype_policy)


class Shards:
    """The map between the unsplit layers' variables and their shards (``pieces``), both ways."""

    plan: TensorPlan

    def pieces(self) -> list[tuple[Any, list, Any]]:
        """Every split layer's (unsplit variable, its pieces, the axis they join on or None)."""
        raise NotImplementedError

    @property
    def unsplit_trainable(self) -> list:
        """The trainable variables of the model unsplit, in its order (what an unsplit run's optimizer holds)."""
        raise NotImplementedError

    @property
    def split_trainable(self) -> list:
        """The trainable variables the split model trains: the shards in place of the split layers' variables."""
        raise NotImplementedError

    def unsplit_weights(self) -> None:
        """The shards written back into the unsplit layers' variables (what checkpoints and exports save)."""
        for variable, pieces, axis in self.pieces():
            variable.assign(join([p.numpy() for p in pieces], axis))

    def resplit(self) -> None:
        """The unsplit layers' weights (a restored checkpoint) into their shards."""
        for variable, pieces, axis in self.pieces():
            for piece, part in zip(pieces, cut(variable.numpy(), len(pieces), axis)):
                piece.assign(part)

    def variable_bytes(self) -> dict[str, int]:
        """The shards' variable bytes on each device, read from where the variables are."""
        out = {d: 0 for d in self.plan.devices}
        for _, pieces, _ in self.pieces():
            for v in pieces:
                out[device_of(v)] = out.get(device_of(v), 0) + int(v.numpy().nbytes)
        return out


class SplitInPlace(Shards):
    """Tensor parallel inside the model Keras's fit runs: the model keeps its own layers (a model's own
    ``train_step`` calls them as it always does), and each layer the plan names computes through its split layer,
    whose shards' variables live on their devices and train in place of the layer's own. Those stay in the model,
    untrained, as the unsplit copy (``unsplit_weights``) that checkpoints and the driver's model read. Any model
    whose split layers are a Dense or a MultiHeadAttention called as such: functional, Sequential or subclassed."""

    def __init__(self, model: "keras.Model", plan: TensorPlan, layers: dict[str, Any], splits: dict[str, Any],
                 unsplit_trainable: list, unsplit_variables: list):
        self.model, self.plan, self.layers, self.splits = model, plan, layers, splits
        self._unsplit_trainable, self.unsplit_variables = unsplit_trainable, unsplit_variables

    @classmethod
    def place(cls, model: "keras.Model", plan: TensorPlan) -> "SplitInPlace":
        found = {layer.name: layer for layer in internals.sublayers(model)}
        trainable, variables = list(model.trainable_variables), list(model.variables)
        layers, splits = {}, {}
        for name, how in plan.splits.items():
            layer = layers[name] = found[name]
            split = splits[name] = _split_layer(layer, how, plan, f"{name}_split")
            if how == "heads":
                split.build()
            else:
                split.build((None, int(layer.kernel.shape[0])))
            for variable, _, _ in split.pieces(layer):
                variable.trainable = False  # the shards train instead
            internals.compute_through(layer, split)
        placed = cls(model, plan, layers, splits, trainable, variables)
        placed.resplit()
        return placed

    def pieces(self) -> list[tuple[Any, list, Any]]:
        return [piece for name, split in self.splits.items() for piece in split.pieces(self.layers[name])]

    @property
    def unsplit_trainable(self) -> list:
        return self._unsplit_trainable

    @property
    def split_trainable(self) -> list:
        return self.model.trainable_variables


def join(parts: list, axis: Any):
    """The pieces of one variable put together (``axis`` None: one piece, whole)."""
    import numpy as np

    return parts[0] if axis is None else np.concatenate(parts, axis=axis)


def cut(value, n: int, axis: Any) -> list:
    """One variable's value cut into its ``n`` pieces (``axis`` None: one piece, whole)."""
    import numpy as np

    return [value] if axis is None else np.split(value, n, axis=axis)


def short_name(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``CPU:1``: one name for a device, however it is spelled."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


def device_of(variable) -> str:
    """The device a Keras variable lives on (its short name)."""
    return short_name(getattr(variable, "value", variable).device)
