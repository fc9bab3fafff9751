"""--tensor-parallel N: one layer's weights split over N devices (Megatron's column/row layout), as a user runs it
on a laptop CPU split into logical devices: the built-in MLP on 2 devices, and a user's functional model with two
MLP blocks (Adam: its slots follow the shards) on 4 devices with --tensor-layout, each against the same run on one
device, weight for weight; the bytes each device holds of the split layers, read from the variables' devices; the
exported model is an ordinary Keras model; bad layouts are one line before training."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import refusals_at_once, run_jobs_at_once, user_module

MODEL = """
import keras


def two_blocks(input_shape, num_classes):
    x = keras.Input(input_shape)
    h = keras.layers.Dense(32, activation="relu", name="up_1")(x)
    h = keras.layers.Dense(16, name="down_1")(h)
    h = keras.layers.Dense(32, activation="gelu", name="up_2")(keras.layers.ReLU()(h))
    h = keras.layers.Dense(16, name="down_2")(h)
    model = keras.Model(x, keras.layers.Dense(num_classes, name="head")(h))
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def with_conv(input_shape, num_classes):
    x = keras.Input(input_shape)
    h = keras.layers.Reshape((8, 8, 1))(x)
    h = keras.layers.Conv2D(4, 3, name="conv")(h)
    h = keras.layers.Dense(6, name="odd")(keras.layers.Flatten()(h))
    return keras.Model(x, keras.layers.Dense(num_classes, name="head")(h))
"""

COMMON = ["--backend", "local", "--epochs", "2", "--no-tensorboard"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor-parallel")
    models = user_module(tmp_path_factory, "tp_models.py", MODEL)
    user = ["--model", f"{models}:two_blocks"]
    commands = {
        "mlp one device": ["--model", "mlp", "--strategy", "one-device"],
        "mlp x2": ["--model", "mlp", "--tensor-parallel", "2"],
        "user one device": [*user, "--strategy", "one-device"],
        "user x4": [*user, "--tensor-parallel", "4", "--tensor-layout", "up_*=column", "down_*=row"],
    }
    done = run_jobs_at_once(*(["jobs/train.py", *COMMON, *flags, "--output", str(root / name.replace(" ", "-"))]
                              for name, flags in commands.items()), timeout=600, at_once=2)
    for name, p in zip(commands, done):
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
    return {name: (root / name.replace(" ", "-"), p) for name, p in zip(commands, done)}


def _weights(run):
    import keras

    model = keras.models.load_model(run / "model.keras")
    # An ordinary Keras model: the split layers' shards were written back into Dense layers.
    assert {type(layer).__name__ for layer in model.layers} <= {"InputLayer", "Dense", "ReLU", "Flatten"}
    return model.get_weights()


@pytest.mark.parametrize("split, alone", [("mlp x2", "mlp one device"), ("user x4", "user one device")])
def test_split_layers_train_as_one_device_weight_for_weight(runs, split, alone):
    (split_run, p), (alone_run, _) = runs[split], runs[alone]
    for a, b in zip(_weights(split_run), _weights(alone_run)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    split_history = (split_run / "history.csv").read_text().splitlines()
    alone_history = (alone_run / "history.csv").read_text().splitlines()
    assert len(split_history) == len(alone_history) == 3

    result = json.loads((split_run / "result.json").read_text())["tensor_parallel"]
    n = len(result["devices"])
    assert n == int(split[-1]) and len(set(result["devices"])) == n
    # Read from the variables' devices: each device holds ~1/N of the split layers (a row layer's bias is whole on
    # the first device).
    assert set(result["device_bytes"]) == set(result["devices"])
    for held in result["device_bytes"].values():
        assert held == pytest.approx(result["unsplit_bytes"] / n, rel=0.05)
    console = p.stdout + p.stderr
    assert f"tensor parallel: {n} devices; " in console and "split layers' variables per device: " in console


def test_the_user_layout_split_every_block_it_names(runs):
    splits = json.loads((runs["user x4"][0] / "result.json").read_text())["tensor_parallel"]["splits"]
    assert splits == {"up_1": "column", "down_1": "row", "up_2": "column", "down_2": "row"}


BAD = [
    (["--tensor-layout", "conv=column"], "conv is a Conv2D; tensor parallel splits Dense layers"),
    (["--tensor-layout", "odd=column"], "its 6 units do not split into 4 equal shards"),
    (["--tensor-layout", "nothing=row"], "--tensor-layout nothing: no layer of "),
    (["--tensor-layout", "odd=sideways"], "--tensor-layout takes LAYER=column, LAYER=row or LAYER=replicated"),
    ([], "give --tensor-layout LAYER=column|row"),
    (["--backend", "ray"], "use it with --backend local"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    models = user_module(tmp_path_factory, "tp_bad.py", MODEL)
    return refusals_at_once(tmp_path_factory, "tp-refused", lambda i, out: [
        "jobs/train.py", "--backend", "local", "--model", f"{models}:with_conv", "--tensor-parallel", "4",
        *BAD[i][0], "--output", str(out)], len(BAD))


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(flags) or "no layout" for flags, _ in BAD])
def test_a_layout_that_cannot_split_is_one_line_before_training(refused, case):
    out, p = refused[case]
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and BAD[case][1] in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not out.exists()
