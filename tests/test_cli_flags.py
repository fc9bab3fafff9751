"""The command line as users type it: flags generated from TrainConfig (app.cli), parsed in-process and in a subprocess.

The in-process tests call app.cli directly (fast, no TensorFlow, no Ray). The
test_subprocess_* ones run ``python jobs/train.py ... --dry-run`` as a user would:
the dry run validates and prints the plan of the default digits run, creates no
output directory and starts no Ray.
"""

import json

import pytest

from app import cli, cli_errors
from conftest import ray_sessions, run_job, run_jobs_at_once


def train(*argv: str):
    return cli.train_args("test", list(argv)).config


def refused(capsys, parse, *argv: str) -> str:
    """The one stderr line of a refused command line (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        parse("test", list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def assert_one_line_error(p, *words: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    assert "Traceback" not in p.stderr
    for word in words:
        assert word in lines[0], lines[0]


# --- in-process: what the parse yields ---------------------------------------------------------------------


def test_list_flag_with_one_value_is_a_one_item_list():
    assert train("--dataset", "d.parquet", "--feature-columns", "features").feature_columns == ["features"]


def test_list_flag_with_several_values():
    assert train("--dataset", "d.parquet", "--feature-columns", "f0", "f1", "f2").feature_columns == ["f0", "f1", "f2"]
    # the list stops at the next flag
    assert train("--dataset", "d.parquet", "--feature-columns", "f0", "f1", "--epochs", "3").epochs == 3


def test_optional_list_left_out_stays_unset():
    config = train()
    assert config.feature_columns is None and config.feature_shape is None


def test_lists_of_ints():
    config = train("--synthetic-shape", "8", "8", "3", "--hidden-units", "8", "--image-size", "32", "32",
                   "--feature-shape", "4", "4", "4")
    assert config.synthetic_shape == [8, 8, 3]
    assert config.hidden_units == [8]
    assert config.image_size == [32, 32]
    assert config.feature_shape == [4, 4, 4]


def test_list_flag_without_values_is_refused(capsys):
    assert "--feature-columns needs at least one value" in refused(capsys, cli.train_args, "--feature-columns")


def test_bools_on_and_off():
    assert train("--no-shuffle").shuffle is False
    assert train("--shuffle").shuffle is True
    assert train("--use-gpu").use_gpu is True
    assert train("--no-use-gpu").use_gpu is False
    assert train("--from-logits").from_logits is True and train().from_logits is None


def test_literals_strings_and_ints():
    config = train("--lr-scaling", "sqrt", "--image-channels", "1", "--backend", "local")
    assert (config.lr_scaling, config.image_channels, config.backend) == ("sqrt", 1, "local")


def test_scalars_with_dashes_and_equals():
    config = train("--per-replica-batch", "64", "--base-lr=0.1", "--cpus-per-worker", "0.5")
    assert (config.per_replica_batch, config.base_lr, config.cpus_per_worker) == (64, 0.1, 0.5)


def test_model_args_is_a_json_object():
    assert train("--model-args", '{"width": 64, "depth": [1, 2]}').model_args == {"width": 64, "depth": [1, 2]}
    assert train().model_args == {}


@pytest.mark.parametrize("value", ["[1, 2]", "64", "{width: 64}"])
def test_model_args_not_a_json_object_is_one_line(capsys, value):
    assert "--model-args must be a JSON object" in refused(capsys, cli.train_args, "--model-args", value)


def test_model_and_dataset_stay_strings():
    config = train("--model", "my_example.py:build_model", "--dataset", "data/train.parquet")
    assert config.model == "my_example.py:build_model"
    assert config.dataset == "data/train.parquet"


def test_bad_literal_is_one_line_naming_flag_and_choices(capsys):
    line = refused(capsys, cli.train_args, "--lr-scaling", "cubic")
    assert "--lr-scaling" in line and "cubic" in line
    assert all(choice in line for choice in ("linear", "sqrt", "none"))
    line = refused(capsys, cli.train_args, "--image-channels", "2")
    assert "--image-channels" in line and "1, 3" in line


def test_bad_int_is_one_line(capsys):
    line = refused(capsys, cli.train_args, "--epochs", "x")
    assert "--epochs" in line and "INT" in line and "'x'" in line
    assert "--synthetic-shape" in refused(capsys, cli.train_args, "--synthetic-shape", "8", "x", "3")
    assert "--epochs" in refused(capsys, cli.train_args, "--epochs")  # no value


def test_unknown_flag_is_one_line_with_a_suggestion(capsys):
    line = refused(capsys, cli.train_args, "--per-replica-bach", "64")
    assert "unknown option --per-replica-bach" in line and "did you mean --per-replica-batch?" in line
    assert "unexpected argument stray" in refused(capsys, cli.train_args, "stray")


def test_out_of_range_value_is_the_configs_one_line(capsys):
    assert "epochs must be > 0 (got 0)" in refused(capsys, cli.train_args, "--epochs", "0")


def test_config_file_is_below_flags(tmp_path):
    file = tmp_path / "my.yaml"
    file.write_text("epochs: 3\nper_replica_batch: 16\ndataset: d.parquet\nfeature_columns: [a, b]\nshuffle: false\n")
    config = train("--config", str(file), "--epochs", "5")
    assert (config.epochs, config.per_replica_batch, config.feature_columns, config.shuffle) \
        == (5, 16, ["a", "b"], False)
    # A flag typed with the field's default value still beats the file.
    config = train("--config", str(file), "--epochs", "15", "--shuffle")
    assert (config.epochs, config.shuffle) == (15, True)


def test_config_file_value_replaced_by_a_flag_is_validated_once(tmp_path, capsys):
    file = tmp_path / "my.yaml"
    file.write_text("epochs: 0\n")
    assert train("--config", str(file), "--epochs", "2").epochs == 2
    assert "epochs must be > 0" in refused(capsys, cli.train_args, "--config", str(file))


def test_resume_reads_the_runs_own_config(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / cli.CONFIG_FILE).write_text(f"epochs: 4\nper_replica_batch: 16\noutput: {out}\n")
    config = train("--resume", "--output", str(out), "--per-replica-batch", "8")
    assert (config.resume, config.epochs, config.per_replica_batch) == (True, 4, 8)
    assert "holds no config.yaml" in refused(capsys, cli.train_args, "--resume", "--output", str(tmp_path / "none"))
    assert "--resume needs --output" in refused(capsys, cli.train_args, "--resume")


def test_dry_run_flag():
    assert cli.train_args("test", ["--dry-run"]).dry_run is True
    assert cli.train_args("test", []).dry_run is False


def test_help_groups_flags_by_section_with_descriptions_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        cli.train_args("Train something.", ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for title in ("run", "data", "model", "optimisation", "output"):
        assert f"{title} options" in out
    assert out.index("run options") < out.index("--num-workers") < out.index("data options")
    assert out.index("optimisation options") < out.index("--per-replica-batch") < out.index("output options")
    assert "Batch size on each replica" in out and "(default: 32)" in out
    assert "--feature-columns STR [STR ...]" in out and "--shuffle, --no-shuffle" in out
    for flag in ["--num-workers", "--use-gpu", "--cpus-per-worker", "--per-replica-batch", "--epochs", "--base-lr",
                 "--lr-scaling", "--warmup-epochs", "--model", "--dataset", "--seed", "--output", "--overwrite",
                 "--config", "--dry-run"]:
        assert flag in out


def test_tune_args_own_flags_and_fixed_config_flags(capsys):
    args = cli.tune_args("test", ["--space", "s.yaml", "--num-workers", "4", "--epochs", "10", "--max-concurrent", "2",
                                  "--scheduler", "fifo", "--dataset", "d.parquet", "--feature-columns", "x", "--output",
                                  "runs/t"])
    assert (args.space, args.num_samples, args.scheduler, args.metric, args.mode, args.max_concurrent, args.output) \
        == ("s.yaml", 1, "fifo", None, None, 2, "runs/t")
    # only what was typed
    assert args.fixed == {"num_workers": 4, "epochs": 10, "dataset": "d.parquet", "feature_columns": ["x"]}
    assert "--space FILE" in refused(capsys, cli.tune_args, "--epochs", "3")
    for flag, reason in [("--overwrite", "never overwritten"), ("--resume", "same --output to resume"),
                         ("--backend", "every trial is a Ray Train run"), ("--config", "reads no config file"),
                         ("--strategy", "MultiWorkerMirroredStrategy"), ("--devices", "--backend local only")]:
        assert f"{flag} is not a sweep flag: " in refused(capsys, cli.tune_args, "--space", "s.yaml", flag, "x")
        assert reason in refused(capsys, cli.tune_args, "--space", "s.yaml", flag, "x")
    # Where every trial keeps its checkpoints is a sweep-wide choice.
    assert cli.tune_args("test", ["--space", "s.yaml", "--storage-path", "/shared/ckpt"]).fixed == {
        "storage_path": "/shared/ckpt"}
    assert "asha, fifo" in refused(capsys, cli.tune_args, "--space", "s.yaml", "--scheduler", "x")


def test_evaluate_args_model_is_the_keras_file(capsys):
    args = cli.evaluate_args("test", ["--model", "runs/x/model.keras", "--dataset", "data/val.parquet",
                                      "--val-fraction", "0.3", "--seed", "3", "--feature-columns", "f",
                                      "--per-replica-batch", "8"])
    assert (args.model, args.checkpoint, args.run) == ("runs/x/model.keras", None, None)
    assert args.overrides == {"dataset": "data/val.parquet", "val_fraction": 0.3, "seed": 3,
                              "feature_columns": ["f"], "per_replica_batch": 8}
    assert cli.evaluate_args("test", ["--run", "runs/x"]).overrides == {}
    assert "give one of --model, --checkpoint, --run" in refused(capsys, cli.evaluate_args)
    assert "exclude each other" in refused(capsys, cli.evaluate_args, "--model", "m.keras", "--run", "r")
    assert "unknown option --epochs" in refused(capsys, cli.evaluate_args, "--run", "r", "--epochs", "3")


def test_an_error_box_the_hook_does_not_word_still_becomes_one_line():
    box = ("╭─ Value error ──────────────╮\n│ Error parsing --n: invalid │\n│ literal for int(): 'q'     │\n"
           "│ ────────────────────────── │\n│ For full helptext, run p -h │\n╰────────────────────────────╯\n")
    assert cli_errors.collapse(box) == "Value error Error parsing --n: invalid literal for int(): 'q'"


def test_importing_cli_stays_light():
    code = "import sys, app.cli; print(sorted(m for m in ('tensorflow', 'ray', 'keras') if m in sys.modules))"
    p = run_job("-c", code, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


# --- subprocess: python jobs/train.py <flags> --dry-run ----------------------------------------------------------


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory, joined):
    """The dry runs below, two at a time, joining the session's Ray (as a job would): {name: (output, process)}."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("dry-runs")
    (root / "my.yaml").write_text("epochs: 0\nlr_scaling: sqrt\n")
    # Columns to name (the built-in data has none): a list column of 64 values, three scalars, 10 classes; read in
    # the process (--backend local), as they would be on Ray.
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"features": pa.array(list(rng.normal(size=(200, 64)).astype("float32")),
                                                  type=pa.list_(pa.float32())),
                             **{f"f{i}": rng.normal(size=200) for i in range(3)}, "label": np.arange(200) % 10}),
                   root / "rows.parquet")
    files = ["--dataset", str(root / "rows.parquet"), "--backend", "local"]
    (root / "compiled.py").write_text(
        "import keras\n\n\ndef build():\n    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])\n"
        "    model.compile('sgd', keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n    return model\n")
    runs = {
        "one value": [*files, "--feature-columns", "features", "--synthetic-shape", "8", "8", "3", "--image-size", "32", "32",
                      "--no-shuffle", "--no-use-gpu", "--model-args", json.dumps({"hidden_units": [8]})],
        "several values": [*files, "--feature-columns", "f0", "f1", "f2", "--hidden-units", "16", "8", "--shuffle",
                           "--overwrite", "--per-replica-batch", "16"],
        "flag over file": ["--config", str(root / "my.yaml"), "--epochs", "2"],
        "file alone": ["--config", str(root / "my.yaml")],
        # A compiled model of the user's with --optimizer: its compile() with the product's optimizer, by Keras's fit
        "optimizer over compile": [*files, "--feature-columns", "features", "--model", f"{root / 'compiled.py'}:build",
                                   "--optimizer", "adam"],
    }
    commands = [["jobs/train.py", *flags, "--output", str(root / name), "--dry-run"] for name, flags in runs.items()]
    done = run_jobs_at_once(*commands, timeout=300, env=joined, at_once=2)
    return {name: (root / name, p) for name, p in zip(runs, done)}


