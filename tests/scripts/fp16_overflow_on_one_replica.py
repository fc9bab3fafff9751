"""Run by tests/test_precision.py in a fresh process (logical CPU devices must be set up before TF starts).

A user's compiled model trained by app.fit on two Mirrored replicas in this process, fp16 with Keras's loss
scaling (mixed_precision="fp16"); replica 1's half of the one batch holds an inf, so only its gradients
overflow. Keras's fit there, as the product runs it, applies the replicas' summed gradient once
(app.training.keras_sync.synchronise_replicas): the step must be skipped on both replicas (weights unchanged and
finite, the inner optimizer's step count 0) and the loss scale halved.
"""

import json
import sys

import keras
import numpy as np

import app

x = np.ones((8, 4), np.float32)
x[6, 0] = np.inf  # in the second half: replica 1's part of the batch
y = np.zeros(8, np.int64)
INITIAL_SCALE = 2.0**15  # keras.optimizers.LossScaleOptimizer's


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", name="dense_0"),
                              keras.layers.Dense(3, name="logits")])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


history = app.fit(build, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, backend="local",
                  strategy="mirrored", devices=2, mixed_precision="fp16", output=sys.argv[1])
model, optimizer = history.model, history.model.optimizer
keras.utils.set_random_seed(0)  # app.fit's default seed: the weights both replicas started from
before = build().get_weights()
after = model.get_weights()
print(json.dumps({
    "finite": bool(all(np.isfinite(w).all() for w in after)),
    "unchanged": bool(all(np.array_equal(a, b) for a, b in zip(before, after))),
    "optimizer": type(optimizer).__name__,
    "steps_applied": int(optimizer.inner_optimizer.iterations.numpy()),
    "scale_before": INITIAL_SCALE,
    "scale_after": float(optimizer.dynamic_scale.numpy()),
    "compute_dtype": model.get_layer("dense_0").compute_dtype,
}))
