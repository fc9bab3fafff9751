"""The product's features on Keras's own fit, for a model with its own train_step on 2 Ray workers
(app.training.keras_features): each is what Keras provides, checked against Keras's own model.fit with the same
setting. One user script (tests/scripts/keras_features_runs.py) makes one Ray run of them all; the learning-rate
rule is checked in this process."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO, clean_env, script_record

SCRIPT = REPO / "tests" / "scripts" / "keras_features_runs.py"


@pytest.fixture(scope="module")
def runs(joined, tmp_path_factory):
    return script_record(SCRIPT, tmp_path_factory, "features.json", joined)


def test_grad_accum_bf16_an_elastic_range_and_tensor_parallel_on_two_workers_train_as_model_fit(runs):
    """grad_accum=2, mixed_precision="bf16", num_workers="1:2" and tensor_parallel=2 at once, a model with its own
    train_step: the History of model.fit with gradient_accumulation_steps=2 under the mixed_bfloat16 policy in one
    process, unsplit (each step's gradients averaged over both workers' rows, then accumulated as Keras accumulates
    them; bf16 rounding in the sums: 1e-2). The split exact in float32: the test below; the resize itself under a
    real two-node cluster: tests/test_elastic.py."""
    run, keras_fit = runs["features"], runs["keras_fit"]["history"]
    assert list(run["history"]) == ["reconstruction"]
    np.testing.assert_allclose(run["history"]["reconstruction"], keras_fit["reconstruction"], rtol=1e-2)
    # Keras counts optimizer steps, one per two batches: 8 batches of 32 an epoch, 3 epochs.
    assert run["iterations"] == 8 * 3 // 2
    assert run["policy"] == "mixed_bfloat16" and run["workers"] in (1, 2)  # the size Ray Train found room for
    for said in ("elastic: 1 to 2 workers", "gradient_accumulation_steps=2", "mixed_bfloat16 dtype policy",
                 "tensor parallel: 2 devices in each worker; encoder by columns, decoder by rows"):
        assert said in run["plan"]
    # Each worker split its own CPU: half of the split layers' bytes on each device (the decoder's bias is whole).
    tp = run["tensor_parallel"]
    assert tp["splits"] == {"encoder": "column", "decoder": "row"} and list(tp["device_bytes"]) == ["CPU:0", "CPU:1"]
    assert sum(tp["device_bytes"].values()) == tp["unsplit_bytes"]


def test_a_worker_killed_inside_an_epoch_goes_on_from_its_step_checkpoint_as_model_fit(runs):
    """checkpoint_every_steps=3 on 2 workers, a model with its own train_step and Adam; rank 0 killed after the 5th
    step of epoch 2: Ray Train restarts the group from the checkpoint at step 3 (the weights, Adam's moments and
    step count, the epoch's metric so far), the epoch's other 5 steps run, then epoch 3: the History and the
    weights of model.fit in one process, which never stopped."""
    run, keras_fit = runs["steps"], runs["steps_keras_fit"]
    assert "resumed at epoch 2 step 3 from its checkpoint" in run["log"], run["log"][-3000:]
    np.testing.assert_allclose(run["history"]["reconstruction"], keras_fit["history"]["reconstruction"], rtol=1e-5)
    for ours, kerass in zip(run["weights"], keras_fit["weights"], strict=True):
        np.testing.assert_allclose(ours, kerass, atol=1e-5)
    assert [(s["workers"], s["epoch"], s["step"]) for s in run["workers_over_time"]] == [(2, 1, 0)]
    assert "checkpoints: every epoch, and every 3 steps inside one" in run["log"]


def test_a_synchronized_batch_norm_normalizes_over_the_global_batch_on_two_workers_as_model_fit(runs):
    """BatchNormalization(synchronized=True) on 2 workers (conv features; called twice in the model's own
    train_step; a last batch cut 3 + 2): each call normalizes over the whole global batch and its gradient flows back
    to both workers' rows, so the weights and moving statistics are model.fit's in one process (normalizing over each
    worker's own part instead: 3e-2)."""
    run = runs["batch_norm"]
    for ours, kerass in zip(run["weights"], run["keras_weights"], strict=True):
        np.testing.assert_allclose(ours, kerass, atol=2e-6)
    # The model's own loss tracker takes one value per worker and step: the short batch's two parts weigh alike.
    np.testing.assert_allclose(run["history"]["loss"], run["keras_history"]["loss"], rtol=1e-2)
    assert "batch normalization: 1 synchronized layer(s) normalize over the global batch" in run["plan"]
    # 10 steps of a dozen all-reduces each (gradients, two calls' sums and their gradients): rank 0's threads do not
    # grow with them (a collective's own timeout starts a thread per op: app.training.stall_watch)
    assert len(run["threads"]) >= 10 and max(run["threads"]) - min(run["threads"]) < 10, run["threads"]


def test_tensor_parallel_on_kerass_fit_is_model_fit_weight_for_weight_and_its_checkpoint_resumes_unsplit(
        tmp_path_factory):
    """A user's script splits its CPU into 2 devices and trains its own-train_step model with tensor_parallel=2 (no
    Ray): the same History as model.fit (float32: the shards' sums in another order); the checkpoint holds the
    model and Adam's moments unsplit, so the run resumed without the split ends on model.fit's weights (1e-6)."""
    record = script_record(REPO / "tests" / "scripts" / "keras_tensor_local.py", tmp_path_factory, "tensor.json",
                           clean_env())
    np.testing.assert_allclose(record["split"]["reconstruction"], record["keras_fit"]["reconstruction"][:2],
                               rtol=1e-6)
    np.testing.assert_allclose(record["resumed"]["reconstruction"], record["keras_fit"]["reconstruction"], rtol=1e-6)
    for ours, kerass in zip(record["weights"], record["keras_weights"], strict=True):
        np.testing.assert_allclose(ours, kerass, atol=1e-6)
    assert "tensor parallel: 2 devices; encoder by columns, decoder by rows" in record["plan"]
    assert record["result"]["device_bytes"] == {"CPU:0": 236, "CPU:1": 204}  # 4 B x (8x3+3 + 3x8+8), (8x3+3 + 3x8)


def test_the_learning_rate_rule_is_kerass_cosine_decay_with_warmup_and_trains_as_model_fit_with_it(tmp_path):
    """The rule on a number is Keras's own CosineDecay with warmup, step for step; asked of app.fit it trains as
    model.fit with that schedule on the user's optimizer; the trained model keeps the user's own rate."""
    import keras

    import app
    from app.training.keras_features import _rule

    rule = _rule()(0.05, 2.0, 8, 24, True)
    # From the unscaled 0.05 up to 0.1 over the warmup (Goyal et al.), then a cosine to 0.
    kerass = keras.optimizers.schedules.CosineDecay(0.05, 24 - 8, warmup_target=0.1, warmup_steps=8)
    np.testing.assert_allclose([float(rule(s)) for s in range(30)], [float(kerass(s)) for s in range(30)],
                               rtol=1e-6, atol=1e-9)
    # An optimizer with the rule copies whole (ZeRO's template is a deepcopy, which Keras makes by saving it), on a
    # number and on the user's own schedule.
    import copy

    for base in (0.05, keras.optimizers.schedules.ExponentialDecay(0.05, 10, 0.5)):
        copied = copy.deepcopy(keras.optimizers.SGD(_rule()(base, 2.0, 8, 24, True)))._learning_rate
        original = _rule()(base, 2.0, 8, 24, True)
        np.testing.assert_allclose([float(copied(s)) for s in range(30)], [float(original(s)) for s in range(30)],
                                   rtol=1e-6)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        return model

    ours = app.fit(build, x, y, batch_size=32, epochs=3, shuffle=False, lr_scaling="linear", reference_batch=16,
                   warmup_epochs=1, lr_decay="cosine", backend="local", output=str(tmp_path / "run"), verbose=0)
    reference = build()
    reference.optimizer.learning_rate = kerass  # 8 batches an epoch: warm up over one, decay over the other two
    expected = reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    np.testing.assert_allclose(ours.history["loss"], expected.history["loss"], rtol=1e-5)
    assert float(ours.model.optimizer.learning_rate.numpy()) == np.float32(0.05)
    assert "learning rate: each optimizer's own rate, scaled linear by 32 rows an update / reference_batch 16 = x2" \
        in (tmp_path / "run" / "train.log").read_text()
