"""Keras callbacks on 2 Ray workers, as model.fit runs them on one machine: EarlyStopping stops every worker at
the same epoch, on_epoch_end sees every compiled metric, ReduceLROnPlateau lowers the LR of every worker,
CSVLogger writes one file, and bad callbacks are one line."""

from __future__ import annotations

import csv
import json
import os

import pytest

from conftest import clean_env, run_job

USER_FILE = '''
import keras

import app


def digits_one_hot():
    x, y = app.digits()
    return x, keras.utils.to_categorical(y, 10)


def compiled_model():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC()])
    return model


class Boom(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise ValueError("disk full, say")


def failing_callbacks():
    return [Boom()]


def raises():
    raise RuntimeError("no callbacks today")


def not_a_list():
    return keras.callbacks.EarlyStopping()
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_callbacks.py"
    path.write_text(USER_FILE)
    return path


def _logs_to_file_class():
    import keras

    class LogsToFile(keras.callbacks.Callback):
        """Appends each on_epoch_end's epoch, logs and the rank it ran on to a JSON-lines file."""

        def __init__(self, path):
            super().__init__()
            self.path = path

        def on_epoch_end(self, epoch, logs=None):
            rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
            with open(self.path, "a") as f:
                f.write(json.dumps({"epoch": epoch, "rank": rank, "logs": logs}) + "\n")

    return LogsToFile


def test_callbacks_on_two_workers_as_model_fit_runs_them(user_file, ray_cluster, tmp_path, monkeypatch, capsys):
    import time

    import keras

    from app import evaluate, train

    monkeypatch.chdir(tmp_path)  # the script's directory: a callback's relative path is found there, as in model.fit
    seen, logged, out = tmp_path / "seen.jsonl", tmp_path / "log.csv", tmp_path / "run"
    callbacks = [
        _logs_to_file_class()(str(seen)),
        # min_delta 10: no epoch after the first improves. The LR halves after epoch 2 (0-based 1) ...
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", min_delta=10, patience=0, factor=0.5),
        # ... and the run stops after epoch 3 (0-based 2), of 5, its weights restored to the first epoch's.
        keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=10, patience=2, restore_best_weights=True),
        keras.callbacks.CSVLogger(str(logged), append=True),  # two writers would write two headers
        keras.callbacks.ModelCheckpoint("ckpt/ep{epoch}.keras"),
        keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: print(f"printed by a callback: {epoch}")),
    ]
    result = train(model=f"{user_file}:compiled_model", data=f"{user_file}:digits_one_hot", callbacks=callbacks,
                   num_workers=2, epochs=5, output=str(out))

    # A callback's print reaches the console, once an epoch (rank 0's), as model.fit's script would show it (Ray
    # forwards a worker's output a moment later: bounded wait).
    printed, deadline = "", time.monotonic() + 30
    while printed.count("printed by a callback") < 3 and time.monotonic() < deadline:
        printed += capsys.readouterr().out
        time.sleep(0.5)
    assert [line for line in printed.splitlines() if "printed by a callback" in line] == \
        [f"printed by a callback: {epoch}" for epoch in range(3)]

    # Both workers stopped after the same epoch (else one would wait in an all-reduce), and the run says why.
    assert result["num_replicas"] == 2 and result["epochs_completed"] == 3
    assert result["stopped_early"] == {"epoch": 3, "reason": "EarlyStopping: val_loss did not improve for 2 epochs "
                                                             "(patience 2)"}
    with (out / "history.csv").open() as f:
        history = list(csv.DictReader(f))
    assert [int(h["epoch"]) for h in history] == [1, 2, 3]

    # The LR the callback set: the compiled SGD's 0.05, as model.fit trains it, halved after epoch 2.
    lrs = [float(h["learning_rate"]) for h in history]
    assert lrs[0] == pytest.approx(0.05) and lrs[1] == lrs[0] and lrs[2] == pytest.approx(lrs[0] / 2)

    # on_epoch_end ran once per epoch, on rank 0 only, with every compiled metric under Keras's names, exact.
    lines = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [(line["epoch"], line["rank"]) for line in lines] == [(0, 0), (1, 0), (2, 0)]
    # (ReduceLROnPlateau, after it in the list, adds learning_rate to the logs, as in model.fit.)
    assert set(lines[0]["logs"]) == {"loss", "accuracy", "auc", "val_loss", "val_accuracy", "val_auc"}
    for line, h in zip(lines, history):
        logs = line["logs"]
        assert logs["val_auc"] == pytest.approx(float(h["val_auc"]), abs=1e-12)
        assert logs["loss"] == pytest.approx(float(h["loss"]), abs=1e-12)

    # CSVLogger: one file, one header, one row per epoch, although two workers trained.
    rows = logged.read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("epoch,") and [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2"]

    # The halved LR was every worker's: the validation sums of both workers' weights after the last epoch equal rank
    # 0's weights of then, which ModelCheckpoint wrote where the script runs, scored in this process (a worker still
    # at the old LR would hold other weights).
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["ep1.keras", "ep2.keras", "ep3.keras"]
    scored = evaluate(str(tmp_path / "ckpt" / "ep3.keras"), data=f"{user_file}:digits_one_hot")
    assert abs(scored["val_loss"] - float(history[2]["val_loss"])) < 1e-5
    assert abs(scored["val_accuracy"] - float(history[2]["val_accuracy"])) < 1e-6
    # restore_best_weights: the run's model is the first epoch's, as model.fit's model would be.
    scored = evaluate(str(out / "model.keras"), data=f"{user_file}:digits_one_hot")
    assert abs(scored["val_loss"] - float(history[0]["val_loss"])) < 1e-5


def test_a_callback_that_raises_ends_the_run_in_one_line_and_keeps_the_last_checkpoint(user_file, ray_cluster,
                                                                                        tmp_path):
    out = tmp_path / "run"
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    p = run_job("jobs/train.py", "--model", "mlp", "--hidden-units", "16", "--callbacks",
                f"{user_file}:failing_callbacks", "--num-workers", "2", "--epochs", "3", "--output", str(out),
                timeout=400, env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "callbacks: Boom on rank 0" in p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert "callback Boom raised ValueError in on_epoch_end: disk full, say" in errors[0] and "(rank 0)" in errors[0]
    assert "Traceback" not in p.stdout + p.stderr and not (out / "result.json").exists()
    kept = [json.loads(s.read_text())["epoch"] for s in (out / "ray").rglob("state.json")]
    assert kept == [1]


@pytest.mark.parametrize("callbacks, message", [
    ("{f}:raises", "my_callbacks.py:raises raised RuntimeError: no callbacks today"),
    ("{f}:not_a_list", "not_a_list returned EarlyStopping instead of a list of keras.callbacks.Callback"),
    ("nonsense", "callbacks 'nonsense': give file.py:function"),
    ("__main__:[EarlyStopping]", "callbacks [EarlyStopping] were a list passed from Python, which a config file "
                                 "cannot hold: pass them again"),
    ("not_callbacks", "invalid config: callbacks holds '3' of type int, not a keras.callbacks.Callback"),
    ("history", "callback History is not supported: the run keeps its history itself"),
    ("monitor", "callback EarlyStopping monitors 'val_acc', which the epoch logs do not have (they have loss, "
                "val_loss, accuracy, val_accuracy, learning_rate)"),
    ("test_hook", "callback OnTest defines on_test_batch_end, which this product never calls"),
])
def test_bad_callbacks_are_one_line_before_training(user_file, tmp_path, callbacks, message):
    import keras

    from app.config import build_config
    from app.errors import UserError
    from app.run.api import dry_run

    class OnTest(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            pass

    given = {"not_callbacks": [keras.callbacks.History(), 3], "history": [keras.callbacks.History()],
             "monitor": [keras.callbacks.EarlyStopping(monitor="val_acc")],
             "test_hook": [OnTest()]}.get(callbacks, callbacks.replace("{f}", str(user_file)))
    # What `python jobs/train.py --dry-run` checks (a run checks the same before training): in this process, no
    # Ray needed for the built-in data, and no TensorFlow strategy (this process's TensorFlow may be initialised).
    # History, a monitor the logs lack and test hooks are the own step's refusals (with parameter servers, which run
    # on it): the built-in model otherwise trains by Keras's fit, which takes them as model.fit does.
    own_step = callbacks in ("history", "monitor", "test_hook")
    fields = {"callbacks": given, "epochs": 1, "output": str(tmp_path / "out")}
    with pytest.raises(UserError) as e:
        dry_run(build_config(None, {**fields, **({"strategy": "parameter-server"} if own_step else {})}))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    if own_step:
        plan = dry_run(build_config(None, fields))
        assert any(line.startswith(f"callbacks: {type(given[0]).__name__} on rank 0") for line in plan), plan
