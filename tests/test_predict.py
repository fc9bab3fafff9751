"""jobs/predict.py and app.predict (issue 28): a trained run applied to a dataset, predictions written as parquet.

Every test uses the session's one small run trained on parquet files (conftest.parquet_run) and its held-out
test files. The command-line test joins the session's Ray (RAY_ADDRESS) with 2 actors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, clean_env, refusals_at_once, run_jobs_at_once


def read(directory):
    import pandas as pd

    return pd.read_parquet(directory)  # the _predict.* files are skipped, as by any reader of the directory


def test_predict_on_two_ray_actors_scores_what_evaluate_scores(parquet_run, joined, tmp_path):
    """One row out per row in, in order, ids kept; the accuracy of the written predictions is evaluate's."""
    run, test = parquet_run
    out = tmp_path / "predictions"
    predicted, scored = run_jobs_at_once(
        ["jobs/predict.py", "--run", str(run), "--dataset", str(test), "--output", str(out), "--keep-columns",
         "id,label", "--num-workers", "2", "--batch-size", "50"],
        # The same rows as evaluate's validation set: the run's training files with the test files held out.
        ["jobs/evaluate.py", "--run", str(run), "--val-dataset", str(test)],
        envs=[joined, clean_env()], timeout=400)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    assert scored.returncode == 0, scored.stderr[-3000:]
    rows = read(out)
    import pyarrow.dataset as pads

    given = pads.dataset(str(test)).to_table().to_pandas()
    assert len(rows) == len(given) == 300
    assert rows["id"].tolist() == given["id"].tolist()  # each row once, in the input's order
    assert list(rows.columns) == ["prediction", "probabilities", "id", "label"]
    probabilities = np.stack(rows["probabilities"].to_numpy())
    assert probabilities.shape == (300, 4) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-5)
    assert (probabilities.argmax(axis=1) == rows["prediction"]).all()
    accuracy = float((rows["prediction"] == rows["label"]).mean())
    metrics = json.loads((run / "eval.json").read_text())
    assert metrics["val_samples"] == 300
    # evaluate reports a float32 (0.81 is 0.8100000024); one row more or less right moves it by 1/300.
    assert accuracy == pytest.approx(metrics["val_accuracy"], abs=1e-6), (accuracy, metrics)
    assert 0.5 < accuracy < 1.0  # a model that learned something, on data it can get wrong
    summary = json.loads((out / "_predict.json").read_text())
    assert summary["rows"] == 300 and summary["options"]["num_workers"] == 2
    # Two actors held the model (Ray Data's own account, in the log).
    assert "MapBatches(Predictor)" in (out / "_predict.log").read_text()
    assert "predictions written to" in predicted.stdout


