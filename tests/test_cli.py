"""Bad input fails fast: one line on stderr, exit status 2, no traceback, before any worker starts or anything is
written; no Ray process is left behind (the local Ray a run starts beside its checks stops with the process)."""

import os

import pytest

from conftest import no_new_raylet, raylets, run_job


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--dataset", "nope"], "unknown dataset 'nope'"),
        (["--per-replica-batch", "0"], "per_replica_batch must be > 0"),
        (["--num-workers", "8"], "8 workers x 1 CPUs need 8 CPUs, but this machine has"),
        (["--use-gpu"], "--use-gpu needs GPUs"),
        # Whole batches only (gradient accumulation): a batch above the rows leaves no step. (Without it, one short
        # step of every row trains, as model.fit does with a batch_size above the rows.)
        (["--per-replica-batch", "5000", "--grad-accum", "2"], "larger than the 1438 training rows"),
        (["--export", "savedmodel"], "--export savedmodel alone leaves no model.keras"),
        # --profile-steps: reversed, not numbers, past the run's steps (15 epochs of 23 here)
        (["--profile-steps", "9:4"], "A:B must have A <= B: for example 4:9"),
        (["--profile-steps", "ten:12"], "takes A:B, the first and last step to profile"),
        (["--profile-steps", "300:400"], "the run has 345 steps (15 epoch(s) of 23); give steps from 1 to 345, for "
         "example 300:345"),
    ],
)
def test_bad_flags(tmp_path, args, message):
    before = raylets()
    p = run_job("jobs/train.py", "--output", str(tmp_path / "out"), *args, timeout=120)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert no_new_raylet(before)
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
    # Not this product's directory: --overwrite would be refused too, so it is not suggested.
    assert p.returncode == 2 and "already exists: choose another --output" in p.stderr
    assert "--overwrite" not in p.stderr
    assert sorted(os.listdir(out)) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "earlier results"


def test_help_explains_every_flag():
    p = run_job("jobs/train.py", "--help", timeout=60)
    assert p.returncode == 0
    for flag in ["--num-workers", "--use-gpu", "--cpus-per-worker", "--per-replica-batch", "--epochs", "--base-lr",
                 "--lr-scaling", "--warmup-epochs", "--model", "--dataset", "--seed", "--output", "--overwrite",
                 "--config"]:
        assert flag in p.stdout
