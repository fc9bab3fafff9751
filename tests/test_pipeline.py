"""--strategy pipeline: one model cut into stages over local devices (2 logical CPUs here), GPipe micro-batches.

Logical CPU devices must be configured before TensorFlow starts, so everything runs in a fresh process:
the command line as the README writes it, and a script that drives the run's own step factory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile

import pytest

from app import cli
from conftest import REPO, clean_env, refusals_at_once, run_job, run_jobs_at_once, user_module

CNN_ON_DIGITS = ["--model", "cnn", "--feature-shape", "8", "8", "1", "--epochs", "5"]

USER_MODELS = textwrap.dedent("""
    import keras


    def residual(input_shape, num_classes):
        x = keras.Input(input_shape)
        h = keras.layers.Dense(32, activation="relu", name="block_1")(x)
        b = keras.layers.Dense(32, activation="relu", name="block_2")(h)
        b = keras.layers.Dense(32, name="block_3")(b)
        h = keras.layers.Add(name="block_4")([h, b])
        return keras.Model(x, keras.layers.Dense(num_classes, name="head")(h))


    class Subclassed(keras.Model):
        def __init__(self, num_classes):
            super().__init__()
            self.hidden, self.head = keras.layers.Dense(16), keras.layers.Dense(num_classes)

        def call(self, x):
            return self.head(self.hidden(x))


    def subclassed(num_classes):
        return Subclassed(num_classes)


    def sequential(input_shape, num_classes):  # layers named by Keras: dense, dense_1, ... (new names each build)
        return keras.Sequential([
            keras.Input(input_shape),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(num_classes),
        ])
