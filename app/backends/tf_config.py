"""Ray Train's TensorFlow backend (TF_CONFIG for MultiWorkerMirroredStrategy), without importing TensorFlow.

Ray's ``TensorflowTrainer`` does two things beyond ``DataParallelTrainer``: it
gives each worker ``TF_CONFIG`` (every worker's address, and its own index)
before the training function runs, and it names the framework. But its backend
lives in ``ray.train.tensorflow``, whose package ``__init__`` imports TensorFlow,
and the Train controller unpickles that backend: so the controller process,
which never runs a TensorFlow op, imported TensorFlow (~4 s on 2 cores) on the
critical path to the first step, and so did the driver. This module is that
backend with only Ray imports (the same TF_CONFIG, built the same way as
ray/train/tensorflow/config.py in ray 2.60); the workers start importing TensorFlow
as soon as they have their TF_CONFIG, on a thread, ahead of the training function.

It leaves out ``TF_USE_LEGACY_KERAS=1``, which TensorflowTrainer sets: this
project uses Keras 3 (``import keras``), and tf_keras is not installed. It
also leaves the framework unnamed: Ray Train's run-state tracking would import
the named framework's modules to record their versions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

import ray
import ray.util
from ray.train.backend import Backend, BackendConfig

from app.internals import ray_train


def _set_tf_config(worker_addresses: list[str], index: int) -> None:
    SET_AT[:] = [time.time()]  # a start-up mark of the worker's (app.training.step_clock)
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": worker_addresses}, "task": {"type": "worker", "index": index}}
    )
    # The training function starts by importing TensorFlow and Keras: seconds of CPU, which here
    # overlap Ray Train's own set-up between this call and that function (its dataset and
    # checkpoint helpers). Importing only: thread counts and collectives are still unset.
    _IMPORTING[:] = [threading.Thread(target=_import_tensorflow, name="import-tensorflow", daemon=True)]
    _IMPORTING[0].start()


_IMPORTING: list[threading.Thread] = []  # the worker's import of TensorFlow, started by _set_tf_config
SET_AT: list[float] = []  # when this worker got its TF_CONFIG (wall clock)


def _import_tensorflow() -> None:
    try:
        importlib.import_module("tensorflow")
        importlib.import_module("keras")
    except Exception:
        pass


def worker_address() -> str:
    """This node's IP and a free port there, where MWMS's gRPC server will listen: "ip:port", "[ipv6]:port".

    What Ray's own TF backend computes (its private get_address_and_port and
    build_address), from public pieces; tests/test_internals.py compares the two.
    """
    host = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    port = _unclaimed_port(family)
    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


# MWMS's gRPC server binds its port seconds after it is chosen (the worker imports TensorFlow in between). A port the
# kernel hands out (bind to 0, as Ray's own backend does) is one it also hands to any process's next outgoing
# connection in that time, and a busy node makes many (Ray's own RPCs): "Could not start gRPC server" (seen in a
# full run of the test suite). Ports below the kernel's ephemeral range, and above Ray's worker ports (10002-19999
# by default), are only ever taken by a process that asks for that very port.
_OWN_PORTS_FROM = 20000


def _unclaimed_port(family: int) -> int:
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_from = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = 32768  # Linux's default
    ports = list(range(_OWN_PORTS_FROM, ephemeral_from))
    random.SystemRandom().shuffle(ports)
    for port in [*ports[:64], 0]:  # 0: the kernel's choice, where none below its range is free
        with contextlib.closing(socket.socket(family, socket.SOCK_STREAM)) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port to listen on")


class _TFConfigBackend(Backend):
    def on_start(self, worker_group, backend_config: "TFConfig") -> None:
        # Backend.on_start's contract: run functions on the workers (execute, execute_single_async).
        addresses = worker_group.execute(worker_address)
        ray.get([
            worker_group.execute_single_async(i, _set_tf_config, worker_addresses=addresses, index=i)
            for i in range(len(worker_group))
        ])


@dataclass
class TFConfig(BackendConfig):
    @property
    def backend_cls(self):
        return _TFConfigBackend


# Ray Train's controller polls the workers every 2 s by default: a run's end (and a failure) is seen up to 2 s late,
# on every run and Tune trial. The poll is a cheap remote call per worker, and a missed one is not a failure (only a
# worker whose polls hang for minutes is). The user's own setting wins.
HEALTH_CHECK_ENV, HEALTH_CHECK_INTERVAL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"


def trainer(train_loop_per_worker, train_loop_config=None, **kwargs):
    """A DataParallelTrainer with the TF_CONFIG backend: what TensorflowTrainer(**kwargs) is, minus the import.

    The training function's config reaches the workers through the object store, unopened on the way. Ray Train
    hands it to its controller inside the run's context, and the controller unpickles that context: a user's
    model function or callbacks (pickled by value) import Keras, hence TensorFlow, when unpickled, so the
    controller, which never runs a TensorFlow op, imported it (~4 s on 2 cores) before it asked for the workers.
    A run without datasets starts no Ray Data actor (app.internals.ray_train).
    """
    # Read by the driver when it starts the controller, which passes it on (Ray Train's ENV_VARS_TO_PROPAGATE).
    os.environ.setdefault(HEALTH_CHECK_ENV, HEALTH_CHECK_INTERVAL_S)
    # The driver's directory and node (see in_drivers_directory); the user's own setting wins.
    here = None if CHDIR_ENV in os.environ else (os.getcwd(), ray.get_runtime_context().get_node_id())
    return ray_train.data_parallel_trainer()(
        train_loop_per_worker=functools.partial(_opened, train_loop_per_worker, here),
        train_loop_config={SHIPPED: ray.put(train_loop_config)},
        backend_config=TFConfig(), **kwargs)


SHIPPED = "shipped"  # the one key of the config Ray Train sees: the object store's reference to the real one


# Ray Train moves each worker into a directory of its run (Ray's session's artifacts), where a relative path in the
# user's code (a callback's file, a file the model function reads) would not mean what it means in the driver; the
# workers stay where Ray starts them (a job's working_dir, the same files on every node), and those on the driver's
# node go to its directory (another node's directory of the same name is not the driver's). Read by the driver in
# trainer.fit(): set around it only (``in_drivers_directory``).
CHDIR_ENV = "RAY_CHDIR_TO_TRIAL_DIR"


@contextlib.contextmanager
def in_drivers_directory():
    """Around ``trainer.fit()``: the workers are not moved into Ray Train's run directory (unless the user set
    RAY_CHDIR_TO_TRIAL_DIR); Ray Tune's trials in this process are not touched after it."""
    if CHDIR_ENV in os.environ:
        yield
        return
    os.environ[CHDIR_ENV] = "0"
    try:
        yield
    finally:
        os.environ.pop(CHDIR_ENV, None)


def _opened(train_loop_per_worker, here: Optional[tuple[str, str]], shipped: dict):
    """In each worker: the training function called with its config, read from the object store; on the driver's
    node, in the driver's working directory (``here``: it and the node's id).

    Unpickling the config imports what a user's functions import (Keras, TensorFlow): after the import thread's
    own import has ended, as two threads importing TensorFlow at once can see a module half made ("module
    'tensorflow.python.data.ops.dataset_ops' has no attribute 'DatasetV2'", seen).
    """
    for thread in _IMPORTING:
        thread.join(timeout=300)  # an import does not hang; if it did, the unpickling's own import says why
    if here is not None and here[1] == ray.get_runtime_context().get_node_id() and os.path.isdir(here[0]):
        os.chdir(here[0])
    return train_loop_per_worker(ray.get(shipped[SHIPPED]))
