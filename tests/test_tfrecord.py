"""TFRecord files as --dataset, written here with tf.io.TFRecordWriter: trained on 2 Ray workers streamed (a list
feature reshaped with --feature-shape) and cached (PNG bytes decoded as an image folder's files), every row once per
epoch; --backend local from the command line without Ray; the same rows and validation split on both backends (a
text feature); each bad file refused with one line before anything starts."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from app import evaluate
from app.config import build_config
from app.data import streamed, text
from app.driver import preflight
from app.errors import UserError
from app.run.api import run_training

ROWS, CLASSES, LENGTH = 240, 3, 16
TINY = dict(num_workers=2, epochs=1, per_replica_batch=16, hidden_units=[16], warmup_epochs=0)


def _feature(values, kind):
    import tensorflow as tf

    if kind == "float":
        return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))
    if kind == "int":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=list(values)))


def write_records(path, records):
    """records: dicts of feature name -> (values, kind)."""
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            features = {name: _feature(values, kind) for name, (values, kind) in record.items()}
            writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())
    return path


def write_tfrecords(directory, files=4):
    """ROWS records over ``files`` files: a learnable list "x", scalars "a" and "b", an int "label", a 10x10 PNG
    "image" bright in its class's colour, and a "caption" text."""
    from PIL import Image

    rng = np.random.default_rng(0)
    y = rng.integers(0, CLASSES, ROWS)
    x = (rng.normal(size=(ROWS, LENGTH)) + 2 * rng.normal(size=(CLASSES, LENGTH))[y]).astype(np.float32)
    captions, _ = text.synthetic_corpus(ROWS, CLASSES, seed=3)
    directory.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(ROWS), files)):
        records = []
        for r in part:
            pixels = rng.normal(60, 20, size=(10, 10, 3))
            pixels[..., y[r]] += 140
            png = io.BytesIO()
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(png, format="PNG")
            records.append({"x": (x[r], "float"), "a": (x[r, :1], "float"), "b": (x[r, 1:2], "float"),
                            "label": ([y[r]], "int"), "image": ([png.getvalue()], "bytes"),
                            "caption": ([captions[r].encode()], "bytes")})
        write_records(directory / f"part-{i}.tfrecord", records)
    return directory


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory):
    return write_tfrecords(tmp_path_factory.mktemp("tfrecord") / "train")


def train(tmp_path, name, **overrides):
    out = tmp_path / name
    return out, run_training(build_config(None, {"output": str(out), **TINY, **overrides}))


def seen_once(out, result):
    """Each epoch's audited sample ids: every trained row once, and with the validation rows and the dropped
    remainder (the odd row of 2 equal shares), every row of the files."""
    (ids,) = json.loads((out / "audit_sample_ids.json").read_text())
    assert len(ids) == len(set(ids)) == result["audit"][0]["seen"] == result["rows"] - result["dropped_samples_per_epoch"]
    assert result["rows"] + result["val_rows"] == ROWS and result["val_rows"] > 0


def test_a_list_feature_streams_on_two_workers_reshaped_every_row_once(ray_cluster, tmp_path, tfrecords):
    out, result = train(tmp_path, "stream", dataset=str(tfrecords), feature_columns=["x"], feature_shape=[4, 4],
                        data_cache="stream", shuffle_buffer=64, audit_sample_ids=True)
    assert result["num_replicas"] == 2 and result["config"]["feature_shape"] == [4, 4]
    seen_once(out, result)


def test_png_bytes_train_cached_on_two_workers_and_evaluate_agrees(ray_cluster, tmp_path, tfrecords):
    out, result = train(tmp_path, "cached", dataset=str(tfrecords), feature_columns=["image"], image_size=[8, 8],
                        model="cnn", conv_filters=[4, 8], data_cache="memory", audit_sample_ids=True)
    seen_once(out, result)
    scored = evaluate(str(out / "model.keras"))  # reads the same files again, the Python twin of jobs/evaluate.py
    assert scored["val_accuracy"] == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)


