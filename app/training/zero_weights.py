"""The weights sharded over the workers too (ZeRO stage 3, ``--shard-optimizer 3``), inside Keras's own fit.

Stages 1 and 2 (app.training.zero) cut the optimizer's state; every worker still holds every weight. At stage 3 each
of N workers keeps 1/N of every weight a layer can gather, and so 1/N of its gradient and of its optimizer state:

- **Cut in place.** Each such layer's weights are replaced, in the layer's own list, by one flat variable each:
  this worker's part of the weight's flat values (``ceil(size / N)`` elements, zeros padding the last part). So
  ``model.trainable_variables`` holds the parts, and the model's optimizer (the user's own object, untouched) is
  built on them: its slots (Adam's moments, SGD's momentum, the accumulators of ``gradient_accumulation_steps``)
  are 1/N of the unsharded ones, and its update of a part is the unsharded update of those elements for the
  elementwise optimizers (app.training.zero.ELEMENTWISE).
- **Gathered as the layer computes.** The layer's ``call`` runs on its whole weights, all-gathered from the parts
  just before it computes and dropped after. Its backward pass gathers them again (the forward pass's copy is not
  kept alive between the two) and recomputes the layer's forward pass from its inputs under a tape, as activation
  checkpointing does; each weight's gradient is then reduce-scattered at once (each worker gets its part, summed
  over the workers, each worker's weighed by its rows), while the backward pass goes on to the layers before.
  The optimizer divides the sum by the global batch's rows (app.training.keras_sync): the gradient of the mean
  loss over the global batch, as unsharded.
- **Which layers.** A layer gathers itself when its ``call`` is a function of its inputs and its own trainable
  weights alone, read as its attributes (Dense, EinsumDense, Conv, Embedding, LayerNormalization, and through them
  MultiHeadAttention and the built-ins). A layer that updates state as it runs (batch-norm statistics), draws
  random numbers, or whose weight carries a constraint or a regularizer (they read the whole weight outside the
  call) stays whole on every worker, all-reduced as unsharded; the plan names it with its bytes
  (app.training.zero_memory decides which, in the driver and on the workers alike).
- **Clipping and loss scaling** (``before_apply``): a part's gradient norm is summed over the workers first, so
  ``clipnorm`` and ``global_clipnorm`` see the whole gradients' norms, as unsharded (Keras's own clipping after it
  changes nothing); a loss scale's overflow in any worker's part skips the step on every worker.
- **Checkpoints hold the whole model.** Every worker takes part in gathering each weight in turn (``gathered``);
  rank 0 alone holds the whole weights for the time it writes them (``whole``), as an unsharded run's layout,
  and the optimizer's state one file per variable and slot (app.training.zero_state.ShardedState).
  A run resumes at any stage or worker count; the driver's model.keras and SavedModel are ordinary Keras files.

Peak per worker: (weights + gradients + optimizer state) / N, plus the largest layer gathered (twice in its
backward pass: its weights and their gradient), plus the activations.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from app.errors import UserError
from app.internals import layers as layer_internals
from app.training import zero
from app.training.collective import SLICE_KEYS, Collective, Site
from app.training.zero_memory import layers_with_weights, part_of, why_whole

CALLS = 64  # calls of one layer in one traced step with keys of their own (a layer shared by inputs, or timesteps)


def build_layers(model, batch) -> None:
    """Create the weights of every layer of ``model`` not built yet (a subclassed model's are made at its first
    call): the model called once on ``batch``'s inputs, in inference (no batch-norm statistics move)."""
    import keras

    if all(layer.built for layer in layer_internals.layers_of(model)):
        return
    model(keras.utils.unpack_x_y_sample_weight(batch)[0], training=False)


def is_shard(variable) -> bool:
    return getattr(variable, "_zero_shard", False)


@dataclass
class Shard:
    """One weight cut over the workers: where it sits in its layer and this worker's flat part of it."""

    layer: Any
    attribute: str  # the layer's attribute that holds it (Dense's ``_kernel``, ``bias``)
    position: int  # its place in the layer's list of trainable variables
    shape: tuple[int, ...]
    name: str
    path: str  # the whole weight's (checkpoints and errors name it)
    dtype: str
    part: int  # elements a worker keeps
    part_shape: tuple[int, ...]  # (part,), or whole rows: (rows, *the rest of shape) for a weight read by rows
    key: int  # its collectives' keys: WEIGHTS + 3 x (key x CALLS + call) + 0 (gather), 1 (again), 2 (gradient)
    variable: Any = None  # this worker's part

    @property
    def length(self) -> int:
        return int(np.prod(self.shape))

    def mine(self, whole: np.ndarray, rank: int) -> np.ndarray:
        """``rank``'s part of the whole weight's values (zeros past their end). A part of whole rows is the same
        flat range, its rows rounded up: the first axis's rows are consecutive in the flat values."""
        flat = np.ravel(whole)[rank * self.part:(rank + 1) * self.part]
        return np.concatenate([flat, np.zeros(self.part - flat.size, flat.dtype)]).reshape(self.part_shape)

    def place(self, variable) -> None:
        """``variable`` in the weight's place in its layer (the part, or the whole one for a while)."""
        layer_internals.place_weight(self.layer, self.attribute, self.position, variable)


