"""The per-worker function of a Keras model trained by its own step: each worker runs ``model.fit``.

A model that brings its step (a compiled model, or one that overrides
``train_step``) is trained by Keras's fit on every worker, on its part of every
global batch (app.data.keras_inputs), with app.training.keras_sync making the
workers one exact run: what Keras itself runs is the model's ``train_step`` /
``test_step``, its compiled losses and metrics, its callbacks and its History.
The product adds, as Keras callbacks on every worker:

- ``Decisions``: the user's callbacks run on rank 0 (only rank 0 writes
  files); what they decide (stop, a new learning rate) is taken by every
  worker at the same point, or the workers' steps would part;
- ``Checkpoints``: every epoch, the model and every optimizer it holds
  (``tf.train.Checkpoint``: no model config needed, any model Keras can train)
  and the epoch's record, written by rank 0 and reported by every worker;
- ``StepCheckpoints`` (checkpoint_every_steps): one every N steps inside an
  epoch too, with the epoch's metric states so far summed over the workers;
- ``StepScalars`` (TensorBoard, log_every_steps): the epoch's logs so far;
- ``StepClock`` (app.training.step_clock): where each epoch's time went on this worker, gathered into the
  checkpoint's state with its start-up marks; ``Profile``: --profile-steps.

A restarted or resumed worker restores the last checkpoint and goes on from
its epoch, as ``initial_epoch`` would; from a checkpoint inside an epoch, it
fits that epoch's steps left (its metric states restored), then the epochs
after it.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from app.data.keras_inputs import KerasData
from app.internals import replicas as replica_internals
from app.training import user_code, zero_state, zero_weights
from app.training.checkpoint import Progress
from app.training.collective import Collective
from app.training.keras_checkpoint import Writer, restore, weights_of
from app.training.keras_features import KerasFeatures
from app.training.zero import ShardedOptimizer
from app.training.zero_weights import is_shard

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# The product's checkpoint layout, one for both engines (jobs/evaluate.py tells them apart by the model file):
# TRAIN_STATE the tf.train.Checkpoint prefix, STATE_FILE the epoch and the history so far, written last.


@dataclass(frozen=True)
class KerasJob:
    """What every worker is handed: the model function and fit()'s arguments, its inputs read once."""

    model_fn: Callable[[], Any]
    train: Any  # KerasData (or Ray's reference to it)
    val: Any  # KerasData, its reference, or None
    epochs: int
    initial_epoch: int = 0
    validation_freq: Any = 1
    seed: int = 0
    callbacks: Optional[list] = None
    stall_timeout_s: Optional[float] = None
    progress_bars: bool = False  # verbose=1 at a terminal: rank 0 draws a bar inside long epochs
    features: KerasFeatures = KerasFeatures()  # the product's features asked for, as Keras provides them
    shard_optimizer: int = 0  # ZeRO's stage (app.training.zero); 0: every worker holds every optimizer's state
    tensorboard_dir: Optional[str] = None  # rank 0's epoch scalars (app.training.tensorboard); None: none
    task: Optional[str] = None  # the task the product compiled the model for (app.training.default_compile), else None
    tensor: Any = None  # --tensor-parallel: the driver's TensorPlan (the layers split, over how many devices); None
    recorded: Optional[dict] = None  # the run's config as config.yaml records it (each checkpoint's state holds it)
    checkpoint_every_steps: Optional[int] = None  # also a checkpoint every N steps inside an epoch (arrays only)
    log_every_steps: int = 0  # TensorBoard's step scalars every N steps (with tensorboard_dir); 0: per epoch only
    audit: bool = False  # --audit-sample-ids: every epoch's training row ids over the workers (app.training.keras_audit)
    stages: Any = None  # --strategy pipeline: the driver's StagePlan (app.training.pipeline); None: no pipeline
    profile_steps: Optional[tuple[int, int]] = None  # --profile-steps A:B: TensorFlow's profiler over those steps
    profile_dir: Optional[str] = None  # where each worker's profile goes (a TensorBoard run per worker)
    compiled: Any = None  # what trained: the compile in force (app.training.compile_record.Compiled)

    @property
    def not_in_force(self) -> tuple[str, ...]:
        """The config fields this run's training does not read (none known: none)."""
        return self.compiled.unused if self.compiled is not None else ()