def test_local_backend_predicts_the_same_without_importing_ray(parquet_run, tmp_path):
    run, test = parquet_run
    out = tmp_path / "local"
    code = f"""
import sys
sys.argv = ["jobs/predict.py", "--run", {str(run)!r}, "--dataset", {str(test)!r}, "--output", {str(out)!r},
            "--keep-columns", "id", "--backend", "local"]
sys.path.insert(0, "jobs")
import runpy
try:
    runpy.run_path("jobs/predict.py", run_name="__main__")
finally:
    assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
    print("no ray")
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "no ray" in p.stdout, p.stderr[-3000:]
    rows = read(out)
    assert len(rows) == 300 and rows["id"].tolist() == sorted(rows["id"])
    import keras
    import pyarrow.dataset as pads

    given = pads.dataset(str(test)).to_table()
    x = np.stack(given.column("features").to_numpy(zero_copy_only=False)).astype(np.float32)
    logits = keras.models.load_model(run / "model.keras").predict(x, verbose=0)  # the built-in mlp ends in logits
    want = np.exp(logits - logits.max(axis=1, keepdims=True))
    want /= want.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(np.stack(rows["probabilities"].to_numpy()), want, atol=1e-5)


def test_app_predict_takes_arrays_and_dataframes(parquet_run, tmp_path):
    """From Python: x alone (the row's position kept as ``row``), or a DataFrame with its own columns."""
    import pandas as pd

    from app import predict

    run, _ = parquet_run
    x = np.random.default_rng(3).normal(size=(70, 16)).astype(np.float32)
    summary = predict(str(run), data=x, output=str(tmp_path / "arrays"), backend="local", keep_columns="row",
                      batch_size=32)
    assert summary["rows"] == 70 and summary["columns"] == ["prediction", "probabilities", "row"]
    by_array = read(tmp_path / "arrays")
    assert by_array["row"].tolist() == list(range(70))
    frame = pd.DataFrame({"features": list(x), "name": [f"r{i}" for i in range(70)]})
    predict(str(run / "model.keras"), data=frame, output=str(tmp_path / "frame"), backend="local",
            keep_columns=["name"])
    by_frame = read(tmp_path / "frame")
    assert by_frame["name"].tolist() == frame["name"].tolist()
    assert (by_frame["prediction"] == by_array["prediction"]).all()


def test_app_predict_on_ray_with_arrays(parquet_run, ray_cluster, tmp_path):
    """Arrays from Python on Ray Data, each actor holding the model: the order and values of the local path."""
    from app import predict

    run, _ = parquet_run
    x = np.random.default_rng(4).normal(size=(120, 16)).astype(np.float32)
    predict(str(run), data=(x, np.zeros(120, np.int64)), output=str(tmp_path / "ray"), num_workers=2,
            batch_size=40, keep_columns=["row", "label"], cpus_per_worker=0.5)
    predict(str(run), data=x, output=str(tmp_path / "local"), backend="local")
    on_ray, local = read(tmp_path / "ray"), read(tmp_path / "local")
    assert on_ray["row"].tolist() == list(range(120)) and (on_ray["label"] == 0).all()
    np.testing.assert_allclose(np.stack(on_ray["probabilities"].to_numpy()),
                               np.stack(local["probabilities"].to_numpy()), atol=1e-6)


BAD_INPUT = [
    (["--run", "{tmp}/no-such-run"], "no such run: "),
    (["--checkpoint", "{tmp}"], "is not a checkpoint"),
    (["--keep-columns", "uid"], "column to keep (--keep-columns) 'uid' not found in dataset"),
    (["--feature-columns", "feature"], "feature column 'feature' not found in dataset"),
    (["--feature-columns", "id", "label"], "do not fit the model: feature column(s) id, label give examples of "
                                           "shape (2,) (2 values), the model takes (16,)"),
    (["--output", "{run}"], "contains the model '"),  # the run's model.keras, which the prediction reads
]


@pytest.fixture(scope="module")
def bad_input_runs(parquet_run, tmp_path_factory):
    """--backend local: the checks are the same before the pool starts."""
    run, test = parquet_run

    def argv(i, out):
        tmp = out.parent / f"tmp{i}"  # a directory that is there, and is not a run or a checkpoint
        tmp.mkdir()
        args = [a.format(tmp=tmp, run=run) for a in BAD_INPUT[i][0]]
        what = [] if any(a in args for a in ("--run", "--checkpoint")) else ["--run", str(run)]
        output = [] if "--output" in args else ["--output", str(out)]
        return ["jobs/predict.py", *what, "--dataset", str(test), *output, "--backend", "local", *args]

    return refusals_at_once(tmp_path_factory, "bad-input", argv, len(BAD_INPUT), timeout=120)


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[message[:40] for _, message in BAD_INPUT])
def test_bad_input_is_one_line_before_the_pool_starts(bad_input_runs, case):
    message = BAD_INPUT[case][1]
    out, p = bad_input_runs[case]
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr
    assert not out.exists()  # nothing written


def test_bad_input_on_ray_is_refused_before_any_actor(parquet_run, joined, tmp_path):
    """On Ray too: the shape is checked on the first rows, read by Ray Data, before the actor pool starts; and
    actors that would take every CPU of the cluster (3 here), leaving none for Ray Data's reads of the files, are
    refused instead of waiting forever (seen: 2 actors x 1 CPU on a `ray start --num-cpus 2` head)."""
    run, test = parquet_run
    common = ["jobs/predict.py", "--run", str(run), "--dataset", str(test)]
    shape, full = run_jobs_at_once([*common, "--output", str(tmp_path / "out"), "--feature-columns", "id"],
                                   [*common, "--output", str(tmp_path / "full"), "--cpus-per-worker", "1.5"],
                                   timeout=300, env=joined)
    assert shape.returncode == 2, shape.stderr[-3000:]
    assert "do not fit the model" in shape.stderr and "MapBatches" not in shape.stderr + shape.stdout
    assert not (tmp_path / "out").exists()
    assert full.returncode == 2 and full.stderr.strip().splitlines() == [
        "error: streamed data needs 1 CPU for Ray Data's reads beside the predicting actors' 3, but the cluster has 3 "
        "CPUs (1 missing): lower --cpus-per-worker to 1 or --num-workers, add a node, or use in-memory data (.npz "
        "files, data functions returning arrays), which needs no Ray Data task"], full.stderr[-3000:]
    assert not (tmp_path / "full").exists()


