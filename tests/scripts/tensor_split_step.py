"""One step of the built-in transformer split in place (SplitInPlace, as a run splits it) over 2 and 4 logical CPU
devices against the unsplit model, in one process (tests/test_tensor_parallel.py runs it): the outputs, and every
gradient (a split variable's pieces put together). Prints JSON: per N, the largest difference of the outputs, and
of the gradients relative to their size."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 4)

from app.models import build_transformer  # noqa: E402
from app.training import tensor_parallel  # noqa: E402

keras.utils.set_random_seed(0)
model = build_transformer((16,), 3, vocab_size=50)
x = np.random.default_rng(0).integers(1, 50, size=(8, 16)).astype("float32")
x[:, 11:] = 0  # padding: the attention's masks
devices = [d.name for d in tf.config.list_logical_devices("CPU")]


def gradients(m):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(m(x)))
    dense = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, m.trainable_variables)]  # embeddings': sparse
    return m(x).numpy(), dict(zip(map(id, m.trainable_variables), dense))


out, grads = gradients(model)
found = {}
for n in (2, 4):
    twin = keras.models.clone_model(model)  # split in place, as a run splits the model Keras's fit trains
    twin.set_weights(model.get_weights())
    plan = tensor_parallel.plan_split(twin, tensor_parallel.BUILTIN_LAYOUTS["transformer"], devices[:n], "t")
    split = tensor_parallel.SplitInPlace.place(twin, plan)
    same = {id(t): id(v) for t, v in zip(split.unsplit_trainable, model.trainable_variables)}
    split_out, split_grads = gradients(twin)
    joined = {same[id(v)]: tensor_parallel.join([split_grads[id(p)] for p in pieces], axis)
              for v, pieces, axis in split.pieces()}
    whole = {same[k]: g for k, g in split_grads.items() if k in same}  # the layers that are not split
    # Relative to each gradient's largest entry, and no less than 1e-3 of the largest entry of any: the key
    # projection's bias has a zero gradient in exact arithmetic (softmax ignores what is added to every score),
    # float noise on both sides.
    floor = 1e-3 * max(np.abs(g).max() for g in grads.values())
    worst = max(float(np.abs(grads[k] - joined.get(k, whole.get(k))).max() / max(np.abs(grads[k]).max(), floor))
                for k in grads)
    found[n] = {"splits": plan.splits, "output": float(np.abs(out - split_out).max()), "gradient": worst,
                "gradients_compared": len(grads)}
print(json.dumps(found))
