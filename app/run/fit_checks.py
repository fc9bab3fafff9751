"""What a run of Keras's fit refuses before it starts (app.run.keras_step), each in one line that names the fix:
fit()'s own arguments as Keras takes them, where the run can go (workers, a resume, a streamed input's limits),
what the output holds, and the steps --profile-steps names."""

from __future__ import annotations

from typing import Any

import numpy as np

from app.backend import backend_of
from app.data import keras_stream
from app.errors import UserError


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
