"""The private APIs app/ relies on (app/internals/), checked against the pinned versions.

Each test fails when an upgrade moves or changes a private name the code uses, or
when a public stand-in stops matching what the library does itself. Tests may import
the private modules to compare; app/ may not (tests/test_architecture.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import time

import keras
import pytest
import ray
from ray.train._internal.base_worker_group import BaseWorkerGroup

from app import internals
from app.backends import tf_config
from app.cluster_config import load_cluster_config
from app.ui import console
from conftest import REPO, clean_env

# --- Ray Train: the TF_CONFIG backend ----------------------------------------------------------------------


class InProcessWorkers(BaseWorkerGroup):
    """A worker group of ``n`` workers that runs each function here, and records each worker's TF variables.

    A subclass of Ray's own abstract worker group: a method Ray adds to the backend contract
    makes it abstract, and this test fails at once.
    """

    def __init__(self, n: int):
        self.n, self.env = n, {}

    def execute(self, func, *args, **kwargs):
        return [func(*args, **kwargs) for _ in range(self.n)]

    def execute_async(self, func, *args, **kwargs):
        return self.execute(func, *args, **kwargs)

    def execute_single(self, worker_index, func, *args, **kwargs):
        keys = ("TF_CONFIG", "TF_USE_LEGACY_KERAS")
        saved = {k: os.environ.pop(k, None) for k in keys}
        try:
            out = func(*args, **kwargs)
            self.env[worker_index] = {k: os.environ[k] for k in keys if k in os.environ}
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        return out

    def execute_single_async(self, worker_index, func, *args, **kwargs):
        return self.execute_single(worker_index, func, *args, **kwargs)

    def __len__(self):
        return self.n

    def get_resources_per_worker(self):
        return {"CPU": 1}


def without_ports(tf_config_json: str) -> dict:
    config = json.loads(tf_config_json)
    hosts = []
    for address in config["cluster"]["worker"]:
        host, port = address.rsplit(":", 1)
        assert 0 < int(port) < 65536
        hosts.append(host)
    config["cluster"]["worker"] = hosts
    return config


def test_our_tf_config_backend_writes_what_rays_tensorflow_backend_writes(monkeypatch):
    """Same TF_CONFIG for the same workers (ports aside: each asks for a free one); no TF_USE_LEGACY_KERAS."""
    from ray.train.tensorflow.config import TensorflowConfig, _TensorflowBackend
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert issubclass(WorkerGroup, BaseWorkerGroup)  # what on_start is given in a real run
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the in-process group returns values, not refs
    theirs, ours = InProcessWorkers(3), InProcessWorkers(3)
    _TensorflowBackend().on_start(theirs, TensorflowConfig())
    tf_config.TFConfig().backend_cls().on_start(ours, tf_config.TFConfig())
    for i in range(3):
        assert without_ports(ours.env[i]["TF_CONFIG"]) == without_ports(theirs.env[i]["TF_CONFIG"])
        assert json.loads(ours.env[i]["TF_CONFIG"])["task"] == {"type": "worker", "index": i}
        # Ray's sets TF_USE_LEGACY_KERAS=1 (tf.keras -> tf_keras, not installed); ours must not.
        assert theirs.env[i]["TF_USE_LEGACY_KERAS"] == "1" and "TF_USE_LEGACY_KERAS" not in ours.env[i]


@pytest.mark.parametrize("ip", ["192.0.2.7", "2001:db8::7"])
def test_worker_address_is_rays_own_address_format(monkeypatch, ip):
    import socket

    from ray._common.network_utils import build_address

    if ":" in ip and not socket.has_ipv6:
        pytest.skip("no IPv6 sockets here")
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: ip)
    try:
        address = tf_config.worker_address()
    except OSError:
        pytest.skip("cannot bind a socket of that family here")
    port = int(address.rsplit(":", 1)[1])
    assert address == build_address(ip, port)


def test_rays_tensorflow_backend_still_takes_the_address_from_the_helpers_ours_copies():
    from ray.train._internal.utils import get_address_and_port
    from ray.train.tensorflow import config

    assert "get_address_and_port" in inspect.getsource(config._TensorflowBackend.on_start)
    assert "ray.util.get_node_ip_address()" in inspect.getsource(get_address_and_port)


# --- Ray: the driver's printer of worker lines (app.ui.console) ---------------------------------------------


def test_ray_init_registers_its_printer_of_worker_lines_under_the_name_the_console_replaces():
    from ray._private import worker

    assert f'"{internals.RAY_PRINTER}"' in inspect.getsource(worker.connect)


def test_the_console_takes_the_place_of_rays_printer_and_gives_it_back(capsys):
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed: list[dict] = []
    # Only the printer ray.init(log_to_driver=True) registers, recording what it is handed (the session's Ray,
    # if a test before this one started it, has its own: put back afterwards).
    saved, dispatcher.handlers = dispatcher.handlers, [(internals.RAY_PRINTER, printed.append)]
    try:
        with console.for_people(verbose=False):
            batch = {"lines": [console.MARK + "epoch   1/2", "a TensorFlow notice"], "pid": 7, "ip": "10.0.0.1",
                     "actor_name": "RayTrainWorker", "is_err": False}
            dispatcher.emit(batch)
            assert capsys.readouterr().out == "epoch   1/2\n"
            assert "(RayTrainWorker pid=7, ip=10.0.0.1) a TensorFlow notice" in console._WorkerLines.early
            assert printed == []  # not verbose: the chatter waits for the log file
        dispatcher.emit({"lines": ["after the run"], "pid": 7, "ip": "10.0.0.1"})
        assert [b["lines"] for b in printed] == [["after the run"]]  # Ray's printer is back
    finally:
        dispatcher.handlers = saved
        console._WorkerLines.early.clear()


def test_a_real_workers_marked_line_reaches_the_console(ray_cluster, capsys):
    @ray.remote(num_cpus=0)
    def say():
        print(console.MARK + "a line for people", flush=True)
        print("chatter", flush=True)

    with console.for_people(verbose=False):
        ray.get(say.remote())
        deadline, out = time.time() + 20, ""
        while "a line for people" not in out and time.time() < deadline:
            time.sleep(0.2)
            out += capsys.readouterr().out
    assert "a line for people\n" in out and "chatter" not in out and console.MARK not in out
    console._WorkerLines.early.clear()


def test_rays_printer_of_the_clusters_messages_is_still_looked_up_by_name_and_the_console_swaps_it():
    from ray._private import worker

    # The thread that prints the raylet's messages calls the module's print_to_stdstream by name at each message.
    assert "print_to_stdstream(" in inspect.getsource(worker.listen_error_messages)
    original = worker.print_to_stdstream
    try:
        console._WorkerLines.install()
        assert isinstance(worker.print_to_stdstream, console._RayMessages)
        assert worker.print_to_stdstream.ray_printer is original
        console._WorkerLines.uninstall()
        assert worker.print_to_stdstream is original
    finally:
        worker.print_to_stdstream = original


# --- Ray Tune: its console reporter (app.tools.tune) ----------------------------------------------------------


def test_tunes_older_output_engine_is_still_chosen_by_the_variable_and_silent_at_verbose_0(
        ray_cluster, monkeypatch, capsys, tmp_path):
    from ray import tune
    from ray.tune.experimental.output import get_air_verbosity

    assert "RAY_AIR_NEW_OUTPUT" in inspect.getsource(get_air_verbosity)
    monkeypatch.setenv(internals.TUNE_NEW_OUTPUT_ENV_VAR, "0")
    assert get_air_verbosity(0) is None  # None: the older engine

    def trainable(config):
        if config["x"] == 2:
            raise ValueError("a trial that fails")
        tune.report({"score": config["x"]})

    tuner = tune.Tuner(tune.with_resources(trainable, {"CPU": 0.5}), param_space={"x": tune.grid_search([1, 2])},
                       run_config=tune.RunConfig(storage_path=str(tmp_path), name="quiet", verbose=0))
    results = tuner.fit()
    assert len(results) == 2 and results.errors
    out = capsys.readouterr().out
    # Nothing from Tune's reporters: no experiment box, no status table, no paragraph for the failed trial.
    assert "Trial" not in out and "trial" not in out and "╭" not in out and "+--" not in out, out


# --- Ray: `ray up`'s offline checks (app.cluster_config) -----------------------------------------------------


def test_ray_up_still_prepares_then_validates_with_the_functions_we_call():
    from ray.autoscaler._private import commands

    source = inspect.getsource(commands._bootstrap_config)
    assert source.index("prepare_config(") < source.index("validate_config(")


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster_ssh.yaml"])
def test_prepare_and_validate_accept_the_shipped_cluster_configs(name):
    prepared = internals.ray_up_prepare_config(load_cluster_config(REPO / name))
    if prepared["provider"]["type"] == "aws":  # as app.cluster_config does: EC2 would fill these
        for node_type in prepared["available_node_types"].values():
            node_type.setdefault("resources", {})
    internals.ray_up_validate_config(prepared)
    for node_type in prepared["available_node_types"].values():  # what cluster_config reads after
        assert isinstance(node_type["min_workers"], int) and isinstance(node_type["max_workers"], int)


# --- Ray Train V2: controller callbacks (app.backends.start_guard) ------------------------------------------------


def test_train_callback_bases_still_have_the_hooks_start_guard_uses():
    from ray.train.v2._internal.callbacks.env_callback import _initialize_env_callbacks
    from ray.train.v2._internal.constants import RAY_TRAIN_CALLBACKS_ENV_VAR

    workers, controller = internals.train_callback_bases()
    for hook in ("before_worker_group_start", "on_worker_group_start", "after_worker_group_start",
                 "after_worker_group_training_start"):
        assert callable(getattr(workers, hook)), hook
    assert inspect.iscoroutinefunction(controller.before_controller_shutdown)
    assert callable(controller.after_controller_start)
    assert internals.TRAIN_CALLBACKS_ENV_VAR == RAY_TRAIN_CALLBACKS_ENV_VAR
    assert "RAY_TRAIN_CALLBACKS_ENV_VAR" in inspect.getsource(_initialize_env_callbacks)  # read by fit()


def test_a_control_step_lost_to_a_dead_worker_is_retried_within_the_budget_once_patched():
    """Ray's own policy ends the run on it (start_guard patches the controller's process)."""
    import ray.train
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2.api.exceptions import ControllerError

    def decisions():
        policy = DefaultFailurePolicy(ray.train.FailureConfig(max_failures=2, controller_failure_limit=2))
        return [policy.make_decision(ControllerError(RayActorError())) for _ in range(3)]

    assert decisions()[0] == FailureDecision.RAISE  # unpatched: a fault the product must cover
    internals.retry_worker_deaths_in_the_controller()
    internals.retry_worker_deaths_in_the_controller()  # idempotent
    assert decisions() == [FailureDecision.RETRY, FailureDecision.RETRY, FailureDecision.RAISE]


# --- Ray: the loggers app.driver.cluster quiets by name ---------------------------------------------------------


def test_the_ray_loggers_app_run_cluster_names_are_still_ray_modules():
    from ray._private import worker

    assert importlib.util.find_spec("ray._private.authentication.authentication_token_setup") is not None
    assert "SIGTERM handler is not set" in inspect.getsource(worker)


# --- Keras: a functional model's graph (app.training.pipeline) -----------------------------------------------


def residual_model():
    x = keras.Input((4,), name="x")
    shared = keras.layers.Dense(4, name="shared")
    h = keras.layers.Dense(4, name="first")(x)
    y = keras.layers.Add(name="add")([shared(h), shared(x)])
    return keras.Model(x, keras.layers.Dense(1, name="out")(y)), shared


def test_is_functional_tells_functional_from_sequential_and_subclassed():
    model, _ = residual_model()
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert internals.is_functional(model)
    assert not internals.is_functional(sequential) and not internals.is_functional(Subclassed())
    assert internals.is_functional(keras.Model(sequential.inputs, sequential.outputs))


def test_nodes_by_depth_holds_one_node_per_call_with_the_attributes_the_pipeline_reads():
    model, shared = residual_model()
    by_depth = internals.nodes_by_depth(model)
    deepest = by_depth[max(by_depth)]
    assert [n.is_input for n in deepest] == [True] and deepest[0].outputs == list(model.inputs)
    assert [n.operation.name for n in by_depth[0]] == ["out"] and by_depth[0][0].outputs == list(model.outputs)
    calls = [n.operation.name for d in sorted(by_depth, reverse=True) for n in by_depth[d] if not n.is_input]
    assert sorted(calls) == ["add", "first", "out", "shared", "shared"]
    add = next(n for nodes in by_depth.values() for n in nodes if n.operation.name == "add")
    assert len(add.input_tensors) == 2  # the two branches, as KerasTensors
    assert internals.times_called(shared) == 2 and internals.times_called(model.get_layer("first")) == 1


def test_keras_history_names_the_layer_that_made_a_tensor_and_can_be_put_back():
    model, _ = residual_model()
    history = internals.keras_history(model.outputs[0])
    assert history.operation is model.get_layer("out") and (history.node_index, history.tensor_index) == (0, 0)
    x = model.inputs[0]
    saved = internals.keras_history(x)
    internals.set_keras_history(x, history)
    assert internals.keras_history(x) is history
    internals.set_keras_history(x, saved)  # what Pipeline.place does after building its stages
    assert internals.keras_history(x).operation is model.get_layer("x")


# --- tyro: parse errors as events (app.cli) ------------------------------------------------------------------


@pytest.mark.parametrize("loss_scale", [False, True])
def test_a_checkpoints_trainable_weights_are_the_optimizers_list_in_the_models_order(tmp_path, loss_scale):
    """app.driver.resume compares these shapes with a model's: the keys must still be the optimizer's list, in order."""
    import tensorflow as tf

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer) if loss_scale else optimizer
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(str(tmp_path / "train_state"))
    shapes = internals.checkpoint_trainable_shapes(tf.train.list_variables(str(tmp_path / "train_state")))
    assert shapes == [tuple(v.shape) for v in model.trainable_variables] == [(5, 3), (3,), (3,), (3,), (3, 2), (2,)]


def test_tyros_error_events_have_the_fields_the_cli_reads():
    events = internals.tyro_error_events()
    assert events is not None and callable(events.on_parse_error)
    fields = {
        "InvalidChoice": {"argument", "value", "choices"},
        "InstantiationFailure": {"argument", "message"},
        "UnrecognizedArgs": {"tokens"},
        "BadValue": {"argument", "offending_value"},
        "MissingArgs": {"missing_arguments"},
        "MissingMutexGroup": {"groups"},
        "MutexConflict": {"first_token", "second_token"},
    }
    for name, needed in fields.items():
        assert needed <= {f.name for f in dataclasses.fields(getattr(events, name))}, name


def test_keras_compile_internals_still_give_what_objective_and_measures_take():
    """compile()'s own objects, and fit()'s resolution of "accuracy" by the labels' shape."""
    import keras
    import numpy as np

    from app import internals

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="softmax")])
    assert internals.compile_arguments(model) is None
    auc = keras.metrics.AUC()
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy", auc])
    args = internals.compile_arguments(model)
    assert args["loss"] == "categorical_crossentropy" and args["metrics"][1] is auc
    one_hot, ids, out = np.eye(4)[[0, 1]], np.array([0, 1]), np.full((2, 4), 0.25)
    assert type(internals.resolve_metric("accuracy", one_hot, out)).__name__ == "CategoricalAccuracy"
    assert type(internals.resolve_metric("accuracy", ids, out)).__name__ == "SparseCategoricalAccuracy"
    loss = internals.resolve_loss("categorical_crossentropy", one_hot, out)
    assert tuple(loss.call(one_hot, out).shape) == (2,)  # per example: call() does not reduce
    assert internals.auto_name_of(auc) == "auc" and internals.auto_name_of(keras.metrics.AUC()) == "auc"
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert internals.learning_rate_schedule(keras.optimizers.Adam(schedule)) is schedule
    constant = internals.learning_rate_schedule(keras.optimizers.SGD(0.25))
    assert float(constant.numpy()) == 0.25 and hasattr(constant, "assign")  # a variable


