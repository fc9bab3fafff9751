"""--backend local, without Ray: one device, MirroredStrategy and central storage, each trained by Keras's fit."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, clean_env, refusals_at_once, run_job, run_jobs_at_once

FULL_BATCH_SGD = [
    "--epochs", "5", "--optimizer", "sgd", "--momentum", "0", "--base-lr", "0.5", "--lr-scaling", "none",
    "--warmup-epochs", "0", "--lr-decay", "constant", "--no-shuffle", "--seed", "7",
]


def local_run(out, *args):
    return local_runs((out, *args))[0]


def local_runs(*runs):
    """(out, *flags) runs of jobs/train.py --backend local, side by side; their result.json."""
    done = run_jobs_at_once(*(["jobs/train.py", "--backend", "local", "--output", str(out), *args]
                              for out, *args in runs), timeout=300)
    for p in done:
        assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / "result.json").read_text()) for out, *_ in runs]


def test_mirrored_over_two_cpus_equals_one_device(tmp_path):
    import keras

    two, one = local_runs(
        (tmp_path / "two", "--strategy", "mirrored", "--devices", "2", "--per-replica-batch", "719", *FULL_BATCH_SGD),
        (tmp_path / "one", "--strategy", "one-device", "--per-replica-batch", "1438", *FULL_BATCH_SGD),
    )
    assert two["strategy"] == "MirroredStrategy" and two["num_replicas"] == 2
    assert one["strategy"] == "default strategy (one replica)" and one["num_replicas"] == 1
    assert two["global_batch_size"] == one["global_batch_size"] == 1438
    w2 = keras.models.load_model(tmp_path / "two" / "model.keras").get_weights()
    w1 = keras.models.load_model(tmp_path / "one" / "model.keras").get_weights()
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # Both train by Keras's fit (its History's keys): the two replicas, each on its half of every global batch, give
    # one device's weights.
    losses = [float(row["loss"]) for row in csv.DictReader((tmp_path / "one" / "history.csv").open())]
    assert one["backend"] == "local" and "loss" in one["history"][0] and two["history"][0].keys() == one["history"][0].keys()
    assert losses[-1] < losses[0] - 0.3  # the 5 full-batch steps really trained


@pytest.fixture(scope="module")
def local_set(tmp_path_factory):
    """Local runs that do not depend on each other, side by side: {name: (output, result.json)}."""
    root = tmp_path_factory.mktemp("local-set")
    runs = {"auto": ["--epochs", "4"],
            "audit": ["--strategy", "mirrored", "--devices", "2", "--epochs", "2", "--per-replica-batch", "50",
                      "--audit-sample-ids"],
            "cs": ["--strategy", "central-storage", "--devices", "2", "--epochs", "3"],
            "cnn": ["--strategy", "mirrored", "--devices", "2", "--dataset", "synthetic", "--synthetic-rows", "512",
                    "--synthetic-shape", "8", "8", "3", "--model", "cnn", "--conv-filters", "4", "8", "--epochs", "2",
                    "--per-replica-batch", "16"]}
    results = local_runs(*((root / name, *flags) for name, flags in runs.items()))
    return {name: (root / name, result) for name, result in zip(runs, results)}


def test_auto_picks_one_cpu_device_here_and_says_why(local_set):
    out, result = local_set["auto"]
    assert result["strategy"] == "default strategy (one replica)"
    assert result["strategy_reason"] == "no TPU, no GPU -> one replica on the CPU"
    assert result["metrics"]["val_accuracy"] >= 0.95
    # The exported model scores the same in a plain process.
    p = run_job("jobs/evaluate.py", "--run", str(out), timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "eval.json").read_text())["val_accuracy"] == pytest.approx(
        result["metrics"]["val_accuracy"], abs=1e-6
    )


def test_mirrored_sees_every_sample_once_per_epoch(local_set):
    out, result = local_set["audit"]
    per_epoch = json.loads((out / "audit_sample_ids.json").read_text())
    assert result["dropped_samples_per_epoch"] == 0  # 14 batches of 100, then a short one of 38 split over the replicas
    for ids in per_epoch:
        assert len(ids) == len(set(ids)) == 1438
    assert per_epoch[0] != per_epoch[1]  # reshuffled


def test_one_replica_with_devices_and_a_resume_of_a_run_stopped_before_its_first_checkpoint_train_by_kerass_fit(
        local_set, tmp_path):
    """--devices 1 asks for one replica, and --resume of a run that wrote its config.yaml but stopped before its
    first checkpoint has nothing to go on from: both train by Keras's fit, as any one-device run (the plan's step)."""
    from app.config import build_config
    from app.run.api import dry_run

    keras_step = "step: Keras's train_step and test_step"
    plan = dry_run(build_config(None, {"backend": "local", "devices": 1, "epochs": 1, "output": str(tmp_path / "one")}))
    assert any(keras_step in line for line in plan), plan
    out, _ = local_set["auto"]
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copy(out / "config.yaml", stopped / "config.yaml")
    plan = dry_run(build_config(None, {"backend": "local", "resume": True, "output": str(stopped), "epochs": 4}))
    assert any(keras_step in line for line in plan), plan


def test_central_storage_trains(local_set):
    _, result = local_set["cs"]
    assert result["strategy"] == "CentralStorageStrategy" and result["num_replicas"] == 2
    assert result["metrics"]["val_accuracy"] > 0.9


def test_several_steps_per_call_equal_one_step_per_call(tmp_path):
    """steps_per_execution is how TPUs are fed; the update sequence must not change."""
    import keras

    common = ["--strategy", "one-device", "--epochs", "2", "--no-shuffle", "--optimizer", "sgd"]
    # 44 steps/epoch: 8 calls of 5 + one of 4
    local_runs((tmp_path / "k1", *common), (tmp_path / "k5", *common, "--steps-per-execution", "5"))
    assert json.loads((tmp_path / "k5" / "result.json").read_text())["config"]["steps_per_execution"] == 5
    w1 = keras.models.load_model(tmp_path / "k1" / "model.keras").get_weights()
    w5 = keras.models.load_model(tmp_path / "k5" / "model.keras").get_weights()
    for a, b in zip(w1, w5):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


IMPOSSIBLE = [
    (["--strategy", "tpu"], "--strategy tpu: no TPU found"),
    (["--strategy", "mirrored", "--devices", "1"], "--strategy mirrored needs 2 or more devices, found 0 GPU(s), 1 CPU"),
    (["--strategy", "central-storage"], "--strategy central-storage needs 2 or more compute devices"),
]


@pytest.fixture(scope="module")
def impossible_runs(tmp_path_factory):
    return refusals_at_once(tmp_path_factory, "impossible", lambda i, out: [
        "jobs/train.py", "--backend", "local", "--output", str(out), *IMPOSSIBLE[i][0]], len(IMPOSSIBLE), timeout=300)


@pytest.mark.parametrize("case", range(len(IMPOSSIBLE)), ids=[" ".join(args) for args, _ in IMPOSSIBLE])
def test_impossible_strategy_requests_fail_clearly(impossible_runs, case):
    out, p = impossible_runs[case]
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and IMPOSSIBLE[case][1] in errors[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_ray_flags_are_refused_for_local_and_vice_versa(tmp_path):
    p = run_job("jobs/train.py", "--strategy", "mirrored", "--output", str(tmp_path / "o"), timeout=300)
    assert p.returncode == 2 and "use it with --backend local" in p.stderr


def test_local_backend_never_imports_ray(tmp_path):
    """--backend local, from a fresh process as app.train runs it: one replica (the default) and a pipeline over 2
    logical CPUs (which must be made before TensorFlow starts)."""
    for name, fields in (("fit", ""), ("pipeline", ', strategy="pipeline", devices=2')):
        code = f"""
