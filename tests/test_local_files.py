"""--backend local on parquet, CSV and image folders: read in the training process, no Ray imported, no raylet
started; the same checks and validation rows as the Ray path; evaluate of such a run without Ray either."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, clean_env

ROWS, CLASSES, LENGTH = 300, 3, 16
FAST = ["--optimizer", "adam", "--base-lr", "0.01", "--lr-scaling", "none", "--warmup-epochs", "0",
        "--per-replica-batch", "16"]

# Runs a job script as a user types it, then checks that Ray never came near the process.
WITHOUT_RAY = """
import os, runpy, sys
import psutil
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
ray = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
ray_processes = [p.name() for p in psutil.Process().children(recursive=True)
                 if any(n in p.name() for n in ("raylet", "gcs_server"))]
assert not ray and not ray_processes, (ray[:5], ray_processes)
print("no ray")
"""


def without_ray(*args: str, cwd=REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WITHOUT_RAY, *args], cwd=cwd, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "no ray" in out, err[-3000:]
    return out


def learnable(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, rows)
    x = rng.normal(size=(rows, LENGTH)) + 2 * rng.normal(size=(CLASSES, LENGTH))[y]
    return x.astype(np.float32), y.astype(np.int64)


def write_data(d):
    """A parquet directory (a list column), a CSV of scalar columns, a float-target CSV, an image folder."""
    from PIL import Image

    x, y = learnable()
    (d / "pq").mkdir()
    for i, part in enumerate(np.array_split(np.arange(ROWS), 2)):
        table = pa.table({"pixels": pa.array(list(x[part]), type=pa.list_(pa.float32())), "label": y[part]})
        pq.write_table(table, d / "pq" / f"part-{i}.parquet")
    with open(d / "c.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*(f"f{i}" for i in range(LENGTH)), "label"])
        w.writerows([*map(float, row), int(label)] for row, label in zip(x, y))
    target = 2e5 + 5e4 * (x[:, :4] @ np.array([0.5, -1.0, 0.25, 1.0]))  # a price, in the 100,000s
    with open(d / "r.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "c", "d", "target"])
        w.writerows([*map(float, row), float(t)] for row, t in zip(x[:, :4], target))
    rng = np.random.default_rng(1)
    for c, name in enumerate(["cat", "dog", "eel"]):  # each class bright in its own colour
        (d / "img" / name).mkdir(parents=True)
        for i in range(40):
            pixels = rng.normal(60, 20, size=(10, 10, 3))
            pixels[..., c] += 140
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(d / "img" / name / f"{i}.png")
    # Class names in the label column (ids in the order --class-names gives them: eel 0, cat 1, dog 2); the
    # validation file holds two of the three classes, so its own sorted names (dog, eel) would map them otherwise.
    names = np.array(["eel", "cat", "dog"])
    for path, rows in (("n.csv", slice(0, 240)), ("nv.csv", slice(240, ROWS))):
        keep = np.arange(ROWS)[rows][y[rows] != 1] if path == "nv.csv" else np.arange(ROWS)[rows]
        with open(d / path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([*(f"f{i}" for i in range(LENGTH)), "species"])
            w.writerows([*map(float, x[i]), names[y[i]]] for i in keep)
    return {"mean": float(np.mean(target)), "std": float(np.std(target))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The five local runs side by side, as a user types them: {name: (output dir, result.json)}."""
    d = tmp_path_factory.mktemp("local-files")
    targets = write_data(d)
    flags = {
        "parquet": ["--dataset", str(d / "pq"), "--epochs", "3"],
        "csv": ["--dataset", str(d / "c.csv"), "--epochs", "3"],
        "images": ["--dataset", str(d / "img"), "--image-size", "8", "8", "--epochs", "3"],
        "regression": ["--dataset", str(d / "r.csv"), "--label-column", "target", "--epochs", "5"],
        "names": ["--dataset", str(d / "n.csv"), "--val-dataset", str(d / "nv.csv"), "--label-column", "species",
                  "--class-names", "eel", "cat", "dog", "--epochs", "3"],
    }
    started = {name: without_ray("jobs/train.py", "--backend", "local", "--output", str(d / name), *FAST, *args)
               for name, args in flags.items()}
    for p in started.values():
        finished(p)
    return {name: (d / name, json.loads((d / name / "result.json").read_text())) for name in flags} | \
        targets | {"data": d}


