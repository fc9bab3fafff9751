"""examples/: each file runs as a user runs it (`python examples/<file>.py`, joined to the session's Ray, in a
directory of its own), again where a second run meets what the first wrote, and the README's Python is in them
verbatim: a documented example cannot break unseen."""

from __future__ import annotations

import json
import re

import pandas as pd
import yaml

from conftest import REPO, run_jobs_at_once

EXAMPLES = REPO / "examples"


def test_the_readmes_python_is_in_the_examples_verbatim():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    sources = [p.read_text() for p in EXAMPLES.glob("*.py")]
    assert len(blocks) >= 2 and all(any(block in source for source in sources) for block in blocks)


def test_every_example_runs_and_trains(joined, tmp_path):
    # my_example.py is a module for the command line; the Keras-step scripts run in tests/test_keras_examples.py.
    others = ("my_example.py", "vae_own_train_step.py", "tf_data_pipeline.py")
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in others)
    assert scripts == ["keras_script.py", "parquet_data.py", "sweep.py"]  # a new example gets its checks here
    keras_script, parquet, sweep = run_jobs_at_once(*([str(EXAMPLES / name)] for name in scripts), timeout=900,
                                                    env=joined, cwd=tmp_path)
    for p in (keras_script, parquet, sweep):
        assert p.returncode == 0, p.stderr[-3000:]

    # The README's app.fit: 10 epochs of the digits on 2 workers; it prints the history's val_accuracy. Adam at
    # Keras's 1e-3 and a global batch of 256, as compiled, on the last 20% of the rows: 0.25 -> 0.81 here.
    val_accuracy = json.loads(keras_script.stdout.strip().splitlines()[-1])
    assert len(val_accuracy) == 10 and val_accuracy[-1] >= 0.75 and val_accuracy[-1] > val_accuracy[0] + 0.3, \
        keras_script.stdout

    # parquet: 1,200 rows in 2 files; predictions for every row, in the files' order.
    run = tmp_path / "runs" / "example-parquet"
    result = json.loads((run / "run" / "result.json").read_text())
    assert result["metrics"]["val_accuracy"] >= 0.9 and result["num_replicas"] == 2, result["metrics"]
    # The built-in mlp on streamed files trains by Keras's fit, its validation the seeded 0.2 of the rows.
    plan = (run / "run" / "train.log").read_text()
    assert "step: Keras's train_step and test_step" in plan and "the seeded 0.2 validation split" in plan, plan[:3000]
    predicted = pd.read_parquet(run / "predictions")
    assert len(predicted) == 1200 and "1200 rows predicted" in parquet.stdout

    # The sweep: both trials ran to their end; the best is named.
    summary = yaml.safe_load((tmp_path / "runs" / "example-sweep" / "summary.yaml").read_text())
    assert summary["trials"] == 2 and "best: lr_scaling " in sweep.stdout

    # A reader runs them again. parquet_data.py and sweep.py write to fixed paths, which now exist: the run and the
    # predictions are replaced, the finished sweep is resumed (Tune's restore) and reports its best again.
    # keras_script.py's app.fit writes a new runs/train-<time> each time, so a second run of it is its first again.
    assert [p.name for p in (tmp_path / "runs").glob("train-*")] and keras_script.returncode == 0
    again = run_jobs_at_once(*([str(EXAMPLES / name)] for name in ("parquet_data.py", "sweep.py")), timeout=900,
                             env=joined, cwd=tmp_path)
    for p in again:
        assert p.returncode == 0, p.stderr[-3000:]
    parquet_again, sweep_again = again
    assert "1200 rows predicted" in parquet_again.stdout and len(pd.read_parquet(run / "predictions")) == 1200
    assert "best: lr_scaling " in sweep_again.stdout

