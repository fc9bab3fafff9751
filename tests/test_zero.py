"""Optimizer state sharded over the workers (shard_optimizer, app.training.zero): the same weights as an unsharded
run and as Keras's own model.fit, 1/N of the state per worker, checkpoints that hold the whole state. One user
script (tests/scripts/zero_runs.py) makes the Ray runs; the cut and the refusals are checked in this process."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO, close_weights, script_record

SCRIPT = REPO / "tests" / "scripts" / "zero_runs.py"


@pytest.fixture(scope="module")
def runs(joined, tmp_path_factory):
    return script_record(SCRIPT, tmp_path_factory, "zero.json", joined)


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum_clipnorm", "adamw_global_clipnorm"])
def test_two_sharded_workers_train_the_weights_of_model_fit_in_one_process(runs, optimizer):
    """Epochs of 200 rows (a short last batch each): Adam (stage 2, a model with its own train_step; 2 epochs, the
    run resumed below), SGD with momentum and clipnorm (stage 1, compiled, a kernel constraint; 3 epochs), AdamW
    with weight decay and global_clipnorm (stage 1, own train_step; 3 epochs): every weight within 1e-6 of
    model.fit's (seen: at most 5e-7)."""
    run = runs[optimizer]
    close_weights(run["sharded"], run["keras_fit"], atol=1e-6)
    np.testing.assert_allclose(run["history"]["loss"], run["keras_history"]["loss"], rtol=1e-5)
    assert "each of the 2 workers keeps 1/2 of every optimizer's state" in run["plan"]


def test_a_model_with_two_optimizers_has_each_sharded_and_trains_as_model_fit(runs):
    """A GAN's shape, compile(d_optimizer=Adam, g_optimizer=SGD with momentum), its own train_step applying each:
    both sharded (their own parts, collectives and checkpoint files), the weights of model.fit after 2 epochs."""
    run = runs["two_optimizers"]
    close_weights(run["sharded"], run["keras_fit"], atol=1e-6)
    np.testing.assert_allclose(run["history"]["d_loss"], run["keras_history"]["d_loss"], rtol=1e-5, atol=1e-6)
    assert run["iterations"] == [2 * 7, 2 * 7]  # 7 batches an epoch (200 rows of 32), each optimizer a step each


def test_sharded_and_unsharded_workers_hold_the_same_weights_and_half_the_state(runs):
    """Sharded and unsharded, on 2 workers for 2 epochs: the same weights; each sharded worker holds half of Adam's moments
    (94 weights cut into parts of 47), plus
    the same counters, and its flat part of the weights."""
    adam = runs["adam"]
    close_weights(adam["sharded_2_epochs"], adam["unsharded"], atol=1e-6)
    weights = 9 * 7 + 7 + 7 * 3 + 3  # 94
    counters = adam["unsharded_result"]["optimizer_state_bytes"] - 2 * weights * 4  # iterations, learning rate
    assert counters == 12 and adam["unsharded_result"]["optimizer_parts_bytes"] == 0
    part = -(-weights // 2)  # 47
    assert adam["result"] == {"optimizer_state_bytes": counters + 2 * part * 4, "optimizer_parts_bytes": part * 4}
    # The plan gives the very bytes result.json does, before any worker starts (SGD with momentum: one slot; the
    # subclassed model with Adam, built by the driver's check of its metrics on a batch: two).
    sgd = runs["sgd_momentum_clipnorm"]
    assert sgd["result"]["optimizer_state_bytes"] == counters + part * 4
    assert f"({counters + part * 4} B of {counters + weights * 4} B a worker)" in sgd["plan"]
    assert f"({counters + 2 * part * 4} B of {counters + 2 * weights * 4} B a worker)" in adam["plan"]


def test_a_sharded_run_resumes_unsharded_on_one_worker_and_an_unsharded_one_sharded_as_if_never_stopped(runs):
    """2 epochs sharded on 2 workers, the third resumed on 1 worker: its checkpoint held the whole state (both
    workers' parts, one file per variable and slot), so the weights are model.fit's 3 epochs. And 2 epochs
    unsharded, the third sharded: each worker kept its part of the unsharded checkpoint's state."""
    adam = runs["adam"]
    close_weights(adam["resumed"], adam["keras_fit_3_epochs"], atol=1e-6)
    assert len(adam["resumed_history"]["loss"]) == 3
    close_weights(adam["resharded"], adam["keras_fit_3_epochs"], atol=1e-6)


def test_fp16_steps_that_overflow_on_any_worker_are_skipped_on_every_worker_sharded_as_unsharded(runs):
    """A LossScaleOptimizer whose first scale (2^19) overflows float16: the steps it skips while the scale halves
    are skipped on both workers alike, sharded as unsharded (the same scale, the same steps, the same weights).
    One model.fit process (an epoch of 7 batches) skips 4 and applies 3. Two workers may skip one more: each
    worker's float16 backward pass carries the mean over its own 16 rows, twice one process's share of a row, so
    it overflows at half the scale."""
    run = runs["fp16"]
    sharded, unsharded, keras_fit = run["sharded"], run["unsharded"], run["keras_fit"]
    assert keras_fit["adam_iterations"] == 3 and keras_fit["scale"] == 2.0 ** 15
    for name in ("scale", "iterations", "adam_iterations"):
        assert sharded[name] == unsharded[name], name
    assert keras_fit["adam_iterations"] - 1 <= sharded["adam_iterations"] <= keras_fit["adam_iterations"]
    close_weights(sharded["weights"], unsharded["weights"], atol=1e-6)
    # The epoch's loss: model.fit's within 2 % (seen: 0.8 %, one step fewer applied on 2 workers).
    assert sharded["history"]["loss"][0] == pytest.approx(keras_fit["history"]["loss"][0], rel=2e-2)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8), world=st.integers(1, 5),
       bucket=st.integers(4, 200))
