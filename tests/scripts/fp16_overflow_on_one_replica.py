"""Run by tests/test_precision.py in a fresh process (logical CPU devices must be set up before TF starts).

Two Mirrored replicas, fp16 with loss scaling; replica 1's batch holds an inf,
so only its gradients overflow. The step must be skipped on both replicas
(weights unchanged and finite) and the loss scale halved.
"""

import json
import sys

import numpy as np

from app.config import build_config
from app.data.arrays import DataFacts
from app.training import optim
from app.training import strategy as strategy_lib
from app.training.measures import Measures
from app.training.model import build_model
from app.training.objective import Objective
from app.training.step import make_train_steps

strategy, _ = strategy_lib.local_strategy("mirrored", 2, 1)
config = build_config(None, {"backend": "local", "mixed_precision": "fp16", "output": sys.argv[1], "hidden_units": [8]})
lr_plan = optim.plan_lr(config, global_batch=8, steps_per_epoch=1)
with strategy.scope():
    model = build_model(config, DataFacts((4,), "classification", 3, 8, 0))
    optimizer = optim.make_optimizer(config, lr_plan)
objective = Objective("classification", "sparse_categorical_crossentropy", True, output_shape=(3,))
steps = make_train_steps(strategy, model, optimizer, Measures(objective, model), global_batch=8)

import tensorflow as tf  # noqa: E402

x = np.ones((8, 4), np.float32)
x[6, 0] = np.inf  # in the second half: replica 1's per-replica batch
y = np.zeros(8, np.int64)
ids = np.arange(8, dtype=np.int64)
batches = tf.data.Dataset.from_tensor_slices((x, y, ids, np.ones(8, np.float32))).batch(4)  # replica 0, then 1
iterator = iter(strategy.distribute_datasets_from_function(lambda _: batches))
before = [w.copy() for w in model.get_weights()]
scale_before = float(optimizer.dynamic_scale.numpy())
steps.one(next(iterator))
after = model.get_weights()
print(json.dumps({
    "finite": bool(all(np.isfinite(w).all() for w in after)),
    "unchanged": bool(all(np.array_equal(a, b) for a, b in zip(before, after))),
    "scale_before": scale_before,
    "scale_after": float(optimizer.dynamic_scale.numpy()),
    "compute_dtype": model.get_layer("dense_0").compute_dtype,
}))
