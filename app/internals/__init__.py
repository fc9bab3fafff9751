"""Every use of a library's private API in app/, behind one door.

Pinned in pyproject.toml: ray 2.60.0, keras 3.15.1, tyro 1.0.17. Each function below is the only place app/
touches a name the library does not publish, and says why no public API does the job. tests/test_internals.py
checks each one against the installed version (the names exist, and still mean what the callers rely on), so an
upgrade that moves them fails there, loudly, instead of in a run. tests/test_architecture.py refuses a private
import anywhere else in app/. A leaf: nothing from app/, and every library is imported inside the function that
needs it (importing this module costs nothing; the local backend never imports Ray).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

# --- Ray: the driver's printer of worker output (app.ui.console) --------------------------------------------
#
# Ray prints every worker's stdout/stderr lines on the driver through one dispatcher
# (ray/_private/ray_logging/__init__.py, ``global_worker_stdstream_dispatcher``), to which
# ray.init(log_to_driver=True) adds its printer under the name "ray_print_logs"
# (ray/_private/worker.py). Ray has no public hook for those lines: the console replaces
# that printer with its own sorter (which keeps Ray's printer and calls it).

RAY_PRINTER = "ray_print_logs"  # the name ray.init gives its printer of worker lines


def swap_worker_line_printer(replace: Callable[[Callable[[dict], None]], Callable[[dict], None]]) -> None:
    """Replace the driver Ray's printer of worker lines by ``replace(printer)``, atomically.

    A no-op without Ray in this process (the local backend), with a Ray that has
    no such dispatcher, or before ray.init (or with log_to_driver=False): then
    there is no printer to replace, and the console shows what Ray prints.
    """
    if "ray" not in sys.modules:  # not imported here: the local backend stays without Ray
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    # Under the dispatcher's own lock, in one step: a batch emitted between a remove
    # and an add would reach no printer.
    with dispatcher._lock:
        dispatcher.handlers = [(name, replace(h) if name == RAY_PRINTER else h) for name, h in dispatcher.handlers]


# --- Ray: the driver's printer of the cluster's messages for this job (app.ui.console) ------------------------
#
# The raylet's warnings and errors for this job are printed on the driver by a thread of Ray's
# (``listen_error_messages`` in ray/_private/worker.py) through that module's ``print_to_stdstream``,
# looked up at each call; not through the dispatcher above. Ray has no public hook for them either.


def swap_ray_message_printer(replace: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """Replace the printer of the cluster's messages to this driver by ``replace(printer)``; a no-op without Ray."""
    if "ray" not in sys.modules:
        return
    try:
        from ray._private import worker
    except ImportError:
        return
    if callable(getattr(worker, "print_to_stdstream", None)):
        worker.print_to_stdstream = replace(worker.print_to_stdstream)


# --- Ray Tune: its console reporter (app.tools.tune) ----------------------------------------------------------
#
# Tune's reporter of Ray 2.60 (ray/tune/experimental/output.py) prints its box and a paragraph per errored trial
# even at RunConfig(verbose=0), whatever callbacks are given (ray/tune/utils/callback.py). Its older engine, chosen
# by this variable (get_air_verbosity, in the driver), prints nothing at verbose=0 (app.ui.tune_console speaks).

TUNE_NEW_OUTPUT_ENV_VAR = "RAY_AIR_NEW_OUTPUT"  # "0": Tune's older output engine


# --- Ray: `ray up`'s offline checks (app.cluster_config) ----------------------------------------------------
#
# `ray up` has no dry run. Before it touches a cloud it runs prepare_config and
# validate_config (ray/autoscaler/_private/commands.py, _bootstrap_config), both in
# ray.autoscaler._private.util; Ray publishes no other way to run them.


def ray_up_prepare_config(config: dict[str, Any]) -> dict[str, Any]:
    """`ray up`'s first offline step: the provider's defaults merged in, node types' min/max filled."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(config)


def ray_up_validate_config(config: dict[str, Any]) -> None:
    """`ray up`'s schema and consistency check (ray-schema.json, head_node_type, min_workers <= max_workers)."""
    from ray.autoscaler._private.util import validate_config

    validate_config(config)