def test_subprocess_dry_run_one_value_list_int_lists_bools_off_model_args(dry_runs):
    out, p = dry_runs["one value"]
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "model: mlp, 610 parameters" in p.stdout, p.stdout  # --model-args' hidden_units [8]: 64x8+8 + 8x10+10
    assert not out.exists()


def test_subprocess_dry_run_several_values_and_bools_on(dry_runs):
    out, p = dry_runs["several values"]
    assert p.returncode == 0, p.stderr
    assert "model: mlp, 290 parameters" in p.stdout, p.stdout  # --hidden-units 16 8: 3x16+16 + 16x8+8 + 8x10+10
    assert "1 worker(s), global batch 16," in p.stdout  # --backend local on a CPU: one replica
    assert not out.exists()


def test_subprocess_dry_run_optimizer_over_a_compiled_models_own_locally(dry_runs):
    out, p = dry_runs["optimizer over compile"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert "compile: the model's own compile(), with its optimizer replaced by Adam at base_lr 0.05 (--optimizer)" \
        in p.stdout, p.stdout
    assert not out.exists()


def test_subprocess_config_file_below_flags(dry_runs):
    out, p = dry_runs["flag over file"]
    assert p.returncode == 0, p.stderr  # the flag replaced the file's invalid value
    assert ", 2 epochs" in p.stdout and "scaled sqrt by" in p.stdout, p.stdout  # the flag's epochs, the file's rule
    assert not out.exists()
    out, p = dry_runs["file alone"]
    assert_one_line_error(p, "epochs must be > 0")  # the file's value where no flag was typed
    assert not out.exists()


def test_subprocess_bad_literal_is_one_line(tmp_path):
    p = run_job("jobs/train.py", "--output", str(tmp_path / "out"), "--lr-scaling", "cubic", "--dry-run", timeout=120)
    assert_one_line_error(p, "--lr-scaling", "cubic", "linear", "sqrt", "none")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, words", [
    (["--epochs", "x"], ["--epochs", "INT"]),
    (["--model-args", "[1]"], ["--model-args must be a JSON object"]),
    (["--num-wrkers", "2"], ["unknown option --num-wrkers", "--num-workers"]),
])
def test_subprocess_bad_value_or_unknown_flag_is_one_line(tmp_path, argv, words):
    before = ray_sessions()
    p = run_job("jobs/train.py", "--output", str(tmp_path / "out"), *argv, "--dry-run", timeout=120)
    assert_one_line_error(p, *words)
    assert ray_sessions() == before  # refused while parsing: no Ray was started


def test_subprocess_help_lists_the_sections():
    p = run_job("jobs/train.py", "--help", timeout=120)
    assert p.returncode == 0, p.stderr
    for title in ("run", "data", "model", "optimisation", "output"):
        assert f"{title} options" in p.stdout
    assert "--feature-columns" in p.stdout and "--dry-run" in p.stdout
