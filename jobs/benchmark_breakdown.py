"""Where the 1-worker Ray path loses against the plain loop: strategy and input, varied one at a time.

    python jobs/benchmark_breakdown.py --config my_workload.yaml

Runs the project's Loop in this process, without Ray Train, for every
combination of strategy (none, or MultiWorkerMirroredStrategy with one worker)
and input (tf.data from arrays in memory, or the Ray Data shard through
``from_generator`` exactly as a Ray worker reads it), each in a fresh
subprocess, and prints steady-state samples/s (epochs after the first). Run
``python jobs/benchmark.py`` for the plain baseline in the same session.
BENCHMARKS.md has the figures.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one(config_file: str, strategy_kind: str, input_kind: str) -> dict:
    import yaml

    from app import data, models, scaling
    from app.benchmark import steady
    from app.config import TrainConfig

    cfg = TrainConfig(**yaml.safe_load(open(config_file)))
    if strategy_kind == "mwms":  # no TF_CONFIG: a one-worker MWMS, as in a 1-worker Ray run
        from app.strategy import multi_worker_strategy

        strategy = multi_worker_strategy(cfg.cpus_per_worker)
    else:
        from app.strategy import set_thread_counts

        set_thread_counts(cfg.cpus_per_worker)
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
    from app.loop import Loop

    source = data.load_source(cfg)
    plan = data.EpochPlan(len(source.train), 1, cfg.per_replica_batch, 1, 1)
    lr_plan = scaling.plan_lr(cfg, plan.global_batch, plan.steps)
    with strategy.scope():
        model = models.build_model(cfg, source.feature_shape, source.num_classes)
        optimizer = scaling.make_optimizer(cfg, lr_plan)
    if input_kind == "arrays":
        ds = data.train_batches_from_arrays(source.train, plan, cfg.seed, True, 0, cfg.epochs)
    else:
        from app import ray_train

        ray_train.connect(cfg)
        shard = ray_train.build_datasets(cfg, source)["train"].streaming_split(1, equal=True)[0]
        ds = data.train_batches_from_shard(shard, plan, source.feature_shape, cfg.epochs)
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: ds))
    loop = Loop.for_run(strategy, model, optimizer, plan.global_batch, cfg)
    per_epoch = []
    for epoch in range(1, cfg.epochs + 1):
        stats = loop.train_epoch(iterator, plan.steps, epoch)
        per_epoch.append(stats.samples / stats.seconds)
    return {"strategy": strategy_kind, "input": input_kind, "per_epoch": per_epoch,
            "samples_per_second": steady(per_epoch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="The workload as a TrainConfig YAML (e.g. the benchmark's).")
    parser.add_argument("--one", nargs=2, metavar=("STRATEGY", "INPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.config, *args.one)), flush=True)
        return
    print(f"{'strategy':<10}{'input':<10}{'samples/s':>10}")
    for strategy_kind in ("none", "mwms"):
        for input_kind in ("arrays", "raydata"):
            p = subprocess.run([sys.executable, __file__, "--config", args.config, "--one", strategy_kind, input_kind],
                               capture_output=True, text=True, cwd=REPO)
            line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{strategy_kind}/{input_kind} failed:\n{p.stderr[-3000:]}")
            r = json.loads(line[len("RESULT "):])
            print(f"{strategy_kind:<10}{input_kind:<10}{r['samples_per_second']:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