import sys
import app
app.train(backend="local", epochs=1, output={str(tmp_path / name)!r}{fields})
assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
print("no ray")
"""
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0 and "no ray" in p.stdout, p.stderr[-3000:]
    assert json.loads((tmp_path / "pipeline" / "result.json").read_text())["strategy"] == "pipeline"
    assert (tmp_path / "fit" / "result.json").exists()


def test_cnn_batch_norm_state_is_one_value_across_replicas(local_set):
    """Each replica updates its own batch-norm moving statistics; the loop averages them every epoch.

    Without that, replica 1 evaluates with different statistics from the ones
    rank 0 exports, and the in-training val metrics disagree with the exported
    model's.
    """
    out, result = local_set["cnn"]
    p = run_job("jobs/evaluate.py", "--run", str(out), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    scored = json.loads((out / "eval.json").read_text())
    assert scored["val_loss"] == pytest.approx(result["metrics"]["val_loss"], rel=1e-5)
    assert scored["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)


class _Accuracy:
    """The measures of an uncompiled classifier, as far as the driver sees them: accuracy = total / count."""

    size = 4

    @staticmethod
    def results(state):
        return {"accuracy": state[0] / state[1]}


MEASURES = _Accuracy()


class ChunkedSteps:
    """A StepRunner that runs its steps in chunks of 16, as the parameter servers' ScheduledSteps does."""

    def __init__(self, bad_step=None):
        self.bad_step, self.numbers = bad_step, []

    def steps_taken(self):
        return 100

    def run(self, iterator, first_step, remaining):
        n = min(16, remaining)
        self.numbers += range(first_step, first_step + n)
        loss = np.nan if self.bad_step in self.numbers[-n:] else 0.5 * n
        return np.array([loss, n, n / 2, n], dtype=np.float64), n  # [loss, count, accuracy's total, count]

    def total(self, local):
        return local

    def evaluate(self, val):
        from app.training.metrics import EpochStats

        return EpochStats.from_sums(np.array([1.0, 8.0, 4.0, 8.0]), 0.1, MEASURES.results)

    def learning_rate(self, global_step):
        return 1.0 / global_step

    def extra_metrics(self):
        return {}


