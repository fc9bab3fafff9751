"""Bad input fails fast: one line on stderr, exit status 2, no traceback, before Ray starts."""

import json
import os

import pytest

from conftest import run_job


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--dataset", "nope"], "unknown dataset 'nope'"),
        (["--per-replica-batch", "0"], "per_replica_batch must be > 0"),
        (["--num-workers", "8"], "8 workers x 1 CPUs need 8 CPUs, but this machine has"),
        (["--use-gpu"], "--use-gpu needs GPUs"),
        (["--per-replica-batch", "5000"], "larger than the 1438 training rows"),
    ],
)
def test_bad_flags(tmp_path, args, message):
    p = run_job("jobs/train.py", "--output", str(tmp_path / "out"), *args, timeout=120)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Started a local Ray instance" not in p.stdout + p.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was created


def test_bad_yaml_files(tmp_path):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("epochs: 2\nnum_gpus: 1\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("epochs: 2\n  lr: : 3\n")
    for f, message in [(unknown, "unknown key 'num_gpus'"), (broken, "is not valid YAML at line")]:
        p = run_job("jobs/train.py", "--config", str(f), timeout=120)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_existing_output_is_never_touched_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("earlier results")
    p = run_job("jobs/train.py", "--output", str(out), timeout=120)
    assert p.returncode == 2 and "already exists" in p.stderr and "--overwrite" in p.stderr
    assert sorted(os.listdir(out)) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "earlier results"


def test_help_explains_every_flag():
    p = run_job("jobs/train.py", "--help", timeout=60)
    assert p.returncode == 0
    for flag in ["--num-workers", "--use-gpu", "--cpus-per-worker", "--per-replica-batch", "--epochs", "--base-lr",
                 "--lr-scaling", "--warmup-epochs", "--model", "--dataset", "--seed", "--output", "--overwrite",
                 "--config"]:
        assert flag in p.stdout


def test_the_cnn_takes_the_builtin_digits_as_they_come(tmp_path):
    """digits' rows carry their image shape (8, 8, 1): the cnn trains on them without --feature-shape (it
    reshapes inside the model), and a Dense model still gets the 64 features."""
    p = run_job("jobs/train.py", "--model", "cnn", "--backend", "local", "--epochs", "1", "--conv-filters", "8",
                "--export", "keras", "--output", str(tmp_path / "cnn"), timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    console = p.stdout + p.stderr
    assert "examples of shape (64,)" in console and "model: cnn" in console
    result = json.loads((tmp_path / "cnn" / "result.json").read_text())
    assert result["epochs_completed"] == 1 and result["task"] == "classification"
    # --export keras: model.keras and no SavedModel
    assert result["model_file"] == "model.keras" and result["saved_model"] is None
    assert (tmp_path / "cnn" / "model.keras").is_file() and not (tmp_path / "cnn" / "saved_model").exists()