def test_the_keras_step_internals_read_inputs_and_reduce_logs_as_fit_does():
    """fit()'s data adapter and validation split; the method fit() and evaluate() turn a step's logs into the epoch's
    with (its name and what it returns); a collective all-reduce outside any strategy (one worker: the value)."""
    import keras
    import numpy as np

    from app import internals

    x, y = np.arange(10, dtype="float32").reshape(5, 2), np.arange(5)
    batches = list(internals.keras_data_adapter(x, y, None, 2, None, {0: 2.0}).get_numpy_iterator())
    assert [len(b[0]) for b in batches] == [2, 2, 1] and batches[0][2].tolist() == [2.0, 1.0]  # class weight -> w
    (train, val) = internals.keras_validation_split((x, y, None), 0.4)
    assert len(train[0]) == 3 and val[0].tolist() == x[3:].tolist()

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    # The metrics' results where the step's log keys are the metrics' names; else the step's own logs.
    assert float(model._get_metrics_result_or_logs({"loss": 1.0})["loss"]) == 0.0
    assert model._get_metrics_result_or_logs({"other": 1.0}) == {"other": 1.0}
    internals.replace_epoch_logs(model, lambda logs: {"replaced": True})
    model.fit(x, y.astype("float32"), epochs=1, verbose=0)  # fit() calls it once at the epoch's end
    assert model.history.history == {"replaced": [True]}