def test_train_then_predict_as_a_new_user_does(local_digits_run, joined, tmp_path):
    """The README's first steps: `jobs/train.py --backend local --epochs 1 --output A`, then `jobs/predict.py
    --model A/model.keras --output P` on the run's own data (the built-in digits, in memory): one row per row
    (--keep-columns row: each row's position in the data, to check the order)."""
    import keras

    from app import digits

    out = tmp_path / "p"
    p = run_jobs_at_once(["jobs/predict.py", "--model", str(local_digits_run / "model.keras"), "--output", str(out),
                          "--keep-columns", "row"], env=joined, timeout=400)[0]
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read(out)
    x, y = digits()
    assert len(rows) == len(y) == 1797 and rows["row"].tolist() == list(range(1797))
    model = keras.models.load_model(local_digits_run / "model.keras")
    want = model.predict(x, verbose=0).argmax(axis=1)
    assert (rows["prediction"].to_numpy() == want).all()
    assert (rows["prediction"] == y).mean() > 0.8  # one epoch learns most of it


TWO_INPUTS = """
import keras
import numpy as np


def build():
    a, b = keras.Input((4,), name="a"), keras.Input((2, 3), name="b")
    h = keras.layers.Concatenate()([a, keras.layers.Flatten()(b)])
    return keras.Model([a, b], keras.layers.Dense(3, activation="softmax")(h))


def named_rows(seed=0):
    rng = np.random.default_rng(seed)
    return ({"a": rng.normal(size=(90, 4)).astype("float32"), "b": rng.normal(size=(90, 2, 3)).astype("float32")},
            rng.integers(0, 3, 90))
"""


def test_app_predict_from_every_in_memory_source(local_digits_run, tmp_path):
    """app.predict with x alone, (x, y), a data function, and a dict of named inputs for a model of two inputs:
    each row once, in order, with what Keras's own predict gives."""
    import importlib.util

    import keras

    from app import digits, predict
    from app.errors import UserError

    run = local_digits_run
    x = digits()[0][:150]
    want = keras.models.load_model(run / "model.keras").predict(x, verbose=0)
    sources = {"array": x, "pair": (x, np.zeros(150, np.int64)), "function": lambda: (x, np.ones(150, np.int64))}
    for name, data in sources.items():
        summary = predict(str(run), data=data, output=str(tmp_path / name), backend="local", batch_size=64,
                          keep_columns="row")
        rows = read(tmp_path / name)
        assert summary["rows"] == 150 and rows["row"].tolist() == list(range(150)), name
        np.testing.assert_allclose(np.stack(rows["probabilities"].to_numpy()), keras.ops.softmax(want), atol=1e-5)

    spec = importlib.util.spec_from_loader("two_inputs", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(TWO_INPUTS, module.__dict__)
    model = module.build()
    model.save(tmp_path / "two.keras")
    named, _ = module.named_rows()
    summary = predict(str(tmp_path / "two.keras"), data=named, output=str(tmp_path / "named"), backend="local",
                      batch_size=32, keep_columns="row")
    rows = read(tmp_path / "named")
    assert summary["rows"] == 90 and rows["row"].tolist() == list(range(90))
    np.testing.assert_allclose(np.stack(rows["probabilities"].to_numpy()), model.predict(named, verbose=0), atol=1e-5)
    with pytest.raises(UserError, match="the model's inputs are a, b; missing b"):
        predict(str(tmp_path / "two.keras"), data={"a": named["a"]}, output=str(tmp_path / "half"), backend="local")
    with pytest.raises(UserError, match="give x as a dict of arrays by input name"):
        predict(str(tmp_path / "two.keras"), data=named["a"], output=str(tmp_path / "flat"), backend="local")
    assert not (tmp_path / "half").exists() and not (tmp_path / "flat").exists()


def test_a_corrupt_model_file_is_one_line_for_evaluate_and_predict(local_digits_run, tmp_path):
    """A truncated copy of a model.keras, a file that is not a zip, and an empty one: exit 2, one line naming the
    file, nothing written."""
    good = (local_digits_run / "model.keras").read_bytes()
    bad = {"truncated": good[: len(good) // 2], "text": b"not a model\n", "empty": b""}
    for name, data in bad.items():
        (tmp_path / f"{name}.keras").write_bytes(data)
    commands = [[job, "--model", str(tmp_path / f"{name}.keras"), *(["--output", str(tmp_path / f"out-{name}")]
                                                                     if job == "jobs/predict.py" else [])]
                for name in bad for job in ("jobs/evaluate.py", "jobs/predict.py")]
    for args, p in zip(commands, run_jobs_at_once(*commands, env=clean_env(), timeout=200, at_once=2)):
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (args, p.stderr[-2000:])
        assert lines[0].startswith(f"error: model file {args[2]!r} is not a Keras model"), lines
    assert not list(tmp_path.glob("out-*"))