def test_the_epoch_driver_numbers_chunked_steps_and_names_a_non_finite_chunk():
    """The one epoch driver under a runner that schedules numbered steps in chunks (parameter servers): the steps
    are numbered on from the restored count, the record carries optimizer_steps, a NaN names its chunk."""
    from app.training.loop import EpochDriver, NonFiniteLoss

    runner = ChunkedSteps()
    driver = EpochDriver(runner, MEASURES)
    metrics, train = driver.run_epoch(1, None, 40, None, dropped=0)
    assert runner.numbers == list(range(100, 140)) and train.samples == 40
    assert metrics["optimizer_steps"] == 140 and metrics["learning_rate"] == 1 / 140
    assert metrics["train_loss"] == 0.5 and metrics["val_accuracy"] == 0.5

    with pytest.raises(NonFiniteLoss, match=r"non-finite training loss in epoch 2, steps 17-32 of 40"):
        EpochDriver(ChunkedSteps(bad_step=120), MEASURES).train_epoch(None, 40, epoch=2)


OWN_STEP_MODELS = '''
import numpy as np
import keras
import tensorflow as tf


class OwnStep(keras.Model):
    """A train_step of its own, its loss a plain function (Keras does not divide it by the replicas)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="loss")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, self(x, training=True),
                                                                               from_logits=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.tracker.update_state(loss, sample_weight=tf.shape(x)[0])
        return {"loss": self.tracker.result()}

    def test_step(self, data):
        x, y = data
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, self(x), from_logits=True))
        self.tracker.update_state(loss, sample_weight=tf.shape(x)[0])
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def _layers(kind):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    if kind == "compiled":  # and an Embedding of ids made from the features: a sparse gradient (tf.IndexedSlices)
        ids = keras.ops.cast(keras.ops.abs(inputs[:, :3]) * 3, "int32") % 8
        hidden = keras.layers.Concatenate()([hidden, keras.layers.Flatten()(keras.layers.Embedding(8, 2)(ids))])
    return (OwnStep if kind == "own" else keras.Model)(inputs, keras.layers.Dense(3)(hidden))


def own():
    model = _layers("own")
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0))
    return model


def compiled():
    model = _layers("compiled")
    model.compile(optimizer=keras.optimizers.Adam(0.01, clipnorm=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 8)).astype("float32")  # 3 batches of 64, then 11 cut 6 + 5 over two replicas
    return {"train": (x, (x[:, 0] > 0).astype("int64") + (x[:, 1] > 1)), "val": (x[:41], np.zeros(41, "int64"))}


if __name__ == "__main__":  # each kind's model by model.fit on one device (or app.fit's: "app"), in one process
    import json
    import sys

    (x, y), val = data()["train"], data()["val"]
    mode, kinds, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
    last = {}
    for kind in kinds:
        build = {"own": own, "compiled": compiled, "accumulated": own, "central": compiled}[kind]
        steps = 2 if kind == "accumulated" else 1
        strategy = "central-storage" if kind == "central" else "mirrored"
        if mode == "app":
            import app

            history = app.fit(build, x, y, batch_size=64, epochs=3, shuffle=False, validation_data=val, verbose=0,
                              backend="local", strategy=strategy, devices=2, grad_accum=steps,
                              output=f"{out}/app_{kind}").history
        else:
            model = build()
            if steps > 1:
                model.optimizer.gradient_accumulation_steps = steps
            history = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, validation_data=val, verbose=0).history
            model.save_weights(f"{out}/{kind}.weights.h5")
        last[kind] = {key: values[-1] for key, values in history.items()}
    print(json.dumps(last))
'''


KINDS = ["own", "compiled", "accumulated", "central"]


