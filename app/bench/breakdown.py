"""The breakdown suite: where the 1-worker Ray path loses to the plain loop, strategy and input varied one at a time.

Runs the project's training loop (app.bench.training) in a plain process,
without Ray Train, for every combination of

- strategy: none (TensorFlow's default strategy, the thread count set as a
  worker sets it: what a 1-worker Ray run trains under), or
  MultiWorkerMirroredStrategy with one worker (no TF_CONFIG): the cost of
  MWMS's scope itself, which every worker of a larger group pays;
- input: ``arrays``, tf.data from the arrays in memory
  (``train_batches_from_arrays``: what a Ray worker and the local backend
  read for in-memory data), or ``raydata``, a Ray Data shard of the same rows,
  reshuffled every epoch, through ``from_generator``
  (``train_batches_from_shard``: what a worker reads for file data kept in
  the object store);

each in a fresh process (``python -m app.bench.breakdown one '<json>'``), and
reports steady-state samples/s (epochs after the first). The throughput suite
measures the plain baseline and the real Ray run.

Then what a step of 2 workers costs beyond the machine's two processes: two
plain processes started at once (``pair``), each one worker of 2 (its part of
every global batch of the epoch's order, as a Ray worker reads it), set up as
a Ray worker sets itself up (TF_CONFIG, app.training.strategy.ray_worker_strategy),
once with the gradients summed across the two (app.training.collective, the
all-reduce 2 Ray workers run every step) and once without (the same work, each
alone): the difference is the all-reduce's wait, with nothing of Ray Train
around it. The gradients' bytes per step are reported beside it.
"""

from __future__ import annotations

import logging
import resource
from pathlib import Path
from typing import Any

from app.bench import report
from app.bench.preset import Preset
from app.bench.proc import child_main, measure, steady
from app.config import TrainConfig

log = logging.getLogger(__name__)

PARAMS: tuple[str, ...] = ()
STRATEGIES = ("none", "mwms")
INPUTS = ("arrays", "raydata")


def _strategy(kind: str, config: TrainConfig):
    if kind == "mwms":  # no TF_CONFIG: MWMS over this one process
        from app.training.strategy import multi_worker_strategy

        return multi_worker_strategy(config.cpus_per_worker)
    from app.training.strategy import set_thread_counts

    set_thread_counts(config.cpus_per_worker)
    import tensorflow as tf

    return tf.distribute.get_strategy()


def _ray_data_shard(config: TrainConfig, split):
    """The rows as a Ray Dataset, globally reshuffled every epoch; the one shard of a 1-worker equal split."""
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    from app.data.arrays import ID, X, Y
    from app.data.ray_input import shuffled_each_epoch
    from app.driver.cluster import connect

    connect(config)
    ds = ray.data.from_arrow(pa.table({X: ArrowTensorArray.from_numpy(split.x), Y: pa.array(split.y),
                                       ID: pa.array(split.ids)}))
    if config.shuffle:
        ds = shuffled_each_epoch(ds, config.seed)
    return ds.streaming_split(1, equal=True)[0]


def _rates(training, iterator, plan, epochs: int) -> tuple[list[float], int]:
    """Samples/s of each of ``epochs`` epochs, and the samples the last one counted (a worker of several counts
    every worker's: its measures are summed across them, as a run's are)."""
    rates, samples = [], 0
    for epoch in range(1, epochs + 1):
        stats = training.epoch(iterator, plan, epoch)
        rates.append(stats.samples / stats.seconds)
        samples = stats.samples
    return rates, samples


def one(payload: dict[str, Any]) -> dict[str, Any]:
    """One combination, in this process: ``{"workload": {...}, "strategy": ..., "input": ...}``."""
    from app.bench.training import build_training, distributed
    from app.data import tf_input
    from app.data.memory import load_source
    from app.data.plan import EpochPlan

    config = TrainConfig(**payload["workload"])
    strategy = _strategy(payload["strategy"], config)
    source = load_source(config)
    plan = EpochPlan.for_run(config, len(source.train), 1)
    training = build_training(config, strategy, source, plan)
    if payload["input"] == "arrays":
        batches = tf_input.train_batches_from_arrays(source.train, plan, config.seed, config.shuffle, 0, config.epochs)
    else:
        shard = _ray_data_shard(config, source.train)
        batches = tf_input.train_batches_from_shard(shard, plan, source.facts, config.epochs)
    per_epoch, _ = _rates(training, distributed(strategy, batches), plan, config.epochs)
    return {"strategy": payload["strategy"], "input": payload["input"], "per_epoch": per_epoch,
            "samples_per_second": steady(per_epoch)}