def trained_rows(data, world: int) -> Optional[int]:
    """Rows an epoch trains on over ``world`` workers (None: counted only as the workers read them)."""
    dropped = data.dropped_rows(world)
    return data.num_rows - dropped if data.num_rows is not None and dropped is not None else None


class KerasSession(Protocol):
    rank: int
    world: int
    strategy: Any  # a local tf.distribute strategy of several replicas (built in its scope), else None

    def start(self) -> None:
        """Threads and collectives, before any other TensorFlow op of this process."""

    def inputs(self) -> tuple[KerasData, Optional[KerasData]]:
        """The training and validation inputs."""

    def last_checkpoint(self) -> Optional[str]:
        """The directory of the checkpoint to go on from, or None."""

    def save_and_report(self, record: dict[str, Any], write: Callable[[str], None]) -> None:
        """Checkpoint the epoch (``write(directory)``, rank 0) and report its record."""

    def worker_nodes(self, collective: Collective) -> list[str]:
        """Each rank's node (Ray's node ids, in rank order; [] without Ray)."""

    def progress_bar(self, total: int, desc: str) -> Any:
        """A tqdm-like bar, drawn where the person watching the run sees it."""


def build(model, data: KerasData, val: Optional[KerasData] = None, sharded: Sequence[ShardedOptimizer] = ()) -> None:
    """Create every variable the model's step uses (layers, optimizers' slots, metrics) without taking a step:
    trace ``train_step`` once on the input's element spec, as fit() would at its first step, and ``test_step`` on
    the validation input's (a worker whose part of the validation rows is empty has the same metric states to sum
    as the others). The unsharded optimizers note their slots as they build (a sharded run's checkpoint names them)."""
    import tensorflow as tf

    from app.training.keras_sync import optimizers_of

    for optimizer in optimizers_of(model):
        if not optimizer.built and all(optimizer is not s.optimizer for s in sharded):
            zero_state.track(optimizer)

    def spec(d):
        return tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), d.rows)

    tf.function(model.train_step).get_concrete_function(spec(data))
    if val is not None:
        tf.function(model.test_step).get_concrete_function(spec(val))


def _fit_parts(model, first: int, skip: int, train: KerasData, val_ds: Any, job: KerasJob, session: KerasSession,
               ids: Any, callbacks: Callable[[Callable[[int], Any], int], list]) -> None:
    """Keras's fit over the run's epochs from ``first``. One pass per epoch, which fit() iterates as it would the
    user's input (the epoch's own batches, or the pipeline every worker runs again). A run that goes on inside an
    epoch (``skip`` of its steps done) fits that epoch's steps left first, on their own (fit() counts an epoch's
    steps from the first one it iterates, and holds every epoch to it)."""
    parts = [range(first, first + 1), range(first + 1, job.epochs)] if skip else [range(first, job.epochs)]
    for epochs in parts:
        if not epochs or model.stop_training and epochs.start > first:
            continue
        # (a streamed input's worker_dataset takes no skip: the driver refuses step checkpoints for it)
        given = {"skip": skip} if skip and epochs.start == first else {}
        if ids is not None:
            given["record"] = ids.record
        train_ds, choose_epoch = train.worker_dataset(epochs, job.seed, session.rank, session.world,
                                                      training=True, **given)
        model.fit(train_ds, epochs=epochs.stop, initial_epoch=epochs.start, validation_data=val_ds,
                  validation_freq=job.validation_freq,
                  callbacks=callbacks(choose_epoch, skip if epochs.start == first else 0), verbose=0, shuffle=False)


