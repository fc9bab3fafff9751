"""What checkpointing adds per epoch: the time to write one checkpoint against one training epoch.

    python jobs/benchmark_checkpoint.py [--repeats 10] [any jobs/train.py model flag]

Runs in one process, no Ray: the default model on the embedded data, one
device. Prints the median checkpoint write (tf.train.Checkpoint of model +
optimizer, model.keras, state.json), the median epoch, and their ratio.
Ray's own part of a report (copying the directory into storage, registering
it) comes on top and is measured by the epoch timings of a real run.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    cli.add_config_flags(parser, exclude={"backend", "strategy", "devices"})
    args = parser.parse_args()

    def body() -> None:
        import tensorflow as tf

        from app import checkpoint, data, models, scaling
        from app.loop import Loop

        config = cli.config_from_args(args).model_copy(update={"num_workers": 1})
        source = data.load_source(config)
        strategy = tf.distribute.get_strategy()
        plan = data.EpochPlan(len(source.train), 1, config.per_replica_batch)
        lr_plan = scaling.plan_lr(config, plan.global_batch, plan.steps)
        model = models.build_model(config, source.feature_shape, source.num_classes)
        optimizer = scaling.make_optimizer(config, lr_plan)
        loop = Loop.for_run(strategy, model, optimizer, plan.global_batch, config)
        batches = data.train_batches_from_arrays(source.train, plan, config.seed, True, 0, args.repeats + 1)
        iterator = iter(strategy.distribute_datasets_from_function(lambda _: batches))
        loop.train_epoch(iterator, plan.steps)  # trace once
        epochs, saves = [], []
        progress = checkpoint.Progress()
        for epoch in range(args.repeats):
            start = time.perf_counter()
            loop.train_epoch(iterator, plan.steps)
            epochs.append(time.perf_counter() - start)
            progress.epoch = epoch + 1
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                checkpoint.save(tmp, model, optimizer, progress.state(config=config, lr_plan=lr_plan, plan=plan))
                saves.append(time.perf_counter() - start)
        epoch_s, save_s = statistics.median(epochs), statistics.median(saves)
        print(f"model {config.model}, {model.count_params():,} parameters, {plan.steps} steps/epoch")
        print(f"median epoch {epoch_s * 1000:.1f} ms, median checkpoint write {save_s * 1000:.1f} ms "
              f"({save_s / epoch_s:.1%} of an epoch), over {args.repeats} epochs")

    cli.main(body)


if __name__ == "__main__":
    main()