def test_the_collectives_run_without_a_timeout_and_an_abort_ends_every_one_after_it():
    """One worker's group: the sum and the gather are the tensor itself, and start no thread that outlives them (a
    timeout would: app.internals.collectives); a traced function's collective that waits is cancelled from another
    thread (app.training.stall_watch); abort_eager makes the next eager one fail in the words app.ui.failures reads
    as a stall. Two MirroredStrategy objects in one process (app.fit called twice) all-reduce other shapes under
    keys of their own (TensorFlow's alone: "Shape mismatch in the collective instance 100"). In a fresh process: an
    abort is for good."""
    import subprocess
    import sys

    script = '''
import threading
import tensorflow as tf
from app.internals import collectives
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
for n in (3, 5):
    strategy = collectives.mirrored_strategy(["/cpu:0", "/cpu:1"])
    summed = tf.function(lambda: strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
        "sum", tf.ones([n]))))()
    assert strategy.experimental_local_results(summed)[0].numpy().tolist() == [2.0] * n
x = tf.constant([1.0, 2.0])
assert collectives.all_reduce(x, 1, 7, 1).numpy().tolist() == [1.0, 2.0]
assert collectives.all_gather(x, 1, 7, 2).numpy().tolist() == [1.0, 2.0]
before = threading.active_count()
for i in range(50):
    collectives.all_reduce(x, 1, 7, 1)
import psutil
threads = psutil.Process().num_threads()
for i in range(200):
    collectives.all_reduce(x, 1, 7, 1)
assert psutil.Process().num_threads() < threads + 20, (threads, psutil.Process().num_threads())
scope, cancel = collectives.cancellable()
threading.Timer(1, cancel).start()
try:
    with scope:  # a step's all-reduce that no peer joins, inside a traced function
        tf.function(lambda t: collectives.all_reduce(t, 2, 8, 3))(x)
except tf.errors.CancelledError:
    print("cancelled")
collectives.abort_eager("a test's abort")
try:
    collectives.all_reduce(x, 2, 9, 4)
except tf.errors.UnavailableError as e:
    assert "Collective ops is aborted by: a test's abort" in str(e), str(e)
    print("aborted")
'''
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["cancelled", "aborted"], p.stderr[-3000:]


