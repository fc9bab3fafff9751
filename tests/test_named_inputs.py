"""A model of several named inputs trained on file columns, then evaluated and used to predict on the same files, as
a user runs the jobs: parquet with a list column ``a`` (4 floats) and an integer category ``b``, read by the model's
input names without --inputs in this process (--backend local: in memory), and on 2 Ray workers (through Ray Data,
``b`` read from a column of another name with --inputs); CSV with one number per input, by name; and the bad
mappings, each refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from conftest import refusals_at_once, run_job, run_jobs_at_once, user_module

MODEL = """
import keras


def two_inputs(num_classes, names=("a", "b")):
    a = keras.Input((4,), name=names[0])
    b = keras.Input((1,), name=names[1])
    category = keras.layers.Flatten()(keras.layers.Embedding(5, 4)(b))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, category]))
    model = keras.Model({names[0]: a, names[1]: b}, keras.layers.Dense(num_classes, activation="softmax")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def two_numbers(num_classes):
    p, q = keras.Input((1,), name="p"), keras.Input((1,), name="q")
    out = keras.layers.Dense(num_classes, activation="softmax")(keras.layers.Concatenate()([p, q]))
    model = keras.Model({"p": p, "q": q}, out)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model
"""

ROWS = 1000


def rows(seed: int = 0) -> pd.DataFrame:
    """3 classes that take both inputs to tell apart: the category ``b`` is the class for 60% of the rows and 3
    ("unknown") for the rest; ``a`` is the class plus noise. Alone, ``b`` reaches ~0.73 and ``a`` ~0.75; together
    ~0.9."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 3, ROWS)
    b = np.where(rng.random(ROWS) < 0.6, label, 3)
    a = (label[:, None] + rng.normal(scale=1.13, size=(ROWS, 4))).astype(np.float32)
    return pd.DataFrame({"a": list(a), "b": b, "label": label})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("named-inputs")
    data = rows()
    (root / "parquet").mkdir()
    for i, part in enumerate(np.array_split(np.arange(ROWS), 2)):  # two files: two blocks for Ray Data
        chunk = data.iloc[part]
        pq.write_table(pa.table({"a": pa.array(list(chunk["a"]), type=pa.list_(pa.float32())),
                                 "category": chunk["b"].to_numpy(), "b": chunk["b"].to_numpy(),
                                 "label": chunk["label"].to_numpy()}), root / "parquet" / f"part-{i}.parquet")
    pd.DataFrame({"p": data["a"].map(np.mean), "q": data["b"], "label": data["label"]}).to_csv(root / "rows.csv",
                                                                                             index=False)
    return root, user_module(tmp_path_factory, "named_models.py", MODEL)


def test_parquet_columns_train_a_two_input_model_by_name_then_evaluate_and_predict(files, tmp_path):
    root, models = files
    run, csv_run = tmp_path / "run", tmp_path / "csv"
    train, csv = run_jobs_at_once(
        ["jobs/train.py", "--backend", "local", "--dataset", str(root / "parquet"), "--model",
         f"{models}:two_inputs", "--epochs", "4", "--no-tensorboard", "--output", str(run)],
        ["jobs/train.py", "--backend", "local", "--dataset", str(root / "rows.csv"), "--model",
         f"{models}:two_numbers", "--epochs", "4", "--no-tensorboard", "--output", str(csv_run)], timeout=300)
    # No --inputs: the model's keras.Input names are columns of the files, so each input reads its own column.
    assert train.returncode == 0, train.stderr[-3000:]
    assert csv.returncode == 0, csv.stderr[-3000:]
    assert "inputs read by name: a, b" in train.stdout + train.stderr
    assert "inputs read by name: p, q" in csv.stdout + csv.stderr
    result = json.loads((run / "result.json").read_text())
    assert result["metrics"]["val_accuracy"] >= 0.83, result["metrics"]  # both inputs are needed for that
    assert json.loads((csv_run / "result.json").read_text())["metrics"]["val_accuracy"] >= 0.6

    evaluated, predicted = run_jobs_at_once(
        ["jobs/evaluate.py", "--model", str(run / "model.keras")],
        ["jobs/predict.py", "--model", str(run / "model.keras"), "--backend", "local", "--keep-columns", "label",
         "--output", str(tmp_path / "predictions")], timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scores = json.loads((run / "eval.json").read_text())
    assert scores["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)  # the same rows
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    out = pd.read_parquet(tmp_path / "predictions")
    assert len(out) == ROWS
    assert (out["prediction"] == out["label"]).mean() >= 0.83


def test_parquet_feeds_named_inputs_on_two_ray_workers_and_the_mapping_serves_prediction(files, joined, tmp_path):
    """On Ray, through Ray Data and each worker's shard: ``b`` is read from the column ``category``
    (--inputs b=category), and the run's recorded mapping serves prediction on the same files."""
    root, models = files
    run = tmp_path / "run"
    p = run_job("jobs/train.py", "--dataset", str(root / "parquet"), "--model", f"{models}:two_inputs", "--inputs",
                "a", "b=category", "--num-workers", "2", "--epochs", "4", "--no-tensorboard", "--output", str(run), env=joined)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = json.loads((run / "result.json").read_text())["metrics"]
    assert metrics["val_accuracy"] >= 0.83, metrics
    predicted = run_job("jobs/predict.py", "--model", str(run / "model.keras"), "--backend", "local",
                        "--keep-columns", "label", "--output", str(tmp_path / "predictions"))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    out = pd.read_parquet(tmp_path / "predictions")
    assert len(out) == ROWS and (out["prediction"] == out["label"]).mean() >= 0.83


BAD = [
    (["--inputs", "a", "c"], "column for input 'c' (--inputs) 'c' not found"),
    (["--inputs", "a", "b=nothing"], "'nothing' not found"),
    (["--inputs", "a", "b", "--feature-columns", "a"], "--inputs gives each named input its column: leave out "
                                                        "--feature-columns"),
    (["--inputs", "a", "b", "b"], "--inputs names an input twice: b"),
    (["--inputs", "a", "category=b"], "the data's inputs are named a, category, but "),
    (["--model-args", '{"names": ["a", "kind"]}'], "mix list/tensor/image-bytes and other columns: name one list, "
     "tensor or image-bytes column, or only scalar columns, with --feature-columns (a model of several named inputs: "
     "give each one its column with --inputs"),
    (["--feature-columns", "a"], "two_inputs takes 2 inputs (a, b), but the data gives one features input of shape "
                                 "(4,): name each input's file column with --inputs a b"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory, files):
    root, models = files
    return refusals_at_once(tmp_path_factory, "named-refused", lambda i, out: [
        "jobs/train.py", "--backend", "local", "--dataset", str(root / "parquet"), "--model", f"{models}:two_inputs",
        *BAD[i][0], "--output", str(out)], len(BAD))


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(flags) for flags, _ in BAD])
def test_bad_inputs_mappings_are_one_line(refused, case):
    out, p = refused[case]
    assert p.returncode == 2, p.stderr[-2000:]
    assert BAD[case][1] in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not out.exists()
