"""Shared fixtures: one local Ray for the whole session, and helpers to run the jobs."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# `ray start` heads in a process group of their own; the benchmark starts its heads the same way.
from app.bench.node import assert_process_group_gone, free_port, ray_cli, start_node, stop_node  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Ray Data 2.60's default parquet reader lists the files with a pool of 32 FooterReader actors per read (each
# pass of a streamed dataset is one), made for object stores over big clusters. The product's own reads use Ray
# Data's first reader, which lists them once (app.data.streamed._listed_once); a Dataset a test's user script makes
# itself (ray.data.read_parquet) takes the default, and on this 2-core machine, with the workers holding their CPUs,
# its actors start one after another: ~60 s for 4 local files. One actor reads the same footers (the same files,
# rows and seeded file shuffle): what a test checks does not change. Ray reads it where the dataset is created
# (read_parquet, in the driver), so it is set for this process and for every job a test starts (clean_env keeps it).
# Ray starts its worker processes at nice 15 (its `worker_niceness`, read by the raylet from the environment it
# starts in): the tests' Rays start theirs at the tests' own priority, above the local lane's (LOCAL_LANE_NICE).
# Every raylet logs "is over 95% full" every 10 s once its disk is (`local_fs_capacity_threshold`), and Ray sends
# that line to every driver joined to it: on a shared CI disk 96 % full (8 GB free of 252) it landed in the consoles
# the tests read for Ray's chatter. The tests write well under a GB: their Rays warn only at a full disk.
KEPT_RAY_ENV = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1", "RAY_worker_niceness": "0",
                "RAY_local_fs_capacity_threshold": "1.0"}
for _name, _value in KEPT_RAY_ENV.items():
    os.environ.setdefault(_name, _value)


# Two lanes, each a pytest-xdist worker (`-n 2` in pyproject.toml): the tests of these files never start, join or
# need a Ray (the local backend, the CLI's checks, the docs, pip's resolution) and run in one, beside the tests that
# use Ray in the other, in the order collected (so still one Ray at a time, own clusters last). A Ray run leaves
# about a third of this 2-core machine idle while its processes start (measured: 66 % busy over three default
# runs), which the local lane takes up.
LOCAL_LANE = {"test_architecture", "test_bad_input_property", "test_benchmarks_doc", "test_builtin_models", "test_cli_reference",
              "test_cluster_config", "test_config", "test_console", "test_export", "test_install",
              "test_keras_step_local", "test_local", "test_local_files", "test_one_line_errors", "test_output_guard",
              "test_pipeline", "test_platforms", "test_precision", "test_readme", "test_tensor_parallel"}


# ... and these tests of files that otherwise use Ray (each runs the local backend only, with no Ray fixture).
LOCAL_LANE_TESTS = {
    "test_zero::test_every_weight_is_in_exactly_one_workers_part_and_the_parts_are_equal",
    "test_benchmark::test_the_checkpoint_suite_times_kerass_fit_and_the_runs_own_checkpoint_write",
    "test_zero::test_what_cannot_be_sharded_is_one_line_before_anything_trains",
    "test_zero::test_one_worker_has_nothing_to_shard_and_trains_as_model_fit",
    "test_recovery::test_local_crash_and_resume_gives_the_uninterrupted_weights",
    "test_recovery::test_local_non_finite_loss_names_its_epoch",
    "test_recovery::test_a_crash_while_saving_leaves_the_previous_checkpoint",
    "test_resume::test_a_finished_local_run_trains_further_and_a_changed_model_is_refused",
    "test_run_files::test_a_local_runs_checkpoints_evaluate_and_its_config_runs_again",
    "test_predict::test_local_backend_predicts_the_same_without_importing_ray",
    "test_tfrecord::test_local_backend_trains_on_tfrecords_without_ray",
    "test_named_inputs::test_bad_inputs_mappings_are_one_line",
    "test_keras_stream::test_the_local_backend_reads_a_path_and_trains_as_keras_fit_weight_for_weight",
    "test_keras_stream::test_a_tfrecord_input_larger_than_4_gib_trains_with_the_process_under_2_gib",
    "test_keras_features::test_the_learning_rate_rule_is_kerass_cosine_decay_with_warmup_and_trains_as_model_fit_with_it",
    "test_keras_features::test_tensor_parallel_on_kerass_fit_is_model_fit_weight_for_weight_and_its_checkpoint_resumes_unsplit",
    "test_keras_stream::test_streamed_inputs_that_cannot_train_are_one_line_before_anything_starts",
    "test_your_own::test_bad_plugins_give_one_line_before_anything_starts",
    "test_your_own::test_users_softmax_convnet_from_a_file_matches_its_logits_twin",
    "test_predict::test_bad_input_is_one_line_before_the_pool_starts",
    "test_tf_data::test_a_pipeline_that_cannot_train_is_one_line_before_anything",
    "test_compiled::test_class_weights_scale_the_loss_as_keras_does",
    "test_compiled::test_sample_weights_of_one_are_no_weights",
    "test_compiled::test_a_compiled_model_that_does_not_fit_is_one_line_before_training",
    "test_keras_step::test_one_worker_is_keras_fit_weight_for_weight_or_refused_as_keras_refuses",
    "test_named_inputs::test_parquet_columns_train_a_two_input_model_by_name_then_evaluate_and_predict",
    "test_callbacks::test_bad_callbacks_are_one_line_before_training",
    "test_elastic::test_the_plan_splits_the_global_batch_of_an_update_at_every_size_with_accumulated_steps",
    "test_data::test_bad_numpy_data_is_refused_without_ray",
    "test_data::test_tokenizer_is_deterministic_and_pads",
    "test_data::test_validation_split_is_seeded_and_stable",
    "test_examples::test_the_readmes_python_is_in_the_examples_verbatim",
    "test_fit::test_at_a_terminal_verbose_1_draws_an_epoch_bar_and_verbose_2_only_the_epoch_lines",
    "test_fit::test_fit_refuses_a_built_model_it_needs_the_function",
    "test_fit::test_a_model_function_given_as_a_functools_partial_pickles_for_the_workers",
    "test_fit::test_a_model_file_function_that_takes_the_products_arguments_trains_by_the_products_step",
    "test_fit::test_fit_refuses_in_one_line_before_anything_starts",
    "test_fit::test_the_own_loops_epoch_record_is_written_and_read_back_under_keras_history_keys_for_any_metric",
    "test_fit::test_validation_split_is_the_last_rows_cut_as_keras_cuts",
    "test_parameter_server::test_parameter_server_requests_that_cannot_be_met_are_one_line",
    "test_parameter_server::test_the_plan_says_why_parameter_servers_train_on_the_products_own_loop",
    "test_parameter_server::test_sharded_embedding_is_one_table_with_sparse_gradients",
    "test_predict::test_a_corrupt_model_file_is_one_line_for_evaluate_and_predict",
    "test_predict::test_app_predict_from_every_in_memory_source",
    "test_predict::test_app_predict_takes_arrays_and_dataframes",
    "test_resume::test_the_schedule_goes_on_from_the_restored_epoch_boundary",
    "test_run_files::test_a_function_passed_from_python_is_recorded_with_what_to_do",
    "test_tfrecord::test_a_binary_parquet_column_of_png_bytes_is_read_as_images",
    "test_tune::test_a_key_both_fixed_and_searched_is_refused",
    "test_tune::test_a_trials_error_is_one_line_whatever_tune_hands_over",
    "test_tune::test_asha_judges_trials_only_after_the_warmup",
    "test_tune::test_bad_spaces_are_refused_by_name",
    "test_tune::test_shipped_spaces_parse",
    "test_tune::test_the_plan_says_where_asha_judges_trials",
    "test_tune::test_the_summary_sorts_trials_by_the_metric_failed_last_and_names_the_best",
    "test_tune::test_trial_lines_say_each_event_in_one_line",
}
# (A test that watches this machine for a new Ray session or raylet, "refused before Ray starts", stays in the Ray lane
# whatever it runs: beside that lane it would see the lane's Rays.)


def lane(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    stem = Path(path).stem
    return "local" if stem in LOCAL_LANE or f"{stem}::{name.split('[')[0]}" in LOCAL_LANE_TESTS else "ray"


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduler (each scope's tests to one worker, in order), the scope being the lane."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)


# The fixtures that give a test the session's Ray (or stop it): never in the local lane.
RAY_FIXTURES = {"ray_cluster", "joined", "two_worker_run", "no_shared_ray"}


def pytest_collection_modifyitems(config, items):
    # Tests that start a Ray cluster of their own run last, after the shared
    # one is shut down: only one Ray instance at a time on this machine.
    items.sort(key=lambda item: item.get_closest_marker("own_ray_cluster") is not None)
    misplaced = [item.nodeid for item in items if lane(item.nodeid) == "local" and (
        RAY_FIXTURES & set(item.fixturenames) or item.get_closest_marker("own_ray_cluster"))]
    if misplaced:
        raise pytest.UsageError(f"tests in the local lane that use a Ray (LOCAL_LANE, LOCAL_LANE_TESTS): {misplaced}")
    # A renamed test would leave its entry behind, and itself in the Ray lane: an entry names a test of its module.
    modules = {Path(item.nodeid.partition("::")[0]).stem: item.module for item in items if hasattr(item, "module")}
    stale = sorted(entry for entry in LOCAL_LANE_TESTS
                   if entry.partition("::")[0] in modules and not hasattr(modules[entry.partition("::")[0]],
                                                                          entry.partition("::")[2]))
    if stale:
        raise pytest.UsageError(f"LOCAL_LANE_TESTS names tests that do not exist: {stale}")


def pytest_configure(config):
    config.addinivalue_line("markers", "own_ray_cluster: the test starts (and stops) its own Ray cluster")


# The local lane only takes what the Ray lane leaves idle (a Ray run leaves about a third of the machine idle while
# its processes start): its process, and every job it starts, at a lower priority than the Ray lane's processes,
# Ray's workers included (KEPT_RAY_ENV). At one priority the two lanes' TensorFlow threads slice both cores, and a
# Ray run's synchronous workers wait on each other's slowest slice; with Ray's workers at their default nice 15
# below the local lane, a streamed-parquet test took 149 s beside it and 40 s alone.
LOCAL_LANE_NICE = 10


@pytest.fixture(autouse=True)
def _local_lane_yields(request):
    if lane(request.node.nodeid) == "local" and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) > 1 \
            and not getattr(_local_lane_yields, "done", False):
        os.nice(LOCAL_LANE_NICE)  # a pytest-xdist worker runs one lane (the scheduler's scope): all its tests
        _local_lane_yields.done = True
    yield


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray: 2 worker CPUs + 1 for Ray Data's tasks (see app.driver.cluster.connect)."""
    import ray

    from app.driver.cluster import init_local_ray

    # As app.driver.cluster does for a local Ray it starts (this is one): nothing preempts its node, so the runs
    # made in this process start no preemption watcher (one more process on their critical path). Jobs that
    # join this Ray from the command line keep theirs, as on any cluster they join.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    init_local_ray(num_cpus=3)  # as a run's local Ray starts (its state API answered by its own dashboard)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def two_worker_run(ray_cluster, tmp_path_factory):
    """One undisturbed default 2-worker run (6 epochs), shared by the tests that compare against it; it audits the
    sample ids each replica trains on (the ids only: the training is the same) and profiles steps 30-32 (TensorFlow's
    profiler: the weights are the same)."""
    from app.config import build_config
    from app.run.api import run_training

    out = tmp_path_factory.mktemp("runs") / "w2"
    result = run_training(
        build_config(None, {"output": str(out), "num_workers": 2, "epochs": 6, "log_every_steps": 10,
                            "audit_sample_ids": True, "profile_steps": "30:32"})
    )
    return out, result


