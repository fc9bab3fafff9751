"""No exception names on the console, and every suggested fix works: property-based (hypothesis, bounded).

Combinations of flags, ranges and values are drawn for train, tune, evaluate and predict, each value either one
the docs accept or one they call invalid, and run as a user runs them: train and tune as dry runs, evaluate and
predict to their end (on the built-in digits, in this process: both are quick). Every outcome must be one of:
exit 0 with no invalid value drawn, or exit 2 with one ``error: <the problem and the fix>`` line. Never a line
``error: <ExceptionName>: ...`` (the last-resort handler, kept for real bugs), never a traceback, never exit 0
when an invalid value was given. Each refusal that suggests a flag or a value is run again with the suggestion
applied, and must not be refused for the same reason. Most runs are in this process (the jobs' own scripts, run
with their argv: a dry run is well under a second once TensorFlow is imported); a few are real subprocesses.

Bounded: a fixed number of examples per job, derandomized (the same examples every run), no deadline per example.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO, clean_env, run_here, run_job, run_jobs_at_once

# A flag's values: (value tokens, valid?). Valid means valid on its own beside the defaults (the built-in digits, 2
# Ray workers, per-replica batch 32); cross-field refusals of valid values are allowed, crashes never.
TRAIN_FLAGS = {
    "--epochs": [(["2"], True), (["0"], False), (["-1"], False), (["1.5"], False), (["two"], False)],
    "--num-workers": [(["1"], True), (["1:2"], True), (["0"], False), (["1:0"], False), (["3:1"], False),
                      (["0:2"], False), (["2:"], False), (["x"], False)],
    # A batch above the rows is one short batch per epoch on in-memory data, as model.fit takes it.
    "--per-replica-batch": [(["16"], True), (["5000"], True), (["0"], False), (["-8"], False)],
    "--global-batch": [(["64"], True), (["4096"], True), (["3"], False), (["0"], False)],
    "--val-fraction": [(["0.25"], True), (["0"], False), (["1"], False), (["nan"], False), (["1.5"], False)],
    "--base-lr": [(["0.01"], True), (["0"], False), (["-1"], False), (["inf"], False), (["nan"], False)],
    "--lr-scaling": [(["sqrt"], True), (["cubic"], False)],
    "--resize-check-s": [(["inf"], False), (["-1"], False), (["nan"], False)],
    "--stall-timeout-s": [(["60"], True), (["inf"], False), (["0"], False)],
    "--cpus-per-worker": [(["0.5"], True), (["0"], False), (["inf"], False)],
    "--max-failures": [(["1"], True), (["-1"], False)],
    "--model": [(["cnn"], True), (["nope"], False), (["missing.py:build"], False)],
    # (./data, a directory of parquet files, streams through Ray Data on the Ray backend: the tune dry run takes it)
    "--dataset": [(["synthetic"], True), (["nope"], False), (["missing.parquet"], False)],
    "--feature-columns": [(["nope"], False)],
    "--inputs": [(["a", "b=label"], False), (["p=b", "q=b"], False)],
    "--label-column": [(["y"], False)],
    "--export": [(["keras,savedmodel"], True), (["savedmodel"], False), (["onnx"], False)],
    "--model-args": [(['{"hidden_units": [8]}'], True), (["[1]"], False), (["{bad"], False)],
    "--checkpoint-every-steps": [(["0"], False)],
    "--grad-accum": [(["2"], True), (["0"], False)],
    "--warmup-epochs": [(["0"], True), (["-1"], False)],
    "--strategy": [(["mirrored"], False), (["bogus"], False)],
    "--class-weight": [(["balanced"], True), (["heavy"], False)],
}
TUNE_FLAGS = {k: v for k, v in TRAIN_FLAGS.items() if k not in ("--strategy",)} | {
    "--num-samples": [(["2"], True), (["0"], False), (["-1"], False)],
    "--max-concurrent": [(["1"], True), (["0"], False)],
    "--scheduler": [(["fifo"], True), (["median"], False)],
    "--overwrite": [([], False)],
    "--backend": [(["local"], False)],
    "--dataset": [*TRAIN_FLAGS["--dataset"], (["data"], True)],
}
# Search spaces: (YAML, valid?).
SPACES = [
    ("lr_scaling: {grid: [linear, sqrt]}\n", True),
    ("epochs: 2\nbase_lr: {loguniform: [0.001, 0.1]}\n", True),
    ("num_workers: {grid: ['1:0', 2]}\n", False),
    ("num_workers: 1:2\nglobal_batch: {grid: [64, 3]}\n", False),
    ("per_replica_batch: {uniform: [8, 64]}\n", False),
    ("base_lr: {uniform: [0.1]}\n", False),
    ("momentun: {grid: [0.0, 0.9]}\n", False),
    ("epochs: {grid: [1, 0]}\n", False),
    ("output: {grid: [a, b]}\n", False),
    ("resize_check_s: {choice: [5, inf]}\nnum_workers: 1:2\n", False),
    ("- not a mapping\n", False),
]
# evaluate and predict: the data flags they take, beside what to use (a run, its model file, its checkpoint).
DATA_FLAGS = {
    "--val-fraction": TRAIN_FLAGS["--val-fraction"],
    "--per-replica-batch": [(["64"], True), (["0"], False)],
    "--seed": [(["3"], True), (["x"], False)],
    "--dataset": [(["digits"], True), (["nope"], False), (["missing.parquet"], False), (["data"], False)],
    "--feature-columns": TRAIN_FLAGS["--feature-columns"],
    "--epochs": [(["3"], False)],  # not an evaluate or predict flag
}
PREDICT_FLAGS = DATA_FLAGS | {
    "--batch-size": [(["128"], True), (["0"], False), (["-1"], False), (["x"], False)],
    "--num-workers": [(["1"], True), (["0"], False)],
    "--cpus-per-worker": [(["1"], True), (["0"], False), (["inf"], False), (["nan"], False)],
    "--keep-columns": [(["prediction"], False)],
}
EXAMPLES = 25  # per job; a refusal's suggestion, when there is one, is one more run

EXCEPTION_LINE = re.compile(r"^error: [A-Z]\w*: ", re.MULTILINE)


@st.composite
def flags(draw, table: dict, at_most: int = 3) -> tuple[list[str], bool]:
    """Some flags of ``table``, each with one of its values: (argv, whether every value drawn is valid)."""
    names = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=at_most, unique=True))
    argv, valid = [], True
    for name in names:
        tokens, ok = draw(st.sampled_from(table[name]))
        argv += [name, *tokens]
        valid &= ok
    return argv, valid


@pytest.fixture(scope="module")
def place(tmp_path_factory, local_digits_run):
    """A working directory with a directory of parquet files called ``data`` (a path, whatever it looks like), and a
    copy of a trained run (evaluate writes eval.json beside its model)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("property")
    (root / "data").mkdir()
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"a": rng.normal(size=64), "b": rng.normal(size=64), "label": np.arange(64) % 2}),
                   root / "data" / "part-0.parquet")
    run = root / "run"
    shutil.copytree(local_digits_run, run)
    return root, run


