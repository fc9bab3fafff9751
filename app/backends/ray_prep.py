"""What every Ray run of the product's needs before its workers start: the preflight check of a run's data (a
parameter-server run's, app.backends.ps), and the config and the user's functions as shipped to the workers
(pickled by value where a worker could not import them: app.backends.keras_fit, app.backends.ps)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from app.backend import backend_of
from app.config import TrainConfig
from app.driver import cluster

log = logging.getLogger(__name__)


def for_workers(config: TrainConfig) -> TrainConfig:
    """The config as shipped to the workers: the model function itself, by value; no data function.

    Workers get the data from the object store or Ray Data, never from the data
    function, so it (and arrays it closes over) is not shipped. A user's model
    function is resolved here and pickled by value: a worker may not be able to
    import its module (a file loaded by path, a test module, a notebook).
    """
    from app import registry

    update: dict[str, Any] = {"dataset": config.model_dump()["dataset"]}
    # The model function, and the callbacks (a function rank 0 calls, or the callbacks' classes), likewise.
    for name, builtins in (("model", registry.MODELS), ("callbacks", {})):
        value = getattr(config, name)
        if isinstance(value, list):
            for c in value:
                by_value(type(c))
        elif value is not None and value not in builtins:
            update[name] = registry.resolve(value, builtins)
            by_value(update[name])
    return config.model_copy(update=update)


def by_value(obj) -> None:
    """Pickle the module that defines ``obj`` by value: a worker may not be able to import it (a file loaded by
    path, a test module, a notebook). What ``obj`` carries is followed: a partial's function and arguments (a
    built-in's carries the run's config, and with it a data function passed from Python), a wrapper's model
    function (app.training.default_compile.CompiledWithDefaults), a config's functions."""
    import functools

    from ray import cloudpickle

    if isinstance(obj, functools.partial):  # a partial's own module is functools: its function's is the one
        for carried in (obj.func, *obj.args, *obj.keywords.values()):
            by_value(carried)
        return
    if hasattr(type(obj), "model_fields"):  # a config: the functions it names
        for name in type(obj).model_fields:
            if callable(value := getattr(obj, name)):
                by_value(value)
        return
    if callable(getattr(obj, "model_fn", None)):
        by_value(obj.model_fn)
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__" or module.__name__.startswith(("app.", "keras")) \
            or module.__name__.split(".")[0] in sys.stdlib_module_names:  # importable everywhere
        return
    cloudpickle.register_pickle_by_value(module)


def check(config: TrainConfig, require_fit: bool = True, loc=None):
    """Preflight for a Ray run: streamed data needs Ray (its checks read the files), in-memory data does not.

    A data function is called in this process (app.driver.preflight.load_data), once. For a run, Ray is
    connected first (sized here), so that a ray.data.Dataset it builds uses that Ray and not one Ray
    Data starts itself; a --dry-run starts no Ray unless the function builds a Dataset. ``loc``: the
    listing of --dataset if the caller made it (app.data.files.located), made here else.
    """
    from app import registry
    from app.data import files
    from app.driver import preflight

    loc = loc or files.located(config)  # listed once for the whole run
    streamed_files = files.streams(loc, backend_of(config).on_ray)
    joining = cluster.joining_a_cluster()  # asked before a data function's Dataset may start a Ray

    if require_fit:
        cluster.check_fits_locally(config)
        # A run: the local Ray starts beside the checks (they import TensorFlow, build the model).
        cluster.start_local_early(config)
        if joining:  # a cluster that refuses us (its token) is said first, before the checks
            cluster.connect(config, reads_for="the workers'" if streamed_files else None)
    function = not isinstance(config.dataset, str) or registry.is_plugin(config.dataset)
    if streamed_files or (function and require_fit):
        cluster.connect_for_data(config, reads=False)
        if streamed_files:  # the parameter servers' actors keep the CPUs asked for: the cluster has room, or no run
            cluster.check_room_for_reads(config, "the workers'")
    checked = preflight.check(config, config.max_workers, loc=loc)  # (parameter servers: no --tensor-parallel)
    # A data function's ray.data.Dataset. The local Ray a run starts has the read CPU by construction
    # (cluster.connect); a cluster may not.
    if checked.source.streamed and not streamed_files and (require_fit or joining):
        cluster.check_room_for_reads(config)
    return checked
