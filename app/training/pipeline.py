"""--strategy pipeline: one model cut into stages, one stage per device, each batch run as micro-batches (GPipe).

Keras 3's own model parallelism (``keras.distribution``) is ignored on the TensorFlow backend, so the
placement is done here, by hand:

- Where a model can be cut: a point in its layer order where exactly one tensor that depends on weights
  crosses from the earlier layers to the later ones. Inside a residual block two cross (the skip and the
  branch), so there is no cut there. Tensors computed from the input alone, without weights (a padding
  mask), may cross too: the stages after the cut recompute them from the input.
- Each stage's variables on its device: the model is cloned with every layer created and called under
  ``tf.device`` of its stage, then the original weights are copied in. The clone is one ordinary Keras
  model (checkpoints, ``--resume`` and the exported model.keras see no stages); each stage is a Keras
  model over the clone's own layers, so the stages share its variables.
- The step: Keras's fit trains the clone (compiled as the user's model, the same optimizer object), its
  ``train_step`` this module's: M micro-batches forward through the stages (one tape per stage per
  micro-batch), then backward from the last stage, each stage's gradients and its input's under that
  stage's device (one ``tape.gradient`` over every variable would leave the gradient ops unplaced), summed
  and applied once by the optimizer (Keras's accumulation, loss scaling and schedule apply as in fit).

Stages work at the same time through TensorFlow's dataflow: the step is one graph in which stage 2 on
micro-batch 1 waits only for stage 1 on micro-batch 1, so stage 1 can go on with micro-batch 2.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from app import internals
from app.errors import UserError

if TYPE_CHECKING:
    import keras



def functional(model: "keras.Model", name: str) -> "keras.Model":
    """The model as a functional graph (a Sequential's own layers, not copies); a subclassed model is refused."""
    import keras

    if isinstance(model, keras.Sequential):
        model = keras.Model(model.inputs, model.outputs, name=model.name)
    if not internals.is_functional(model):
        raise UserError(
            f"--strategy pipeline cuts functional and Sequential models, and {name} is a subclassed "
            f"{type(model).__name__} (its call() is Python, there is no graph to cut): build it with "
            "keras.Model(inputs, outputs) or keras.Sequential, or use another --strategy"
        )
    return model


@dataclass
class Graph:
    """A functional model's nodes in an order where each comes after its inputs, and where it can be cut."""

    nodes: list[Any]
    params: list[int]  # per node; a shared layer's weights count at its first node
    cuts: dict[str, int] = field(default_factory=dict)  # layer name -> node position, for every valid cut
    boundary: dict[str, Any] = field(default_factory=dict)  # layer name -> the one weighted tensor crossing there
    needs_input: dict[str, bool] = field(default_factory=dict)  # the stage starting there recomputes from the input
    why_not: dict[str, str] = field(default_factory=dict)  # layer name -> why there is no cut before it

    @classmethod
    def of(cls, model: "keras.Model") -> "Graph":
        import keras

        by_depth = internals.nodes_by_depth(model)  # deeper = further from the outputs: inputs come first
        nodes = [n for d in sorted(by_depth, reverse=True) for n in by_depth[d] if n.operation and not n.is_input]
        produced = {id(t): -1 for t in model.inputs}
        last_use: dict[int, int] = {}
        tensors = {id(t): t for t in model.inputs}
        free = {id(t) for t in model.inputs}  # computed from the input alone, without weights
        params, seen = [], set()
        for i, node in enumerate(nodes):
            op = node.operation
            weights = getattr(op, "weights", [])  # keras.ops functions (cast, add) have none
            params.append(0 if id(op) in seen else sum(math.prod(w.shape) for w in weights))
            seen.add(id(op))
            for t in node.input_tensors:
                last_use[id(t)] = i
            inputs_free = all(id(t) in free for t in node.input_tensors)
            for t in node.outputs:
                produced[id(t)], tensors[id(t)] = i, t
                if inputs_free and not weights:
                    free.add(id(t))
        for t in model.outputs:
            last_use[id(t)] = len(nodes)
        calls: dict[int, list[int]] = {}  # a layer with weights -> the positions it is called at
        for i, node in enumerate(nodes):
            if getattr(node.operation, "weights", None):
                calls.setdefault(id(node.operation), []).append(i)
        graph = cls(nodes, params)
        for i, node in enumerate(nodes):
            op = node.operation
            if not isinstance(op, keras.layers.Layer):
                continue
            crossing = [k for k, p in produced.items() if p < i <= last_use.get(k, -1)]
            weighted = [k for k in crossing if k not in free]
            split = next((nodes[p[0]].operation.name for p in calls.values() if p[0] < i <= p[-1]), None)
            if internals.times_called(op) != 1:
                graph.why_not[op.name] = "it is a shared layer (called more than once)"
            elif split:
                graph.why_not[op.name] = f"layer {split} is called before and after it (its weights live on one device)"
            elif len(weighted) != 1:
                graph.why_not[op.name] = (f"{len(weighted)} tensors that depend on weights cross there (inside a "
                                          "residual block?)" if weighted else "no layer before it has weights")
            else:
                graph.cuts[op.name] = i
                graph.boundary[op.name] = tensors[weighted[0]]
                graph.needs_input[op.name] = len(crossing) > 1
        return graph

    def stage_of(self, cut_positions: Sequence[int], i: int) -> int:
        return bisect.bisect_right(list(cut_positions), i)

    def describe(self, positions: Sequence[int], devices: Sequence[str]) -> list[dict[str, Any]]:
        """Each stage's first and last layer, parameter count and device (result.json's ``stages``)."""
        import keras

        stages = [{"first": None, "last": None, "parameters": 0, "device": d} for d in devices]
        for i, node in enumerate(self.nodes):
            stage = stages[self.stage_of(positions, i)]
            stage["parameters"] += self.params[i]
            if isinstance(node.operation, keras.layers.Layer):
                stage["first"] = stage["first"] or node.operation.name
                stage["last"] = node.operation.name
        return stages


@dataclass(frozen=True)
class StagePlan:
    """Where the driver cut the model, for the worker to apply to the model it builds."""

    # Node position at which each stage after the first starts: positions, because a model whose layers are
    # named by Keras gets new names each time it is built in a process (dense, then dense_1).
    starts: tuple[int, ...]
    stages: tuple[dict[str, Any], ...]  # each stage's first and last layer, parameters and device (result.json)
    microbatches: int = 1  # each batch run as this many micro-batches

    def line(self) -> str:
        """The plan's line: the stages, where each runs."""
        where = "; ".join(f"{s['first']} .. {s['last']} ({s['parameters']:,} parameters) on {s['device']}"
                          for s in self.stages)
        return f"pipeline: {len(self.stages)} stages, each batch as {self.microbatches} micro-batches: {where}"


def plan_stages(model: "keras.Model", split_at: Sequence[str] | None, devices: Sequence[str], name: str,
                microbatches: int = 1) -> StagePlan:
    """One stage per device: cut at ``split_at`` (the layers that start a stage), or where parameters balance.

    A request that cannot be met is one UserError line naming the layers the model can be cut at.
    """
    graph = Graph.of(functional(model, name))
    where = f"{name} can be cut at: {', '.join(graph.cuts) or 'no layer (two tensors cross every point)'}"
    if split_at:
        for layer in split_at:
            if layer not in graph.cuts:
                why = graph.why_not.get(layer, "no layer has that name")
                raise UserError(f"--split-at {layer}: {why}; {where}")
        positions = [graph.cuts[c] for c in split_at]
        if positions != sorted(set(positions)):
            raise UserError(f"--split-at {','.join(split_at)}: give each layer once, in the model's order; {where}")
        if len(split_at) + 1 != len(devices):
            raise UserError(
                f"--split-at {','.join(split_at)} makes {len(split_at) + 1} stages, but there are {len(devices)} "
                f"devices (one stage each): give {len(devices) - 1} layer name(s), or --devices {len(split_at) + 1}"
            )
        cuts = list(split_at)
    else:
        if len(graph.cuts) < len(devices) - 1:
            raise UserError(f"--strategy pipeline: {len(devices)} stages need {len(devices) - 1} cut(s), and {where}: "
                            f"use fewer --devices")
        cuts = _balanced(graph, len(devices))
    starts = tuple(graph.cuts[c] for c in cuts)
    return StagePlan(starts, tuple(graph.describe(starts, devices)), microbatches)


def _balanced(graph: Graph, stages: int) -> list[str]:
    """The cuts that make the largest stage (in parameters) as small as possible (dynamic programming)."""
    names = list(graph.cuts)  # in the model's order
    before = [sum(graph.params[:graph.cuts[n]]) for n in names]  # parameters before each cut
    total = sum(graph.params)
    # best[k][j]: (largest stage, previous cut) for k+1 stages ending at cut j
    best = [[(before[j], -1) for j in range(len(names))]]
    for _ in range(stages - 2):
        prev = best[-1]
        best.append([min(((max(prev[i][0], before[j] - before[i]), i) for i in range(j)), default=(float("inf"), -1))
                     for j in range(len(names))])
    j = min(range(len(names)), key=lambda j: max(best[-1][j][0], total - before[j]))
    chosen = []
    for k in range(stages - 2, -1, -1):
        chosen.append(names[j])
        j = best[k][j][1]
    return chosen[::-1]


class Pipeline:
    """The placed model (one ordinary Keras model) and its stages, each a Keras model on its device."""

    def __init__(self, model: "keras.Model", stages: list["keras.Model"], devices: list[str], needs_input: list[bool]):
        self.model, self.stages, self.devices, self.needs_input = model, stages, devices, needs_input

    @classmethod
    def place(cls, model: "keras.Model", plan: StagePlan, input_shape: Sequence[int] = (),
              name: str = "the model") -> "Pipeline":
        """Clone ``model`` with each stage's layers (variables and calls) on its device, weights copied in."""
        import keras
        import numpy as np
        import tensorflow as tf

        if not model.built:  # a Sequential without keras.Input gets its graph on its first call
            model(np.zeros((1, *input_shape), np.float32))
        source = functional(model, name)
        graph = Graph.of(source)
        name_at = {position: layer for layer, position in graph.cuts.items()}
        if not set(plan.starts) <= set(name_at):
            raise RuntimeError(f"{name} built here is not the model the stages were planned on")
        cuts = [name_at[p] for p in plan.starts]  # this build's names (the clone keeps them)
        devices = [s["device"] for s in plan.stages]
        device_of = {}
        for i, node in enumerate(graph.nodes):
            device_of.setdefault(id(node.operation), devices[graph.stage_of(plan.starts, i)])
        placed_on = {}

        def clone(layer):
            with tf.device(device_of[id(layer)]):
                new = layer.__class__.from_config(layer.get_config())
            placed_on[id(new)] = device_of[id(layer)]
            return new

        def call(layer, *args, **kwargs):  # a layer builds (creates its variables) on its first call
            with tf.device(placed_on[id(layer)]):
                return layer(*args, **kwargs)

        placed = keras.models.clone_model(source, clone_function=clone, call_function=call)
        placed.set_weights(source.get_weights())
        cloned = Graph.of(placed)
        x = placed.inputs
        bounds = [placed.input] + [cloned.boundary[c] for c in cuts] + [placed.output]
        needs_input = [False] + [cloned.needs_input[c] for c in cuts]
        history = [internals.keras_history(t) for t in x]
        parts = [
            keras.Model(bounds[k] if k == 0 else [bounds[k], *x] if needs_input[k] else bounds[k], bounds[k + 1],
                        name=f"stage_{k}")
            for k in range(len(devices))
        ]
        # A stage that also takes the model's input re-registers that input tensor with a node of its own
        # (keras clone_graph_nodes); put it back, or the placed model can no longer be saved.
        for t, h in zip(x, history):
            internals.set_keras_history(t, h)
        return cls(placed, parts, devices, needs_input)

    def _call(self, k: int, h, x, training: bool):
        return self.stages[k]([h, x] if self.needs_input[k] else h, training=training)

    def __call__(self, x, training: bool = False):
        """The model's forward pass, stage by stage, each on its device (evaluation)."""
        import tensorflow as tf

        h = x = tf.convert_to_tensor(x)
        for k, device in enumerate(self.devices):
            with tf.device(device):
                h = self._call(k, h, x, training)
        return h

    def keras_train_step(self, microbatches: int):
        """The placed model's ``train_step`` for Keras's fit: ``microbatches`` micro-batches (parts a row apart; a
        batch of fewer rows: whole) all forward through the stages, then all backward, one update by the model's
        optimizer. Each micro-batch's loss is Keras's compiled one (``compute_loss``, every stage's penalties) weighed
        by its part of the batch: the batch's mean, as Keras's default reduction (sum over the batch size) gives it;
        the compiled metrics take the batch's outputs, as in Keras's step."""
        import tensorflow as tf

        model, last = self.model, len(self.stages) - 1
        variables = [stage.trainable_variables for stage in self.stages]
        tracker = internals.loss_tracker(model)

        def forward(x, y, w, part):
            """One micro-batch through every stage: per stage (tape, its input, what to differentiate); loss, output."""
            h, taped, loss = x, [], None
            for k, device in enumerate(self.devices):
                with tf.device(device), tf.GradientTape() as tape:
                    if k:
                        tape.watch(h)
                    out = self._call(k, h, x, training=True)
                    if k == last:  # every stage's penalties are in Keras's loss; the last stage's are its own
                        loss = model.compute_loss(x=x, y=y, y_pred=out, sample_weight=w, training=True) * part
                        targets = [model.optimizer.scale_loss(loss)]
                    else:  # this stage's penalties' gradients, here, under its device
                        penalty = self.stages[k].losses
                        targets = [out] + ([model.optimizer.scale_loss(tf.add_n(penalty) * part)] if penalty else [])
                taped.append((tape, h, targets))
                h = out
            return taped, loss, h

        def backward(taped, grads):
            """From the last stage down, each stage's gradients under its device; summed into ``grads``."""
            upstream = None
            for k in range(last, -1, -1):
                tape, h, targets = taped[k]
                with tf.device(self.devices[k]):
                    seeds = ([upstream] if upstream is not None else [tf.ones_like(targets[0])]) + \
                        [tf.ones_like(t) for t in targets[1:]]
                    got = tape.gradient(targets, variables[k] + ([h] if k else []), output_gradients=seeds)
                    for i, (g, v) in enumerate(zip(got, variables[k])):
                        g = tf.zeros_like(v) if g is None else g
                        grads[k][i] = g if grads[k][i] is None else _add(grads[k][i], g)
                upstream = (tf.zeros_like(h) if got[-1] is None else got[-1]) if k else None

        @tf.autograph.experimental.do_not_convert  # plain Python loops: unrolled into one graph, which is the point
        def through_stages(x, y, w, rows, parts: int):
            """The batch as ``parts`` micro-batches (none empty: ``rows`` >= ``parts``): every variable's gradient
            summed over them, the batch's loss, its outputs."""
            sizes = rows // parts + tf.cast(tf.range(parts) < rows % parts, tf.int32)
            leaves = [None if t is None else tf.split(t, sizes, num=parts) for t in tf.nest.flatten((x, y, w))]
            passes = [forward(*tf.nest.pack_sequence_as((x, y, w), [None if t is None else t[m] for t in leaves]),
                              tf.cast(sizes[m], tf.float32) / tf.cast(rows, tf.float32))
                      for m in range(parts)]  # all forward, then all backward (GPipe)
            grads = [[None] * len(v) for v in variables]
            for taped, _, _ in passes:
                backward(taped, grads)
            out = tf.nest.map_structure(lambda *t: tf.concat(t, 0), *[o for _, _, o in passes])
            return [g for gs in grads for g in gs], tf.add_n([loss for _, loss, _ in passes]), out

        def train_step(data):
            import keras

            x, y, w = keras.utils.unpack_x_y_sample_weight(data)
            rows = tf.shape(tf.nest.flatten(x)[0])[0]
            if microbatches == 1:
                grads, loss, out = through_stages(x, y, w, rows, 1)
            else:  # a batch of fewer rows than micro-batches (an epoch's short last one) goes whole: an empty
                # micro-batch would give batch normalisation's statistics a NaN
                grads, loss, out = tf.cond(rows >= microbatches, lambda: through_stages(x, y, w, rows, microbatches),
                                           lambda: through_stages(x, y, w, rows, 1))
            model.optimizer.apply_gradients(zip(grads, [v for vs in variables for v in vs]))
            tracker.update_state(loss, sample_weight=rows)
            return model.compute_metrics(x, y, out, sample_weight=w)

        return train_step


def plan_for_fit(model: "keras.Model", name: str, own_step: Sequence[str], split_at: Sequence[str] | None,
                 devices: Sequence[str], microbatches: int, first_batch: Any) -> StagePlan:
    """The driver's plan for a pipeline Keras's fit trains (``model``: compiled, with one optimizer; ``own_step``:
    the parts of Keras's step it overrides, refused: its step is the pipeline's)."""
    from app.training.keras_sync import optimizers_of
    from app.training.tensor_parallel import built_on

    if own_step:
        raise UserError(f"--strategy pipeline runs each batch's micro-batches through the stages in a train_step of its "
                        f"own, and {name} trains by its own {', '.join(own_step)}: train it without the pipeline")
    if len(optimizers_of(model)) != 1:
        raise UserError(f"--strategy pipeline updates the stages with one optimizer, the model's compiled one, and "
                        f"{name} holds {len(optimizers_of(model))}: train it without the pipeline")
    given = (internals.compile_arguments(model) or {}).get("loss")
    for loss in given.values() if isinstance(given, dict) else given if isinstance(given, (list, tuple)) else [given]:
        if getattr(loss, "reduction", "sum_over_batch_size") not in ("sum_over_batch_size", "mean"):
            raise UserError(f"--strategy pipeline weighs each micro-batch's loss by its share of the rows: the batch's "
                            f"loss for Keras's default reduction (sum_over_batch_size), and {name}'s {type(loss).__name__}"
                            f" reduces by {loss.reduction!r}: compile it with the default, or train without the pipeline")
    built_on(model, first_batch)
    return plan_stages(model, split_at, devices, name, microbatches)


def for_fit(model: "keras.Model", plan: StagePlan, first_batch: Any) -> "keras.Model":
    """The model Keras's fit trains for a pipeline: ``model`` (built, compiled) placed stage by stage on its devices
    (a clone, compiled as ``model`` was, its optimizer the same object), its ``train_step`` the micro-batched one,
    its ``call`` the stages' (evaluation and prediction run them too)."""
    import types

    import keras

    from app.training.tensor_parallel import built_on

    built_on(model, first_batch)  # a Sequential without keras.Input gets its graph on its first call
    pipe = Pipeline.place(model, plan)
    placed = pipe.model
    placed.compile(**{**internals.compile_arguments(model), "optimizer": model.optimizer, "jit_compile": False})
    # Built here, not inside the step's condition: the optimizer's state, the compiled loss's and metrics' (reset)
    x, y, w = keras.utils.unpack_x_y_sample_weight(first_batch)
    out = pipe(x)
    placed.compute_loss(x=x, y=y, y_pred=out, sample_weight=w, training=False)
    placed.compute_metrics(x, y, out, sample_weight=w)
    placed.reset_metrics()
    placed.optimizer.build(placed.trainable_variables)
    placed.train_step = pipe.keras_train_step(plan.microbatches)
    placed.call = types.MethodType(lambda self, inputs, training=None, mask=None: pipe(inputs, training), placed)
    return placed


def _add(a, b):
    """Two gradients of one variable; an embedding's sparse ones (IndexedSlices) stay sparse."""
    import tensorflow as tf

    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
