"""Run by tests/test_pipeline.py in a fresh process (logical CPU devices must be set up before TF starts).

Two compiled models, each trained a few steps (SGD with momentum, Keras's ``train_on_batch``) three ways from
the same initial weights: Keras's own step on one device, and the pipeline over 2 logical CPUs with 1 and with
4 micro-batches (the run's own code path: the stage plan, the placement, the model Keras's fit trains):

- a model with a residual block and an L2-regularised layer, on digits, its batch of 1,437 rows split into
  micro-batches of unequal sizes (360, 359, 359, 359);
- the built-in transformer (small), on token ids with padding: its padding mask crosses the cut and is
  recomputed by the second stage, and its embedding's gradients are sparse;

and a model with batch normalisation given a batch of 3 rows with 4 micro-batches (it goes whole).

Prints, as JSON per model: the stages; per pipeline, the largest weight difference from the one-device
run, how far the weights moved, the first step's logs (loss, accuracy; one-device's too), where each layer's
variables live, the largest difference between the stages' forward pass and the saved-and-reloaded model, and
how many of the traced step's gradient ops (constants aside) each device got ('' = unplaced), and the devices
of the evaluation step's matrix products.
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

from app.data.builtin import digits
from app.models import build_transformer
from app.training import strategy as strategy_lib
from app.training.pipeline import for_fit, plan_stages

STEPS = 3


def residual_model():
    x = keras.Input((64,))
    h = keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3), name="inner")(x)
    branch = keras.layers.Dense(32, activation="tanh", name="branch_a")(h)
    branch = keras.layers.Dense(32, name="branch_b")(branch)
    h = keras.layers.Add(name="add")([h, branch])
    h = keras.layers.Dense(16, activation="relu", name="block_2")(h)
    return keras.Model(x, keras.layers.Dense(10, name="logits")(h))


def transformer():
    return build_transformer((16,), 2, vocab_size=256, embed_dim=16, num_heads=2, ff_dim=16)


def text_rows():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 256, size=(200, 16))
    lengths = rng.integers(4, 17, size=200)
    ids[np.arange(16) >= lengths[:, None]] = 0  # padding
    return ids.astype("float32"), (ids[:, 0] % 2).astype("int64")


def digit_rows():
    x, y = digits()
    return x.reshape(len(x), -1)[:1437].astype("float32"), y[:1437]


CASES = {"residual": (residual_model, digit_rows, None, 0.3),
         "transformer": (transformer, text_rows, ["attention_1"], 0.05)}


def compiled(build, lr):
    keras.utils.set_random_seed(3)
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def ops_of(graph):
    """Every op of a traced step, those of its conditions' branches too (the pipelined one's micro-batches)."""
    for op in graph.get_operations():
        yield op
        for branch in ("then_branch", "else_branch"):
            try:
                name = op.get_attr(branch).name
            except ValueError:
                continue
            yield from ops_of(graph._get_function(name).graph)


def train(model, x, y):
    first = model.train_on_batch(x, y, return_dict=True)
    for _ in range(STEPS - 1):
        model.train_on_batch(x, y)
    return {k: float(v) for k, v in first.items()}


devices = (strategy_lib.local_strategy("pipeline", 2, 1), strategy_lib.stage_devices())[1]
out = {}
for name, (build, rows, split_at, lr) in CASES.items():
    x, y = rows()
    reference = compiled(build, lr)
    initial = reference.get_weights()
    ref_first = train(reference, x, y)
    out[name] = {"one_device_first_step": ref_first, "pipelines": {}}
    for m in (1, 4):
        model = compiled(build, lr)
        plan = plan_stages(model, split_at, devices, name, m)
        out[name]["stages"] = list(plan.stages)
        placed = for_fit(model, plan, (x, y))
        first = train(placed, x, y)
        spec = (tf.TensorSpec((None, *x.shape[1:]), tf.float32), tf.TensorSpec((None,), tf.int64))
        graph = tf.function(placed.train_step).get_concrete_function(spec).graph
        grad_devices = [op.device.split("/device:")[-1] for op in ops_of(graph)  # constants run nowhere
                        if op.name.startswith("gradient_tape/") and op.type != "Const"]
        evaluation = tf.function(placed.test_step).get_concrete_function(spec).graph  # the stages' call, placed
        eval_devices = sorted({op.device.split("/device:")[-1] for op in evaluation.get_operations()
                               if op.type in ("MatMul", "BatchMatMulV2", "Einsum")})
        placed.save(f"{sys.argv[1]}-{name}-{m}.keras")  # the placed model is one ordinary model
        reloaded = keras.models.load_model(f"{sys.argv[1]}-{name}-{m}.keras")
        out[name]["pipelines"][m] = {
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(placed.get_weights(),
                                                                            reference.get_weights())),
            "moved": max(float(np.abs(a - b).max()) for a, b in zip(placed.get_weights(), initial)),
            "first_step": first,
            "variable_devices": {layer.name: sorted({v.value.device.split("/device:")[-1] for v in layer.weights})
                                 for layer in placed.layers if layer.weights},
            "gradient_ops_per_device": {d: grad_devices.count(d) for d in sorted(set(grad_devices))},
            "evaluation_devices": eval_devices,
            "exported_vs_stages": float(np.abs(reloaded(x[:64]).numpy() - placed(x[:64]).numpy()).max()),
        }
# A batch of fewer rows than micro-batches (an epoch's short last one) goes through the stages whole: a model with
# batch normalisation takes the one-device step, its moving statistics finite.
def normalised():
    x = keras.Input((64,))
    h = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(16, name="inner")(x))
    return keras.Model(x, keras.layers.Dense(10, name="logits")(keras.layers.Dense(16, name="block_2")(h)))


x, y = digit_rows()
reference, model = compiled(normalised, 0.1), compiled(normalised, 0.1)
placed = for_fit(model, plan_stages(model, ["block_2"], devices, "normalised", 4), (x[:32], y[:32]))
reference.train_on_batch(x[:3], y[:3])
placed.train_on_batch(x[:3], y[:3])
out["short_batch"] = {
    "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(placed.get_weights(), reference.get_weights())),
    "finite": bool(all(np.isfinite(w).all() for w in placed.get_weights())),
}
print(json.dumps(out))