def error_line(text: str) -> str | None:
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else None


def assert_told_well(argv: list[str], valid: bool, code: int, text: str) -> None:
    assert "Traceback (most recent call last)" not in text, (argv, text[-3000:])
    assert not EXCEPTION_LINE.search(text), (argv, error_line(text))
    if not valid:
        assert code != 0, (argv, "an invalid value was accepted", text[-2000:])
    if code != 0:
        assert code == 2 and error_line(text) is not None, (argv, code, text[-2000:])


# --- every suggested fix works -----------------------------------------------------------------------------------

_SUGGESTED = re.compile(r"\b(?:use|give|pass|or|e\.g\.|with) (--[a-z][a-z-]*)(?: ([\w./:{}\"\[\],-]+))?")
_NOT_A_VALUE = {"your", "and", "or", "to", "the", "a", "for", "with", "it", "them", "instead", "is"}


_SWITCHES = {"--overwrite", "--resume", "--dry-run", "--use-gpu", "--show-logs"}


def suggestion(line: str) -> tuple[str, list[str] | None] | None:
    """The first concrete fix a refusal suggests: a flag and its value (["64"]; [] for a switch; None to leave the
    flag out); None when it suggests nothing concrete."""
    for flag, value in _SUGGESTED.findall(line):
        value = value.rstrip(",.;")
        if value and value not in _NOT_A_VALUE:
            return flag, [value]
        if flag in _SWITCHES:
            return flag, []
    if swapped := re.search(r"give (\d+:\d+)", line):
        return "--num-workers", [swapped.group(1)]
    if "leave it out" in line or "leave them out" in line:
        flags = re.findall(r"(--[a-z][a-z-]*)", line.split("leave")[0])
        return (flags[0], None) if flags else None
    return None


