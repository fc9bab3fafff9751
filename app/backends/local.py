"""What a run in this process without Ray needs before Keras's fit trains it (app.backends.keras_fit): the local
strategy, made before TensorFlow starts its devices, and an epoch's progress bar in this terminal. Ray is never
imported here."""

from __future__ import annotations

from app.config import TrainConfig
from app.errors import UserError
from app.training import strategy as strategy_lib


def tqdm_bar(total: int, desc: str):
    """An epoch's bar in this process's terminal (gone once the epoch's line is printed)."""
    import tqdm

    return tqdm.tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def make_strategy(config: TrainConfig):
    """The local strategy and why (devices are configured before TensorFlow initialises them: first); a pipeline's
    devices, one per stage, are made here too."""
    try:
        strategy, reason = strategy_lib.local_strategy(config.strategy, config.devices, config.cpus_per_worker)
    except strategy_lib.StrategyUnavailable as e:
        raise UserError(str(e)) from None
    return strategy, reason
