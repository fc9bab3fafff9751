"""Parameter-server training on Ray actors (--strategy parameter-server), and the sharded embedding table.

Real actors, real TensorFlow servers, joined to the session's Ray: the
transformer with its table in 4 shards over 2 parameter servers learns as the
MWMS run does while one of its workers is SIGKILLed; with one worker (no asynchrony) the path gives one device's weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import REPO, alive_actors, clean_env, frozen_by_the_test, run_job

# A small transformer on the built-in generated texts: learns in 3 epochs (val accuracy ~0.95).
TEXT = {"model": "transformer", "dataset": "synthetic-text", "synthetic_text_rows": 800, "vocab_size": 512,
        "sequence_length": 24, "embed_dim": 16, "num_heads": 2, "ff_dim": 32, "num_blocks": 1,
        "optimizer": "adam", "base_lr": 0.003, "lr_scaling": "none", "epochs": 3, "embedding_shards": 4}


def flags(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def checkpointed_epoch(out) -> int:
    """The epoch of the chief's last complete checkpoint (tf.train.CheckpointManager's pointer file), or 0."""
    pointer = out / "checkpoint" / "checkpoint"
    found = re.search(r'^model_checkpoint_path: "epoch-(\d+)"', pointer.read_text(), re.M) if pointer.exists() else None
    return int(found.group(1)) if found else 0


def test_sharded_transformer_on_two_ps_survives_a_killed_worker_and_a_frozen_ps_and_learns_like_mwms(
        ray_cluster, tmp_path):
    """2 workers + 2 PS, the token table in 4 shards, from the command line joined to a cluster. After epoch 1 a
    worker is SIGKILLed (the run goes on); after epoch 2 a parameter server is SIGSTOPped (nothing moves for
    --stall-timeout-s: the driver's restart loop restarts the cluster from the last checkpoint). Every epoch
    completes, the shards sit on both servers, and val accuracy is within 10% of the MWMS run's."""
    from app.config import build_config
    from app.run.api import run_training
    # The stall bound is above a killed worker's own recovery (Ray restarts its actor, the coordinator re-runs its
    # steps: ~20 s on a loaded 2-core machine, once over 30 s in a CI-style run), so only the frozen server trips it.
    out, stall = tmp_path / "ps", 45
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    cmd = [sys.executable, "jobs/train.py", "--strategy", "parameter-server", "--num-workers", "2", "--num-ps", "2",
           "--cpus-per-worker", "0.5", "--cpus-per-ps", "0.5", *flags(TEXT), "--max-failures", "1",
           "--stall-timeout-s", str(stall), "--output", str(out)]
    driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The MWMS baseline trains meanwhile, in this process (2 x 0.5 CPU beside the run's 2: the session's 3 CPUs;
    # its workers are RayTrainWorkers, not the Workers killed below). Its synchronous result does not depend
    # on what else runs; the two start-ups overlap.
    baseline: dict = {}
    mwms_config = build_config(None, {**TEXT, "output": str(tmp_path / "mwms"), "num_workers": 2, "cpus_per_worker": 0.5})
    mwms_thread = threading.Thread(target=lambda: baseline.update(result=run_training(mwms_config)), daemon=True)
    mwms_thread.start()

    def alive(kind: str) -> list:
        return alive_actors(ray_cluster, kind)

    def wait_for_checkpoint(epoch: int) -> None:
        deadline = time.time() + 240
        while checkpointed_epoch(out) < epoch and driver.poll() is None:
            assert time.time() < deadline, f"no checkpoint of epoch {epoch} within 240 s"
            time.sleep(0.2)
        assert driver.poll() is None, driver.communicate()[1][-3000:]

    with frozen_by_the_test(driver) as frozen:
        wait_for_checkpoint(1)
        assert len(alive("Worker")) == 2 and len(alive("ParameterServer")) == 2
        os.kill(alive("Worker")[0].pid, signal.SIGKILL)
        wait_for_checkpoint(2)
        frozen.append(alive("ParameterServer")[1].pid)
        os.kill(frozen[0], signal.SIGSTOP)  # alive but silent, as a stuck host or a partition leaves it
        stdout, stderr = driver.communicate(timeout=400)
    assert driver.returncode == 0, stderr[-3000:]
    console = stdout + stderr
    assert "Traceback" not in console and "pid=" not in console, console
    assert re.search(r"no step, evaluation or checkpoint for (4[5-9]|5[0-9]) s \(--stall-timeout-s\).*restart 1 of 1",
                     console), console
    resumed = re.search(r"resumed at epoch (\d) step 0 from its checkpoint", console)
    assert resumed and int(resumed.group(1)) >= 3, console  # the epoch training goes on at: 2 were done
    history = [row.split(",") for row in (out / "history.csv").read_text().splitlines()[1:]]
    assert [int(row[0]) for row in history] == [1, 2, 3]
    assert [row[-1] for row in history] == ["0"] * (int(resumed.group(1)) - 1) + ["1"] * (4 - int(resumed.group(1)))

    result = json.loads((out / "result.json").read_text())
    assert result["strategy"] == "ParameterServerStrategy" and result["epochs_completed"] == 3
    assert (result["num_workers"], result["num_ps"], result["restarts"]) == (2, 2, 1)
    assert result["optimizer_steps"] == 3 * result["steps_per_epoch"] == 3 * (640 // 32)
    shards = {k: v for k, v in result["variable_placement"].items() if "token_embedding/shard_" in k}
    assert len(shards) == 4
    assert {re.search(r"/job:ps/replica:0/task:(\d)/", d).group(1) for d in shards.values()} == {"0", "1"}, shards

    mwms_thread.join(timeout=400)
    assert "result" in baseline, "the MWMS baseline did not finish"
    mwms = baseline["result"]
    ps_acc, mwms_acc = result["metrics"]["val_accuracy"], mwms["metrics"]["val_accuracy"]
    print(f"\nval accuracy after 3 epochs: parameter-server (a worker killed, a server frozen) {ps_acc:.4f}, "
          f"MWMS {mwms_acc:.4f}")
    assert mwms_acc > 0.6, "the MWMS baseline did not learn: the comparison would mean nothing"
    assert ps_acc >= 0.9 * mwms_acc


def test_one_worker_parameter_server_gives_one_device_weights(ray_cluster, tmp_path):
    """No asynchrony with one worker: full-batch SGD steps match one device's to 1e-5."""
    import keras

    from app import train

    same = {"dataset": "synthetic", "synthetic_rows": 200, "synthetic_shape": [8], "synthetic_classes": 3,
            "model": "mlp", "hidden_units": [16], "per_replica_batch": 160, "epochs": 3, "optimizer": "sgd",
            "momentum": 0.0, "warmup_epochs": 0, "lr_decay": "constant", "base_lr": 0.5, "reference_batch": 160,
            "shuffle": False, "tensorboard": False}
    # TensorFlow's threads are fixed in this process already: one device runs as a user runs it, beside the
    # parameter-server run (its own process; the two overlap).
    local = {k: v for k, v in same.items() if k not in ("shuffle", "tensorboard")}
    local.update(synthetic_shape=8, hidden_units=16)
    one_device = subprocess.Popen([sys.executable, "jobs/train.py", "--backend", "local", "--strategy", "one-device",
                                   *flags(local), "--no-shuffle", "--no-tensorboard", "--output", str(tmp_path / "one")],
                                  cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ps = train(**same, strategy="parameter-server", num_workers=1, num_ps=1, cpus_per_ps=0.5,
                   cpus_per_worker=0.5, output=str(tmp_path / "ps"))
    finally:
        _, stderr = one_device.communicate(timeout=300)
    assert one_device.returncode == 0, stderr[-3000:]
    one = json.loads((tmp_path / "one" / "result.json").read_text())
    assert ps["optimizer_steps"] == 3 and one["steps_per_epoch"] == 1
    # The chief's model, one ordinary model, exported for serving by the driver.
    assert ps["saved_model"]["inputs"] == {"x": {"dtype": "float32", "shape": [-1, 8]}}
    assert (tmp_path / "ps" / "saved_model" / "saved_model.pb").is_file()
    a = keras.models.load_model(tmp_path / "ps" / "model.keras").get_weights()
    b = keras.models.load_model(tmp_path / "one" / "model.keras").get_weights()
    losses = [float(row.split(",")[1]) for row in (tmp_path / "ps" / "history.csv").read_text().splitlines()[1:]]
    assert losses[-1] < losses[0], losses  # the steps did move the weights
    diff = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    print(f"\nmax |w_ps - w_one_device| after 3 full-batch steps: {diff:.2e}")
    assert diff < 1e-5

    # The run's last checkpoint (tf.train.CheckpointManager's, in <output>/checkpoint) scored as a user does it.
    p = run_job("jobs/evaluate.py", "--checkpoint", str(tmp_path / "ps" / "checkpoint"), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    scored = json.loads((tmp_path / "ps" / "checkpoint" / "epoch-3.eval.json").read_text())
    assert scored["val_accuracy"] == pytest.approx(ps["metrics"]["val_accuracy"], abs=1e-6)


def test_sharded_embedding_is_one_table_with_sparse_gradients(tmp_path):
    """K shards look up exactly what one Embedding with their rows does; gradients stay sparse; it saves and loads."""
    import keras
    import tensorflow as tf

    from app.layers import ShardedEmbedding

    layer = ShardedEmbedding(10, 3, num_shards=4)
    ids = tf.constant([[1, 9, 0], [4, 4, 7]])
    with tf.GradientTape() as tape:
        out = layer(ids)
        loss = tf.reduce_sum(out ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert [tuple(s.shape) for s in layer.shards] == [(3, 3), (3, 3), (2, 3), (2, 3)]
    np.testing.assert_array_equal(out.numpy(), tf.gather(layer.full_table(), ids).numpy())
    assert all(isinstance(g, tf.IndexedSlices) for g in grads)
    model = keras.Sequential([keras.Input((3,)), layer])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded(ids).numpy(), model(ids).numpy())


@pytest.mark.parametrize("args, message", [
    (["--backend", "local", "--strategy", "parameter-server"], "runs on Ray actors: use it with --backend ray"),
    (["--num-ps", "2"], "--num-ps and --cpus-per-ps are for --strategy parameter-server"),
    (["--strategy", "parameter-server", "--num-ps", "9", "--cpus-per-ps", "4"], "parameter servers x 4 CPUs need"),
    (["--strategy", "parameter-server", "--grad-accum", "2"], "leave --grad-accum and --steps-per-execution at 1"),
])
def test_parameter_server_requests_that_cannot_be_met_are_one_line(args, message):
    p = subprocess.run([sys.executable, "jobs/train.py", *args], cwd=REPO, env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_the_plan_says_why_parameter_servers_train_on_the_products_own_loop():
    """The plan (a --dry-run's, on in-memory data) says in one line why this run is not Keras's fit."""
    p = subprocess.run([sys.executable, "jobs/train.py", "--strategy", "parameter-server", "--num-workers", "2",
                        "--cpus-per-worker", "0.5", "--dry-run"], cwd=REPO, env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step: the product's own loop, not Keras's fit (Keras 3's fit has no ParameterServerStrategy)" in p.stdout