def test_a_split_layer_computes_inside_the_users_model_and_the_step_counter_is_assignable():
    """sublayers finds a subclassed model's nested layers; compute_through makes a built layer call another and
    list its variables (so the model's trainable variables are the other's once the layer's own are marked not
    trainable); step_counter is the variable iterations reads, also when it is divided for gradient accumulation."""
    import keras
    import numpy as np

    from app import internals

    class Outer(keras.Model):
        def __init__(self):
            super().__init__()
            self.block = keras.Sequential([keras.layers.Dense(3, name="inner")])

        def call(self, x):
            return self.block(x)

    model = Outer()
    model(np.ones((1, 2), "float32"))
    inner = next(layer for layer in internals.sublayers(model) if layer.name == "inner")
    other = keras.layers.Dense(3, kernel_initializer="ones", bias_initializer="zeros")
    other.build((None, 2))
    for v in inner.weights:
        v.trainable = False
    internals.compute_through(inner, other)
    assert model(np.ones((1, 2), "float32")).numpy().tolist() == [[2.0, 2.0, 2.0]]  # training= is Keras's to pass
    assert [id(v) for v in model.trainable_variables] == [id(v) for v in other.weights]

    optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
    optimizer.build(model.trainable_variables)
    internals.step_counter(optimizer).assign(4)
    assert int(optimizer.iterations) == 2