@pytest.mark.parametrize("feature, shape", [
    ({"text_column": "caption", "vocab_size": 512, "sequence_length": 24}, (24,)),  # UTF-8 bytes, tokenized
    ({"feature_columns": ["image"], "image_size": [8, 8]}, (8, 8, 3)),  # PNG bytes, decoded and resized
])
def test_text_and_image_bytes_give_the_same_rows_on_both_backends(ray_cluster, tmp_path, tfrecords, feature, shape):
    """Local read and Ray Data's read agree row for row (features, ids), and on the validation split."""
    flags = {"output": str(tmp_path / "o"), **TINY, "dataset": str(tfrecords), **feature}
    local = preflight.load_data(build_config(None, {**flags, "backend": "local"}), 1)
    on_ray = streamed.prepare(build_config(None, flags), 2)
    assert local.facts == on_ray.facts and local.facts.feature_shape == shape
    if "image_size" in feature:  # scaled to [0, 1] as an image folder's pixels
        assert local.train.x.min() >= 0.0 and local.train.x.max() <= 1.0 and local.train.x.max() > 0.5
    by_id = {r["id"]: r["x"] for r in on_ray.train.take_all()}
    assert sorted(local.train.ids.tolist()) == sorted(by_id)
    assert all(np.array_equal(by_id[i], x) for i, x in zip(local.train.ids.tolist(), local.train.x))
    assert sorted(local.val.ids.tolist()) == sorted(r["id"] for r in on_ray.val.take_all() if r["w"] > 0)


def test_local_backend_trains_on_tfrecords_without_ray(tfrecords, tmp_path):
    from test_local_files import FAST, finished, without_ray

    out = tmp_path / "local"
    finished(without_ray("jobs/train.py", "--backend", "local", "--output", str(out), "--dataset", str(tfrecords),
                         "--feature-columns", "x", "--epochs", "3", *FAST))
    result = json.loads((out / "result.json").read_text())
    assert result["backend"] == "local" and result["task"] == "classification"
    assert result["metrics"]["val_accuracy"] > 0.8  # chance: 1/3


def bad_tfrecords(d):
    """(--dataset and flags, the one line's words) for each bad TFRecord input; files written under ``d``."""
    (d / "garbage.tfrecord").write_bytes(b"PAR1 this is not a TFRecord file" * 4)
    good = {"x": (np.zeros(4), "float"), "label": ([0], "int")}
    write_records(d / "ok.tfrecords", [good] * 20)
    ragged = [good] * 20 + [{"x": (np.zeros(3), "float"), "label": ([1], "int")}]
    write_records(d / "ragged.tfrecord", ragged)
    one_value = [good] * 20 + [{"x": ([0.5], "float"), "label": ([1], "int")}]
    write_records(d / "one-value.tfrecord", one_value)
    write_records(d / "text.tfrecord", [{"caption": ([b"not an image"], "bytes"), "label": ([0], "int")}] * 20)
    return [
        ({"dataset": str(d / "garbage.tfrecord")}, "garbage.tfrecord is not a TFRecord file"),
        ({"dataset": str(d / "ok.tfrecords"), "feature_columns": ["pixels"]},
         "feature column 'pixels' not found in dataset"),
        ({"dataset": str(d / "ragged.tfrecord")}, "feature column 'x' has ragged feature shapes"),
        ({"dataset": str(d / "one-value.tfrecord")}, "feature column 'x' has ragged feature shapes"),
        ({"dataset": str(d / "text.tfrecord")}, "feature column 'caption' holds bytes that are not an image"),
    ]


def test_bad_tfrecords_are_one_line_before_anything_starts_on_both_backends(ray_cluster, tmp_path):
    for flags, words in bad_tfrecords(tmp_path):
        for backend in ("ray", "local"):
            out = tmp_path / "out"
            with pytest.raises(UserError) as info:
                config = build_config(None, {"output": str(out), **TINY, **flags, "backend": backend})
                run_training(config) if backend == "ray" else preflight.load_data(config, 1)
            message = str(info.value)
            assert words in message and "\n" not in message, (backend, flags, message)
            assert not out.exists()


def test_a_binary_parquet_column_of_png_bytes_is_read_as_images(tmp_path):
    """Encoded images are a column kind, not a TFRecord special: parquet's binary column decodes the same way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.data import tfrecord
    from app.data.files import locate

    d = write_tfrecords(tmp_path / "tfr", files=1)
    (table,) = tfrecord.batches(locate(str(d)), None, ROWS)  # the records as Ray Data's reader lays them out
    pq.write_table(table.select(["image", "label"]), tmp_path / "images.parquet")
    assert pa.types.is_binary(pq.read_schema(tmp_path / "images.parquet").field("image").type)
    flags = {"output": str(tmp_path / "o"), "backend": "local", "feature_columns": ["image"], "image_size": [8, 8]}
    from_parquet = preflight.load_data(build_config(None, {**flags, "dataset": str(tmp_path / "images.parquet")}), 1)
    from_tfrecord = preflight.load_data(build_config(None, {**flags, "dataset": str(d)}), 1)
    assert from_parquet.facts == from_tfrecord.facts
    assert np.array_equal(from_parquet.train.x, from_tfrecord.train.x)
