"""Bad input that only shows when it is loaded (a compile() metric Keras does not know, a tf.data pipeline that
fails when read, a damaged checkpoint): one line naming it, exit 2, nothing written. Anything else that escapes
is one line too, its traceback kept in a file the line names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, refusals_at_once, user_module

USER = """
import keras
import numpy as np
import tensorflow as tf


def misspelt_metric(input_shape, num_classes):
    m = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["acuracy"])
    return m


def unknown_loss(input_shape, num_classes):
    m = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(num_classes, activation="softmax")])
    m.compile(optimizer="adam", loss="sparse_categorical_crosentropy")
    return m


def parts_batched_differently():
    rng = np.random.default_rng(0)
    xs = tf.data.Dataset.from_tensor_slices(rng.normal(size=(200, 4)).astype("float32")).batch(16)
    ys = tf.data.Dataset.from_tensor_slices(rng.integers(0, 3, 200)).batch(10)
    return tf.data.Dataset.zip((xs, ys))


def named_classes():
    import pandas as pd

    return pd.DataFrame({"petal": [1.4, 4.7, 6.0, 1.3], "species": ["setosa", "versicolor", "virginica", "setosa"]})
"""


def damaged(run, into, file: str, keep: float = 0.5):
    """A copy of ``run`` whose checkpoint file ``file`` keeps only its first ``keep`` share of bytes."""
    shutil.copytree(run, into)
    target = into / "checkpoint" / file
    data = target.read_bytes()
    target.write_bytes(data[: int(len(data) * keep)])
    return into


CASES = [
    ("misspelt metric", "error: the model's compile() names metric 'acuracy', which Keras does not know"),
    ("unknown loss", "error: the model's compile() names loss 'sparse_categorical_crosentropy', which Keras does "
                     "not know"),
    ("unknown --loss", "error: unknown loss 'nope': give a Keras loss name such as"),
    ("tf.data batched differently", "parts_batched_differently's tf.data.Dataset failed when read: Input element "
                                    "must have the same batch size in each component"),
    ("class names in a DataFrame", "named_classes: label column 'species' holds 'setosa', not a number: map each "
                                   "class name to an id 0..K-1 first"),
    ("resume, truncated index", "train_state' cannot be read (not an sstable"),
    ("resume, truncated weights", "train_state' cannot be read (Read less bytes than requested)"),
    ("resume, truncated state", "state.json' cannot be read (JSONDecodeError"),
    ("evaluate, truncated state", "state.json' cannot be read (JSONDecodeError"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, local_digits_run):
    user = user_module(tmp_path_factory, "bad_inputs.py", USER)
    root = tmp_path_factory.mktemp("damaged")
    # The checkpoint Keras's fit left in the run's output (app.training.keras_worker's layout).
    index = damaged(local_digits_run, root / "index", "train_state.index")
    weights = damaged(local_digits_run, root / "weights", "train_state.data-00000-of-00001")
    state = damaged(local_digits_run, root / "state", "state.json")
    local = ["jobs/train.py", "--backend", "local", "--epochs", "2"]
    commands = [
        [*local, "--model", f"{user}:misspelt_metric"],
        [*local, "--model", f"{user}:unknown_loss"],
        [*local, "--loss", "nope"],  # the built-in, compiled by the product on Keras's fit
        [*local, "--dataset", f"{user}:parts_batched_differently"],
        [*local, "--dataset", f"{user}:named_classes", "--label-column", "species"],
        [*local, "--resume", "--output", str(index)],
        [*local, "--resume", "--output", str(weights)],
        [*local, "--resume", "--output", str(state)],
        ["jobs/evaluate.py", "--checkpoint", str(state / "checkpoint")],
    ]

    def argv(i, out):
        fresh = "--output" not in commands[i] and commands[i][0] == "jobs/train.py"
        return [*commands[i], *(["--output", str(out)] if fresh else [])]

    before = {run: files_of(run) for run in (index, weights, state)}
    return refusals_at_once(tmp_path_factory, "one-line", argv, len(CASES)), before


def files_of(run) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[name for name, _ in CASES])
def test_loaded_input_that_is_wrong_is_one_line(runs, case):
    results, before = runs
    out, p = results[case]
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert CASES[case][1] in lines[0], lines[0]
    assert not out.exists()  # a fresh run's --output (the resumes and evaluate name the damaged runs instead)
    for run, files in before.items():  # a refused resume or evaluation leaves the run as it was; its log may grow
        now = files_of(run)
        log = now.pop("train.log", b"")
        assert log.startswith(files.pop("train.log", b"")) and now == files, run


def test_an_unexpected_error_is_one_line_with_its_traceback_kept(tmp_path):
    """A defect of ours (here: a division by zero inside the entry point's body) still reaches the console as one
    line, with the exception's type and message and where the whole traceback is, exit 1."""
    code = "from app import cli\n\ndef body():\n    return 1 / 0\n\ncli.main(body)\n"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    found = re.fullmatch(r"error: ZeroDivisionError: division by zero \(traceback in (\S+)\)", lines[0])
    assert found, lines[0]
    kept = Path(found.group(1)).read_text()
    assert kept.startswith("Traceback (most recent call last)") and 'File "<string>", line 4, in body' in kept
