"""What a run of Keras's fit refuses before it starts (app.run.keras_step), each in one line that names the fix:
fit()'s own arguments as Keras takes them, where the run can go (workers, a resume, a streamed input's limits),
what the output holds, the steps --profile-steps names, and a model whose training does not fit a worker."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from app.backend import backend_of
from app.data import keras_stream
from app.errors import UserError

log = logging.getLogger(__name__)


def check_arguments(args) -> None:
    """fit()'s own arguments (app.run.keras_step.FitArguments) as Keras takes them."""
    counts = {"batch_size": args.batch_size, "validation_batch_size": args.validation_batch_size,
              "steps_per_epoch": args.steps_per_epoch, "validation_steps": args.validation_steps}
    epochs, initial_epoch, verbose = args.epochs, args.initial_epoch, args.verbose
    validation_freq, num_workers, validation_split = args.validation_freq, args.num_workers, args.validation_split
    for name, value in counts.items():  # None: Keras's default
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise UserError(f"{name} must be a positive integer, or None for Keras's default (got {value!r})")
    if verbose not in (0, 1, 2, "auto") or isinstance(verbose, bool):
        raise UserError(f"verbose must be 0, 1, 2 or 'auto', as in Keras's fit (got {verbose!r})")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise UserError(f"epochs must be a positive integer (got {epochs!r})")
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
        raise UserError(f"initial_epoch must be an integer from 0 to epochs - 1 = {epochs - 1} (got {initial_epoch!r}): "
                        "epochs counts from 0, as in Keras, so it is the last epoch's number, not how many to train")
    if isinstance(validation_freq, bool) or not (isinstance(validation_freq, int) and validation_freq >= 1 or
                                                  isinstance(validation_freq, (list, tuple)) and validation_freq):
        raise UserError(f"validation_freq must be a positive integer (validate every that many epochs) or a list of "
                        f"epoch numbers (from 1), as in Keras (got {validation_freq!r})")
    if isinstance(num_workers, bool) or isinstance(num_workers, int) and num_workers < 1:
        raise UserError(f"num_workers must be a positive integer, or a range MIN:MAX for an elastic run (got "
                        f"{num_workers!r})")
    if not 0 <= validation_split < 1:
        raise UserError(f"validation_split must be in [0, 1) (got {validation_split!r})")


def checked_world(config, x: Any, validation_data: Any, num_workers: Any) -> int:
    """The workers the checks take (an elastic range, num_workers="1:4": its largest; every size cuts each global
    batch over its workers, so the math does not change with the size), after what the request's place refuses:
    a --resume with nothing to go on from, more workers than the local Ray would hold, and a streamed input with an
    elastic range or step checkpoints (before the data is read and anything starts)."""
    from app.backends import run_checkpoints

    run_checkpoints.check_resumable(config)
    if backend_of(config).on_ray:  # the local Ray this would start cannot hold the workers: said now, not after a wait
        from app.driver import cluster

        cluster.check_fits_locally(config)
    if config.elastic and (keras_stream.is_streamed(x) or keras_stream.is_streamed(validation_data)):
        raise UserError(f"num_workers={num_workers!r}: a path or a ray.data.Dataset is split into equal shares of a "
                        "fixed number of workers; give num_workers a number")
    if config.checkpoint_every_steps and keras_stream.is_streamed(x):
        raise UserError(f"checkpoint_every_steps={config.checkpoint_every_steps}: a path or a ray.data.Dataset streams "
                        "each epoch anew, so a run cannot go on from a step inside one; leave it out (every epoch is "
                        "checkpointed), or give the rows in memory")
    return 1 if not backend_of(config).on_ray else config.max_workers


