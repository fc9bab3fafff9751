"""Mixed precision (fp16 with loss scaling, bf16) and gradient accumulation, in the shared loop."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_local import FULL_BATCH_SGD, local_run, local_runs

from conftest import REPO, clean_env


def weights(path):
    import keras

    return keras.models.load_model(path / "model.keras").get_weights()


def test_two_accumulated_micro_batches_equal_one_batch_twice_the_size(tmp_path):
    """K=2 at batch B == K=1 at batch 2B, full-batch SGD, under Mirrored (a real all-reduce): Keras's gradient
    accumulation on Keras's fit over 2 local replicas."""
    # 1,436 training rows (1797 - round(1797 x 0.2009)): one whole batch of 1,436 either way. (With the default
    # 1,438, the single run would end each epoch on a short batch of 2 rows, which accumulation cannot cut.)
    common = ["--strategy", "mirrored", "--devices", "2", "--val-fraction", "0.2009", *FULL_BATCH_SGD]
    accumulated, single = local_runs((tmp_path / "k2", *common, "--per-replica-batch", "359", "--grad-accum", "2"),
                                     (tmp_path / "k1", *common, "--per-replica-batch", "718"))
    assert accumulated["global_batch_size"] == single["global_batch_size"] == 1436
    # Keras's fit counts its steps, one a micro-batch; the optimizer updates once for both
    assert accumulated["grad_accum"] == 2 and accumulated["steps_per_epoch"] == 2 * single["steps_per_epoch"] == 2
    for a, b in zip(weights(tmp_path / "k1"), weights(tmp_path / "k2")):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert accumulated["metrics"]["train_loss"] == pytest.approx(single["metrics"]["train_loss"], rel=1e-5)


def test_the_lr_rule_scales_with_the_accumulated_global_batch(tmp_path):
    result = local_run(tmp_path / "lr", "--strategy", "one-device", "--epochs", "1", "--grad-accum", "4")
    assert result["global_batch_size"] == 128  # 32 per replica x 1 replica x 4 micro-batches
    assert result["learning_rate"] == pytest.approx(0.1 * 128 / 32)  # the mlp's 0.1, linear rule, reference batch 32


@pytest.mark.parametrize("precision, policy", [("fp16", "mixed_float16"), ("bf16", "mixed_bfloat16")])
def test_mixed_precision_matches_float32_accuracy(precision, policy, precision_runs):
    import keras

    runs, results = precision_runs
    result, float32_run = results[precision], results["off"]
    assert result["mixed_precision"] == precision
    assert float32_run["metrics"]["val_accuracy"] >= 0.9  # a baseline that learned: else equal means nothing
    assert abs(result["metrics"]["val_accuracy"] - float32_run["metrics"]["val_accuracy"]) <= 0.01
    model = keras.models.load_model(runs / precision / "model.keras")
    assert model.get_layer("dense_0").dtype_policy.name == policy  # hidden layers compute in 16 bits
    assert model.get_layer("logits").compute_dtype == "float32"  # the logits (and the loss) stay float32
    assert all(w.dtype == np.float32 for w in model.get_weights())  # variables stay float32


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    """float32, fp16 and bf16 runs (5 epochs, one device), side by side: their start-ups overlap."""
    runs = tmp_path_factory.mktemp("precision")
    names = ("off", "fp16", "bf16")
    done = local_runs(*((runs / name, "--strategy", "one-device", "--epochs", "5", "--mixed-precision", name)
                        for name in names))
    return runs, dict(zip(names, done))


def test_fp16_overflow_on_one_replica_skips_the_step_on_all(tmp_path):
    """Keras's LossScaleOptimizer checks the gradients it is given; Keras's fit on local replicas, as the product
    runs it, gives it the replicas' sum, so an overflow on one is a skipped step on all."""
    p = subprocess.run([sys.executable, "tests/scripts/fp16_overflow_on_one_replica.py", str(tmp_path / "o")],
                       cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["compute_dtype"] == "float16"
    assert seen["finite"] and seen["unchanged"], seen  # skipped everywhere, no inf summed into the weights
    assert seen["optimizer"] == "LossScaleOptimizer" and seen["steps_applied"] == 0, seen
    assert seen["scale_after"] == seen["scale_before"] / 2  # and the loss scale backed off