@pytest.fixture(scope="session")
def joined(ray_cluster):
    """The environment of a job script that joins the session's Ray (one Ray on this machine at a time)."""
    return clean_env(RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address, RAY_AUTH_MODE="token")


def user_module(tmp_path_factory, name: str, text: str) -> Path:
    """A user's own Python file (model and data functions), written where the test's jobs can load it."""
    path = tmp_path_factory.mktemp(Path(name).stem) / name
    path.write_text(text)
    return path


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log directory, read back the way TensorBoard reads it."""
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


@pytest.fixture
def no_shared_ray():
    """Stop the session's Ray (if any) before a test that runs a cluster of its own."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def ray_sessions() -> set[str]:
    """Ray's session directories on this machine: a new one means a Ray was started."""
    return {p.name for p in Path("/tmp/ray").glob("session_2*")}


def raylets() -> set[int]:
    """This user's raylet processes (one per running Ray node)."""
    found = subprocess.run(["pgrep", "-u", str(os.getuid()), "raylet"], capture_output=True, text=True)
    return {int(pid) for pid in found.stdout.split()}


def no_new_raylet(before: set[int], within: float = 20) -> bool:
    """No raylet but those of ``before`` left within ``within`` seconds (a local Ray that a job started stops with
    the job: its raylet sees its parent gone and exits, in a second or so)."""
    import time

    deadline = time.monotonic() + within
    while raylets() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    return not raylets() - before