def pair(payload: dict[str, Any]) -> dict[str, Any]:
    """One of 2 workers, in this process: ``{"workload": {...}, "rank": r, "summed": bool, "tf_config": {...}}``."""
    import json
    import os

    from app.bench.training import build_training, distributed
    from app.data import tf_input
    from app.data.memory import load_source
    from app.data.plan import EpochPlan
    from app.training.collective import ALONE, Collective
    from app.training.strategy import ray_worker_strategy

    config, rank = TrainConfig(**payload["workload"]), payload["rank"]
    if payload["summed"]:
        os.environ["TF_CONFIG"] = json.dumps(payload["tf_config"])
    strategy = ray_worker_strategy(config.cpus_per_worker, None, 2 if payload["summed"] else 1)
    collective = Collective(2, None, rank) if payload["summed"] else ALONE
    source = load_source(config)
    plan = EpochPlan.for_run(config, len(source.train), 2)  # each process: one worker of 2, summed or not
    training = build_training(config, strategy, source, plan, collective)
    batches = tf_input.train_batches_from_arrays(source.train, plan, config.seed, config.shuffle, 0, config.epochs,
                                                 rank)
    per_epoch, samples = _rates(training, distributed(strategy, batches), plan, config.epochs)
    gradient_bytes = sum(int(v.numpy().nbytes) for v in training.training.model.trainable_variables)
    return {"per_epoch": per_epoch, "samples_per_second": steady(per_epoch), "samples_per_epoch": samples,
            "gradient_bytes": gradient_bytes, "steps_per_epoch": plan.steps}


def _pair(workload: dict[str, Any], summed: bool) -> dict[str, Any]:
    from app.driver.cluster import free_port

    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    both = measure("app.bench.breakdown", "pair", [
        {"workload": workload, "rank": r, "summed": summed,
         "tf_config": {"cluster": cluster, "task": {"type": "worker", "index": r}}} for r in range(2)])
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)  # both processes waited for: their CPU time is counted
    # Summed, each process counts both workers' samples (its measures are summed across the two, as a run's are):
    # each one's rate is the pair's. Not summed, each counts its own: the pair's rate is their sum.
    pick = (lambda rates: sum(rates) / len(rates)) if summed else sum
    return {"summed": summed, "processes": both,
            "samples_per_second": pick([p["samples_per_second"] for p in both]),
            "samples_per_epoch": int(pick([p["samples_per_epoch"] for p in both])),
            "gradient_bytes": both[0]["gradient_bytes"], "steps_per_epoch": both[0]["steps_per_epoch"],
            # Both processes' CPU seconds (user + system), start-up included: where the all-reduce's cost would show
            # if it were compute rather than waiting.
            "cpu_seconds": (ended.ru_utime - used.ru_utime) + (ended.ru_stime - used.ru_stime)}


def run(preset: Preset, out: Path, command: str) -> list[Path]:
    results = []
    for strategy in STRATEGIES:
        for kind in INPUTS:
            log.info("strategy %s, input %s ...", strategy, kind)
            results.append(measure("app.bench.breakdown", "one",
                                   {"workload": preset.workload, "strategy": strategy, "input": kind})[0])
            log.info("    %.0f samples/s", results[-1]["samples_per_second"])
    print(report.breakdown_table(results))
    log.info("2 processes at once, each one worker of 2: gradients summed, then not ...")
    pairs = [_pair(preset.workload, summed) for summed in (True, False)]
    print(report.pair_lines(pairs))
    return [report.write_json(out / "breakdown.json",
                              {"command": command, "preset": preset.as_dict(), "results": results,
                               "two_workers": pairs})]


if __name__ == "__main__":
    child_main({"one": one, "pair": pair})