# --- Ray Train V2: controller callbacks (app.backends.start_guard) -------------------------------------------------
#
# A worker group whose start fails half-way is shut down only by a callback on the Train
# controller. Ray Train's callback classes (ray/train/v2/_internal/execution/callback.py) are
# DeveloperAPI, reached only through the private package; extra ones are named in the
# environment variable ``RAY_TRAIN_CALLBACKS`` (ray/train/v2/_internal/constants.py), read by fit().

TRAIN_CALLBACKS_ENV_VAR = "RAY_TRAIN_CALLBACKS"


def train_callback_bases() -> tuple[type, type]:
    """Ray Train V2's ``(WorkerGroupCallback, ControllerCallback)``, the bases of a controller-side callback."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    return WorkerGroupCallback, ControllerCallback


def retry_worker_deaths_in_the_controller() -> None:
    """Have this process's Ray Train failure policy retry a control step that fails on a dead worker.

    Ray 2.60 retries a ``ControllerError`` only when its cause is a start failure (``RETRYABLE_CONTROLLER_ERRORS``
    in failure_handling/default.py): a worker that dies between its group's start and the train function (the
    launch's ``ray.get`` in ``WorkerGroup._start_impl``) ends the run whatever ``max_failures`` says. Retryable, it
    counts against ``controller_failure_limit``, which the product sets to the same budget. Called in the controller.
    """
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.execution.failure_handling import default

    if RayActorError not in default.RETRYABLE_CONTROLLER_ERRORS:
        default.RETRYABLE_CONTROLLER_ERRORS = (*default.RETRYABLE_CONTROLLER_ERRORS, RayActorError)


# --- Keras: a functional model's graph (app.training.pipeline) -----------------------------------------------
#
# Cutting a model into stages needs its call graph: which layer calls consume which
# tensors. Keras 3 publishes the layers (model.layers, model.operations) but not the
# nodes (one per call) that connect them, nor the class of a functional model.


def is_functional(model: Any) -> bool:
    """Whether ``model`` is a functional model (``keras.Model(inputs, outputs)``), with a graph of nodes.

    A Sequential is not one (convert it first); a subclassed model is not one.
    """
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def nodes_by_depth(model: Any) -> dict[int, list[Any]]:
    """A functional model's nodes (one per layer call) by depth: 0 holds the outputs' nodes, the deepest the inputs'.

    Each node has ``operation`` (the layer or op called), ``is_input``,
    ``input_tensors`` and ``outputs`` (its KerasTensors).
    """
    return model._nodes_by_depth


def times_called(layer: Any) -> int:
    """How many times ``layer`` was called on symbolic tensors (more than one: a shared layer)."""
    return len(layer._inbound_nodes)


def keras_history(tensor: Any) -> Any:
    """The record of which node produced a KerasTensor (Keras rewrites it when a model re-registers the tensor)."""
    return tensor._keras_history


def set_keras_history(tensor: Any, history: Any) -> None:
    tensor._keras_history = history


# --- Keras: what compile() was given, and how fit() resolves it (app.training.objective, measures) ----------
#
# What a compiled model was given, read by the product where Keras's fit is not what runs it (the own loop of a
# pipeline and of parameter servers, evaluate's checks, the defaults for a model that compiles nothing). Keras
# publishes ``model.optimizer`` and ``model.loss`` but not the metrics as the user gave them (``model.metrics``
# holds them only once fit() has built them), nor the functions by which fit() turns "accuracy" or "crossentropy"
# into the class that fits the labels.


def compile_arguments(model: Any) -> Optional[dict[str, Any]]:
    """What ``model.compile(...)`` was called with (optimizer, loss, metrics, weighted_metrics, loss_weights,
    ...), the objects themselves; None for a model that was never compiled."""
    if not getattr(model, "compiled", False) or not hasattr(model, "_compile_config"):
        return None
    return dict(model._compile_config.config)


def input_keys(model: Any) -> list[str]:
    """The keys a dict x must have for a functional model: its inputs' dict keys when it was built on a dict of
    inputs (``keras.Model({"x1": keras.Input(name="a")}, ...)`` takes x["x1"]), else its input tensors' names."""
    struct = getattr(model, "_inputs_struct", None)
    return list(struct) if isinstance(struct, dict) else [i.name for i in model.inputs or ()]


def loss_tracker(model: Any) -> Any:
    """The compiled model's mean of its batches' losses (its History's "loss"), which a step of the product's updates
    as Keras's own ``train_step`` does."""
    return model._loss_tracker


