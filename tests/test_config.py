"""Config, LR scaling and epoch arithmetic: pure functions, no TensorFlow, no Ray."""

import math

import pytest

from app.config import TrainConfig, build_config
from app.data.plan import EpochPlan
from app.errors import UserError
from app.training.optim import plan_lr, scaled_lr


def test_defaults_are_valid_and_global_batch_is_per_replica_times_replicas():
    c = build_config(None, {"num_workers": 3, "per_replica_batch": 16})
    assert EpochPlan.for_run(c, 1000, c.num_workers).global_batch == 48
    assert c.output.startswith("runs/train-")


def test_a_run_started_in_the_same_second_as_another_writes_a_directory_of_its_own(tmp_path, monkeypatch):
    """Two app.fit calls of a script within one second: the second's default output is runs/train-<time>-2, not the
    first's directory (which it would refuse as existing)."""
    import datetime

    import app.config

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 6, 4, 5, 6)

    monkeypatch.setattr(app.config._dt, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    first = build_config(None, {}).output
    (tmp_path / first).mkdir(parents=True)
    second = build_config(None, {}).output
    (tmp_path / second).mkdir()
    assert (first, second, build_config(None, {}).output) == (
        "runs/train-20261206-040506", "runs/train-20261206-040506-2", "runs/train-20261206-040506-3")


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nbase_lr: 0.2\n")
    c = build_config(f, {"epochs": 5, "base_lr": None})
    assert (c.epochs, c.base_lr) == (5, 0.2)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"model": "resnet9000"}, "unknown model 'resnet9000'"),
        ({"dataset": "imagenet"}, "unknown dataset 'imagenet'"),
        ({"per_replica_batch": 0}, "per_replica_batch must be > 0"),
        ({"per_replica_batch": -4}, "per_replica_batch must be > 0"),
        ({"lr_scaling": "cubic"}, "lr_scaling"),
        ({"epochs": 0}, "epochs"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(overrides, expected):
    with pytest.raises(UserError) as e:
        build_config(None, overrides)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_yaml_key_is_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: 3\nlearnin_rate: 0.1\n")
    with pytest.raises(UserError, match="unknown key 'learnin_rate'"):
        build_config(f)


def test_unparseable_yaml_says_where(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("epochs: [3\n")
    with pytest.raises(UserError, match="not valid YAML at line"):
        build_config(f)


def test_every_field_round_trips_through_yaml(tmp_path):
    c = build_config(None, {"output": str(tmp_path / "o"), "hidden_units": [8]})
    f = tmp_path / "c.yaml"
    f.write_text(c.to_yaml())
    assert build_config(f) == c


@pytest.mark.parametrize(
    "rule, factor", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)]
)
def test_lr_scaling_rules(rule, factor):
    assert scaled_lr(0.1, rule, global_batch=256, reference_batch=64) == pytest.approx(0.1 * factor)


def test_warmup_ramps_from_base_to_scaled_lr_then_holds():
    c = TrainConfig(output="x", base_lr=0.1, reference_batch=32, lr_scaling="linear",
                    warmup_epochs=2, lr_decay="constant", epochs=5)
    from app.training.optim import lr_schedule

    plan = plan_lr(c, global_batch=128, steps_per_epoch=10)
    assert plan.peak_lr == pytest.approx(0.4) and plan.warmup_steps == 20
    sched = lr_schedule(c, plan)
    lrs = [float(sched(s)) for s in (0, 10, 20, 35, 49)]
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[1] == pytest.approx(0.25)
    assert lrs[2:] == pytest.approx([0.4, 0.4, 0.4])


def test_epoch_plan_equalises_shards_and_counts_the_dropped_rows():
    p = EpochPlan(num_rows=1438, num_workers=2, per_replica_batch=32)
    assert p.steps == 22  # 719 rows per worker -> 22 full batches
    assert p.samples == 22 * 64 and p.dropped == 1438 - 1408
    with pytest.raises(UserError, match="larger than the 1438 training rows"):
        EpochPlan(1438, 2, 1000).check()
    assert math.isclose(EpochPlan(1438, 2, 719).steps, 1)


@pytest.mark.parametrize("rows, workers, replicas", [(499, 2, 1), (499, 1, 1), (100, 2, 2), (1438, 3, 1), (64, 2, 1)])
def test_the_whole_batches_of_an_epoch_cover_distinct_rows_and_are_one_workers_global_batches(rows, workers, replicas):
    """The own step's plan (a pipeline, parameter servers): whole batches, each row at most once, the rows left over
    fewer than a global batch; step s's global batch is the same rows whatever the number of workers."""
    p = EpochPlan(rows, workers, 16, replicas)
    starts, sizes = p.slices()
    assert starts.shape == sizes.shape == (workers, p.steps * replicas) and (sizes == 16).all()
    covered = sorted(r for s, n in zip(starts.ravel(), sizes.ravel()) for r in range(s, s + n))
    assert covered == list(range(p.samples)) and p.dropped == rows % (16 * workers * replicas)
    # The same global batches as one worker with the global batch, in the same order.
    one = EpochPlan(rows, 1, 16 * workers * replicas)
    one_starts, one_sizes = one.slices()
    step_rows = sizes.reshape(workers, p.steps, replicas).sum(axis=(0, 2))
    assert list(step_rows) == list(one_sizes[0]) and list(starts[0, ::replicas]) == list(one_starts[0])


@pytest.mark.parametrize("given", [(1, 4), [1, 4], "1:4"])
def test_a_worker_range_is_taken_from_python_a_list_or_the_command_lines_text(given):
    c = build_config(None, {"num_workers": given, "global_batch": 48})
    assert c.num_workers == (1, 4) and c.elastic and (c.min_workers, c.max_workers) == (1, 4)
    assert c.restarts == 10 and build_config(None, {"num_workers": given, "max_failures": 1}).restarts == 1
    # The global batch is kept at every size: each replica's part of it.
    assert [EpochPlan.for_run(c, 960, n).per_replica_batch for n in (1, 2, 3, 4)] == [48, 24, 16, 12]
    assert {EpochPlan.for_run(c, 960, n).steps for n in (1, 2, 3, 4)} == {20}
    assert build_config(None, {"num_workers": "2:2"}).num_workers == 2 and not build_config(None, {}).elastic


def test_a_worker_range_in_a_yaml_file_is_a_range_not_a_base_60_number(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("num_workers: 1:2\nepochs: 0x10\nglobal_batch: 64\n")  # PyYAML's safe_load: 1:2 is 62
    c = build_config(f, {})
    assert c.num_workers == (1, 2) and c.epochs == 16
    # Written back as the run records it (config.yaml): read again, the same range; the derived per-replica
    # batch is not recorded as if it had been set.
    (tmp_path / "again.yaml").write_text(c.to_yaml())
    again = build_config(tmp_path / "again.yaml", {})
    assert again.num_workers == (1, 2) and again.global_batch == 64 and "per_replica_batch" not in again.model_fields_set