def test_every_weight_is_in_exactly_one_workers_part_and_the_parts_are_equal(sizes, world, bucket):
    from app.training.zero import cut

    buckets = cut(sizes, [4] * len(sizes), ["float32"] * len(sizes), world, bytes_per_bucket=bucket)
    assert [i for b in buckets for i in b.members] == list(range(len(sizes)))
    for b in buckets:
        assert b.part * world >= b.length
        assert b.part * world - b.length < world  # the padding: less than one element a worker
        covered = [np.zeros(s, int) for s in b.sizes]
        for rank in range(world):
            held = 0
            for j, a, z in b.pieces(rank):
                covered[j][a:z] += 1
                held += z - a
            assert held <= b.part
        assert all((c == 1).all() for c in covered)


def _compiled(optimizer):
    def build():
        import keras

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer(), loss="mse")
        return model

    return build


def test_what_cannot_be_sharded_is_one_line_before_anything_trains(tmp_path):
    """A stage other than 1, 2 or 3; an optimizer whose update is not element by element; weight-decay exclusions;
    parameter servers; the product's own step (a built-in model): each refused in one line, nothing written."""
    import keras

    import app
    from app.config import TrainConfig
    from app.errors import UserError

    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")

    def adamw_excluding():
        optimizer = keras.optimizers.AdamW(0.01)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    for optimizer, said in ((keras.optimizers.Adafactor, "Adafactor's update of a weight reads more than"),
                            (adamw_excluding, "AdamW.exclude_from_weight_decay names variables")):
        with pytest.raises(UserError) as refused:
            app.fit(_compiled(optimizer), x, y, epochs=1, shard_optimizer=1, backend="local",
                    output=str(tmp_path / "never"), verbose=0)
        assert said in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UserError, match="shard_optimizer: Input should be 0, 1, 2 or 3") as refused:
        app.fit(_compiled(keras.optimizers.Adam), x, y, epochs=1, shard_optimizer=4, backend="local",
                output=str(tmp_path / "never"), verbose=0)
    with pytest.raises(ValueError, match="parameter servers already hold it apart"):
        TrainConfig(strategy="parameter-server", shard_optimizer=1)
    with pytest.raises(UserError, match="each hold it whole"):  # several local replicas
        app.train(model="mlp", epochs=1, shard_optimizer=1, backend="local", strategy="mirrored", devices=2,
                  output=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


def test_one_worker_has_nothing_to_shard_and_trains_as_model_fit(tmp_path):
    """shard_optimizer with one worker (the local backend): the plan says it trains unsharded, and it does."""
    import keras

    import app

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")

    def build():
        keras.utils.set_random_seed(2)
        return _compiled(lambda: keras.optimizers.Adam(0.01))()

    ours = app.fit(build, x, y, epochs=2, shard_optimizer=2, backend="local", output=str(tmp_path / "run"),
                   shuffle=False, verbose=0)
    reference = build()
    reference.fit(x, y, epochs=2, shuffle=False, verbose=0)
    close_weights(ours.model.get_weights(), reference.get_weights(), atol=1e-7)
    assert "shard_optimizer 2: one worker, nothing to shard: it trains unsharded" in \
        (tmp_path / "run" / "train.log").read_text()