def history(out, column):
    with open(out / "history.csv") as f:
        return [float(row[column]) for row in csv.DictReader(f)]


def every_row_once(result, rows):
    """Each row validated, trained on or dropped, once (parquet and CSV split rows by a hash of their content)."""
    val = result["val_rows"]
    # One replica trains every training row, the short last batch too: none dropped.
    assert val + result["rows"] == rows and result["dropped_samples_per_epoch"] == 0
    # --val-fraction 0.2, in expectation: within 4 standard deviations of the binomial (120 images, split by a
    # hash of their path, which holds the test's temporary directory: 12 of 120 is seen once in a few hundred runs)
    sd = (rows * 0.2 * 0.8) ** 0.5
    assert 0.2 * rows - 4 * sd < val < 0.2 * rows + 4 * sd and val > 0


@pytest.mark.parametrize("name", ["parquet", "csv"])
def test_parquet_and_csv_train_locally_without_ray(runs, name):
    out, result = runs[name]
    assert result["backend"] == "local" and result["task"] == "classification"
    every_row_once(result, ROWS)
    assert result["metrics"]["val_accuracy"] > 0.8  # chance: 1/3


def test_image_folder_trains_locally_without_ray(runs):
    out, result = runs["images"]
    assert result["task"] == "classification" and result["config"]["image_size"] == [8, 8]
    every_row_once(result, 120)
    assert result["metrics"]["val_accuracy"] > 0.8