""")


def run(out, *args, timeout=300):
    return run_job("jobs/train.py", "--backend", "local", "--output", str(out), *args, timeout=timeout)


def result_of(p, out) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_pipeline_over_two_devices_equals_one_device_with_1_and_4_micro_batches(tmp_path):
    """A residual model (digits, unequal micro-batches) and the transformer (its mask recomputed past the cut; sparse
    embedding grads): the model Keras's fit trains for the pipeline against Keras's own step on one device."""
    p = subprocess.run([sys.executable, "tests/scripts/pipeline_equals_one_device.py", str(tmp_path / "o")], cwd=REPO,
                       env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    models = json.loads(p.stdout.strip().splitlines()[-1])
    # A batch of fewer rows than micro-batches goes whole: batch normalisation's statistics stay finite (an empty
    # micro-batch made them NaN), the step the one-device one
    assert models.pop("short_batch") == {"max_abs_diff": 0.0, "finite": True}
    assert set(models) == {"residual", "transformer"}
    assert models["residual"]["stages"][1]["first"] == "branch_a"  # balanced; inside the residual block there is no cut
    assert models["transformer"]["stages"][1]["first"] == "attention_1"
    for name, out in models.items():
        stages = out["stages"]
        assert [s["device"] for s in stages] == ["/device:CPU:0", "/device:CPU:1"]
        for m in ("1", "4"):
            run = out["pipelines"][m]
            assert run["max_abs_diff"] < 1e-5, (name, m, run)
            assert run["moved"] > 1e-2  # the steps really changed the weights
            for key, value in out["one_device_first_step"].items():  # Keras's logs of the first step, as Keras's own
                assert run["first_step"][key] == pytest.approx(value, rel=1e-5), (name, m, key)
            # Each stage's variables on its own device, every gradient op and the evaluation on a stage's device.
            devices = run["variable_devices"]
            assert devices[stages[0]["first"]] == ["CPU:0"] and devices[stages[1]["last"]] == ["CPU:1"], devices
            assert sorted({d for ds in devices.values() for d in ds}) == ["CPU:0", "CPU:1"]
            assert set(run["gradient_ops_per_device"]) == {"CPU:0", "CPU:1"}, (name, m, run["gradient_ops_per_device"])
            assert run["evaluation_devices"] == ["CPU:0", "CPU:1"]
            # The placed model is one ordinary model: saved and reloaded, it computes what the stages compute.
            assert run["exported_vs_stages"] < 1e-5


def test_cnn_pipeline_on_digits_matches_one_device(tmp_path):
    """The README's command: the CNN over 2 stages reaches the one-device val accuracy; the model is one model.
    (Not to the digit: its batch norm normalises each micro-batch, one device the whole batch. The exact math is
    test_pipeline_over_two_devices_equals_one_device_with_1_and_4_micro_batches's.)"""
    out = tmp_path / "pipe"
    local = ["jobs/train.py", "--backend", "local", *CNN_ON_DIGITS]
    q, p = run_jobs_at_once([*local, "--output", str(tmp_path / "one"), "--strategy", "one-device"],
                            [*local, "--output", str(out), "--strategy", "pipeline", "--devices", "2",
                             "--pipeline-microbatches", "4"], timeout=300)
    one, pipe = result_of(q, tmp_path / "one"), result_of(p, out)
    assert pipe["strategy"] == "pipeline"
    accuracy = pipe["metrics"]["val_accuracy"]
    assert accuracy >= one["metrics"]["val_accuracy"] - 0.01, (pipe["metrics"], one["metrics"])
    assert accuracy > 0.95
    stages = pipe["stages"]
    assert [s["device"] for s in stages] == ["/device:CPU:0", "/device:CPU:1"]
    assert stages[0]["first"] == "conv_0_0" and stages[1]["last"] == "logits"
    assert all(s["parameters"] > 0 for s in stages)
    assert "pipeline: 2 stages, each batch as 4 micro-batches" in p.stderr  # the plan lines
    assert "step: the pipeline's train_step (each batch's micro-batches through the stages, then back, one update " \
           "by the compiled optimizer) and Keras's test_step over the stages" in p.stderr
    # The exported model is one ordinary model (the equivalence script reloads one and checks its outputs).
    with zipfile.ZipFile(out / "model.keras") as saved:
        exported = json.loads(saved.read("config.json"))
    layers = [layer["config"]["name"] for layer in exported["config"]["layers"]]
    assert exported["class_name"] == "Functional" and "conv_0_0" in layers and "logits" in layers
    assert not any(name.startswith("stage_") for name in layers)
    # ... and so is the SavedModel for serving, exported from it: 8x8x1 digits, any batch size.
    assert pipe["saved_model"]["inputs"] == {"x": {"dtype": "float32", "shape": [-1, 8, 8, 1]}}
    assert (out / "saved_model" / "saved_model.pb").is_file()


def test_users_sequential_model_over_three_stages_cut_where_asked(tmp_path):
    (tmp_path / "my_models.py").write_text(USER_MODELS)
    out = tmp_path / "seq"
    result = result_of(run(out, "--strategy", "pipeline", "--devices", "3", "--split-at", "dense_1,dense_2",
                           "--epochs", "2", "--pipeline-microbatches", "2",
                           "--model", f"{tmp_path / 'my_models.py'}:sequential"), out)
    assert [(s["first"], s["last"], s["device"]) for s in result["stages"]] == [
        ("dense", "dense", "/device:CPU:0"), ("dense_1", "dense_1", "/device:CPU:1"),
        ("dense_2", "dense_2", "/device:CPU:2")]
    assert [s["parameters"] for s in result["stages"]] == [64 * 64 + 64, 64 * 32 + 32, 32 * 10 + 10]
    assert result["metrics"]["val_accuracy"] > 0.8


def test_app_fit_of_a_keras_script_trains_a_pipeline_and_returns_kerass_history(tmp_path):
    """A Keras script imports Keras first and app.fit checks the model before the run: the pipeline's logical
    devices are still made before TensorFlow starts, and the History has Keras's keys (history.csv's names). The
    pipeline trains by Keras's fit: Keras's gradient accumulation, fp16's loss scaling, --resume from its checkpoint;
    a model of its own step, or a loss of another reduction, is one line."""
    code = textwrap.dedent(f"""
        import json
        import keras
        import numpy as np
        import app
        from app.errors import UserError

        def build():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            return model

        x = np.random.default_rng(0).normal(size=(320, 5)).astype("float32")
        y = (x[:, 0] > 0).astype("int64")
        pipe = dict(backend="local", strategy="pipeline", devices=2, output={str(tmp_path / "run")!r}, verbose=0,
                    batch_size=32, validation_split=0.2, grad_accum=2)
        history = app.fit(build, x, y, epochs=2, **pipe)
        resumed = app.fit(build, x, y, epochs=3, resume=True, **pipe)
        fp16 = app.fit(build, x, y, epochs=1, **{{**pipe, "output": {str(tmp_path / "fp16")!r}, "grad_accum": 1,
                                                   "mixed_precision": "fp16"}})

        class OwnStep(keras.Model):
            def train_step(self, data):
                return super().train_step(data)

        def own_step():
            inputs = keras.Input((5,))
            model = OwnStep(inputs, keras.layers.Dense(2)(keras.layers.Dense(16)(inputs)))
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            return model

        def summed():
            model = build()
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
            return model

        refused = []
        for refusal in (own_step, summed):
            try:
                app.fit(refusal, x, y, epochs=1, **{{**pipe, "output": {str(tmp_path / "never")!r}}})
            except UserError as e:
                refused.append(str(e))
        print(json.dumps({{"fp16": [type(fp16.model.optimizer).__name__, fp16.history["loss"][0]], "refused": refused,
                           "keys": list(history.history), "epoch": history.epoch,
                           "strategy": history.result["strategy"], "resumed": resumed.epoch,
                           "updates": int(resumed.model.optimizer.iterations.numpy()),
                           "first": [round(v, 6) for v in resumed.history["loss"][:2]],
                           "before": [round(v, 6) for v in history.history["loss"]]}}))
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # Keras's keys, in the order model.fit's History has them (the TensorFlow step returns its logs by name)
    assert (got["keys"], got["epoch"], got["strategy"]) == (["accuracy", "loss", "val_accuracy", "val_loss"], [0, 1],
                                                            "pipeline")
    # Resumed from its checkpoint for a third epoch: Keras's gradient accumulation took one update every 2 steps
    # (256 rows: 8 steps an epoch, 4 updates), and the epochs before come back as they were.
    assert got["resumed"] == [0, 1, 2] and got["first"] == got["before"], got
    assert got["updates"] == 3 * 4, got
    # fp16: Keras's compile wraps the optimizer in a LossScaleOptimizer, whose scaled loss the stages' step takes
    assert got["fp16"][0] == "LossScaleOptimizer" and 0 < got["fp16"][1] < 1, got
    # A model of its own step: one line, before any training (the pipeline's step would not be its own)
    assert got["refused"][0].startswith("--strategy pipeline runs each batch's micro-batches through the stages in "
                                        "a train_step of its own, and own_step trains by its own train_step"), got
    # A loss of another reduction than Keras's default: the micro-batches' weighed losses would not add up to it
    assert "summed's SparseCategoricalCrossentropy reduces by 'sum': compile it with the default" in got["refused"][1]
    assert not (tmp_path / "never").exists()
    header = (tmp_path / "run" / "history.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "epoch" and set(got["keys"]) <= set(header), header


def test_split_at_takes_a_comma_list_or_separate_values():
    base = ["--backend", "local", "--strategy", "pipeline"]
    assert cli.train_args("t", [*base, "--split-at", "block_2,block_4,block_6"]).config.split_at == [
        "block_2", "block_4", "block_6"]
    assert cli.train_args("t", [*base, "--split-at", "block_2", "block_4"]).config.split_at == ["block_2", "block_4"]


def one_error_line(p) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    return errors[0]


CUTS = [
    (["--devices", "2", "--split-at", "block_3"], ["--split-at block_3: 2 tensors that depend on weights cross there",
                                                  "can be cut at: block_2, head"]),
    (["--devices", "1"], ["--strategy pipeline needs 2 or more devices (one per stage), found 0 GPU(s), 1 CPU"]),
]


@pytest.fixture(scope="module")
def cut_refusals(tmp_path_factory):
    models = user_module(tmp_path_factory, "my_models.py", USER_MODELS)
    return refusals_at_once(tmp_path_factory, "cuts", lambda i, out: [
        "jobs/train.py", "--backend", "local", "--output", str(out), "--strategy", "pipeline", "--model",
        f"{models}:residual", *CUTS[i][0]], len(CUTS), timeout=300)


@pytest.mark.parametrize("case", range(len(CUTS)), ids=[" ".join(args) for args, _ in CUTS])
def test_a_cut_that_cannot_be_made_is_one_line_before_training(cut_refusals, case):
    out, p = cut_refusals[case]
    line = one_error_line(p)
    for word in CUTS[case][1]:
        assert word in line, line
    assert not out.exists()


@pytest.mark.parametrize("model, split_at, words", [
    ("residual", ["block_9"], ["--split-at block_9: no layer has that name; my model can be cut at: block_2, head"]),
    ("residual", ["block_4"], ["--split-at block_4: 2 tensors that depend on weights cross there"]),
    ("residual", ["head", "block_2"], ["give each layer once, in the model's order"]),
    ("residual", ["block_2"], ["makes 2 stages, but there are 3 devices"]),
    ("subclassed", None, ["--strategy pipeline cuts functional and Sequential models, and my model is a subclassed "
                          "Subclassed"]),
])
def test_what_cannot_be_cut_is_named(tmp_path, model, split_at, words):
    """The same check the run makes before training (the line above), on more cases, in this process."""
    import numpy as np

    from app.errors import UserError
    from app.training.pipeline import plan_stages

    namespace: dict = {}
    exec(USER_MODELS, namespace)
    built = namespace[model](**({"input_shape": (64,)} if model != "subclassed" else {}), num_classes=10)
    built(np.zeros((1, 64), np.float32))
    with pytest.raises(UserError) as e:
        plan_stages(built, split_at, ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"], "my model")
    for word in words:
        assert word in str(e.value), e.value


@pytest.mark.parametrize("args, words", [
    (["--split-at", "x"], ["--split-at and --pipeline-microbatches are for --strategy pipeline"]),
    (["--pipeline-microbatches", "2"], ["--split-at and --pipeline-microbatches are for --strategy pipeline"]),
])
def test_pipeline_flags_out_of_place_are_one_line(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        cli.train_args("t", ["--backend", "local", *args])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and all(w in line for w in words), line