def applied(argv: list[str], flag: str, value: list[str] | None) -> list[str]:
    """``argv`` with ``flag`` set to ``value`` (None: left out)."""
    kept, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token == flag
        if not skipping:
            kept.append(token)
    return kept if value is None else [*kept, flag, *value]


def reason(line: str) -> str:
    """A refusal's words without its values: two lines with the same reason compare equal."""
    return re.sub(r"'[^']*'|\d+(?:\.\d+)?(?::\d+)?", "_", line)


def check_suggestion(script: str, argv: list[str], text: str, cwd: Path) -> None:
    line = error_line(text)
    found = suggestion(line) if line else None
    if found is None:
        return
    again = applied(argv, *found)
    code, text_again = run_here(script, again, cwd)
    assert_told_well(again, True, code, text_again)
    new = error_line(text_again) if code else None
    assert new is None or reason(new) != reason(line), (argv, line, again, new)


# --- the jobs ------------------------------------------------------------------------------------------------------

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_train_dry_runs(place, data):
    root, _ = place
    argv, valid = data.draw(flags(TRAIN_FLAGS))
    argv = [*argv, "--dry-run", "--output", str(root / "out-train")]
    code, text = run_here("train.py", argv, root)
    assert_told_well(argv, valid, code, text)
    assert not (root / "out-train").exists()
    check_suggestion("train.py", argv, text, root)


@SETTINGS
@given(st.data())
def test_tune_dry_runs(place, data):
    root, _ = place
    number = data.draw(st.sampled_from(range(len(SPACES))))
    text_space, space_ok = SPACES[number]
    space = root / f"space-{number}.yaml"
    space.write_text(text_space)
    argv, valid = data.draw(flags(TUNE_FLAGS, at_most=2))
    argv = ["--space", str(space), *argv, "--dry-run", "--output", str(root / "out-tune")]
    code, text = run_here("tune.py", argv, root)
    assert_told_well(argv, valid and space_ok, code, text)
    assert not (root / "out-tune").exists()
    check_suggestion("tune.py", argv, text, root)


def what_to_use(run: Path):
    """What evaluate and predict are pointed at: (flags, valid?)."""
    return st.sampled_from([
        (["--run", str(run)], True),
        (["--model", str(run / "model.keras")], True),
        (["--checkpoint", str(run / "checkpoint")], True),
        (["--run", str(run / "nope")], False),
        (["--model", str(run / "config.yaml")], False),
        (["--checkpoint", str(run / "history.csv")], False),
        ([], False),
    ])


@SETTINGS
@given(st.data())
def test_evaluate(place, data):
    root, run = place
    use, use_ok = data.draw(what_to_use(run))
    argv, valid = data.draw(flags(DATA_FLAGS, at_most=2))
    argv = [*use, *argv]
    code, text = run_here("evaluate.py", argv, root)
    assert_told_well(argv, valid and use_ok, code, text)
    check_suggestion("evaluate.py", argv, text, root)


@SETTINGS
@given(st.data())
def test_predict(place, data):
    root, run = place
    use, use_ok = data.draw(what_to_use(run))
    out, out_ok = data.draw(st.sampled_from([(root / "preds", True), (root, False), (run, False), (root / "data", False)]))
    argv, valid = data.draw(flags(PREDICT_FLAGS, at_most=2))
    # In this process on the local backend: Ray's actor pool is for the subprocess cases below.
    argv = [*use, *argv, "--output", str(out), "--overwrite", "--backend", "local"]
    code, text = run_here("predict.py", argv, root)
    assert_told_well(argv, valid and use_ok and out_ok, code, text)
    check_suggestion("predict.py", argv, text, root)


