"""A Keras script's model as its user compiled it: its optimizer, loss and metrics, one-hot labels, tf.keras,
class weights, on 2 Ray workers, every metric exact over the workers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import refusals_at_once, run_job, run_jobs_at_once, tensorboard_scalars, user_module

USER_FILE = '''
import keras
import numpy as np
import tensorflow as tf

import app


def build_model():
    """The Keras script's model, compiled as the script compiles it."""
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC()])
    return model


def digits_one_hot():
    x, y = app.digits()
    return x.reshape(-1, 8, 8, 1), keras.utils.to_categorical(y, 10)


def digits_ids():
    return app.digits()


def tf_keras_model():
    """tf.keras, as older scripts spell it: a class-id loss object, a top-k metric, RMSprop."""
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer=tf.keras.optimizers.RMSprop(2e-3),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[tf.keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3"), "accuracy"])
    return model


def compiled(input_shape, loss, metrics=("accuracy",)):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="adam", loss=loss, metrics=list(metrics))
    return model


def sparse_loss_model(input_shape):
    return compiled(input_shape, "sparse_categorical_crossentropy")


def categorical_loss_model(input_shape):
    return compiled(input_shape, "categorical_crossentropy")


def two_inputs():
    """Named inputs: a dict of arrays, keyed as the model's keras.Input names."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(1200, 4)).astype("float32"), rng.normal(size=(1200, 3)).astype("float32")
    return {"a": a, "b": b}, ((a[:, 0] + b[:, 1]) > 0).astype("int64")


def two_input_model():
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(2, activation="softmax")(h))
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def renamed_inputs():
    x, y = two_inputs()
    return {"left": x["a"], "right": x["b"]}, y


def two_outputs():
    """Named outputs: a dict of labels, keyed as the model's output names."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1200, 5)).astype("float32")
    return x, {"kind": (x[:, 0] > 0).astype("int64"), "size": (x @ np.arange(5)).astype("float32")}


def two_output_model():
    x = keras.Input((5,))
    h = keras.layers.Dense(16, activation="relu")(x)
    model = keras.Model(x, {"kind": keras.layers.Dense(2, activation="softmax", name="kind")(h),
                            "size": keras.layers.Dense(1, name="size")(h)})
    model.compile(optimizer="adam", loss={"kind": "sparse_categorical_crossentropy", "size": "mse"},
                  loss_weights={"kind": 1.0, "size": 0.1}, metrics={"kind": ["accuracy"], "size": ["mae"]})
    return model


def mislabelled_outputs():
    x, y = two_outputs()
    return x, {"kind": y["kind"], "length": y["size"]}


def ones_as_sample_weights():
    x, y = digits_one_hot()
    return x, y, np.ones(len(y), "float32")


