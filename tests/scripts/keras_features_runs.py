"""A user's script: a model with its own train_step trained by app.fit on 2 Ray workers with the product's features
(those Keras provides itself, app.training.keras_features, and its Dense layers split over each worker's devices,
app.training.tensor_parallel), and by Keras's own model.fit with the same settings.

    python keras_features_runs.py OUT      (joined to a running Ray: RAY_ADDRESS)

Writes OUT/features.json: each run's History. tests/test_keras_features.py reads it.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
from autoencoder import Autoencoder

import app

out = Path(sys.argv[1])
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")


def build(accumulate=None):
    keras.utils.set_random_seed(3)
    model = Autoencoder()
    model.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate))
    return model


runs = {}
# One run with every feature at once, on an elastic range (the session's Ray has room for 2): Keras's gradient
# accumulation under its mixed_bfloat16 policy, the two Dense layers split over 2 devices of each worker (Megatron's
# pair: the encoder by columns, the decoder by rows); the reference is model.fit with the same two Keras settings in
# one process, unsplit.
history = app.fit(build, x, batch_size=32, epochs=3, shuffle=False, num_workers="1:2", grad_accum=2,
                  mixed_precision="bf16", tensor_parallel=2, tensor_layout=["encoder=column", "decoder=row"],
                  output=str(out / "features"), verbose=0)
runs["features"] = {"history": history.history, "workers": history.result["workers"],
                    "tensor_parallel": history.result["tensor_parallel"],
                    "iterations": int(history.model.optimizer.iterations.numpy()),
                    "policy": history.model.encoder.dtype_policy.name,
                    "plan": (out / "features" / "train.log").read_text()}
keras.config.set_dtype_policy("mixed_bfloat16")
reference = build(2).fit(x, batch_size=32, epochs=3, shuffle=False, verbose=0)
runs["keras_fit"] = {"history": reference.history}
(out / "features.json").write_text(json.dumps(runs, indent=1))