def learning_rate_schedule(optimizer: Any) -> Any:
    """The optimizer's learning rate as it was given: its schedule object, or its variable for a constant rate
    (``learning_rate`` is the rate at the current step; an unsplit twin of a split run's optimizer needs the object)."""
    return optimizer._learning_rate


def wrap_learning_rate(optimizer: Any, wrap: Callable[[Any], Any]) -> None:
    """The optimizer's rate (its float, or its own schedule) replaced by the schedule ``wrap(rate)`` returns, its rate
    variable left in place: Keras's ``learning_rate`` setter untracks that variable, a removal from the list
    ``tf.train.Checkpoint`` reads (it then refuses to write: "A list element was replaced"), and the checkpoint of
    the trained model would no longer match a model built without the schedule."""
    own = optimizer._learning_rate  # a keras Variable, a LearningRateSchedule or a callable
    optimizer._learning_rate = wrap(float(own.numpy()) if hasattr(own, "numpy") else own)


def resolve_metric(identifier: Any, y_true: Any, y_pred: Any) -> Any:
    """A compile() metric (a name, a function, a Metric) -> the Metric object fit() would use for these shapes."""
    from keras.src.trainers.compile_utils import get_metric

    return get_metric(identifier, y_true, y_pred)


def resolve_loss(identifier: Any, y_true: Any, y_pred: Any) -> Any:
    """A compile() loss (a name, a function, a Loss) -> the Loss object fit() would use for these shapes."""
    from keras.src.trainers.compile_utils import get_loss

    return get_loss(identifier, y_true, y_pred)


def auto_name_of(obj: Any) -> str:
    """The name Keras gives an object of this class that was not named (``AUC()`` -> "auc"); each further
    one in the process gets a suffix (auc_1, auc_2), so a name alone does not say whether it was chosen."""
    from keras.src.utils.naming import to_snake_case

    return to_snake_case(type(obj).__name__)


# --- Keras: which entries of a training checkpoint are the model's trainable weights (app.training.checkpoint) ---
#
# ``tf.train.Checkpoint(model=..., optimizer=...)`` stores each variable once, under its shortest path: a built
# Keras 3 optimizer's list ``_trainable_variables`` (base_optimizer.py; a LossScaleOptimizer's too), so the model's
# trainable weights are ``optimizer/_trainable_variables/<i>``, in ``model.trainable_variables``' order. Keras
# publishes no map from checkpoint keys to weights (the model's own paths are deeper and private).

TRAINABLE_KEY = r"^optimizer/_trainable_variables/(\d+)/\.ATTRIBUTES/VARIABLE_VALUE$"


def checkpoint_trainable_shapes(entries: list[tuple[str, list[int]]]) -> list[tuple[int, ...]]:
    """The shapes of a checkpoint's trainable weights, in the model's order, from ``tf.train.list_variables``."""
    import re

    found = {int(m.group(1)): tuple(shape) for key, shape in entries if (m := re.match(TRAINABLE_KEY, key))}
    return [found[i] for i in sorted(found)]


# --- tyro: parse errors as events (app.cli) ------------------------------------------------------------------
#
# tyro reports a parse error as a multi-line box; ``tyro._errors.on_parse_error`` (marked
# experimental in tyro 1.0.17, not exported) hands the error over as an event instead.


def tyro_error_events() -> Optional[Any]:
    """tyro's module of parse-error events (``on_parse_error``, ``InvalidChoice``, ...), or None without it."""
    try:
        from tyro import _errors
    except ImportError:
        return None
    return _errors


# --- Keras: a layer computing through another; an optimizer's step counter (app.training.tensor_parallel) --------
#
# Keras has no public way to add a sublayer to a built layer (its tracker locks after build) nor to swap a
# layer's computation (``__call__`` calls ``self.call``); ``iterations`` is a divided tensor, not the variable,
# when the optimizer accumulates gradients.


def sublayers(model: Any) -> list[Any]:
    """Every layer inside ``model``, nested ones too (``model.layers``: a subclassed model's top level only)."""
    return model._flatten_layers(include_self=False)


def compute_through(layer: Any, other: Any) -> None:
    """Built ``layer`` calls ``other.call`` (with the arguments it takes) and holds ``other``'s variables."""
    import inspect

    layer._layers.append(other)
    takes = inspect.signature(other.call).parameters
    object.__setattr__(layer, "call", lambda *args, **kwargs: other.call(
        *args, **{k: v for k, v in kwargs.items() if k in takes}))