@contextlib.contextmanager
def frozen_by_the_test(driver: subprocess.Popen):
    """Yields the list of pids the test SIGSTOPs; at the end, however the test went, the driver is killed if it
    still runs and every stopped process is resumed (so that Ray can stop it)."""
    frozen: list[int] = []
    try:
        yield frozen
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def alive_actors(ray, class_name: str) -> list:
    """The session cluster's live actors of one class. Its address is given: without one, Ray's state API
    takes the cluster named in /tmp/ray/ray_current_cluster, which is the last `ray start` on this machine
    (a test's head, stopped since, or someone else's) and never this session's local Ray; seen in CI: a
    stale address there, and "Timed out while waiting for GCS" after 60 s."""
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address,
                       filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])


# A shell command in the README's or a guide's code blocks: an indented line that starts with a program.
_PROGRAM = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python3?|ray|tensorboard|pip|docker|curl|saved_model_cli)\s")


def doc_commands() -> list[tuple[str, str]]:
    """(document, command) for every command the README and the guides give, as a reader would type it: a line
    continued with ``\\`` joined to the next, a trailing ``# comment`` cut, and each program of a chain
    (``a && b``, ``ray job submit ... -- python jobs/train.py ...``) a command of its own."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            command = lines[i].strip()
            if lines[i].startswith("    ") and _PROGRAM.match(command):
                while command.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    command = command[:-1].rstrip() + " " + lines[i].strip()
                command = re.split(r"\s#\s", command)[0]
                found += [(doc.name, part.strip()) for part in re.split(r"\s&&\s|\s--\s", command)]
            i += 1
    return found


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") or k in KEPT_RAY_ENV}
    env.update(extra)
    return env


def venv_env() -> dict[str, str]:
    """clean_env with this interpreter's scripts first on PATH (saved_model_cli, tensorboard, ray), as in an activated
    venv: the tests may run as `.venv/bin/python -m pytest` without activating it."""
    return clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def run_job(*args: str, timeout: float = 600, env: dict[str, str] | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python *args`` from the repository (or ``cwd``), as a user runs it; ``.seconds`` is how long it took."""
    import time

    started = time.monotonic()
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                       timeout=timeout)
    p.seconds = time.monotonic() - started
    return p


