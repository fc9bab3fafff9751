"""A user's script: a model with its own train_step, its Dense layers split over 2 devices of this process by
app.fit (tensor_parallel=2, no Ray), then resumed unsplit for one more epoch; and Keras's own model.fit of the
same model, unsplit, for as many epochs. The script splits its CPU into 2 logical devices itself, before any
TensorFlow op, as app.fit's one line asks of a process without 2 devices.

    python keras_tensor_local.py OUT

Writes OUT/tensor.json: each run's History and final weights. tests/test_keras_features.py reads it.
"""

import json
import sys
from pathlib import Path

import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from autoencoder import Autoencoder  # noqa: E402

import app  # noqa: E402

out = Path(sys.argv[1])
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")


def build():
    keras.utils.set_random_seed(3)
    model = Autoencoder(hidden=6, activation="relu")  # a hidden layer of 6 between the two split layers
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


split = app.fit(build, x, batch_size=32, epochs=2, shuffle=False, backend="local", tensor_parallel=2,
                tensor_layout=["encoder=column", "decoder=row"], output=str(out / "split"), verbose=0)
# The checkpoint holds the model and Adam's moments unsplit: the run goes on without the split.
resumed = app.fit(build, x, batch_size=32, epochs=3, shuffle=False, backend="local", resume=True,
                  output=str(out / "split"), verbose=0)
reference = build()
keras_fit = reference.fit(x, batch_size=32, epochs=3, shuffle=False, verbose=0)
(out / "tensor.json").write_text(json.dumps({
    "split": split.history, "resumed": resumed.history, "keras_fit": keras_fit.history,
    "weights": [w.tolist() for w in resumed.model.get_weights()],
    "keras_weights": [w.tolist() for w in reference.get_weights()],
    "result": split.result["tensor_parallel"], "plan": (out / "split" / "train.log").read_text()}, indent=1))