# Refusals known to suggest a fix (flag, value, or leaving a flag out): each one's suggestion is found and works.
SUGGESTING = [
    ("train.py", ["--dry-run", "--global-batch", "3"]),
    ("train.py", ["--dry-run", "--num-workers", "3:1"]),
    ("train.py", ["--dry-run", "--resize-check-s", "5"]),
    ("train.py", ["--dry-run", "--feature-columns", "x"]),
    ("train.py", ["--dry-run", "--export", "savedmodel"]),
    ("train.py", ["--dry-run", "--backend", "local", "--num-workers", "1:2"]),
    ("train.py", ["--dry-run", "--strategy", "mirrored"]),
    ("train.py", ["--dry-run", "--output", "."]),
    ("train.py", ["--dry-run", "--output", "ours"]),
    ("tune.py", ["--space", f"{REPO}/tune_spaces/smoke.yaml", "--dry-run", "--output", "."]),
    ("predict.py", ["--run", "run", "--output", "run", "--overwrite", "--backend", "local"]),
]


@pytest.mark.parametrize("script, argv", SUGGESTING, ids=[" ".join(a[:4]) for _, a in SUGGESTING])
def test_each_suggested_fix_works(place, script, argv):
    root, _ = place
    (root / "ours").mkdir(exist_ok=True)  # an earlier run's directory, as this product leaves it
    (root / "ours" / ".ray-tf-train").write_text('{"kind": "train"}')
    (root / "ours" / "result.json").write_text("{}")
    code, text = run_here(script, argv, root)
    assert code == 2 and suggestion(error_line(text)) is not None, text[-2000:]
    check_suggestion(script, argv, text, root)


def test_some_as_real_subprocesses(place):
    """A few of the same kinds, each a process of its own as a user types it (no state shared with other runs)."""
    root, run = place
    cases = [
        (["jobs/train.py", "--dry-run", "--inputs", "a", "b=label", "--dataset", "data"], "is the label column"),
        (["jobs/train.py", "--dry-run", "--backend", "local", "--num-workers", "1:2", "--global-batch", "3"],
         "--num-workers 1:2 is for Ray workers"),
        (["jobs/tune.py", "--space", str(REPO / "tune_spaces" / "smoke.yaml"), "--num-samples", "0", "--dry-run"],
         "--num-samples must be at least 1"),
        (["jobs/predict.py", "--run", str(run), "--output", str(run), "--overwrite", "--backend", "local"],
         "contains the model"),
        (["jobs/train.py", "--dry-run", "--dataset", "data", "--inputs", "a", "b", "--label-column", "a"],
         "'a' is the label column"),
    ]
    done = run_jobs_at_once(*([str(REPO / a) if a.startswith("jobs/") else a for a in argv] for argv, _ in cases),
                            timeout=300, env=clean_env(), at_once=2, cwd=root)
    for (argv, words), p in zip(cases, done):
        assert_told_well(argv, False, p.returncode, p.stdout + p.stderr)
        assert words in p.stderr, (argv, p.stderr[-2000:])


def test_a_directory_that_exists_is_a_dataset_path_and_zero_rows_to_predict_say_so(place, tmp_path):
    """``--dataset data`` where ./data is a directory of parquet files is that directory (not an unknown name); and
    a prediction given no rows says so."""
    import numpy as np

    import app
    from app.errors import UserError

    root, run = place
    # A process of its own: the local backend sets TensorFlow's threads, which this process has initialised already.
    p = run_job(str(REPO / "jobs" / "train.py"), "--dry-run", "--backend", "local", "--dataset", "data", "--output",
                str(tmp_path / "o"), cwd=root, timeout=300)
    assert p.returncode == 0 and "training rows" in p.stdout + p.stderr, p.stderr[-2000:]
    with pytest.raises(UserError, match="has no rows to predict"):
        app.predict(str(run), data=np.zeros((0, 64), np.float32), output=str(tmp_path / "p"), backend="local")
    assert not (tmp_path / "p").exists()
