"""Your own model and data, any task, from the command line as a user types it and from Python.

Each run joins the session's Ray (as `ray job submit` would) and trains on 2 workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, clean_env, doc_commands, refusals_at_once, run_here, run_job, run_jobs_at_once

USER_FILE = '''
import keras
import numpy as np

import app


def load_data():
    x, y = app.digits()
    return x.reshape(-1, 8, 8, 1), y


def convnet(input_shape, num_classes, head="softmax"):
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes, activation=None if head == "logits" else head),
    ])


def build_model(input_shape, num_classes):
    return convnet(input_shape, num_classes)


def regression_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1200, 6)).astype("float32")
    y = (x @ np.array([1.5, -2.0, 0.5, 0.0, 1.0, 3.0]) + 0.1 * rng.normal(size=1200)).astype("float32")
    return x, y


def binary_data():
    x, y = regression_data(1)
    return x, (y > 0).astype("int64")


def sigmoid_model(input_shape):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1, activation="sigmoid")])


def ray_dataset():
    import ray.data

    x, y = binary_data()
    return ray.data.from_items([{"features": list(map(float, row)), "label": int(c)} for row, c in zip(x, y)])


def returns_four():
    x, y = binary_data()
    return x, y, y, y


def raises():
    raise ValueError("no such bucket")


def callbacks(output_dir):  # the README's --callbacks example
    return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1),
            keras.callbacks.CSVLogger(f"{output_dir}/keras_log.csv")]


def fails_in_the_workers(input_shape, num_classes):
    import os

    if os.environ.get("TF_CONFIG"):  # set in the Ray workers, not in the driver's checks
        raise RuntimeError("out of GPU memory, say")
    return convnet(input_shape, num_classes)
'''

FAST = ["--num-workers", "2", "--epochs", "3", "--warmup-epochs", "0"]


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_example.py"
    path.write_text(USER_FILE)
    return path



def train_cli(out, *args, env):
    p = run_job("jobs/train.py", "--output", str(out), *args, timeout=400, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert_console_for_people(p, out, result["epochs_completed"])
    return result


def assert_console_for_people(p, out, epochs: int) -> None:
    """The plan, one line per epoch, the result; Ray's and TensorFlow's lines only in <output>/train.log."""
    console = p.stdout + p.stderr
    lines = console.splitlines()
    # (Keras's fit's plan starts with the run; the own step's, which reads files for a built-in model, ends with it.)
    assert [line.split(":")[0] for line in lines if line.split(":")[0] in ("data", "model", "run")] in \
        (["run", "model", "data"], ["data", "model", "run"]), console
    assert len([line for line in lines if re.match(r"epoch +\d+/\d+ ", line)]) == epochs, console
    result_lines = p.stdout.splitlines()
    assert result_lines[-2].startswith("val_") and result_lines[-1].startswith("outputs written to"), console
    for chatter in ("pid=", "TrainingReport", "Traceback", "tqdm", "absl", "WARNING"):
        assert chatter not in console, (chatter, console)
    log = (out / "train.log").read_text()  # written by every run; a Ray run's holds Ray Train's own lines
    assert "backend local" in console or "TrainController" in log, log[:2000]


def test_users_softmax_convnet_from_a_file_matches_its_logits_twin(user_file, tmp_path):
    # (A user's model file on two Ray workers: the binary, regression and error tests here.)
    # The loss takes probabilities from the softmax model and logits from its twin: the same training
    # (compared in one process, where the runs are cheap: the loss is the same code on every backend).
    local = ["--backend", "local", "--dataset", f"{user_file}:load_data", "--epochs", "3", "--warmup-epochs", "0"]
    runs = {"soft-local": [], "logits-local": ["--model-args", '{"head": "logits"}']}
    for p in run_jobs_at_once(*(["jobs/train.py", "--output", str(tmp_path / name), "--model", f"{user_file}:convnet",
                                 *extra, *local] for name, extra in runs.items()), timeout=400, env=clean_env()):
        assert p.returncode == 0, p.stderr[-3000:]
    soft, twin = (json.loads((tmp_path / name / "result.json").read_text()) for name in runs)
    assert soft["task"] == "classification" and soft["metrics"]["val_accuracy"] > 0.85
    assert soft["metrics"]["val_accuracy"] == pytest.approx(twin["metrics"]["val_accuracy"], abs=0.02)


def test_regression_on_float_targets(user_file, joined, tmp_path):
    result = train_cli(tmp_path / "reg", "--dataset", f"{user_file}:regression_data", "--model", "mlp",
                       "--hidden-units", "32", "--optimizer", "adam", "--base-lr", "0.02", *FAST, env=joined)
    assert result["task"] == "regression"
    assert set(result["metrics"]) == {"train_loss", "train_mae", "val_loss", "val_mae"}
    # A built-in model on in-memory data trains by Keras's fit: its epoch logs are Keras's, compiled with the defaults.
    assert {"loss", "mae", "val_loss", "val_mae"} <= set(result["history"][-1]) and result["num_replicas"] == 2
    import importlib.util

    spec = importlib.util.spec_from_file_location("u", user_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    variance = float(np.var(module.regression_data()[1]))
    assert result["metrics"]["val_loss"] < 0.05 * variance  # val MSE far below the targets' variance


def test_binary_sigmoid_model_on_a_users_ray_dataset(user_file, joined, tmp_path):
    result = train_cli(tmp_path / "bin", "--dataset", f"{user_file}:ray_dataset", "--model",
                       f"{user_file}:sigmoid_model", "--feature-columns", "features", "--base-lr", "0.2", *FAST,
                       env=joined)
    assert result["task"] == "binary" and result["num_replicas"] == 2
    assert result["metrics"]["val_accuracy"] > 0.9
    # Evaluation decides the task as training did (one sigmoid output over two classes: binary), so it scores the
    # exported model as the workers did.
    p = run_job("jobs/evaluate.py", "--run", str(tmp_path / "bin"), timeout=300, env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    scored = json.loads((tmp_path / "bin" / "eval.json").read_text())
    assert scored["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)


def test_python_api_with_functions_defined_here(ray_cluster, tmp_path):
    import keras

    from app import evaluate, train

    def load_data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(800, 4)).astype("float32")
        return x, (x[:, 0] + x[:, 1] > 0).astype("int64")

    def build_model(input_shape, num_classes):
        return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes, activation="softmax")])

    result = train(model=build_model, data=load_data, num_workers=2, epochs=3, warmup_epochs=0, base_lr=0.2,
                   output=str(tmp_path / "api"))
    assert result["metrics"]["val_accuracy"] > 0.9 and result["num_replicas"] == 2
    assert (tmp_path / "api" / "model.keras").is_file()
    assert result["config"]["model"].endswith("build_model")

    # Re-scored in this process, as the README shows it, with the same data function.
    scored = evaluate(str(tmp_path / "api" / "model.keras"), data=load_data)
    assert abs(scored["val_accuracy"] - result["metrics"]["val_accuracy"]) < 1e-6
    assert json.loads((tmp_path / "api" / "eval.json").read_text())["dataset"].endswith("load_data")


def test_an_error_in_the_workers_is_one_line_and_its_trace_is_in_the_log(user_file, joined, tmp_path):
    p = run_job("jobs/train.py", "--output", str(tmp_path / "out"), "--dataset", f"{user_file}:load_data",
                "--model", f"{user_file}:fails_in_the_workers", *FAST, timeout=300, env=joined)
    assert p.returncode == 1, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    # Both ranks raise; Ray Train ends the group at the first failure it sees, so the line names one rank or both.
    assert len(errors) == 1 and re.search(r"RuntimeError: out of GPU memory, say \(rank (0, 1|0|1)\) ", errors[0]), \
        p.stderr[-3000:]
    assert f"full traceback in {tmp_path / 'out' / 'train.log'}" in errors[0]
    assert "Traceback" not in p.stdout + p.stderr
    log = (tmp_path / "out" / "train.log").read_text()
    assert "Traceback" in log and "fails_in_the_workers" in log


BAD_PLUGINS = [
    (["--dataset", "{f}:returns_four"], "returns_four returned a tuple of 4; expected (x, y) or (x, y, sample_weight)"),
    (["--dataset", "{f}:raises"], "raises raised ValueError: no such bucket"),
    (["--dataset", "{f}:nope"], "has no function 'nope'"),
    (["--model", "{f}:sigmoid_model"], "outputs 1 value(s) per example (shape (1,)), but 10 classes needs 10"),
    (["--model", "mlp", "--model-args", '{"widht": 64}'], "does not take argument(s) widht"),
    (["--model", "cnn", "--dataset", "{f}:binary_data"], "cnn needs images"),
]


@pytest.fixture(scope="module")
def bad_plugin_runs(user_file, tmp_path_factory):
    """--backend local: the checks are the same, and no Ray starts (the cases stay cheap)."""
    return refusals_at_once(tmp_path_factory, "bad-plugins", lambda i, out: [
        "jobs/train.py", "--backend", "local", "--output", str(out), "--epochs", "1",
        *(a.replace("{f}", str(user_file)) for a in BAD_PLUGINS[i][0])], len(BAD_PLUGINS), timeout=120)


@pytest.mark.parametrize("case", range(len(BAD_PLUGINS)), ids=[message[:40] for _, message in BAD_PLUGINS])
def test_bad_plugins_give_one_line_before_anything_starts(bad_plugin_runs, case):
    message = BAD_PLUGINS[case][1]
    out, p = bad_plugin_runs[case]
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr and "Traceback" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if line.startswith("error:")]) == 1, p.stderr
    assert not out.exists()
    if " raised " in message:  # the user's own traceback is kept where the line says
        trace = re.search(r"\(traceback in (\S+)\)", p.stderr)
        assert trace, p.stderr
        assert 'raise ValueError("no such bucket")' in Path(trace.group(1)).read_text()


def test_dry_run_prints_the_plan_for_every_readme_command(user_file, ray_cluster, tmp_path):
    import shlex

    (tmp_path / "my_run.yaml").write_text("epochs: 2\n")
    # The README's own-files example: a parquet directory with a label column y.
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "train").mkdir()
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"a": rng.normal(size=200), "b": rng.normal(size=200), "y": rng.integers(0, 2, 200)}),
                   tmp_path / "train" / "part-0.parquet")
    # Every jobs/train.py command of the README and the guides (tests/test_readme.py checks the other commands).
    commands = [command for _, command in doc_commands() if command.startswith("python jobs/train.py")
                # --help is read by tests/test_readme.py; no TPU here: tests/test_local.py checks its one-line refusal.
                and "--help" not in command and "--strategy tpu" not in command]
    commands = list(dict.fromkeys(commands))  # a command the README and a guide both give: one dry run
    assert len(commands) >= 5

    def argv(command: str) -> list[str]:
        # A guide's my_example.py is the test's file of functions; the README's examples/my_example.py is there.
        command = re.sub(r"(?<![/\w])my_example\.py", str(user_file), command)
        command = command.replace("my_run.yaml", str(tmp_path / "my_run.yaml")).replace("data/train/", f"{tmp_path}/train/")
        return [*shlex.split(command)[2:], "--dry-run", "--output", str(tmp_path / "never")]

    def told(command: str, code: int, text: str) -> None:
        assert code == 0, (command, text[-2000:])
        assert "global batch" in text and "learning rate" in text, command

    # The local commands as processes of their own, two at a time (a local run sets TensorFlow's thread counts for
    # its process); meanwhile the Ray ones in this process, as `python jobs/train.py` runs them (tests/conftest.py
    # run_here), joined to the session's Ray: each a dry run of well under a second once TensorFlow is imported.
    local = [c for c in commands if "--backend local" in c]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        processes = {c: pool.submit(run_job, "jobs/train.py", *argv(c), timeout=180) for c in local}
        for command in (c for c in commands if c not in processes):
            told(command, *run_here("train.py", argv(command), REPO))
        for command, process in processes.items():
            p = process.result()
            told(command, p.returncode, p.stdout + p.stderr)
    assert not (tmp_path / "never").exists()
