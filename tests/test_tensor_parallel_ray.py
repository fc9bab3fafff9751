"""--tensor-parallel N with data parallel (Megatron's layout: tensor parallel inside a node, data parallel across
nodes): 2 Ray workers, each holding one replica whose split layers live on 2 devices of its own (logical CPUs here),
the workers' gradients all-reduced shard by shard, against one device training the same global batch. The Ray run
is a user's script that used TensorFlow before calling app.train: its driver cannot split its own CPU any more."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_tensor_parallel import MODEL, _weights

from conftest import clean_env, run_jobs_at_once, user_module

# A user's script whose TensorFlow started its devices before the run (one CPU device, which can no longer be
# split in that process): the workers, processes of their own, split theirs.
SCRIPT = """
import sys

import tensorflow as tf

tf.zeros([1])

import app

app.train(model=sys.argv[1], num_workers=2, tensor_parallel=2, tensor_layout=["up_*=column", "down_*=row"],
          epochs=2, global_batch=64, tensorboard=False, output=sys.argv[2])
"""


def test_two_ray_workers_each_split_over_two_devices_train_as_one_device(joined, tmp_path, tmp_path_factory):
    models = user_module(tmp_path_factory, "tp_ray_models.py", MODEL)
    (script := tmp_path / "tp_script.py").write_text(SCRIPT)
    split, alone = tmp_path / "split", tmp_path / "alone"
    on_ray, one_device = run_jobs_at_once(
        [str(script), f"{models}:two_blocks", str(split)],
        ["jobs/train.py", "--model", f"{models}:two_blocks", "--epochs", "2", "--global-batch", "64",
         # --tensor-parallel 1: a function of the product's arguments on one device, unsplit
         "--no-tensorboard", "--backend", "local", "--strategy", "one-device", "--tensor-parallel", "1",
         "--output", str(alone)],
        envs=[joined, clean_env()], timeout=600)
    for p in (on_ray, one_device):
        assert p.returncode == 0, p.stderr[-3000:]
    console = (split / "train.log").read_text()  # app.train's plan lines: the run's log
    assert "tensor parallel: 2 devices in each worker; up_1 by columns, up_2 by columns, down_1 by rows, down_2 by " \
           "rows" in console, console[-3000:]
    assert "split layers' variables per device: counted in each worker" in console, console[-3000:]
    assert "2 worker(s), global batch 64 (= 32 per worker)" in console

    # Adam's slots follow the shards on each worker; the all-reduce sums each shard's gradient across the workers.
    for a, b in zip(_weights(split), _weights(alone)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    result = json.loads((split / "result.json").read_text())
    assert result["num_replicas"] == 2 and result["strategy"] == "collective all-reduce (one replica per worker)"
    tp = result["tensor_parallel"]
    assert tp["splits"] == {"up_1": "column", "down_1": "row", "up_2": "column", "down_2": "row"}
    assert list(tp["device_bytes"]) == tp["devices"] == ["CPU:0", "CPU:1"]  # as the first worker counted them
    for held in tp["device_bytes"].values():
        assert held == pytest.approx(tp["unsplit_bytes"] / 2, rel=0.05)