def step_counter(optimizer: Any) -> Any:
    """The variable that counts an optimizer's ``apply`` calls."""
    return optimizer._iterations


# --- Keras: an optimizer's clipping and weight-decay exclusions (app.training.zero) --------------------------------
#
# ``BaseOptimizer._backend_apply_gradients`` clips the (accumulated) gradients with ``self._clip_gradients`` just
# before the update (keras/src/optimizers/base_optimizer.py); ``exclude_from_weight_decay`` keeps its variables and
# name pattern in ``_exclude_from_weight_decay`` / ``_exclude_from_weight_decay_pattern``. An optimizer that updates
# flat parts of many variables clips by the variables' norms across the parts, and cannot exclude by variable.


def replace_clip_gradients(optimizer: Any, clip: Callable[[list], list]) -> None:
    """Make ``optimizer`` clip its gradients with ``clip(grads)`` (its own clipping is ``clip``'s to call)."""
    optimizer._clip_gradients = clip


def own_clip_gradients(optimizer: Any) -> Callable[[list], list]:
    return type(optimizer)._clip_gradients.__get__(optimizer)


def weight_decay_exclusions(optimizer: Any) -> bool:
    """Whether ``exclude_from_weight_decay`` was given any variable or name."""
    return bool(getattr(optimizer, "_exclude_from_weight_decay", None)
                or getattr(optimizer, "_exclude_from_weight_decay_pattern", None))


# --- Keras: fit()'s own reading of its inputs (app.data.keras_inputs) ---------------------------------------------
#
# ``model.fit`` reads x, y, sample_weight and class_weight through a data adapter chosen by input kind
# (keras/src/trainers/data_adapters/__init__.py: arrays, tf.data, PyDataset, generators, ...), and takes
# ``validation_split`` off the end of arrays with ``array_slicing.train_validation_split``. Keras publishes
# neither; running them reads every input exactly as fit() would, instead of one reader per kind here.


def keras_data_adapter(x: Any, y: Any, sample_weight: Any, batch_size: Optional[int], steps_per_epoch: Optional[int],
                       class_weight: Any) -> Any:
    """fit()'s adapter for these inputs, unshuffled (the caller orders the epochs itself)."""
    from keras.src.trainers.data_adapters import get_data_adapter

    return get_data_adapter(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                            steps_per_epoch=steps_per_epoch, shuffle=False, class_weight=class_weight)


def keras_validation_split(arrays: tuple, validation_split: float) -> tuple[tuple, tuple]:
    """fit()'s ``validation_split``: (train arrays, validation arrays), the last fraction of the rows validating."""
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split

    return train_validation_split(arrays, validation_split=validation_split)


# --- Keras: where fit() and evaluate() turn a step's logs into an epoch's (app.training.keras_sync) ---------------
#
# Both call ``self._get_metrics_result_or_logs(logs)`` once at the end of an epoch or an evaluation
# (keras/src/backend/tensorflow/trainer.py): the metrics' results when their names are the step's log keys,
# else the last step's logs. That is the one point where a worker's own numbers become the epoch's, so the
# cross-worker reduction replaces it on the model instance.


def replace_epoch_logs(model: Any, reduce: Callable[[Any], Any]) -> None:
    """Make ``model``'s epoch and evaluation logs ``reduce(logs)``."""
    model._get_metrics_result_or_logs = reduce


def flat_logs(logs: dict) -> dict:
    """A step's logs as fit() hands them to callbacks and History: nested dicts flattened (their leaves' keys), in
    key order, values as Python numbers (Keras's own ``pythonify_logs``, applied after the epoch's logs are made)."""
    from keras.src.utils.python_utils import pythonify_logs

    return pythonify_logs(logs)


def keep_keras_names(fresh: bool = False) -> Callable[[], None]:
    """Keras's name counters (``keras.backend.get_uid``: what makes a second AUC ``auc_1``) as they are now; call
    the returned function to put them back. A model the driver builds only to inspect it then leaves the names of
    the model the run builds in this process as ``model.fit`` would have them. ``fresh``: the counters are then
    emptied, as a new process has them (a Ray worker's)."""
    import collections

    from keras.src.backend.common import global_state

    saved = dict(global_state.get_global_attribute("object_name_uids") or {})
    if fresh:
        global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))

    def restore() -> None:
        global_state.set_global_attribute("object_name_uids", collections.defaultdict(int, saved))

    return restore