def test_the_replica_internals_turn_off_kerass_division_and_sum_and_build_as_fit_builds():
    """Under a strategy of 2 replicas: Keras divides a Loss object's loss by them, except inside unscaled_losses; the
    TensorFlow optimizer's sum of the replicas' gradients is the method gradients_summed_before_apply replaces;
    symbolic_build makes the optimizer's slots and leaves fit() nothing to build; before_epoch_logs runs first
    where fit() makes the epoch's logs; an optimizer, a LossScaleOptimizer too, applies in the cross-replica context.
    (tests/test_local.py trains by them against model.fit.)"""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    from app.internals import replicas

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])  # one device: the class is what Keras reads
    loss = keras.losses.MeanSquaredError()
    with strategy.scope():
        two = tf.distribute.get_strategy()
        assert two is strategy
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    assert hasattr(TFOptimizer, "_all_reduce_sum_gradients")
    replicas.gradients_summed_before_apply(model.optimizer)
    assert model.optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
    with replicas.unscaled_losses():
        assert float(loss(np.ones(2), np.zeros(2))) == 1.0
    x = np.ones((4, 2), "float32")
    replicas.symbolic_build(model, (x, x[:, :1]))
    assert model.optimizer.built and model.built
    seen = []
    replicas.before_epoch_logs(model, lambda: seen.append("first"))
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert seen == ["first"] and "loss" in model.history.history
    # Keras's optimizer updates through maybe_merge_call, which in the cross-replica context now calls its function;
    # a LossScaleOptimizer's apply there is its common apply (its own refuses that context).
    replicas.merge_call_in_cross_replica_context()
    assert not replicas.strategy_merges()  # no strategy: nothing to merge
    assert tf.__internal__.distribute.interim.maybe_merge_call(lambda s, v: (s, v), strategy, 3) == (strategy, 3)
    with strategy.scope():
        assert replicas.strategy_merges()  # Mirrored on a CPU
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
        variable = keras.Variable(np.ones(2, "float32"))
        replicas.cross_replica_apply(scaled)([tf.ones(2) * scaled.initial_scale], [variable])
        np.testing.assert_allclose(variable.numpy(), np.zeros(2))
        replicas.cross_replica_apply(scaled)([tf.constant([np.inf, 1.0])], [variable])  # skipped, scale halved
        np.testing.assert_allclose(variable.numpy(), np.zeros(2))
        assert float(scaled.dynamic_scale.numpy()) == scaled.initial_scale / 2
    # Central storage's one copy of a variable: its aggregation, and a Keras variable's assignment, replaceable
    # (tests/test_local.py's "central" case trains by them against model.fit).
    from tensorflow.python.distribute.ps_values import AggregatingVariable

    assert isinstance(AggregatingVariable.aggregation, property)
    assert "_aggregation" in AggregatingVariable.__init__.__code__.co_names
    assert callable(variable._direct_assign) and isinstance(variable._value, tf.Variable)


