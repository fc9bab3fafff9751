"""Ray Tune sweeps: every trial a real Ray Train run (the run jobs/train.py makes of its config: app.run.trial), a
user's own compiled model trained by Keras's fit; bad spaces refused before any trial."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from app.errors import UserError
from app.tools import tune
from app.ui import tune_console
from conftest import REPO, clean_env, run_job, run_jobs_at_once


def test_smoke_sweep_from_the_command_line_then_its_best_config_trains_and_a_trial_evaluates(
        ray_cluster, tmp_path):
    """jobs/tune.py as a user runs it, joined to a cluster (two trials at once: 2 x 2 workers x 0.5 CPU), 2 trials x
    2 epochs and one that fails: its console for people (the rest in tune.log); its best config fed back into
    jobs/train.py; a trial's checkpoint scored by jobs/evaluate.py in another process."""
    out = tmp_path / "sweep"
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    # A per-replica batch of 1024 on 2 workers, 2 micro-batches accumulated (whole batches only), is more than the
    # digits' training rows: that trial fails at once (a config the sweep's checks pass: they do not read the data).
    space = tmp_path / "space.yaml"
    space.write_text("grad_accum: 2\nper_replica_batch: {grid: [1024, 16, 32]}\n")
    # A list-valued field fixed for every trial (--hidden-units) once crashed the summary after the whole sweep.
    # --storage-path: every trial's Ray Train checkpoints under <storage-path>/<sweep>/<trial>/train.
    storage = tmp_path / "storage"
    # Flags fix a field for every trial (the sweeps guide's --num-workers, --epochs), --max-concurrent caps the trials.
    p = run_job("jobs/tune.py", "--space", str(space), "--num-workers", "2", "--epochs", "2", "--max-concurrent", "2",
                "--cpus-per-worker", "0.5",
                "--hidden-units", "32", "16", "--scheduler", "fifo", "--output", str(out),
                "--storage-path", str(storage), timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert yaml.safe_load((out / tune.SUMMARY_FILE).read_text())["trials"] == 3

    table = pd.read_csv(out / tune.RESULTS_FILE)
    assert list(table["trial"]) == [1, 2, 3] and list(table["config/per_replica_batch"]) == [1024, 16, 32]
    finished = table[table["config/per_replica_batch"] != 1024]
    assert (finished["epochs_run"] == 2).all() and finished["val_accuracy"].notna().all()
    assert (finished["error"].fillna("").astype(str) == "").all()
    assert table["error"][0].startswith("global batch 4096 (= 1024 per replica x 2 replicas x 2 accumulated")

    # The console: the plan, a line per trial event, the trials by the metric, the best; none of Ray's own output.
    console_text = p.stdout + p.stderr
    lines = console_text.splitlines()
    assert len(lines) <= 40, console_text
    for chatter in ("Training finished iteration", "Reporting training result", "Trial status", "+------", "╭",
                    "absl", "pid=", "(raylet)", "worker processes"):
        assert chatter not in console_text, console_text
    assert not [line for line in lines if line.startswith(("I0000", "W0000", "E0000"))], console_text
    assert f"sweep: {space}: 3 trial(s) of per_replica_batch 1024, 16, 32" in p.stdout
    assert "trial 2 started  per_replica_batch=16" in p.stdout and "trial 3  epoch 2/2  val_accuracy " in p.stdout
    assert "trial 1 failed: global batch 4096 (= 1024 per replica" in p.stdout
    assert "trial 2 finished: val_accuracy " in p.stdout and "trial 3 finished: val_accuracy " in p.stdout
    best_row = table.loc[table["val_accuracy"].idxmax()]
    assert f"best: trial {best_row['trial']}, val_accuracy {best_row['val_accuracy']:.4f}" in p.stdout
    assert f"best config: {out / tune.BEST_CONFIG_FILE}" in p.stdout
    # Everything Ray and TensorFlow printed, and the failed trial's whole traceback, are in tune.log.
    log = (out / tune_console.LOG_FILE).read_text()
    # The Train workers' and controller's own lines, forwarded by Ray (a trial process itself prints nothing).
    assert "Reporting training result" in log and "(RayTrainWorker pid=" in log and "(TrainController pid=" in log
    assert "trial 1 (" in log and "Traceback" in log and "best: trial" in log

    # Each trial was a real multi-worker Train run: its own Train storage with checkpoints.
    states = list(storage.glob("sweep/run_trial_*/train/checkpoint_*/state.json"))
    assert len(states) >= 2 and not list(out.glob("run_trial_*/train/checkpoint_*"))
    assert len(list(storage.glob("sweep/run_trial_*/train/tensorboard"))) == 2
    assert (out / tune.PLOT_FILE).stat().st_size > 10_000

    # The best config trained again, and a trial's checkpoint evaluated on the validation split, each in a
    # process of its own: independent of each other, so side by side (their start-ups overlap).
    best_file = out / tune.BEST_CONFIG_FILE
    best = yaml.safe_load(best_file.read_text())
    # (A trial trained by Keras's fit: its run's output holds its model; its checkpoints, the weights --resume reads.)
    trial_run = next(out.glob("run_trial_*/run/model.keras"), None) or next(storage.glob("sweep/run_trial_*/run/model.keras"))
    p, e = run_jobs_at_once(["jobs/train.py", "--config", str(best_file), "--output", str(tmp_path / "again")],
                            ["jobs/evaluate.py", "--run", str(trial_run.parent)], timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    again = json.loads((tmp_path / "again" / "result.json").read_text())
    assert again["config"]["per_replica_batch"] == best["per_replica_batch"] == best_row["config/per_replica_batch"]
    assert again["epochs_completed"] == 2
    assert best["hidden_units"] == again["config"]["hidden_units"] == [32, 16]
    assert again["metrics"]["val_accuracy"] == pytest.approx(best_row["val_accuracy"], abs=0.03)

    assert e.returncode == 0, e.stderr[-3000:]
    evaluated = json.loads((trial_run.parent / "eval.json").read_text())
    trained = json.loads((trial_run.parent / "result.json").read_text())["metrics"]
    assert evaluated["val_accuracy"] == pytest.approx(trained["val_accuracy"], abs=1e-6)
    # A trial's checkpoint (Keras's fit's, with its model.keras) is scored in a plain process too.
    scored = run_job("jobs/evaluate.py", "--checkpoint", str(states[0].parent), timeout=300, env=env)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert 0 <= json.loads((states[0].parent / "eval.json").read_text())["val_accuracy"] <= 1


def test_a_sweep_with_show_logs_shows_rays_lines_too_and_one_whose_trials_all_failed_says_so(ray_cluster, tmp_path):
    """--show-logs: what went to tune.log is on the console as well. One trial that fails at once keeps it cheap."""
    out = tmp_path / "sweep"
    space = tmp_path / "space.yaml"
    space.write_text("num_workers: 2\ngrad_accum: 2\nper_replica_batch: 1024\n")
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    p = run_job("jobs/tune.py", "--space", str(space), "--cpus-per-worker", "0.5", "--output", str(out),
                "--show-logs", timeout=300, env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "trial 1 failed: global batch 4096" in p.stdout
    assert "error: no trial reported 'val_accuracy'" in p.stderr
    # Ray's own lines, which a sweep without --show-logs keeps in tune.log only: Tune's controller on the trial that
    # failed, with its traceback.
    log = (out / tune_console.LOG_FILE).read_text()
    assert "ERROR tune_controller.py" in p.stderr and "Trial task failed" in log


USER_MODEL = """
import keras


def build():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model
"""


def test_a_sweep_of_a_users_compiled_model_trains_each_trial_by_kerass_fit(ray_cluster, tmp_path):
    """A model function of no arguments (its own optimizer, loss and metric), named relative to the user's directory
    (each trial runs in a directory of Tune's): each trial is the run jobs/train.py makes of it, Keras's fit on the
    trial's workers, its every epoch reported to Tune (the trial lines, the table). The trials are elastic
    (num_workers: 1:2 in the space, plain YAML, where 1:2 would be the base-60 number 62 to PyYAML), and the best
    config, fed back to jobs/train.py, plans the same range."""
    from app.training.keras_callbacks import RECORD_KEYS  # an epoch record's keys besides Keras's logs

    models = tmp_path / "my_model.py"
    models.write_text(USER_MODEL)
    space = tmp_path / "space.yaml"
    space.write_text("num_workers: 1:2\nglobal_batch: {grid: [16, 64]}\n")
    out = tmp_path / "sweep"
    env = clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")
    p = run_job(str(REPO / "jobs" / "tune.py"), "--space", "space.yaml", "--model", "my_model.py:build",
                "--cpus-per-worker", "0.5", "--epochs", "2", "--scheduler", "fifo", "--max-concurrent", "1",
                "--output", "sweep", timeout=400, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "each trial: a Ray Train run of 1:2 worker(s) x 0.5 CPU" in p.stdout
    table = pd.read_csv(out / tune.RESULTS_FILE)
    assert list(table["config/global_batch"]) == [16, 64] and (table["epochs_run"] == 2).all()
    assert "trial 2  epoch 2/2  val_accuracy " in p.stdout
    runs = sorted(out.glob("*/run/result.json"))
    assert len(runs) == 2
    for path in runs:
        result = json.loads(path.read_text())
        # Keras's fit's record: each epoch's logs under Keras's names, the run's own Adam at the rate it compiled
        assert [sorted(set(r) - set(RECORD_KEYS)) for r in result["history"]] == \
            [["accuracy", "loss", "val_accuracy", "val_loss"]] * 2
        assert all(r["samples_per_second"] > 0 and r["workers"] in (1, 2) for r in result["history"])
        assert result["time_to_first_step_seconds"] > 0
        assert result["global_batch_size"] in (16, 64) and result["base_lr"] == pytest.approx(3e-3)
        row = table[table["config/global_batch"] == result["global_batch_size"]]
        assert float(row["val_accuracy"].iloc[0]) == pytest.approx(result["metrics"]["val_accuracy"], abs=1e-6)
    dry = run_job(str(REPO / "jobs" / "train.py"), "--config", str(out / tune.BEST_CONFIG_FILE), "--output",
                  str(tmp_path / "again"), "--dry-run", timeout=300, env=env, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    best = yaml.safe_load((out / tune.BEST_CONFIG_FILE).read_text())
    assert best["num_workers"] == "1:2" and best["global_batch"] in (16, 64), best
    said = dry.stdout + dry.stderr
    assert "elastic: 1 to 2 workers" in said and f"the global batch {best['global_batch']} stays at every size" in said


@pytest.mark.parametrize(
    "space, message",
    [
        ("learning_rate: {grid: [0.1, 0.2]}\n", "unknown key 'learning_rate'"),
        ("base_lr: {logspace: [0.01, 0.1]}\n", "key 'base_lr' has a malformed domain"),
        ("base_lr: {uniform: [0.1]}\n", "'base_lr': bad uniform arguments"),
        ("base_lr: {grid: 0.1}\n", "'base_lr': grid needs a non-empty list"),
        ("lr_scaling: {grid: [linear, cubic]}\n", "'lr_scaling' = 'cubic' is invalid"),
        ("per_replica_batch: {choice: [32, 0]}\n", "'per_replica_batch' = 0 is invalid"),
        ("output: {grid: [a, b]}\n", "'output' cannot be searched"),
    ],
)
def test_bad_spaces_are_refused_by_name(tmp_path, space, message):
    f = tmp_path / "space.yaml"
    f.write_text(space)
    with pytest.raises(UserError) as e:
        tune.load_space(f, {})
    assert message in str(e.value)


def test_a_key_both_fixed_and_searched_is_refused(tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("epochs: {grid: [1, 2]}\n")
    with pytest.raises(UserError, match="both fixed by a flag and searched"):
        tune.load_space(f, {"epochs": 3})


def test_shipped_spaces_parse():
    spaces = sorted((REPO / "tune_spaces").glob("*.yaml"))
    assert len(spaces) >= 3, spaces  # the folder moved, or its files did: this test would check nothing
    for f in spaces:
        space = tune.load_space(f, {})
        assert any(tune._is_domain(v) for v in space.values()), f"{f.name} searches nothing"


def test_bad_space_fails_before_ray_starts(tmp_path):
    f = tmp_path / "space.yaml"
    f.write_text("momentun: {grid: [0.0, 0.9]}\n")
    p = run_job("jobs/tune.py", "--space", str(f), "--output", str(tmp_path / "o"), timeout=120)
    assert p.returncode == 2 and "unknown key 'momentun'" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "o").exists()


def test_asha_judges_trials_only_after_the_warmup():
    from app.config import build_config

    space = tune.load_space(REPO / "tune_spaces" / "lr_scaling.yaml", {})
    searched = {k: v for k, v in space.items() if tune._is_domain(v)}
    base = build_config(None, {"output": "x", **{k: v for k, v in space.items() if k not in searched}})
    scheduler = tune.asha(base, searched)
    assert scheduler._max_t == 6
    assert min(milestone for milestone, _ in scheduler._brackets[0]._rungs) == 2  # warmup 1 epoch + 1


# --- the console's lines, without a cluster ----------------------------------------------------------------


class FakeTrial:
    def __init__(self, config, last_result=None, path="/x/run_trial_0"):
        self.config, self.last_result, self.path = config, last_result or {}, path
        self.pickled_error_file, self.error_file = None, None


def test_trial_lines_say_each_event_in_one_line(capsys, tmp_path):
    lines = tune_console.TrialLines(["base_lr", "lr_scaling"], "val_accuracy", epochs=6)
    a, b, c = (FakeTrial({"base_lr": 0.1, "lr_scaling": rule}) for rule in ("linear", "sqrt", "none"))
    trials = [a, b, c]
    lines.on_trial_start(0, trials, b)
    lines.on_trial_result(0, trials, b, {"epoch": 1, "val_accuracy": 0.91234, "val_loss": 0.3, "train_loss": 0.4,
                                          "epoch_seconds": 2.04})
    lines.on_trial_result(0, trials, b, {"training_iteration": 1})  # none of ours: nothing to say
    b.last_result = {"epoch": 2, "val_accuracy": 0.9, "val_loss": 0.3, "time_total_s": 40.2}
    lines.on_trial_complete(0, trials, b)  # ASHA stopped it at its rung
    a.last_result = {"epoch": 6, "val_accuracy": 0.95, "val_loss": 0.2, "time_total_s": 60}
    lines.on_trial_complete(0, trials, a)
    c.error_file = tmp_path / "error.txt"
    c.error_file.write_text("Failure # 1\nTraceback (most recent call last):\n  ...\nValueError: bad value\n")
    lines.on_trial_error(0, trials, c)
    assert capsys.readouterr().out.splitlines() == [
        "trial 2 started  base_lr=0.1  lr_scaling=sqrt",
        "trial 2  epoch 1/6  val_accuracy 0.9123  val_loss 0.3000  train_loss 0.4000  2.0 s",
        "trial 2 stopped early by the scheduler after 2 of 6 epochs: val_accuracy 0.9000  val_loss 0.3000  40 s",
        "trial 1 finished: val_accuracy 0.9500  val_loss 0.2000  60 s",
        "trial 3 failed: ValueError: bad value",
    ]


def test_a_trials_error_is_one_line_whatever_tune_hands_over():
    from ray.exceptions import RayTaskError

    from app.errors import RunFailed

    raised = RayTaskError("ImplicitFunc.train", "Traceback (most recent call last):\n  ...", RunFailed("training "
                          "failed: NaN loss (rank 0) (full traceback in x)"))
    assert tune_console.one_line(raised) == "training failed: NaN loss (rank 0) (full traceback in x)"
    assert tune_console.one_line(KeyError("num_workers")) == "KeyError: 'num_workers'"
    assert tune_console.one_line(None).startswith("unknown error")


def test_the_summary_sorts_trials_by_the_metric_failed_last_and_names_the_best():
    table = pd.DataFrame({
        "trial": [1, 2, 3, 4], "config/lr_scaling": ["linear", "sqrt", "none", "linear"],
        "epochs_run": [6, 2, 0, 6], "val_accuracy": [0.91, 0.95, None, 0.97], "val_loss": [0.3, 0.2, None, 0.1],
        "wall_seconds": [60.0, 20.0, None, 61.0], "error": ["", "", "ValueError: bad", ""]})
    lines = tune_console.summary_lines(table, "val_accuracy", "max", 6, "/out/best_config.yaml",
                                       ["config/lr_scaling"])
    rows = [line.split() for line in lines[2:6]]
    assert [row[0] for row in rows] == ["4", "2", "1", "3"]
    assert lines[3].endswith("2/6       0.9500   0.2000      20 stopped early")
    assert rows[3][-1] == "failed" and rows[3][3] == "-"
    assert lines[-2] == "best: trial 4, val_accuracy 0.9700  lr_scaling=linear"
    assert lines[-1] == "best config: /out/best_config.yaml (train it: python jobs/train.py --config /out/best_config.yaml)"


def test_the_plan_says_where_asha_judges_trials():
    from app.config import build_config

    space = tune.load_space(REPO / "tune_spaces" / "lr_scaling.yaml", {})
    searched = {k: v for k, v in space.items() if tune._is_domain(v)}
    base = build_config(None, {"output": "x", **{k: v for k, v in space.items() if k not in searched}})
    assert tune.scheduler_line("asha", base, searched, "val_accuracy").startswith("asha: at epoch 2, 4 a trial")
    assert tune_console.trial_count(space, 2) == 2 * 9