def _model(job: KerasJob, session: KerasSession, train, val, collective: Collective, marks) -> tuple:
    """The worker's model, built as the run's features ask, synchronised over the workers (or the local replicas),
    its step timed and traced: (model, the tensor split or None, the sharded optimizers, the in-graph clock or
    None)."""
    from app.training import keras_features, keras_sync, step_clock, tensor_optimizer

    strategy = session.strategy
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras_features.build(job.model_fn, job.features)
    marks.mark("model")
    if strategy is not None:  # one process, several replicas: their all-reduce is the strategy's
        keras_sync.synchronise_replicas(model)
    if job.stages is not None:  # --strategy pipeline: fit trains the model placed stage by stage on its devices
        from app.training.pipeline import for_fit

        model = for_fit(model, job.stages, train.first_batch())
    split = tensor_optimizer.Split(model, job.tensor, train) if job.tensor is not None else None
    if split is not None:  # a worker's variables live on several devices: its all-reduces run on the first
        collective.device = split.shards.plan.devices[0]
    # The step's body and sync timed inside it: a worker of one replica (a local strategy's replicas run the step
    # in a replica context, where the clock's variables are not theirs to add to).
    in_graph = step_clock.InGraph() if strategy is None else None
    if job.shard_optimizer == 3 and collective.world > 1:  # the layers' weights must exist to be cut
        zero_weights.build_layers(model, train.first_batch())
    sharded = keras_sync.synchronise(model, collective, job.shard_optimizer, in_graph)
    if in_graph is not None:
        in_graph.wrap_step(model)
    with user_code.named(model):  # the model's steps are traced here first
        if strategy is None:
            build(model, train, val, sharded)
        else:  # its variables are the strategy's, made in its scope (a step traced outside a replica cannot read them)
            replica_internals.symbolic_build(model, train.first_batch())
            replica_internals.updates_exact_on_one_copy(model)  # central storage's one copy of each variable
    marks.mark("traced")
    return model, split, sharded, in_graph


def _starting_state(job: KerasJob, session: KerasSession, model, collective: Collective, sharded: list,
                    split) -> dict[str, Any]:
    """The run's state as this worker starts: the last checkpoint's (a restart or a resize), else epoch 0 with
    rank 0's weights on every worker; and what result.json records of the worker (its node, its optimizers' bytes)."""
    from app.training import keras_sync, zero

    state: dict[str, Any] = {"epoch": job.initial_epoch, "history": []}
    nodes = session.worker_nodes(collective)  # where each rank runs (result.json)
    resumed = session.last_checkpoint()
    if resumed is not None:
        weights = weights_of(sharded)  # stage 3: read whole (an unsharded layout), each worker keeps its part
        with weights.whole() if weights is not None else contextlib.nullcontext():
            state = restore(model, resumed, sharded, split)
        state["attempt"] = state.get("attempt", 0) + 1
    else:
        # Every worker starts from rank 0's weights (a model function need not be seeded).
        # (a part of a sharded weight was cut from rank 0's whole weight: app.training.zero_weights)
        collective.broadcast_variables([v for v in model.variables if "float" in str(v.dtype) and not is_shard(v)])
    progress = Progress(epoch=state["epoch"], step=state.get("step", 0), worker_nodes=nodes,
                        workers_over_time=state.get("workers_over_time", []))
    resized = progress.sized(session.world, state.get("worker_nodes"))  # the run's size since each (re)start
    state["workers_over_time"], state["worker_nodes"] = progress.workers_over_time, nodes
    if resumed is not None and session.rank == 0:  # one line: the resize (if any) and where training goes on
        log.info("%sresumed at %s from its checkpoint", f"{resized}; " if resized else "", progress.position())

    # What jobs/evaluate.py --checkpoint reads back: the run's config (its data) and the task it scores.
    state["config"], state["task"] = job.recorded or {}, job.task
    # What this worker holds for its optimizers (result.json): their variables, and a sharded one's flat weights.
    state["optimizer_state_bytes"] = zero.state_bytes(keras_sync.optimizers_of(model))
    state["optimizer_parts_bytes"] = sum(p.numpy().nbytes for s in sharded for p in s.parts)
    if split is not None:  # what each of this worker's devices holds of the split layers (result.json)
        state["tensor_device_bytes"] = split.shards.variable_bytes()
    return state


def _validation(val, job: KerasJob, session: KerasSession):
    """This worker's validation dataset (None: no validation)."""
    if getattr(val, "streamed", False):
        # Each worker scores a part of a streamed validation set whose size only its end tells: Keras's evaluate
        # then warns at the end of its first pass that the input "ran out of data; interrupting training". It did
        # not: every row was scored.
        warnings.filterwarnings("ignore", message="Your input ran out of data", category=UserWarning)
    return None if val is None else val.worker_dataset(range(1), job.seed, session.rank, session.world,
                                                       training=False)[0]