def test_a_batch_norm_layers_moments_are_replaceable_over_its_reduction_axes():
    """Keras's BatchNormalization computes a training call's moments by ``_moments`` over ``_reduction_axes`` (every
    axis but the features'), and its call uses what replace_moments gives (tests/test_keras_features.py trains a
    synchronized one on 2 workers against model.fit)."""
    import keras
    import numpy as np

    from app.internals import batch_norm

    layer = keras.layers.BatchNormalization(synchronized=True)
    x = np.random.default_rng(0).normal(size=(4, 3, 3, 2)).astype("float32")
    layer(x, training=True)
    assert batch_norm.reduction_axes(layer) == [0, 1, 2]
    seen = []

    def moments(own, inputs, mask):
        seen.append(mask)
        return own(inputs, mask)

    batch_norm.replace_moments(layer, moments)
    out = layer(x, training=True)
    assert seen == [None]
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
    np.testing.assert_allclose(out, (x - mean) / np.sqrt(var + layer.epsilon), atol=1e-5)


def test_one_call_of_rays_gcs_client_answers_for_the_cluster(ray_cluster):
    """app.internals.ray_auth's call: None from the session's Ray (this process holds its token) and from an address
    nothing answers at within the wait; a refused token is its error (tests/test_start_faults.py, in 5 s, not 25)."""
    import time

    from app.internals.ray_auth import cluster_refusal

    assert cluster_refusal(ray_cluster.get_runtime_context().gcs_address) is None
    started = time.monotonic()
    assert cluster_refusal("127.0.0.1:9", wait_s=0.5) is None
    assert time.monotonic() - started < 5