def check_run(config, model, train, world: int, args) -> None:
    """The output directory, a resumed run's epochs and checkpoint, batches every worker can take a part of, step
    checkpoints of an input that can go on from a step, and --profile-steps: said before any worker starts."""
    from app.backends import run_checkpoints
    from app.driver import outputs

    outputs.check_output_dir(config)
    done = run_checkpoints.epochs_done(config)
    epochs = args.epochs
    if done >= epochs:
        raise UserError(f"the run in {config.output_dir()} already finished its {done} epochs: give --epochs (epochs=) "
                        f"more than {done} to train it further with --resume (resume=True)")
    if done:  # a damaged checkpoint, or a model that is not the checkpoint's
        run_checkpoints.check_fits(model, config)
    if train.num_batches and train.steps and train.dropped_rows(world) >= train.num_rows:
        raise UserError(f"every batch of x has fewer rows than the {world} workers: use fewer workers or larger "
                        "batches")
    if config.checkpoint_every_steps and (train.pipeline is not None or not train.counted):
        raise UserError(f"checkpoint_every_steps={config.checkpoint_every_steps}: a run goes on from a step inside an "
                        f"epoch of arrays (or a PyDataset) only; x is a {type(args.x).__name__}, whose epochs run "
                        "anew: leave it out (every epoch is checkpointed)")
    check_profile_steps(config, train, args.epochs)


def check_profile_steps(config, train, epochs: int) -> None:
    """--profile-steps inside the run's steps (where they are known before it starts), else one line."""
    if config.profile_steps is None or not train.steps:
        return
    first, last = config.profile_steps
    total = train.steps * epochs
    if last > total:
        raise UserError(f"--profile-steps {first}:{last}: the run has {total} steps ({epochs} epoch(s) of "
                        f"{train.steps}); give steps from 1 to {total}, for example {min(first, total)}:{total}")


def memory_lines(config, model, optimizers: list, world: int) -> list[str]:
    """The plan's line of each worker's training bytes at ZeRO's stages 0-3; a run whose stage does not fit the
    budget (--memory-per-worker, else this machine's memory shared by its workers) is refused, with the stage that
    fits, before any worker starts. Nothing when the bytes are not known before the workers build the model (a
    subclassed model, several optimizers) or the run is on one worker."""
    from app.training import zero_memory

    if world == 1 or len(optimizers) != 1 or not backend_of(config).on_ray:
        return []
    try:  # the optimizer's slots are counted on a copy of it: one that cannot be copied leaves the line out
        needs = zero_memory.training_bytes(model, optimizers[0], world)
    except Exception as e:  # whatever a user's optimizer (or its schedule) raises when copied or built on one weight
        log.debug("no memory line in the plan: %s", e)
        return []
    if needs is None:
        return []
    budget, why = _budget(config, world)
    figures = ", ".join(f"stage {stage} {_gib(n)}" for stage, n in needs.items())
    line = (f"memory: each worker's weights, gradients and optimizer state (activations not counted): {figures}"
            + (f"; budget {_gib(budget)} ({why})" if budget else ""))
    stage = config.shard_optimizer
    if budget and needs[stage] > budget:
        if needs[3] > budget:
            even = f", and {_gib(needs[3])} even at --shard-optimizer 3" if stage != 3 else ""
            raise UserError(f"the model's training needs {_gib(needs[stage])} a worker at --shard-optimizer {stage}{even}, "
                            f"more than the {_gib(budget)} budget ({why}): more workers, more memory a worker "
                            "(--memory-per-worker), or a smaller model")
        raise UserError(f"the model's training needs {_gib(needs[stage])} a worker at --shard-optimizer {stage}, more "
                        f"than the {_gib(budget)} budget ({why}); at --shard-optimizer 3 it needs {_gib(needs[3])}: "
                        "give --shard-optimizer 3 (shard_optimizer=3)")
    return [line]


def _budget(config, world: int) -> tuple[float, str]:
    """(bytes, why) a worker may use; (0, "") where it is not known (a cluster without --memory-per-worker)."""
    from app.driver import cluster

    if config.memory_per_worker:
        return config.memory_per_worker * 2**30, "--memory-per-worker"
    if cluster.joining_a_cluster():
        return 0, ""
    return cluster.local_memory_gib() * 2**30 / world, f"the memory a Ray started here can reserve, shared by {world} " \
        "workers"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