@pytest.fixture(scope="module")
def mirrored_runs(tmp_path_factory):
    """Each kind from jobs/train.py, and model.fit's references and app.fit's runs each in one script process (a
    "central" run's reference is the compiled model's model.fit): {"cli": {kind: process}, "keras": process, "app":
    process, "root": the directory}. The script's app.fit calls one after another make a strategy each in one
    process, each all-reducing other shapes under keys of its own (TensorFlow's MirroredStrategy alone reuses the
    first's: "Shape mismatch in the collective instance 100")."""
    root = tmp_path_factory.mktemp("mirrored")
    (root / "models.py").write_text(OWN_STEP_MODELS)

    def cli(kind):
        model = {"accumulated": "own", "central": "compiled"}.get(kind, kind)
        strategy = "central-storage" if kind == "central" else "mirrored"
        return [str(REPO / "jobs" / "train.py"), "--backend", "local", "--strategy", strategy, "--devices", "2",
                "--model", f"models.py:{model}", "--dataset", "models.py:data", "--epochs", "3", "--no-shuffle",
                # the global batch is the rows of an update: model.fit's 64 a step, accumulated over 2 steps
                *(["--global-batch", "128", "--grad-accum", "2"] if kind == "accumulated" else ["--global-batch", "64"]),
                "--output", str(root / f"run_{kind}")]

    # The script of 4 app.fit runs first: the longest, it runs beside all the others.
    from_script, keras_fit, *runs = run_jobs_at_once(
        [str(root / "models.py"), "app", ",".join(KINDS), str(root)],
        [str(root / "models.py"), "keras", "own,compiled,accumulated", str(root)],
        *(cli(kind) for kind in KINDS), cwd=root, timeout=600, at_once=3)
    for p in (*runs, keras_fit, from_script):
        assert p.returncode == 0, p.stderr[-3000:]
    return {"cli": dict(zip(KINDS, runs)), "keras": keras_fit, "app": from_script, "root": root}


@pytest.mark.parametrize("kind", KINDS)
def test_a_users_model_on_two_mirrored_replicas_trains_as_model_fit_on_one_device(mirrored_runs, kind):
    """A model with its own train_step (a plain loss function, global-norm clipping) and a compiled one (a Loss object,
    per-variable clipping, an Embedding whose sparse gradient Adam takes slice by slice), each on MirroredStrategy over
    2 logical CPUs with a short last batch cut 6 + 5: the weights and History of model.fit on one device with the same
    global batch, as Keras's own fit would not give (it divides only a Loss object's loss by the replicas, and clips
    each replica's gradient). The same from jobs/train.py and from app.fit in a script. "accumulated": the own
    train_step with grad_accum 2, which is Keras's gradient_accumulation_steps=2 (Keras's fit alone refuses it over
    several local replicas: its update is a merge_call inside a condition). "central": the compiled model under central
    storage (one copy of each variable, where Keras's fit alone counts a metric's state once per replica)."""
    root, ours = mirrored_runs["root"], mirrored_runs["cli"][kind]
    model = {"accumulated": "own", "central": "compiled"}.get(kind, kind)
    reference_kind = "compiled" if kind == "central" else kind
    result = json.loads((root / f"run_{kind}" / "result.json").read_text())
    assert result["strategy"] == ("CentralStorageStrategy" if kind == "central" else "MirroredStrategy")
    assert result["num_replicas"] == 2
    assert result["global_batch_size"] == 64 * (2 if kind == "accumulated" else 1)  # the rows of an update
    assert "replicas in this process" in ours.stdout + ours.stderr
    # model.fit's History, its last epoch
    last = json.loads(mirrored_runs["keras"].stdout.strip().splitlines()[-1])[reference_kind]
    assert sorted(last) == (["loss", "val_loss"] if model == "own" else ["accuracy", "loss", "val_accuracy", "val_loss"])
    assert {key: result["history"][-1][key] for key in last} == pytest.approx(last, rel=1e-5)
    from_script = mirrored_runs["app"]
    assert json.loads(from_script.stdout.strip().splitlines()[-1])[kind] == pytest.approx(last, rel=1e-5)
    assert "INFO" not in from_script.stderr  # the strategy's own lines go to the run's log
    assert json.loads((root / f"app_{kind}" / "result.json").read_text())["num_replicas"] == 2
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"models_{kind}", root / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    reference = getattr(models, model)()
    reference.load_weights(root / f"{reference_kind}.weights.h5")
    trained = getattr(models, model)()
    trained.load_weights(root / f"run_{kind}" / "weights.weights.h5")  # (a subclass of __main__: no model.keras)
    for a, b in zip(reference.get_weights(), trained.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