def test_our_trainer_starts_no_ray_data_actor_without_datasets_and_rays_own_callbacks_otherwise():
    """app.internals.ray_train: Ray Train's default callbacks, less the DatasetsCallback (whose DatasetManager actor
    starts with every run) where the run has no dataset; with one, exactly Ray's own list."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from app.internals.ray_train import data_parallel_trainer

    def callbacks(cls, **datasets):
        trainer = cls(lambda config: None, backend_config=tf_config.TFConfig(), datasets=datasets or None,
                      scaling_config=ray.train.ScalingConfig(num_workers=1))
        return [type(c) for c in trainer._create_default_callbacks()]

    rays = callbacks(DataParallelTrainer)
    assert DatasetsCallback in rays  # Ray still makes it on every run: what ours leaves out
    assert callbacks(data_parallel_trainer()) == [c for c in rays if c is not DatasetsCallback]
    assert callbacks(data_parallel_trainer(), train=lambda: None) == callbacks(DataParallelTrainer, train=lambda: None)
    assert DatasetsCallback in callbacks(data_parallel_trainer(), train=lambda: None)


def test_a_layers_own_weights_are_where_internals_layers_puts_another_in_their_place():
    """Keras keeps a Dense layer's weights in its own list and reads them as attributes, and TensorFlow names each as a
    dependency of the layer: a variable put in a weight's place is the one the layer lists and reads, and the old one
    is no longer held by the layer (ZeRO's stage 3 frees it: app.training.zero_weights)."""
    import gc
    import weakref

    import keras
    import numpy as np

    from app.internals import layers

    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    assert layers.own_trainable(dense) == [dense.kernel, dense.bias]
    assert not layers.keeps_state(dense) and not layers.draws_random(dense)
    old = weakref.ref(dense.kernel)
    new = keras.Variable(np.ones((4, 3), "float32"))
    layers.place_weight(dense, "_kernel", 0, new)
    gc.collect()
    assert old() is None and layers.weight_in_place(dense, 0) is new and dense.kernel is new
    np.testing.assert_allclose(dense(np.ones((1, 4), "float32")), [[4.0, 4.0, 4.0]])
    batch_norm = keras.layers.BatchNormalization()
    batch_norm.build((None, 4))
    assert layers.keeps_state(batch_norm)
    optimizer = keras.optimizers.SGD()
    optimizer.build([new])
    assert layers.optimizer_variables(optimizer) == [new]
