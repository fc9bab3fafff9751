"""Run by tests/test_pipeline.py in a fresh process (logical CPU devices must be set up before TF starts).

Two models, each trained a few full-batch SGD steps three ways from the same initial weights: the usual
step on one device, and the pipeline over 2 logical CPUs with 1 and with 4 micro-batches (the run's own
code path: the strategy, the stage plan, the placement and the step factory):

- a model with a residual block and an L2-regularised layer, on digits;
- the built-in transformer (small), on synthetic text: its padding mask crosses the cut and is recomputed
  by the second stage, and its embedding's gradients are sparse.

Prints, as JSON per model: the stages; per pipeline, the largest weight difference from the one-device
run, how far the weights moved, the summed [loss, count, metric state] of the first step (one-device's too),
where each stage's variables live, the largest difference between the stages' forward pass and the
saved-and-reloaded model, and how many of the compiled step's gradient ops (constants aside) each
device got ('' = unplaced).
"""

import json
import sys

import keras
import numpy as np

from app.config import build_config
from app.driver import preflight
from app.training import optim
from app.training import strategy as strategy_lib
from app.training.measures import Measures
from app.training.model import build_model
from app.training.pipeline import Pipeline
from app.training.step import make_train_steps, replica_train_step

STEPS = 3


def residual_model(input_shape, num_classes):
    x = keras.Input(input_shape)
    h = keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3), name="inner")(x)
    branch = keras.layers.Dense(32, activation="tanh", name="branch_a")(h)
    branch = keras.layers.Dense(32, name="branch_b")(branch)
    h = keras.layers.Add(name="add")([h, branch])
    h = keras.layers.Dense(16, activation="relu", name="block_2")(h)
    return keras.Model(x, keras.layers.Dense(num_classes, name="logits")(h))


CASES = {
    # digits: 1,438 training rows; a full batch of 1,436 splits into 4 micro-batches
    "residual": {"model": residual_model, "per_replica_batch": 1436},
    "transformer": {"model": "transformer", "dataset": "synthetic-text", "synthetic_text_rows": 250,
                    "per_replica_batch": 200, "sequence_length": 16, "vocab_size": 256, "embed_dim": 16,
                    "num_heads": 2, "ff_dim": 16, "split_at": ["attention_1"], "base_lr": 0.05},
}


def config(case: dict, microbatches: int | None):
    pipeline = {"strategy": "pipeline", "pipeline_microbatches": microbatches} if microbatches else {
        "strategy": "one-device", "split_at": None}
    return build_config(None, {
        "backend": "local", "output": sys.argv[1], "optimizer": "sgd", "momentum": 0.9, "base_lr": 0.3,
        "lr_scaling": "none", "warmup_epochs": 0, "lr_decay": "constant", "seed": 3, **case, **pipeline,
    })


def train(case: dict, checked, microbatches: int | None):
    cfg, batch_size = config(case, microbatches), case["per_replica_batch"]
    train = checked.source.train
    batch = (train.x[:batch_size], train.y[:batch_size], train.ids[:batch_size], train.weights()[:batch_size])
    with strategy.scope():
        model = build_model(cfg, checked.facts)
        optimizer = optim.make_optimizer(cfg, optim.plan_lr(cfg, batch_size, STEPS))
    initial = model.get_weights()
    pipe = Pipeline.place(model, checked.model["pipeline"], checked.facts.feature_shape) if microbatches else None
    model = pipe.model if pipe else model
    measures = Measures(checked.objective, model)
    step = pipe.train_step(optimizer, measures, batch_size, microbatches) if pipe \
        else replica_train_step(model, optimizer, measures, batch_size)
    steps = make_train_steps(strategy, model, optimizer, measures, step)
    first = [float(v) for v in steps.one(batch)[0].numpy()]
    for _ in range(STEPS - 1):
        steps.one(batch)
    graph = steps.one.get_concrete_function(batch).graph
    grad_devices = [op.device.split("/device:")[-1] for op in graph.get_operations()  # constants run nowhere
                    if op.name.startswith("gradient_tape/") and op.type != "Const"]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), initial))
    exported = None
    if pipe:  # the stages' forward pass (evaluation) against the saved and reloaded model.keras
        model.save(f"{sys.argv[1]}.keras")
        reloaded = keras.models.load_model(f"{sys.argv[1]}.keras")
        exported = float(np.abs(reloaded(batch[0][:64]).numpy() - pipe(batch[0][:64]).numpy()).max())
    return model.get_weights(), first, moved, grad_devices, pipe, exported


strategy, _ = strategy_lib.local_strategy("pipeline", 2, 1)
devices = strategy_lib.stage_devices()
out = {}
for name, case in CASES.items():
    checked = preflight.check(config(case, 4), 1, 1, stage_devices=devices)
    reference, ref_first, *_ = train(case, checked, None)
    out[name] = {"stages": list(checked.model["pipeline"].stages), "one_device_first_step": ref_first, "pipelines": {}}
    for m in (1, 4):
        weights, first, moved, grad_devices, pipe, exported = train(case, checked, m)
        out[name]["pipelines"][m] = {
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(weights, reference)),
            "moved": moved,
            "first_step": first,
            "variable_devices": [sorted({v.value.device.split("/device:")[-1] for v in s.variables})
                                 for s in pipe.stages],
            "gradient_ops_per_device": {d: grad_devices.count(d) for d in sorted(set(grad_devices))},
            "exported_vs_stages": exported,
        }
print(json.dumps(out))