def test_a_label_column_of_class_names_trains_evaluates_and_predicts_by_name(runs):
    """A CSV whose label column holds class names, ids in the order --class-names gives them (not sorted), and a
    validation CSV of two of the three names: trained, then scored again by jobs/evaluate.py (the same numbers: the
    run's config.yaml maps the names as training did, where the file's own sorted names would not), and predicted by
    name, each row's most probable output the id its true name has."""
    import pyarrow.parquet as pq

    out, result = runs["names"]
    assert result["config"]["class_names"] == ["eel", "cat", "dog"] and result["task"] == "classification"
    assert result["metrics"]["val_accuracy"] > 0.8
    d = runs["data"]
    reading = [without_ray("jobs/evaluate.py", "--run", str(out)),
               without_ray("jobs/predict.py", "--run", str(out), "--backend", "local", "--dataset", str(d / "nv.csv"),
                           "--keep-columns", "species", "--output", str(d / "named")),
               without_ray("jobs/train.py", "--backend", "local", "--dataset", str(d / "n.csv"), "--label-column",
                           "species", "--task", "regression", "--dry-run")]
    for p in reading[:2]:
        finished(p)
    scored = json.loads((out / "eval.json").read_text())
    assert scored["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)
    assert scored["val_loss"] == pytest.approx(result["metrics"]["val_loss"], rel=1e-5)
    predicted = pq.read_table(d / "named").to_pandas()
    assert set(predicted["species"]) == {"eel", "dog"} and (predicted["prediction"] == predicted["species"]).mean() > 0.8
    ids = np.stack(predicted["probabilities"]).argmax(axis=1)
    assert (ids == predicted["species"].map({"eel": 0, "cat": 1, "dog": 2})).mean() > 0.8
    _, err = reading[2].communicate(timeout=300)
    assert reading[2].returncode != 0 and "label column 'species' holds strings (class names), but --task " \
        "regression needs numbers to predict" in err, err[-2000:]


def test_float_target_csv_is_a_local_regression(runs):
    out, result = runs["regression"]
    assert result["task"] == "regression"
    # Targets in the 100,000s train at the defaults: the mlp predicts in their units, its mean squared error
    # weighted by 1 / their variance (SGD at 0.1 on them as they are: a non-finite loss in the first epoch).
    assert result["metrics"]["val_loss"] < 0.2  # a fifth of the variance: far below predicting the mean
    assert result["metrics"]["val_mae"] < 0.3 * runs["std"]
    import keras
    rescale = keras.saving.load_model(out / "model.keras", compile=False).get_layer("in_target_units")
    # Their mean and standard deviation over the training rows: near those of every row.
    assert abs(rescale.offset - runs["mean"]) < 0.1 * runs["std"] and 0.9 < rescale.scale / runs["std"] < 1.1


def test_evaluate_of_a_local_parquet_run_needs_no_ray(runs):
    out, result = runs["parquet"]
    finished(without_ray("jobs/evaluate.py", "--run", str(out)))
    scored = json.loads((out / "eval.json").read_text())
    assert scored["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)
    assert scored["val_samples"] == result["val_rows"]


def test_bad_files_are_refused_locally_with_the_ray_paths_words(tmp_path):
    from test_data import bad_data_cases

    from app.config import build_config
    from app.driver import preflight
    from app.errors import UserError
    (tmp_path / "gaps.csv").write_text("age,fare,survived\n22,7.25,0\n,71.3,1\n26,7.9,1\n35,53.1,1\n")
    gaps = (["--dataset", str(tmp_path / "gaps.csv"), "--label-column", "survived"], "feature column 'age' has 1 value "
            "missing: drop or fill those rows first (pandas: df.dropna() or df.fillna(...)), or leave the column out")
    (tmp_path / "dates.csv").write_text("when,size,label\n2020-01-01 00:00:00,1.5,0\n2020-01-01 01:00:00,0.2,1\n")
    dates = (["--dataset", str(tmp_path / "dates.csv")], "feature column 'when' has type timestamp[s], expected "
             "numbers, lists of numbers or encoded images: convert it to numbers first (a date or time, pandas: "
             "pd.to_datetime(df[column]).astype('int64')), or leave it out with --feature-columns")
    for args, words in [*bad_data_cases(tmp_path)[:5], gaps, dates]:  # the file cases
        flags = dict(zip(args[::2], args[1::2]))
        config = build_config(None, {"backend": "local", "output": str(tmp_path / "o"), "dataset": args[1],
                                     "label_column": flags.get("--label-column", "label"),
                                     "class_names": [flags["--class-names"]] if "--class-names" in flags else None})
        with pytest.raises(UserError) as info:
            preflight.load_data(config, 1)
        assert words in str(info.value) and "\n" not in str(info.value), (args, str(info.value))


def test_data_larger_than_memory_is_refused_naming_the_ray_backend(tmp_path, monkeypatch):
    import psutil

    from app.config import build_config
    from app.driver import preflight
    from app.errors import UserError
    x, y = learnable()
    pq.write_table(pa.table({"pixels": pa.array(list(x), type=pa.list_(pa.float32())), "label": y}),
                   tmp_path / "d.parquet")
    memory = psutil.virtual_memory()._replace(available=50_000)  # ~300 rows x (64 B + 4 x 80 B) will not fit
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    config = build_config(None, {"backend": "local", "output": str(tmp_path / "o"),
                                 "dataset": str(tmp_path / "d.parquet")})
    with pytest.raises(UserError, match="does not fit in memory for --backend local.*train on it with --backend ray"):
        preflight.load_data(config, 1)


def test_a_tensor_column_ray_data_wrote_keeps_its_shape_locally(tmp_path):
    """pyarrow alone reads Ray Data's tensor type as flat lists: the shape comes from the column's metadata."""
    from ray.data.extensions import ArrowTensorArray  # only to write the file: nothing of Ray runs

    from app.config import build_config
    from app.driver import preflight

    x, y = learnable()
    pq.write_table(pa.table({"t": ArrowTensorArray.from_numpy(x.reshape(-1, 4, 4)), "label": y}),
                   tmp_path / "d.parquet")
    config = build_config(None, {"backend": "local", "output": str(tmp_path / "o"), "dataset": str(tmp_path / "d.parquet")})
    source = preflight.load_data(config, 1)
    assert source.facts.feature_shape == (4, 4) and source.train.x.shape[1:] == (4, 4)
    flat = preflight.load_data(config.model_copy(update={"feature_shape": [16]}), 1)
    assert flat.facts.feature_shape == (16,)


SCORED_MODELS = '''
import keras


@keras.saving.register_keras_serializable(package="scored")
class OwnTestStep(keras.Model):
    """Keras's train step, its own test step: the mean of each row's largest logit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.top = keras.metrics.Mean(name="top_logit")

    def call(self, x):
        return self.dense(x)

    def test_step(self, data):
        self.top.update_state(keras.ops.max(self(data[0], training=False), axis=-1))
        return {"top_logit": self.top.result()}


def metrics():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"),
                           keras.metrics.MeanIoU(num_classes=3, sparse_y_pred=False)])
    return model


def own_test_step():
    model = OwnTestStep()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
'''


def test_evaluate_scores_as_kerass_evaluate(tmp_path):
    """jobs/evaluate.py runs Keras's evaluate on the run's model: its compiled metrics as Keras names them, or its own
    test_step (a class its model file registers, imported from the run's config): what the run's last epoch
    reported, and what keras's evaluate gives on the same rows; prediction loads that class too, and reads a .npz
    without labels."""
    import keras

    x, y = learnable(400)
    np.savez(tmp_path / "train.npz", x=x[:300], y=y[:300])
    np.savez(tmp_path / "val.npz", x=x[300:], y=y[300:])
    (tmp_path / "scored.py").write_text(SCORED_MODELS)
    # Trained from the data's own directory, with relative paths: evaluated and predicted from elsewhere (the
    # repository), the run's files are found from where it started.
    data = ["--dataset", "train.npz", "--val-dataset", "val.npz", "--feature-columns", "x", "--label-column", "y",
            "--epochs", "2", "--per-replica-batch", "16"]
    names = ("metrics", "own_test_step")
    for p in [without_ray(str(REPO / "jobs" / "train.py"), "--backend", "local", "--output", name,
                          "--model", f"scored.py:{name}", *data, cwd=tmp_path) for name in names]:
        finished(p)
    np.savez(tmp_path / "unlabelled.npz", x=x[:50])  # prediction needs no labels
    # What reads the two runs, side by side: each evaluation, two predictions, and a refused evaluation (below).
    reading = [*(without_ray("jobs/evaluate.py", "--run", str(tmp_path / name)) for name in names),
               without_ray("jobs/predict.py", "--run", str(tmp_path / "own_test_step"), "--backend", "local",
                           "--output", str(tmp_path / "predicted")),
               without_ray("jobs/predict.py", "--run", str(tmp_path / "metrics"), "--backend", "local",
                           "--dataset", str(tmp_path / "unlabelled.npz"), "--output", str(tmp_path / "unlabelled"))]
    # A --loss the labels do not fit: one line before the evaluation's graph runs.
    refused = without_ray("jobs/evaluate.py", "--run", str(tmp_path / "metrics"), "--loss", "categorical_crossentropy")
    for p in reading:
        finished(p)
    scored = {name: json.loads((tmp_path / name / "eval.json").read_text()) for name in names}
    trained = {name: json.loads((tmp_path / name / "result.json").read_text())["metrics"] for name in names}
    # An unnamed metric object is named as the run's History names it (a second of its class in one process would
    # be "..._1": the driver builds the model again to export it).
    assert {k for k in scored["metrics"] if k.startswith("val_")} == {
        "val_loss", "val_accuracy", "val_top2", "val_mean_io_u", "val_samples"}
    assert {k for k in scored["own_test_step"] if k.startswith("val_")} == {"val_top_logit", "val_samples"}
    model = keras.models.load_model(tmp_path / "metrics" / "model.keras")
    by_keras = model.evaluate(x[300:], y[300:], batch_size=16, verbose=0, return_dict=True)
    for name in names:
        assert scored[name]["val_samples"] == 100
        for key, value in scored[name].items():
            if key.startswith("val_") and key != "val_samples":
                assert value == pytest.approx(trained[name][key], rel=1e-5), (name, key)
    for key, value in by_keras.items():
        assert scored["metrics"][f"val_{key}"] == pytest.approx(value, rel=1e-5), key
    assert json.loads((tmp_path / "predicted" / "_predict.json").read_text())["rows"] == 300
    assert json.loads((tmp_path / "unlabelled" / "_predict.json").read_text())["rows"] == 50
    _, err = refused.communicate(timeout=300)
    assert refused.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "error: the model's loss categorical_crossentropy does not take these labels and its outputs" in err
