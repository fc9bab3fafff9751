"""Run by tests/test_pipeline.py in a fresh process (logical CPU devices must be set up before TF starts).

A model with a residual block and an L2-regularised layer, trained a few full-batch SGD steps on digits
three ways from the same initial weights: the usual step on one device, and the pipeline over 2 logical
CPUs with 1 and with 4 micro-batches (the run's own code path: the strategy, the stage plan, the
placement and the step factory). Prints, as JSON, each pipeline's largest weight difference from the
one-device run, each run's summed [loss, correct, count] of the first step, where each stage's variables
live, and how many of the compiled step's gradient ops each device got ('': unplaced).
"""

import json
import sys

import keras
import numpy as np

from app.config import build_config
from app.run import preflight
from app.training import optim
from app.training import strategy as strategy_lib
from app.training.model import build_model
from app.training.pipeline import Pipeline
from app.training.step import make_train_steps

STEPS, BATCH = 4, 1436  # full batch: digits has 1,438 training rows; 1,436 splits into 4 micro-batches


def residual_model(input_shape, num_classes):
    x = keras.Input(input_shape)
    h = keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3), name="inner")(x)
    branch = keras.layers.Dense(32, activation="tanh", name="branch_a")(h)
    branch = keras.layers.Dense(32, name="branch_b")(branch)
    h = keras.layers.Add(name="add")([h, branch])
    h = keras.layers.Dense(16, activation="relu", name="block_2")(h)
    return keras.Model(x, keras.layers.Dense(num_classes, name="logits")(h))


def config(microbatches: int, strategy: str):
    return build_config(None, {
        "backend": "local", "strategy": strategy, "model": residual_model, "output": sys.argv[1],
        "optimizer": "sgd", "momentum": 0.9, "base_lr": 0.3, "lr_scaling": "none", "warmup_epochs": 0,
        "lr_decay": "constant", "per_replica_batch": BATCH, "seed": 3,
        **({"pipeline_microbatches": microbatches} if strategy == "pipeline" else {}),
    })


strategy, _ = strategy_lib.local_strategy("pipeline", 2, 1)
devices = strategy_lib.stage_devices()
checked = preflight.check(config(4, "pipeline"), 1, 1, stage_devices=devices)
stages, facts, objective = checked.model["pipeline"], checked.facts, checked.objective
train = checked.source.train
batch = (train.x[:BATCH], train.y[:BATCH], train.ids[:BATCH])


def train_steps(microbatches: int | None):
    cfg = config(microbatches or 1, "pipeline" if microbatches else "one-device")
    lr_plan = optim.plan_lr(cfg, BATCH, STEPS)
    with strategy.scope():
        model = build_model(cfg, facts)
        optimizer = optim.make_optimizer(cfg, lr_plan)
    pipe = Pipeline.place(model, stages, facts.feature_shape) if microbatches else None
    model = pipe.model if pipe else model
    step = pipe.train_step(optimizer, objective, BATCH, microbatches) if pipe else None
    steps = make_train_steps(strategy, model, optimizer, objective, BATCH, replica_step=step)
    first = [float(v) for v in steps.one(batch)[0].numpy()]
    for _ in range(STEPS - 1):
        steps.one(batch)
    graph = steps.one.get_concrete_function(batch).graph
    grad_ops = [op for op in graph.get_operations() if op.name.startswith("gradient_tape/")]
    return model, first, [op.device.split("/device:")[-1] for op in grad_ops], pipe


reference, ref_first, _, _ = train_steps(None)
out = {"stages": stages.stages, "one_device_first_step": ref_first, "pipelines": {}}
for m in (1, 4):
    model, first, grad_devices, pipe = train_steps(m)
    out["pipelines"][m] = {
        "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights())),
        "moved": max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), build_model(
            config(1, "one-device"), facts).get_weights())),
        "first_step": first,
        "variable_devices": [sorted({v.value.device.split("/device:")[-1] for v in s.variables}) for s in pipe.stages],
        "gradient_ops_per_device": {d: grad_devices.count(d) for d in sorted(set(grad_devices))},
    }
print(json.dumps(out))
