"""User data: real loaders on files written here (parquet, CSV, image folder, npz, text), 2-worker
training on each, the transformer learning text, and every bad-data case refused with its message
before an output directory or a worker exists."""

from __future__ import annotations

import concurrent.futures
import csv
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app import evaluate
from app.config import build_config
from app.data import blocks, memory, streamed, text
from app.errors import UserError
from app.run.api import run_training
from conftest import clean_env, run_job

ROWS, CLASSES, LENGTH = 320, 3, 16
# Tiny model and one epoch: these tests check the data path, not accuracy.
TINY = dict(num_workers=2, epochs=1, per_replica_batch=16, hidden_units=[16], warmup_epochs=0)


def learnable(rows=ROWS, length=LENGTH, seed=0):
    """Rows of `length` floats whose class shows in their mean pattern."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, rows)
    patterns = rng.normal(size=(CLASSES, length))
    return (rng.normal(size=(rows, length)) + 2 * patterns[y]).astype(np.float32), y.astype(np.int64)


def write_parquet(directory, x, y, files=2, column="pixels"):
    directory.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(y)), files)):
        table = pa.table({column: pa.array(list(x[part]), type=pa.list_(pa.float32())), "label": y[part]})
        pq.write_table(table, directory / f"part-{i}.parquet")
    return directory


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def train(tmp_path, name, **overrides):
    out = tmp_path / name
    result = run_training(build_config(None, {"output": str(out), **TINY, **overrides}))
    return out, result


def history(out, column):
    with open(out / "history.csv") as f:
        return [float(row[column]) for row in csv.DictReader(f)]


def check_one_epoch(out, result, train_rows, val_rows, in_memory=False):
    """Streamed files: an equal share of floor(rows / 2) on each worker in batches of 16 (the epoch's last one as
    short on both), the odd row left out; in memory: every row, the epoch ending on a short batch (split over the 2
    workers), as model.fit's does."""
    assert result["epochs_completed"] == 1 and result["num_replicas"] == 2
    steps = -(-train_rows // 32) if in_memory else -(-(train_rows // 2) // 16)
    assert result["steps_per_epoch"] == steps and result["rows"] == train_rows
    assert result["dropped_samples_per_epoch"] == (0 if in_memory else train_rows % 2)
    assert result["val_rows"] == val_rows  # every val row scored once
    assert np.isfinite(history(out, "loss")[0])
    assert (out / "model.keras").is_file()


# --- training on each format (2 workers, 1 epoch) ---------------------------------------------


def test_parquet_split_is_disjoint_and_small_data_is_kept_in_memory(ray_cluster, tmp_path):
    """(Training on parquet: the streamed test below; on in-memory preprocessed data: CSV and images.)"""
    x, y = learnable()
    path = write_parquet(tmp_path / "pq", x, y)
    config = build_config(None, {"output": str(tmp_path / "unused"), **TINY, "dataset": str(path)})
    first = streamed.prepare(config, 2)
    assert first.num_train_rows + first.num_val_rows == ROWS
    assert 0.1 < first.num_val_rows / ROWS < 0.3
    val_ids = {r["id"] for r in first.val.take_all() if r["w"] > 0}
    train_ids = {r["id"] for r in first.train.take_all()}
    assert len(val_ids) == first.num_val_rows and len(train_ids) == first.num_train_rows
    assert not val_ids & train_ids
    assert first.feature_shape == (LENGTH,) and first.num_classes == CLASSES
    assert first.cached == {"train": True, "val": True}  # small: preprocessed once, kept in memory


def test_streamed_parquet_trains_and_sees_every_row_once_per_epoch(ray_cluster, tmp_path):
    """Parquet with --data-cache stream: files reshuffled and rows shuffled in a local buffer each epoch; still equal
    steps on both workers and no row twice."""
    x, y = learnable()
    path = write_parquet(tmp_path / "pq", x, y, files=4)
    out, result = train(
        tmp_path, "run", dataset=str(path), data_cache="stream", shuffle_buffer=64, epochs=2, audit_sample_ids=True
    )
    import json

    per_epoch = json.loads((out / "audit_sample_ids.json").read_text())
    assert len(per_epoch) == 2
    for ids in per_epoch:
        assert len(ids) == len(set(ids)) == result["rows"] - result["dropped_samples_per_epoch"]
    assert per_epoch[0] != per_epoch[1] and set(per_epoch[0]) == set(per_epoch[1])  # a new order each epoch
    # Each worker's part of the streamed validation rows ends where its stream does, as planned: Keras's warning
    # that the input "ran out of data; interrupting training" is not the run's
    assert "ran out of data" not in (out / "train.log").read_text()


def test_streamed_datasets_read_small_blocks_within_their_own_budget(ray_cluster, tmp_path):
    """--data-cache stream: the train and val datasets (not the driver's other datasets) read 16 MiB blocks and
    may hold at most --stream-buffer-mib in the object store; Ray Train is handed those options (its default would
    replace them with the driver's, i.e. half the object store)."""
    from ray.data import DataContext

    x, y = learnable()
    path = write_parquet(tmp_path / "pq", x, y)
    config = build_config(
        None, {"output": str(tmp_path / "unused"), **TINY, "dataset": str(path), "data_cache": "stream",
               "stream_buffer_mib": 300},
    )
    current = DataContext.get_current()
    before = current.target_max_block_size, current.execution_options.resource_limits
    prepared = streamed.prepare(config, 2)
    assert prepared.cached == {"train": False, "val": False}
    handed = streamed.data_config({"train": prepared.train, "val": prepared.val}, prepared.cached)
    for name, ds in (("train", prepared.train), ("val", prepared.val)):
        assert ds.context.target_max_block_size == streamed.STREAM_BLOCK_BYTES
        for options in (ds.context.execution_options, handed._resolve_execution_options(name)):
            assert options.resource_limits.object_store_memory == 300 * 2**20
    assert (current.target_max_block_size, current.execution_options.resource_limits) == before
    with pytest.raises(UserError, match="stream_buffer_mib"):
        build_config(None, {"stream_buffer_mib": 64})


def test_csv_trains_with_a_separate_validation_file(ray_cluster, tmp_path):
    x, y = learnable(length=4)
    header = ["f0", "f1", "f2", "f3", "label"]
    train_csv = write_csv(tmp_path / "train.csv", header, [[*map(float, r), int(c)] for r, c in zip(x[:250], y[:250])])
    val_csv = write_csv(tmp_path / "val.csv", header, [[*map(float, r), int(c)] for r, c in zip(x[250:], y[250:])])
    out, result = train(tmp_path, "run", dataset=str(train_csv), val_dataset=str(val_csv), per_replica_batch=16)
    check_one_epoch(out, result, 250, 70)
    # The mlp standardises its inputs with the training file's moments, added up from the statistics pass's blocks.
    import keras
    standardize = keras.saving.load_model(out / "model.keras", compile=False).get_layer("standardize").get_config()
    np.testing.assert_allclose(standardize["mean"], x[:250].astype(np.float64).mean(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(standardize["variance"], x[:250].astype(np.float64).var(0), rtol=1e-5)


def test_float_targets_in_files_are_a_regression_streamed_and_cached_and_evaluate_agrees(ray_cluster, tmp_path):
    """--task regression on CSV (streamed: read block by block every epoch) from the command line, scored again
    by app.evaluate; binary labels in parquet (cached) from Python."""
    x, _ = learnable(length=4)
    target = x @ np.array([1.0, -2.0, 0.5, 0.0], np.float32)
    table = write_csv(tmp_path / "reg.csv", ["f0", "f1", "f2", "f3", "target"],
                      [[*map(float, r), float(t)] for r, t in zip(x, target)])
    out = tmp_path / "reg"
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    binary = write_parquet(tmp_path / "bin", x, (target > 0).astype(np.int64))
    # The command line run and the Python one (below) side by side, their start-ups overlapping: 2 x 2 workers
    # x 0.5 CPU leave the session's third CPU to Ray Data's reads (streamed CSV here, the parquet's caching there).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cli = pool.submit(
            run_job, "jobs/train.py", "--output", str(out), "--dataset", str(table), "--label-column", "target",
            "--task", "regression", "--data-cache", "stream", "--num-workers", "2", "--epochs", "1",
            "--per-replica-batch", "16", "--warmup-epochs", "0", "--cpus-per-worker", "0.5",
            env=env, timeout=300)
        bin_out, bin_result = train(tmp_path, "bin-run", dataset=str(binary), task="binary", model="mlp",
                                    cpus_per_worker=0.5)
        p = cli.result()
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["task"] == "regression" and "val_mae" in result["metrics"]
    assert "its output in the targets' units" in p.stdout + p.stderr
    # The mlp's constants are its training rows' moments, the seeded holdout left out: the rows the local backend
    # trains on (test_local_backend_holds_out_the_rows_a_ray_run_holds_out: the same rows).
    import keras

    from app.driver import preflight
    local = preflight.load_data(build_config(None, {"output": str(tmp_path / "l"), "backend": "local",
                                                    "dataset": str(table), "label_column": "target",
                                                    "task": "regression"}), 1).train
    assert 0 < len(local) < len(target)
    saved = keras.saving.load_model(out / "model.keras", compile=False)
    rescale, standardize = saved.get_layer("in_target_units"), saved.get_layer("standardize").get_config()
    np.testing.assert_allclose(rescale.offset, local.y.astype(np.float64).mean(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rescale.scale ** 2, local.y.astype(np.float64).var(), rtol=1e-5)
    np.testing.assert_allclose(standardize["mean"], local.x.astype(np.float64).mean(0), rtol=1e-6, atol=1e-7)
    assert np.isfinite(history(out, "val_mae")).all()
    # Scored again from the exported model, reading the same CSV (the Python twin of jobs/evaluate.py --run).
    scored = evaluate(str(out / "model.keras"))
    assert abs(scored["val_mae"] - result["metrics"]["val_mae"]) < 1e-5

    out, result = bin_out, bin_result
    assert result["task"] == "binary"
    # Every row once: validated or trained on (parquet splits rows by a hash of their content).
    assert result["val_rows"] + result["rows"] == len(target) and result["val_rows"] > 0


def test_image_folder_trains_with_two_workers(ray_cluster, tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(["cat", "dog", "eel"]):
        (tmp_path / "img" / name).mkdir(parents=True)
        for i in range(40):
            pixels = np.clip(rng.normal(60 + 60 * c, 30, size=(10, 10, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "img" / name / f"{i}.png")
    config = build_config(None, {"output": str(tmp_path / "x"), **TINY, "dataset": str(tmp_path / "img"),
                                 "image_size": [8, 8]})
    prepared = streamed.prepare(config, 2)
    assert prepared.feature_shape == (8, 8, 3) and prepared.num_classes == 3
    pixels = np.stack([r["x"] for r in prepared.train.take(20)])
    assert pixels.min() >= 0.0 and 0.5 < pixels.max() <= 1.0  # decoded, resized, normalised in Ray Data
    # The cnn under 2 MWMS workers: batch norm, and its moving statistics averaged across workers.
    out, result = train(tmp_path, "run", dataset=str(tmp_path / "img"), image_size=[8, 8], model="cnn",
                        conv_filters=[4, 8])
    check_one_epoch(out, result, prepared.num_train_rows, prepared.num_val_rows)


def test_npz_trains_with_two_workers(ray_cluster, tmp_path):
    x, y = learnable()
    np.savez(tmp_path / "d.npz", features=x.reshape(ROWS, 4, 4), target=y)
    out, result = train(
        tmp_path, "run", dataset=str(tmp_path / "d.npz"), feature_columns=["features"], label_column="target"
    )
    check_one_epoch(out, result, ROWS - 64, 64, in_memory=True)  # in memory: exactly round(0.2 x 320) val rows


def test_transformer_learns_a_text_column(ray_cluster, tmp_path):
    texts, y = text.synthetic_corpus(640, CLASSES, seed=3)
    path = write_csv(tmp_path / "text.csv", ["review", "stars"], zip(texts, y.tolist()))
    out, result = train(
        tmp_path, "run", dataset=str(path), text_column="review", label_column="stars", model="transformer",
        vocab_size=512, sequence_length=24, embed_dim=16, num_heads=2, ff_dim=32, num_blocks=1,
        optimizer="adam", base_lr=0.003, lr_scaling="none", epochs=4, per_replica_batch=32,
    )
    losses = history(out, "loss")
    assert losses[-1] < 0.6 * losses[0], losses
    assert result["metrics"]["val_accuracy"] > 0.6, result["metrics"]


def test_tokenizer_is_deterministic_and_pads():
    ids = text.tokenize(["Hello, hello world", None, ""], vocab_size=100, sequence_length=4)
    assert ids.shape == (3, 4) and ids.dtype == np.float32
    assert ids[0, 0] == ids[0, 1] != ids[0, 2] and ids[0, 3] == 0  # case folded, same word same id, padded
    assert (ids[1] == 0).all() and (ids[2] == 0).all()
    assert ((ids[0, :3] >= 1) & (ids[0, :3] < 100)).all()


# --- bad data: one clear line each, before anything is created ---------------------------------


def refused(tmp_path, match, **overrides):
    out = tmp_path / "out"
    with pytest.raises(UserError, match=match) as info:
        run_training(build_config(None, {"output": str(out), **TINY, **overrides}))
    message = str(info.value)
    assert "\n" not in message
    assert not out.exists()  # refused before the output directory (and the workers) existed
    return message


@pytest.fixture(scope="module")
def good_parquet(tmp_path_factory):
    x, y = learnable()
    return write_parquet(tmp_path_factory.mktemp("data") / "pq", x, y)


def test_missing_columns_are_named_with_the_columns_that_exist(ray_cluster, tmp_path, good_parquet):
    msg = refused(tmp_path, "feature column 'nope' not found", dataset=str(good_parquet), feature_columns=["nope"])
    assert "it has pixels, label" in msg
    msg = refused(tmp_path, "label column 'target' not found", dataset=str(good_parquet), label_column="target")
    assert "it has pixels, label" in msg


def test_wrong_dtypes_are_refused(ray_cluster, tmp_path):
    strings = write_csv(tmp_path / "s.csv", ["a", "label"], [[1.0, "cat"], [2.0, "dog"]] * 20)
    refused(tmp_path, r"label column 'label' holds strings \(class names\), but --task regression needs numbers",
            dataset=str(strings), task="regression")
    floats = write_csv(tmp_path / "f.csv", ["a", "label"], [[1.0, 0.5], [2.0, 1.5]] * 20)
    refused(tmp_path, r"label column 'label' has type double, but --task classification needs integer class ids",
            dataset=str(floats), task="classification")
    refused(tmp_path, r"--class-names names the classes of a label column of names \(strings\), and column 'label' "
            "holds double", dataset=str(floats), class_names=["a", "b"])
    text_features = write_csv(tmp_path / "t.csv", ["name", "label"], [["x y", 0], ["z", 1]] * 20)
    refused(tmp_path, r"feature column 'name' has type string, expected numbers", dataset=str(text_features))


def test_ragged_feature_shapes_are_refused(ray_cluster, tmp_path):
    (tmp_path / "ragged").mkdir()
    rows = [np.zeros(16, np.float32)] * 50 + [np.zeros(15, np.float32)]
    pq.write_table(pa.table({"pixels": pa.array(rows, type=pa.list_(pa.float32())), "label": [0] * 51}),
                   tmp_path / "ragged" / "p.parquet")
    refused(tmp_path, r"feature column 'pixels' has ragged feature shapes: lists of length 15 to 16",
            dataset=str(tmp_path / "ragged"))


def test_empty_datasets_are_refused(ray_cluster, tmp_path):
    (tmp_path / "nofiles").mkdir()
    refused(tmp_path, r"dataset '.*nofiles' is empty: no files found", dataset=str(tmp_path / "nofiles"))
    (tmp_path / "norows").mkdir()
    pq.write_table(pa.table({"pixels": pa.array([], type=pa.list_(pa.float32())), "label": pa.array([], pa.int64())}),
                   tmp_path / "norows" / "p.parquet")
    refused(tmp_path, r"dataset '.*norows' is empty: 0 rows", dataset=str(tmp_path / "norows"))
    header_only = write_csv(tmp_path / "h.csv", ["a", "label"], [])
    refused(tmp_path, r"is empty", dataset=str(header_only))


def test_labels_out_of_range_are_refused(ray_cluster, tmp_path, good_parquet):
    refused(tmp_path, r"label column 'label': labels go up to 2, but --num-classes is 2 \(class ids must be 0..1\)",
            dataset=str(good_parquet), num_classes=2)
    negative = write_csv(tmp_path / "n.csv", ["a", "label"], [[1.0, 0], [2.0, -3]] * 20)
    refused(tmp_path, r"label column 'label': a label is negative \(-3\)", dataset=str(negative))


def test_bad_numpy_data_is_refused_without_ray(tmp_path):
    cases = {
        "label array 'label' not found in dataset .*: it has x, y: give --label-column one of them":
            dict(x=np.zeros((5, 2)), y=np.arange(5)),
        r"label array 'label' has dtype float64, expected integers": dict(x=np.zeros((5, 2)), label=np.ones(5)),
        "array 'x' .* has ragged feature shapes": dict(
            x=np.array([np.zeros(2), np.zeros(3)], dtype=object), label=np.arange(2)
        ),
        "is empty: 0 rows": dict(x=np.zeros((0, 2)), label=np.zeros(0, np.int64)),
        r"label array 'label': a label is negative \(-1\)": dict(x=np.zeros((5, 2)), label=np.arange(5) - 1),
    }
    for i, (match, arrays) in enumerate(cases.items()):
        np.savez(tmp_path / f"{i}.npz", **arrays)
        # Float labels are a regression target under --task auto: a classification run refuses them.
        config = build_config(None, {"output": str(tmp_path / "o"), "dataset": str(tmp_path / f"{i}.npz"),
                                     "task": "classification"})
        with pytest.raises(UserError, match=match):
            memory.load_source(config)


def test_local_backend_holds_out_the_rows_a_ray_run_holds_out(ray_cluster, tmp_path, good_parquet):
    """The local backend reads parquet in its process (tests/test_local_files.py); its split is the Ray path's."""
    from app.driver import preflight

    local = preflight.load_data(build_config(None, {"output": str(tmp_path / "l"), "backend": "local",
                                                    "dataset": str(good_parquet)}), 1)
    on_ray = streamed.prepare(build_config(None, {"output": str(tmp_path / "r"), **TINY,
                                                  "dataset": str(good_parquet)}), 2)
    assert not local.streamed and local.facts == on_ray.facts
    assert sorted(local.train.ids.tolist()) == sorted(r["id"] for r in on_ray.train.take_all())
    assert sorted(local.val.ids.tolist()) == sorted(r["id"] for r in on_ray.val.take_all() if r["w"] > 0)
    by_id = {r["id"]: r["x"] for r in on_ray.val.take_all() if r["w"] > 0}
    assert all(np.array_equal(by_id[i], x) for i, x in zip(local.val.ids.tolist(), local.val.x))
    assert local.facts.feature_moments is None is on_ray.facts.feature_moments  # a list column: one scale

    # Columns of one number each, on scales of their own, and a float target (a regression): the mlp's moments and
    # its targets' are those of the training rows only, added up over Ray Data's blocks (each block's held-out rows
    # left out) as over the local read. A column that never changes keeps its scale (variance 1): a later value is
    # not divided by Keras's epsilon.
    x, _ = learnable(length=4)
    x = x * np.array([0.1, 30.0, 1600.0, 0.0], np.float32) + np.array([0, 0, 0, 7], np.float32)
    price = (3e5 + 400 * x[:, 1] - 20 * x[:, 2]).astype(np.float32)
    table = tmp_path / "columns"
    table.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(price)), 3)):
        pq.write_table(pa.table({**{name: x[part, j] for j, name in enumerate("abcd")}, "price": price[part]}),
                       table / f"part-{i}.parquet")
    regression = {"dataset": str(table), "label_column": "price", "task": "regression"}
    source = preflight.load_data(build_config(None, {"output": str(tmp_path / "l"), "backend": "local",
                                                     **regression}), 1)
    train, targets = source.train.x.astype(np.float64), source.train.y.astype(np.float64)
    on_ray = build_config(None, {"output": str(tmp_path / "r"), **TINY, **regression})
    # What a Ray run's built-in is built for (streamed.built_in_facts, the statistics pass alone), and the facts of
    # its prepared datasets (streamed.prepare).
    built_for, prepared = streamed.built_in_facts(on_ray), streamed.prepare(on_ray, 2).facts
    assert source.facts.task == built_for.task == prepared.task == "regression"
    assert built_for.num_train_rows == prepared.num_train_rows == len(train) < len(price)
    for facts in (source.facts, built_for, prepared):
        assert facts.feature_moments.count == len(train)
        moments = facts.feature_moments
        np.testing.assert_allclose(moments.mean, train.mean(0), rtol=1e-9)
        np.testing.assert_allclose(moments.variance[:3], train.var(0)[:3], rtol=1e-7)
        assert moments.mean[3] == 7 and moments.variance[3] == 1
        assert facts.label_moments.count == len(targets)
        np.testing.assert_allclose(facts.label_moments.mean, [targets.mean()], rtol=1e-12)
        np.testing.assert_allclose(facts.label_moments.variance, [targets.var()], rtol=1e-7)


def test_validation_split_is_seeded_and_stable():
    ids = np.arange(100_000, dtype=np.int64) * 7919
    a = blocks.in_validation(ids, seed=0, val_fraction=0.2)
    assert (a == blocks.in_validation(ids, seed=0, val_fraction=0.2)).all()
    assert abs(a.mean() - 0.2) < 0.01
    b = blocks.in_validation(ids, seed=1, val_fraction=0.2)
    assert 0.1 < (a & b).mean() / 0.2 < 0.3  # another seed: another, independent split


def bad_data_cases(d):
    """(flags, the one line's words) for bad data as a user brings it; files are written under ``d``."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)).astype("float32"), rng.integers(0, 2, 200)
    nan_x = x.copy()
    nan_x[5, 1], nan_x[7, 2] = np.nan, np.inf
    write_parquet(d / "nan-pq", nan_x, y, files=1, column="x")
    np.savez(d / "nan.npz", x=nan_x, label=y)
    np.savez(d / "tabular.npz", x=x, label=y)
    strings = [[float(a), "cat" if b else "dog"] for a, b in zip(x[:, 0], y)]
    write_csv(d / "strings.csv", ["a", "label"], strings)
    (d / "broken.csv").write_text("a,b,label\n1,2,0\n3,4\n5,6,1\n")
    write_csv(d / "prices.csv", ["rooms", "price"], [[int(r), int(1e5 + 5e4 * r)] for r in rng.integers(1, 8, 200)])
    (d / "broken.tfrecord").write_bytes(b"PAR1 not a TFRecord file" * 4)  # tests/test_tfrecord.py: the other cases
    return [
        (["--dataset", str(d / "nan-pq")], "column 'x' has 2 NaN or infinite values"),
        (["--dataset", str(d / "nan.npz"), "--feature-columns", "x"], "2 of 200 rows hold NaN or infinite values"),
        (["--dataset", str(d / "strings.csv"), "--class-names", "cat"], "label column 'label' of "
         f"'{d / 'strings.csv'}' holds class names the run's classes (cat) lack: 'dog'; add them to --class-names"),
        (["--dataset", str(d / "broken.csv")], "CSV parse error: Expected 3 columns, got 2: 3,4"),
        (["--dataset", str(d / "prices.csv"), "--label-column", "price"], "label column 'price': integer labels up "
         "to 450,000 make 450,001 classes, more than the 200 rows: give --task regression if they are numbers to "
         "predict"),
        (["--num-classes", "5"], "labels go up to 9, but --num-classes is 5"),
        (["--model", "cnn", "--dataset", str(d / "tabular.npz"), "--feature-columns", "x"], "cnn needs images"),
        (["--dataset", str(d / "broken.tfrecord")], "broken.tfrecord is not a TFRecord file (its framing breaks"),
    ]


def test_bad_data_is_one_line_before_training_and_never_touches_an_earlier_run(ray_cluster, tmp_path):
    """From the command line, joined to a running cluster, each with --overwrite of an earlier run's directory."""
    import json

    from conftest import clean_env, run_jobs_at_once

    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    from app.driver import output_guard

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "result.json").write_text(json.dumps({"epochs_completed": 15}))
    (earlier / output_guard.MARKER).write_text(json.dumps({"kind": "train"}))  # a run's: --overwrite may replace it
    cases = bad_data_cases(tmp_path)
    # Two at a time (each is mostly a TensorFlow import): all of them refuse before touching the directory.
    runs = run_jobs_at_once(*(["jobs/train.py", "--output", str(earlier), "--overwrite", *args] for args, _ in cases),
                            timeout=120, env=env, at_once=2)
    for (args, words), p in zip(cases, runs):
        assert p.returncode == 2, (args, p.stderr[-2000:])
        assert p.stderr.strip().splitlines() == [p.stderr.strip().splitlines()[-1]], (args, p.stderr[-3000:])
        assert p.stderr.startswith("error: ") and words in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stdout + p.stderr and p.seconds < 60, (args, p.seconds)
    assert sorted(q.name for q in earlier.iterdir()) == [output_guard.MARKER, "result.json"]