def keras_fit_worker(job: KerasJob, session: KerasSession) -> None:
    """One worker's part of ``app.fit`` for a model trained by its own step."""
    entered = getattr(session, "entered", None) or time.time()  # a Ray worker's: before it set its threads up
    session.start()
    import keras

    from app.training import keras_audit, keras_callbacks, keras_sync, step_clock

    marks = step_clock.Marks.of_worker(entered, getattr(session, "configured", None))

    collective = Collective(session.world, job.stall_timeout_s, session.rank)
    keras.utils.set_random_seed(job.seed)
    train, val = session.inputs()
    marks.mark("inputs")
    strategy = session.strategy
    model, split, sharded, in_graph = _model(job, session, train, val, collective, marks)
    clock = step_clock.StepClock(in_graph, marks)
    state = _starting_state(job, session, model, collective, sharded, split)
    first, skip = state["epoch"], state.get("step", 0)
    steps = train.steps_on(session.world, first, job.seed)
    writer = Writer(model, state, sharded, split, session.rank)

    def save_step() -> None:
        if sharded:
            writer.gather()
        session.save_and_report({"epoch": state["epoch"], "step": state["step"], "workers": session.world},
                                writer.write)

    own = list(job.callbacks or [])
    board = keras_callbacks.Board(job.tensorboard_dir, state) if job.tensorboard_dir and session.rank == 0 else None
    bar = [keras_callbacks.Bar(session.progress_bar, steps, job.epochs)] if job.progress_bars and session.rank == 0 \
        else []
    # Every worker takes part in each point's sums; rank 0 writes them.
    step_scalars = [keras_callbacks.StepScalars(job.log_every_steps, collective, board)] \
        if job.log_every_steps and job.tensorboard_dir else []
    ids = keras_audit.IdLog() if job.audit else None
    audit = [keras_audit.AuditIds(ids, collective, state, session.rank)] if ids is not None else []

    def callbacks(choose_epoch: Callable[[int], Any], skip: int) -> list:
        """A fit's callbacks (``skip``: the first epoch's steps done before it, from a checkpoint inside it)."""
        # Points the input at the epoch that begins: fit() makes the epoch's iterator after every on_epoch_begin.
        epoch_input = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: choose_epoch(epoch))
        goes_on = [keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: keras_sync.restore_step_state(
            model, state.get("metric_states", []), session.rank))] if skip else []
        stepped = [keras_callbacks.StepCheckpoints(
            job.checkpoint_every_steps, lambda epoch: train.steps_on(session.world, epoch, job.seed), save_step,
            state, collective, skip)] if job.checkpoint_every_steps else []
        watch = [keras_callbacks.StepWatch(collective.watch)] if collective.watch is not None else []
        profile = [step_clock.Profile(*job.profile_steps, f"{job.profile_dir}/worker-{session.rank}",
                                      first * (steps or 0) + skip)] if job.profile_steps and job.profile_dir else []
        return [clock, *watch, *profile, epoch_input, *goes_on,
                *(own if session.rank == 0 else keras_callbacks.on_every_worker(own)), *bar,
                keras_callbacks.Decisions(collective, model, session.rank, keras_callbacks.acts_per_batch(own)),
                *stepped, *audit,
                keras_callbacks.Checkpoints(session, writer.write, state, job.epochs, gather=writer.gather if sharded else None,
                                            own=own if session.rank == 0 else [],
                                            rows=trained_rows(train, session.world), finite=job.task is not None,
                                            settle=collective if own else None, clock=clock,
                                            collective=collective, sync_timed=in_graph is not None and not sharded),
                *([board] if board is not None else []), *step_scalars]

    val_ds = _validation(val, job, session)
    try:
        with user_code.named(model, lambda e: keras_callbacks.raised_by_callback(e, own)), \
                replica_internals.unscaled_losses() if strategy is not None else contextlib.nullcontext():
            _fit_parts(model, first, skip, train, val_ds, job, session, ids, callbacks)
    except Exception as e:
        if collective.watch is not None and collective.watch.aborted:  # the step's error is the cancellation's
            raise collective.watch.error() from e
        raise
    finally:
        if collective.watch is not None:
            collective.watch.close()
        if board is not None:
            board.close()