def script_record(script: Path, tmp_path_factory, record: str, env: dict[str, str], timeout: float = 900) -> dict:
    """Run a user's script (tests/scripts/) with an output directory and read the JSON record it writes there."""
    import json

    out = tmp_path_factory.mktemp(script.stem)
    p = run_job(str(script), str(out), timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Starting execution of Dataset" not in p.stderr, "Ray Data's own lines reached a verbose=0 console"
    return json.loads((out / record).read_text())


def run_jobs_at_once(*commands: list[str], timeout: float = 600, env: dict[str, str] | None = None,
                     envs: list[dict[str, str]] | None = None, at_once: int | None = None, cwd: Path = REPO
                     ) -> list[subprocess.CompletedProcess]:
    """Independent job runs side by side (two local trainings a test compares): their start-ups overlap.

    ``envs`` gives each command its own environment (else all get ``env``). ``at_once`` caps how many run
    together (default: all): 2 for many short refusals, each mostly a TensorFlow import on one of 2 cores."""
    import concurrent.futures

    envs = envs or [env] * len(commands)
    with concurrent.futures.ThreadPoolExecutor(at_once or len(commands)) as pool:
        return list(pool.map(lambda args, e: run_job(*args, timeout=timeout, env=e, cwd=cwd), commands, envs))


def refusals_at_once(tmp_path_factory, name: str, argv, cases: int, timeout: float = 200,
                     env: dict[str, str] | None = None) -> list[tuple[Path, subprocess.CompletedProcess]]:
    """The runs of a parametrized refusal test's cases, made once (a module fixture) two at a time: each is mostly
    a TensorFlow import on one of 2 cores. ``argv(i, out)`` is case i's command; ``out`` is a directory of its own
    that a refusal must not create. Returns (out, process) per case."""
    root = tmp_path_factory.mktemp(name)
    outs = [root / f"case{i}" for i in range(cases)]
    return list(zip(outs, run_jobs_at_once(*(argv(i, out) for i, out in enumerate(outs)), timeout=timeout, env=env,
                                           at_once=2)))


# --- clusters a test starts itself (ray start, ray up) -----------------------

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_TOOLS_MISSING = (
    "" if os.path.exists(SSHD) and shutil.which("rsync") and shutil.which("ssh-keygen")
    else "needs sshd, ssh-keygen and rsync (Debian: apt-get install openssh-server rsync; .ci/run does)"
)




@pytest.fixture(scope="session")
def local_digits_run(tmp_path_factory):
    """A new user's first run: the built-in digits, one epoch, --backend local (as the README's first commands)."""
    out = tmp_path_factory.mktemp("local-digits") / "a"
    p = run_job("jobs/train.py", "--backend", "local", "--epochs", "1", "--output", str(out), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def parquet_run(tmp_path_factory):
    """A small run trained on parquet files (an id, a list column of 16 features, 4 classes that overlap), 2 epochs,
    --backend local, and held-out test files: shared by the export and prediction tests. (run dir, test dir)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("parquet-run")
    centers = np.random.default_rng(1).normal(size=(4, 16))
    for name, n, first_id in (("train", 800, 0), ("test", 300, 10_000)):
        rng = np.random.default_rng(first_id)
        y = rng.integers(0, 4, n)
        x = (rng.normal(size=(n, 16)) + 0.6 * centers[y]).astype(np.float32)
        (root / name).mkdir()
        for i, part in enumerate(np.array_split(np.arange(n), 2)):  # two files: two blocks for Ray Data
            pq.write_table(pa.table({"id": np.arange(first_id, first_id + n)[part], "label": y[part],
                                     "features": pa.array(list(x[part]), type=pa.list_(pa.float32()))}),
                           root / name / f"part-{i}.parquet")
    run = root / "run"
    p = run_job("jobs/train.py", "--backend", "local", "--dataset", str(root / "train"), "--feature-columns",
                "features", "--epochs", "2", "--hidden-units", "32", "--no-tensorboard", "--output", str(run),
                timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, root / "test"


@contextlib.contextmanager
def working_directory(path: Path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_here(script: str, argv: list[str], cwd: Path) -> tuple[int, str]:
    """A job script run in this process with ``argv``, as ``python jobs/<script> ...`` runs it: (exit status,
    everything it printed). A local-backend training runs in a process of its own: it sets TensorFlow's thread
    counts, which cannot change once this process has initialised TensorFlow."""
    local = "--backend" in argv and argv[argv.index("--backend") + 1:][:1] == ["local"]
    if script == "train.py" and local:
        p = run_job(str(REPO / "jobs" / script), *argv, cwd=cwd, timeout=120)
        return p.returncode, p.stdout + p.stderr
    out = io.StringIO()
    old_argv, code = sys.argv, 0
    # A job script makes its console rules last for its process (app.ui.console.for_this_process) and adds handlers
    # to the root logger: run in this process, they are put back afterwards, or every later test's console changes.
    from app.ui import console

    rules, root_handlers = dict(console._people), list(logging.getLogger().handlers)
    sys.argv = [str(REPO / "jobs" / script), *argv]
    if str(REPO / "jobs") not in sys.path:
        sys.path.insert(0, str(REPO / "jobs"))  # the scripts import _bootstrap from beside them
    try:
        with working_directory(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(REPO / "jobs" / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old_argv
        console._people.update(rules)
        logging.getLogger().handlers[:] = root_handlers
        if not rules["active"]:
            console._WorkerLines.uninstall()
    return code, out.getvalue()


# Each lane's test time (setup, call and teardown of its tests), summed in the controller: the longer lane is the
# run's wall time, and what to make cheaper when the run nears its budget (README, "what CI runs").
_LANE_SECONDS = {"ray": 0.0, "local": 0.0}


def pytest_runtest_logreport(report):
    _LANE_SECONDS[lane(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter):
    if any(_LANE_SECONDS.values()):
        terminalreporter.write_line("lanes: " + ", ".join(f"{name} {seconds:,.0f} s"
                                                          for name, seconds in _LANE_SECONDS.items()))


def close_weights(a: list, b: list, atol: float) -> None:
    """Two runs' weights (lists of arrays, as a test script's JSON holds them), each within ``atol``."""
    import numpy as np

    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)