class ShardedWeights:
    """The model's weights cut over the workers (see the module docstring)."""

    def __init__(self, collective: Collective, rows: Any):
        """``rows.value``: the rows of the step being traced (app.training.keras_sync)."""
        self.collective, self.rows = collective, rows
        self.shards: list[Shard] = []
        self._calls: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self._whole = False

    @classmethod
    def cut(cls, model, collective: Collective, rows: Any) -> "ShardedWeights":
        """Cut every layer of ``model`` that gathers itself (its weights rank 0's first: a model function need not
        be seeded)."""
        import keras

        weights = cls(collective, rows)
        layers = [layer for layer in layers_with_weights(model) if why_whole(layer) is None]
        collective.broadcast_variables([v for layer in layers for v in layer_internals.own_trainable(layer)])
        for layer in layers:
            by_id = {id(v): k for k, v in vars(layer).items() if isinstance(v, keras.Variable)}
            shards = []
            for position, v in enumerate(layer_internals.own_trainable(layer)):
                shard = Shard(layer, by_id[id(v)], position, tuple(int(d) for d in v.shape), v.name, v.path,
                              str(v.dtype), *part_of(v.shape, collective.world, isinstance(layer, keras.layers.Embedding)),
                              len(weights.shards) + len(shards))
                # Read as they are (the gather sends the variable's dtype); the whole weight is cast for the call.
                shard.variable = keras.Variable(shard.mine(v.numpy(), collective.rank), dtype=v.dtype, name=v.name,
                                                trainable=True, autocast=False)
                shard.variable._zero_shard = True
                shard.place(shard.variable)
                shards.append(shard)
            weights.shards += shards
            weights._gather_in(layer, shards)
        return weights

    # --- the step -------------------------------------------------------------------------------------------------

    def _gather_in(self, layer, shards: list[Shard]) -> None:
        """``layer`` computes on its whole weights, gathered as it calls (and again for its gradients)."""
        def call(*args, **kwargs):
            if self._whole:  # the whole weights are in place (a checkpoint being written or read)
                return own_call(*args, **kwargs)
            return self._gathered_call(layer, own_call, shards, args, kwargs)

        own_call = layer_internals.replace_call(layer, call)

    def _call_index(self, layer) -> int:
        """This call's place among ``layer``'s calls in the function being traced (0 outside one)."""
        import tensorflow as tf

        if tf.executing_eagerly():
            return 0
        counts = self._calls.setdefault(tf.compat.v1.get_default_graph(), {})
        index = counts[id(layer)] = counts.get(id(layer), -1) + 1
        if index >= CALLS:  # its keys would be another weight's
            raise UserError(f"shard_optimizer=3: {layer.name} is called more than {CALLS} times in one step, and each "
                            "call gathers its weights with collectives of its own: call it fewer times a step (a "
                            "loop over timesteps: keras.layers.RNN or TimeDistributed), or give shard_optimizer=2")
        return index

    def _gathered_call(self, layer, own_call: Callable, shards: list[Shard], args: tuple, kwargs: dict):
        import tensorflow as tf

        structure = (args, kwargs)
        leaves = tf.nest.flatten(structure)
        # The float tensors the call reads are the custom gradient's inputs (their gradient is the layer's); ids,
        # masks and flags are closed over.
        at = [i for i, a in enumerate(leaves) if tf.is_tensor(a) and a.dtype.is_floating]
        keys = [Site.WEIGHTS + 3 * (s.key * CALLS + self._call_index(layer)) for s in shards]
        outputs: dict[str, Any] = {}

        def forward(xs, wholes):
            filled = list(leaves)
            for i, x in zip(at, xs):
                filled[i] = x
            a, k = tf.nest.pack_sequence_as(structure, filled)
            for s, w in zip(shards, wholes):  # Keras casts a float variable to the compute dtype as the call reads it
                layer_internals.set_for_call(layer, s.attribute, tf.cast(w, layer.compute_dtype) if layer.autocast else w)
            try:
                return own_call(*a, **k)
            finally:
                for s in shards:
                    layer_internals.set_for_call(layer, s.attribute, s.variable)

        @tf.custom_gradient
        def run(*inputs):
            xs, parts = list(inputs[:len(at)]), inputs[len(at):]
            # Gathered once the layer's inputs exist (and again once its outputs' gradients do): nothing else orders
            # the gathers, and TensorFlow would run every layer's at the step's start, all the whole weights at once.
            with tf.control_dependencies([a for a in leaves if tf.is_tensor(a)]):
                wholes = [self._gather(s, p, key) for s, p, key in zip(shards, parts, keys)]
            y = forward(xs, wholes)
            outputs["y"] = y
            # A softmax's output carries its logits (Keras's cross-entropy reads them instead of the probabilities):
            # they leave the custom gradient as outputs of their own, and go back on the outputs below.
            outputs["logits"] = [i for i, t in enumerate(tf.nest.flatten(y)) if _logits(t) is not None]

            def with_logits(flat: list) -> list:
                return flat + [_logits(flat[i]) for i in outputs["logits"]]

            def grad(*dys):
                with tf.control_dependencies([d for d in dys if d is not None]):
                    wholes = [self._gather(s, p, key + 1) for s, p, key in zip(shards, parts, keys)]
                with tf.GradientTape() as tape:
                    tape.watch(xs + wholes)
                    again = with_logits(tf.nest.flatten(forward(xs, wholes)))
                found = tape.gradient(again, xs + wholes, output_gradients=list(dys))
                d_xs = [tf.zeros_like(x) if g is None else g for x, g in zip(xs, found[:len(xs)])]
                return (*d_xs, *[self._scatter(s, g, key + 2) for s, g, key in zip(shards, found[len(xs):], keys)])

            return with_logits(tf.nest.flatten(y)), grad

        flat = run(*[leaves[i] for i in at], *[tf.convert_to_tensor(s.variable) for s in shards])
        count = len(tf.nest.flatten(outputs["y"]))
        for i, logits in zip(outputs["logits"], flat[count:]):
            flat[i]._keras_logits = logits
        return tf.nest.pack_sequence_as(outputs["y"], flat[:count])

    def _gather(self, shard: Shard, part, key: int):
        import tensorflow as tf

        whole = tf.reshape(self.collective.gather_in_graph(part, key), [-1])
        return tf.reshape(whole[:shard.length], shard.shape)

    def _scatter(self, shard: Shard, gradient, key: int):
        """This worker's part of the weight's gradient summed over the workers, each weighed by its rows. An
        embedding's gradient (the rows its batch looked up) stays that: every worker's rows are gathered and each
        keeps those of its part, as an unsharded run gathers them (app.training.collective), so the optimizer
        updates the same rows from the same slices."""
        import tensorflow as tf

        world, n = self.collective.world, self.rows.value
        if isinstance(gradient, tf.IndexedSlices) and len(shard.part_shape) > 1:
            weighed = tf.IndexedSlices(gradient.values * tf.cast(n, gradient.values.dtype), gradient.indices,
                                       gradient.dense_shape)
            every = self.collective.gather_slices_in_graph(weighed, Site.SLICES_OF_WEIGHTS + shard.key * SLICE_KEYS)
            first = self.collective.rank * shard.part_shape[0]
            rows = tf.cast(every.indices, tf.int64) - first
            mine = (rows >= 0) & (rows < shard.part_shape[0])
            return tf.IndexedSlices(tf.cast(tf.boolean_mask(every.values, mine), shard.variable.dtype),
                                    tf.cast(tf.boolean_mask(rows, mine), every.indices.dtype),
                                    tf.constant(shard.part_shape, every.indices.dtype))
        flat = tf.zeros([shard.length]) if gradient is None else \
            tf.reshape(tf.cast(tf.convert_to_tensor(gradient), tf.float32), [-1]) * n
        flat = tf.concat([flat, tf.zeros([shard.part * world - shard.length])], 0)
        summed = self.collective.scatter_sum_in_graph(tf.reshape(flat, [world, shard.part]), key)
        return tf.reshape(tf.cast(summed, shard.variable.dtype), shard.part_shape)

    def before_apply(self, optimizer, grads: list, variables: list) -> list:
        """The mean gradients (in ``variables``' order) as the optimizer takes them: a loss scale's overflow in any
        part is one on every worker (all skip the step together), and clipping sees the whole gradients."""
        import tensorflow as tf

        if hasattr(optimizer, "inner_optimizer"):  # a LossScaleOptimizer: an inf in one worker's part poisons all
            bad = [tf.reduce_sum(tf.cast(~tf.math.is_finite(_values(g)), tf.float32))
                   for g, v in zip(grads, variables) if g is not None and is_shard(v)]
            if bad:
                poison = tf.where(self.collective.in_graph(tf.add_n(bad), Site.WEIGHT_NORMS - 1) > 0, float("nan"), 0.0)
                grads = [g if g is None or not is_shard(v) else _times(g, poison + 1.0)
                         for g, v in zip(grads, variables)]
        return self._clip(optimizer, grads, variables)

    def _clip(self, optimizer, grads: list, variables: list) -> list:
        """Keras's clipping by each variable's norm or the global norm, the parts' squares summed over the workers
        (a whole variable's gradient is the same on every worker: counted once), of the gradients unscaled (a loss
        scale's): Keras's own clipping then finds every norm within its bound and changes nothing."""
        import tensorflow as tf

        inner = getattr(optimizer, "inner_optimizer", optimizer)
        clipnorm, global_clipnorm = inner.clipnorm, inner.global_clipnorm
        if not (clipnorm and clipnorm > 0) and not (global_clipnorm and global_clipnorm > 0):
            return grads
        given = [i for i, g in enumerate(grads) if g is not None]
        squares = [tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(grads[i]), tf.float32))) for i in given]
        parted = tf.constant([1.0 if is_shard(variables[i]) else 0.0 for i in given])
        local = tf.stack(squares) if squares else tf.zeros([0])
        summed = self.collective.in_graph(local * parted, Site.WEIGHT_NORMS) + local * (1 - parted)
        scale = tf.cast(optimizer.dynamic_scale, tf.float32) if inner is not optimizer else 1.0
        norms = tf.sqrt(summed) / scale
        out = list(grads)
        if clipnorm and clipnorm > 0:  # Keras's _clip_by_norm: g x c / max(norm, c), per variable
            for j, i in enumerate(given):
                out[i] = _times(grads[i], clipnorm / tf.maximum(norms[j], clipnorm))
            return out
        norm = tf.sqrt(tf.reduce_sum(tf.square(norms)))  # Keras's clip_by_global_norm (NaN: a norm not finite)
        factor = global_clipnorm * tf.minimum(1.0 / norm, 1.0 / global_clipnorm) + (norm - norm)
        for i in given:
            out[i] = _times(grads[i], factor)
        return out

    # --- checkpoints: the whole model -------------------------------------------------------------------------

    def gathered(self, rank: int) -> Optional[list[np.ndarray]]:
        """Every worker, the same calls in the same order: each whole weight gathered in turn; rank 0 keeps them
        (the others: None)."""
        import tensorflow as tf

        kept = []
        for s in self.shards:
            whole = np.asarray(self.collective.gather_tensor(tf.convert_to_tensor(s.variable)))[:s.length]
            if rank == 0:
                kept.append(whole.reshape(s.shape))
        return kept if rank == 0 else None

    @contextmanager
    def whole(self, values: Optional[list[np.ndarray]] = None, keep: bool = True):
        """The model holds its whole weights for the time of the block (``values``, as ``gathered`` gives them, each
        let go as its variable is made; None: zeros, a checkpoint about to be read into them). After it each worker
        keeps its part of them (``keep``; else the parts stand as they were: the block only read the weights)."""
        import keras

        made = []
        for k, s in enumerate(self.shards):
            value = values[k] if values is not None else np.zeros(s.shape, zero._numpy_dtype(s.dtype))
            if values is not None:
                values[k] = None
            made.append(keras.Variable(value, dtype=s.dtype, name=s.name, trainable=True))
            del value
            s.place(made[-1])
        self._whole = True
        try:
            yield made
        finally:
            self._whole = False
            for s, w in zip(self.shards, made):
                s.place(s.variable)
                if keep:
                    s.variable.assign(s.mine(w.numpy(), self.collective.rank))

    def spec(self, variable) -> Any:
        """What a checkpoint's file of ``variable``'s slots is named and shaped after: the whole weight for a
        part, else the variable."""
        for s in self.shards:
            if s.variable is variable:
                return s
        return variable


def _logits(tensor) -> Any:
    """The logits a Keras softmax's output carries (None: none)."""
    return getattr(tensor, "_keras_logits", None)


def _values(gradient):
    """A gradient's values (a tf.IndexedSlices' slices)."""
    return getattr(gradient, "values", gradient)


def _times(gradient, factor):
    """``gradient`` times a scalar, a tf.IndexedSlices kept sparse."""
    import tensorflow as tf

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype), gradient.indices,
                                gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)