class LargestOutput(keras.metrics.Metric):
    """A running maximum: its state does not add up over batches."""

    def __init__(self, name="largest_output", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable((), initializer="zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.largest.assign(keras.ops.maximum(self.largest, keras.ops.max(y_pred)))

    def result(self):
        return self.largest


def non_additive_metric_model(input_shape):
    return compiled(input_shape, "sparse_categorical_crossentropy", metrics=[LargestOutput()])


def auc_on_class_ids_model(input_shape):  # AUC takes labels of the outputs' shape, not class ids
    return compiled(input_shape, "sparse_categorical_crossentropy", metrics=[keras.metrics.AUC()])


def precision_on_class_ids_model(input_shape):  # so does Precision; TensorFlow's op says it
    return compiled(input_shape, "sparse_categorical_crossentropy", metrics=[keras.metrics.Precision()])


class Unfinished(keras.layers.Layer):
    def call(self, inputs):
        raise ValueError("this layer is not written yet")


def unfinished_layer_model(input_shape):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(), Unfinished(), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    return user_module(tmp_path_factory, "keras_script.py", USER_FILE)


def test_the_keras_script_on_two_workers_reports_its_own_metrics_exactly(user_file, joined, tmp_path):
    """The script's model (Adam 1e-3, categorical cross-entropy on one-hot labels, accuracy + AUC) from the
    command line on 2 Ray workers, trained by Keras's fit: it learns, its History keys are Keras's, its Adam keeps
    the rate it was compiled with, and the AUC the workers summed equals keras.metrics.AUC over the exported
    model's predictions in this one process. Its TensorBoard step scalars every 23 steps (--log-every-steps: an
    epoch's last step) are the epoch's logs summed over both workers, as its epoch scalars are."""
    import keras

    from app.config import build_config
    from app.data import memory

    out = tmp_path / "run"
    p = run_job("jobs/train.py", "--model", f"{user_file}:build_model", "--dataset", f"{user_file}:digits_one_hot",
                "--num-workers", "2", "--epochs", "8", "--log-every-steps", "23", "--output", str(out), timeout=400,
                env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    console = p.stdout + p.stderr
    assert "step: Keras's train_step and test_step for the compiled loss and metrics, run by model.fit on each of 2 " \
           "worker(s)" in console
    assert "validation: 359 rows" in console  # the seeded --val-fraction 0.2 of the data function's 1,797 rows
    # Its Adam trains at the LR it was compiled with, as model.fit would: no scaling, warmup or decay.
    trained = keras.models.load_model(out / "model.keras")
    assert type(trained.optimizer).__name__ == "Adam"
    assert float(trained.optimizer.learning_rate) == pytest.approx(1e-3)
    result = json.loads((out / "result.json").read_text())
    assert result["metric"] == "val_accuracy" and result["num_replicas"] == 2 and result["global_batch_size"] == 64
    assert result["metrics"]["val_accuracy"] >= 0.95 and result["epochs_completed"] == 8
    # The record says what trained: the model's compile, in the plan, result.json and config.yaml; the product's
    # optimizer, rate and LR rule, which it replaced, are nowhere listed as in force.
    assert "compile: the model's own compile(): optimizer Adam at learning rate 0.001; loss categorical_crossentropy;" \
           " metrics accuracy, auc" in console
    assert result["compiled"]["optimizers"] == [{"name": "optimizer", "class": "Adam", "learning_rate": 0.001}]
    assert (result["compiled"]["loss"], result["compiled"]["metrics"]) == ("categorical_crossentropy", ["accuracy", "auc"])
    assert (result["base_lr"], result["lr_scaling"], result["learning_rate"]) == (0.001, "none", 0.001)
    not_in_force = {"optimizer", "base_lr", "momentum", "loss", "lr_scaling", "warmup_epochs", "lr_decay", "hidden_units"}
    assert not_in_force <= set(result["compiled"]["not_in_force"]) and not not_in_force & set(result["config"])
    recorded = (out / "config.yaml").read_text()
    in_force = recorded.split("# Defaults in force")[1].split("# Not in force")[0]
    assert not [f for f in not_in_force if f"# {f}:" in in_force], in_force
    assert "# Not in force for this run" in recorded and "optimizer" in recorded.split("# Not in force")[1]
    history = (out / "history.csv").read_text().splitlines()[0].split(",")
    assert {"loss", "auc", "val_auc", "accuracy", "val_accuracy"} <= set(history)
    assert p.stdout.strip().splitlines()[-2].startswith("val_accuracy ")  # the run's last line: its metric first
    # The outputs every run writes: each rank's node, the curves, rank 0's TensorBoard epoch scalars (the numbers
    # of history.csv, under the names result.json gives them).
    assert len(result["worker_nodes"]) == 2 and result["strategy"].startswith("collective all-reduce")
    assert "run: backend ray, collective all-reduce (one replica per worker), 2 worker(s), global batch 64 (= 32 per " \
           "worker), 23 steps per epoch, 8 epochs" in console
    assert (result["backend"], result["per_replica_batch"], result["grad_accum"], result["mixed_precision"]) == \
        ("ray", 32, 1, "off")
    assert (out / "curves.png").stat().st_size > 10_000
    scalars = tensorboard_scalars(out / "tensorboard")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    recorded = [float(line.split(",")[history.index("val_auc")])
                for line in (out / "history.csv").read_text().splitlines()[1:]]
    assert [step for step, _ in scalars["epoch/val_auc"]] == list(range(1, 9))
    np.testing.assert_allclose([v for _, v in scalars["epoch/val_auc"]], recorded, rtol=1e-6)
    assert {"epoch/train_loss", "epoch/learning_rate", "epoch/samples_per_second"} <= set(scalars)
    for name in ("train_loss", "train_auc"):
        assert [step for step, _ in scalars[f"step/{name}"]] == [23 * e for e in range(1, 9)], name
        np.testing.assert_allclose([v for _, v in scalars[f"step/{name}"]], [v for _, v in scalars[f"epoch/{name}"]],
                                   rtol=1e-5)
    assert "step/learning_rate" in scalars
    # The model function (pickled by value, it imports Keras) reached the workers without the Train controller
    # unpickling it: TensorFlow's start-up notice is the workers', never the controller's (docs/design.md).
    log = (out / "train.log").read_text().splitlines()
    notices = [line for line in log if "oneDNN custom operations" in line]
    assert notices and not [line for line in notices if line.startswith("(TrainController")], notices

    # One process, Keras's own metrics, the same validation rows.
    config = build_config(None, {"dataset": f"{user_file}:digits_one_hot", "output": str(tmp_path / "x")})
    val = memory.load_source(config).val
    probabilities = trained.predict(val.x, verbose=0)
    auc, accuracy = keras.metrics.AUC(), keras.metrics.CategoricalAccuracy()
    auc.update_state(val.y, probabilities)
    accuracy.update_state(val.y, probabilities)
    assert abs(result["metrics"]["val_auc"] - float(auc.result())) < 1e-6
    assert abs(result["metrics"]["val_accuracy"] - float(accuracy.result())) < 1e-6


def test_tf_keras_model_with_class_weights_on_two_workers(user_file, ray_cluster, tmp_path):
    """A tf.keras model (RMSprop, a loss object with from_logits, a named top-3 metric) and --class-weight
    balanced, on 2 Ray workers: it trains with what it was compiled with, by Keras's fit."""
    import keras

    from app import train

    result = train(model=f"{user_file}:tf_keras_model", data=f"{user_file}:digits_ids", num_workers=2, epochs=2,
                   class_weight="balanced", output=str(tmp_path / "tfk"))
    # "top3" does not say which way is better; accuracy does: it is the run's metric.
    assert result["metric"] == "val_accuracy"
    assert result["metrics"]["val_top3"] >= result["metrics"]["val_accuracy"] > 0.5
    trained = keras.models.load_model(tmp_path / "tfk" / "model.keras")
    assert type(trained.optimizer).__name__ == "RMSprop" and float(trained.optimizer.learning_rate) == \
        pytest.approx(2e-3)


@pytest.fixture(scope="module")
def weighted_runs(user_file, tmp_path_factory):
    """Three local runs of the same compiled model, side by side: plain, every class weighed 2, and a data function
    that returns sample weights of 1. {name: output}."""
    root = tmp_path_factory.mktemp("weighted")
    common = ["jobs/train.py", "--model", f"{user_file}:build_model", "--backend", "local", "--strategy",
              "one-device", "--epochs", "1", "--no-shuffle", "--warmup-epochs", "0", "--lr-decay", "constant"]
    digits = ["--dataset", f"{user_file}:digits_one_hot"]
    runs = {"plain": digits, "doubled": [*digits, "--class-weight", json.dumps({str(c): 2.0 for c in range(10)})],
            "ones": ["--dataset", f"{user_file}:ones_as_sample_weights"]}
    done = run_jobs_at_once(*([*common, *flags, "--output", str(root / name)] for name, flags in runs.items()))
    for p in done:
        assert p.returncode == 0, p.stderr[-2000:]
    return {name: root / name for name in runs}


def test_class_weights_scale_the_loss_as_keras_does(weighted_runs):
    """Every class weighed 2: the reported loss doubles, and Adam (invariant to the gradient's scale) takes
    the same steps (local backend: the loss code is the one every backend runs)."""
    plain, doubled = (json.loads((weighted_runs[n] / "result.json").read_text()) for n in ("plain", "doubled"))
    assert doubled["metrics"]["train_loss"] == pytest.approx(2 * plain["metrics"]["train_loss"], rel=1e-3)
    # Validation is unweighted, as in Keras's fit: the same model up to Adam's epsilon, the same val loss.
    assert doubled["metrics"]["val_loss"] == pytest.approx(plain["metrics"]["val_loss"], rel=2e-3)


def test_a_two_output_model_on_two_workers_reports_each_outputs_metrics(user_file, ray_cluster, tmp_path):
    """A loss, a loss weight and metrics per output, as compile() says, each metric named by its output."""
    from app import train

    result = train(model=f"{user_file}:two_output_model", data=f"{user_file}:two_outputs", num_workers=2,
                   epochs=2, output=str(tmp_path / "two_out"))
    assert {"train_kind_accuracy", "train_size_mae", "val_kind_accuracy", "val_size_mae"} <= set(result["metrics"])
    assert result["metric"] == "val_kind_accuracy" and 0.5 < result["metrics"]["val_kind_accuracy"] <= 1
    assert result["metrics"]["val_size_mae"] > 0


def test_sample_weights_of_one_are_no_weights(weighted_runs):
    """(x, y, sample_weight) from a data function, all 1: the very same training as (x, y)."""
    import keras

    wa = keras.models.load_model(weighted_runs["plain"] / "model.keras", compile=False).get_weights()
    wb = keras.models.load_model(weighted_runs["ones"] / "model.keras", compile=False).get_weights()
    for a, b in zip(wa, wb):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


BAD_COMPILE = [
    ("sparse_loss_model", "digits_one_hot", (), "loss sparse_categorical_crossentropy takes class ids, but the "
     "labels are one-hot (10 columns): compile with loss='categorical_crossentropy'"),
    ("categorical_loss_model", "digits_ids", (), "loss categorical_crossentropy takes one-hot labels, but the labels "
     "are class ids: compile with loss='sparse_categorical_crossentropy'"),
    ("two_input_model", "renamed_inputs", (), "the data's inputs are named left, right, but "),
    ("two_input_model", "digits_ids", (), "takes 2 inputs (a, b), but the data gives one features input of shape "
     "(64,): name each input's file column with --inputs a b (or NAME=COLUMN), return a dict of arrays keyed a, b "
     "from a data function"),
    ("two_output_model", "mislabelled_outputs", (), "the labels are named kind, length, but "),
    ("categorical_loss_model", "digits_one_hot", ("--class-weight", "{\"0\": oops}"),
     "--class-weight '{\"0\": oops}': give 'balanced' or a JSON object"),
    # The workers sum every metric's state: a running maximum's would be wrong on 2, so it is refused there.
    ("non_additive_metric_model", "digits_ids", ("--num-workers", "2"), "metric largest_output (LargestOutput) keeps "
     "a state that does not add up over batches, so it cannot be combined exactly over workers"),
    # What Keras's fit raises at its first step, said before any worker starts, with the shapes given.
    ("auc_on_class_ids_model", "digits_ids", ("--num-workers", "2"), "the model's compiled loss and metrics fail on "
     "a batch as Keras's fit would: ValueError: "),
    # ... in TensorFlow's words, without its framing ("{{function_node __wrapped__LogicalAnd_device_/job:...}}").
    ("precision_on_class_ids_model", "digits_ids", ("--num-workers", "2"), "fail on a batch as Keras's fit would: "
     "InvalidArgumentError: Incompatible shapes: [1,"),
    # A layer of the user's own that raises as the model function builds it: its words, not Keras's framing of them
    # (the layer named, its arguments dumped) over several lines.
    ("unfinished_layer_model", "digits_ids", (), "keras_script.py:unfinished_layer_model raised ValueError: this "
     "layer is not written yet (traceback in "),
]


@pytest.fixture(scope="module")
def bad_compile_runs(user_file, tmp_path_factory):
    """--backend local: the checks are the driver's, the same on Ray; a case for several Ray workers is a --dry-run
    (its checks are the run's, before any Ray starts)."""
    def argv(i, out):
        model, data, extra, _ = BAD_COMPILE[i]
        return ["jobs/train.py", "--model", f"{user_file}:{model}", "--dataset", f"{user_file}:{data}", *extra,
                *(["--dry-run"] if "--num-workers" in extra else ["--backend", "local"]), "--output", str(out)]

    return refusals_at_once(tmp_path_factory, "bad-compile", argv, len(BAD_COMPILE))


@pytest.mark.parametrize("case", range(len(BAD_COMPILE)), ids=[f"{m}-{d}" for m, d, _, _ in BAD_COMPILE])
def test_a_compiled_model_that_does_not_fit_is_one_line_before_training(bad_compile_runs, case):
    message = BAD_COMPILE[case][3]
    out, p = bad_compile_runs[case]
    errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and message in errors[0], p.stdout + p.stderr
    assert "Traceback" not in p.stderr and not out.exists()
